"""Snapshot format: one safetensors file holding a document prefix's KV cache.

Tensors are ``k.{layer}`` / ``v.{layer}`` shaped ``[kv_heads, tokens, head_dim]`` (batch dimension
dropped); the header carries the metadata needed to check that a snapshot fits a request (document,
version, model fingerprint, the exact prefix token ids).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

FORMAT_VERSION = "1"
DOC_ID_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
VERSION_PATTERN = re.compile(r"^[0-9A-Za-z][0-9A-Za-z.+_-]{0,63}$")
_KEY = re.compile(r"^(?P<doc>[^/#]+)/(?P<ver>[^/#]+)/(?P<fp>[0-9a-f]{16})(?:#(?P<part>[1-9][0-9]*))?$")


class SnapshotFormatError(ValueError):
    """Bytes that are not a CAGFlow snapshot, or a snapshot whose header is inconsistent."""


def validate_doc_id(doc_id: str) -> str:
    if not isinstance(doc_id, str) or not DOC_ID_PATTERN.match(doc_id):
        raise ValueError(f"doc_id {doc_id!r} must be 1-128 chars of a-z, 0-9, '.', '_', '-' starting with a letter/digit")
    return doc_id


def validate_version(version: str) -> str:
    if not isinstance(version, str) or not VERSION_PATTERN.match(version) or ".." in version:
        raise ValueError(f"version {version!r} must be 1-64 chars of letters, digits, '.', '+', '_', '-'")
    return version


@dataclass(frozen=True, order=True)
class SnapshotKey:
    """``{doc_id}/{doc_version}/{model_fingerprint[:16]}[#part]``: a model or document change is a new key."""

    doc_id: str
    doc_version: str
    fingerprint16: str
    part: int | None = None

    def __post_init__(self) -> None:
        validate_doc_id(self.doc_id)
        validate_version(self.doc_version)
        if not re.fullmatch(r"[0-9a-f]{16}", self.fingerprint16):
            raise ValueError(f"fingerprint {self.fingerprint16!r} must be 16 lowercase hex digits")
        if self.part is not None and self.part < 1:
            raise ValueError("part numbers start at 1")

    @classmethod
    def for_model(cls, doc_id: str, doc_version: str, model_fingerprint: str, part: int | None = None) -> "SnapshotKey":
        return cls(doc_id, doc_version, model_fingerprint[:16], part)

    @classmethod
    def parse(cls, text: str) -> "SnapshotKey":
        match = _KEY.match(text or "")
        if not match:
            raise ValueError(f"snapshot key {text!r} is not of the form doc_id/version/fingerprint16[#part]")
        part = match.group("part")
        return cls(match.group("doc"), match.group("ver"), match.group("fp"), int(part) if part else None)

    def __str__(self) -> str:
        base = f"{self.doc_id}/{self.doc_version}/{self.fingerprint16}"
        return f"{base}#{self.part}" if self.part is not None else base

    @property
    def object_name(self) -> str:
        """Where the file lives in a store; '#' is avoided in object names."""
        suffix = f".part{self.part}" if self.part is not None else ""
        return f"snapshots/{self.doc_id}/{self.doc_version}/{self.fingerprint16}{suffix}.safetensors"


@dataclass
class Snapshot:
    """A document prefix's KV cache, immutable once built: requests read it, never write it."""

    doc_id: str
    doc_version: str
    part: int | None
    model_fingerprint: str
    prefix_token_ids: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    created_at: float = field(default_factory=lambda: round(time.time(), 6))  # exact through the header
    title: str = ""
    system_prompt: str = ""  # the rendered document block, so a request can tokenise its full prompt

    @property
    def key(self) -> SnapshotKey:
        return SnapshotKey.for_model(self.doc_id, self.doc_version, self.model_fingerprint, self.part)

    @property
    def n_tokens(self) -> int:
        return len(self.prefix_token_ids)

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def to_bytes(self) -> bytes:
        tensors: dict[str, torch.Tensor] = {}
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            tensors[f"k.{layer}"] = k.contiguous()
            tensors[f"v.{layer}"] = v.contiguous()
        metadata = {
            "format": "cagflow-kv",
            "format_version": FORMAT_VERSION,
            "doc_id": self.doc_id,
            "doc_version": self.doc_version,
            "part": "" if self.part is None else str(self.part),
            "title": self.title,
            "system_prompt": self.system_prompt,
            "model_fingerprint": self.model_fingerprint,
            "n_tokens": str(self.n_tokens),
            "n_layers": str(len(self.keys)),
            "dtype": str(self.dtype).removeprefix("torch."),
            "prefix_token_ids": json.dumps(self.prefix_token_ids, separators=(",", ":")),
            "created_at": f"{self.created_at:.6f}",
        }
        return st_save(tensors, metadata=metadata)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> "Snapshot":
        metadata = read_metadata(data)
        try:
            tensors = st_load(bytes(data))
        except Exception as exc:  # safetensors raises several unrelated types for bad input
            raise SnapshotFormatError(f"not a safetensors snapshot: {exc}") from None
        try:
            n_layers = int(metadata["n_layers"])
            keys = [tensors[f"k.{i}"] for i in range(n_layers)]
            values = [tensors[f"v.{i}"] for i in range(n_layers)]
            prefix = json.loads(metadata["prefix_token_ids"])
            part = int(metadata["part"]) if metadata["part"] else None
            snapshot = cls(metadata["doc_id"], metadata["doc_version"], part, metadata["model_fingerprint"],
                           prefix, keys, values, float(metadata["created_at"]), metadata["title"],
                           metadata["system_prompt"])
        except (KeyError, ValueError) as exc:
            raise SnapshotFormatError(f"snapshot header incomplete or malformed: {exc}") from None
        if any(k.shape[-2] != len(prefix) for k in keys) or str(snapshot.dtype).removeprefix("torch.") != metadata["dtype"]:
            raise SnapshotFormatError("snapshot tensors disagree with the header (token count or dtype)")
        return snapshot


def read_metadata(data: bytes | bytearray | memoryview) -> dict[str, str]:
    """The snapshot header alone (no tensors), validated to be a CAGFlow snapshot of a known format."""
    try:
        header_len = int.from_bytes(bytes(data[:8]), "little")
        if not 0 < header_len <= len(data) - 8:
            raise ValueError("header length out of range")
        metadata = json.loads(bytes(data[8:8 + header_len])).get("__metadata__") or {}
    except (ValueError, AttributeError) as exc:
        raise SnapshotFormatError(f"not a safetensors snapshot: {exc}") from None
    if metadata.get("format") != "cagflow-kv":
        raise SnapshotFormatError("safetensors file is not a cagflow-kv snapshot")
    if metadata.get("format_version") != FORMAT_VERSION:
        raise SnapshotFormatError(f"unsupported snapshot format version {metadata.get('format_version')!r}")
    return metadata


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()
