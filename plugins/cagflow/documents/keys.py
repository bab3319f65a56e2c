"""Snapshots without their tensors: document ids and versions, the snapshot key
``{doc_id}/{doc_version}/{model_fingerprint[:16]}[#part]``, and a snapshot file's header. No torch: stores,
manifests, checks and the router use these.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from ..errors import CagflowError

DOC_ID_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}\Z")
VERSION_PATTERN = re.compile(r"^[0-9A-Za-z][0-9A-Za-z.+_-]{0,63}\Z")
FORMAT_VERSION = "1"
_KEY = re.compile(r"^(?P<doc>[^/#]+)/(?P<ver>[^/#]+)/(?P<fp>[0-9a-f]{16})(?:#(?P<part>[1-9][0-9]*))?$")


class SnapshotFormatError(CagflowError, ValueError):
    """Bytes that are not a CAGFlow snapshot, or a snapshot whose header is inconsistent."""

    code = "snapshot_format"


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


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


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
