"""Snapshot format: one safetensors file holding a document prefix's KV cache.

Tensors are ``k.{layer}`` / ``v.{layer}`` shaped ``[kv_heads, tokens, head_dim]`` (batch dimension
dropped); the header carries the metadata needed to check that a snapshot fits a request (document,
version, model fingerprint, the exact prefix token ids).
"""

from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import dataclass, field

import torch
from safetensors.torch import save as st_save

from .keys import FORMAT_VERSION, SnapshotFormatError, SnapshotKey, read_metadata


_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}
warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)  # snapshots are read-only


def _tensor_views(data: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """The safetensors tensors as views into ``data``, not copies: loading a snapshot costs its read and its
    checksum, nothing more. The tensors keep ``data`` alive; nothing writes them (requests only read)."""
    try:
        header_len = int.from_bytes(bytes(data[:8]), "little")
        header = json.loads(bytes(data[8:8 + header_len]))
        base = 8 + header_len
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES[info["dtype"]]
            start, end = (int(x) for x in info["data_offsets"])
            shape = [int(x) for x in info["shape"]]
            count = math.prod(shape)
            if not 0 <= start <= end <= len(data) - base or end - start != count * dtype.itemsize:
                raise ValueError(f"tensor {name}: offsets {start}..{end} do not fit its shape or the file")
            flat = (torch.frombuffer(data, dtype=dtype, count=count, offset=base + start) if count
                    else torch.empty(0, dtype=dtype))
            tensors[name] = flat.view(shape)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SnapshotFormatError(f"not a safetensors snapshot: {exc}") from None
    return tensors


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
        tensors = _tensor_views(data)
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


def passage_state_bytes(keys: list[torch.Tensor], values: list[torch.Tensor], model_fingerprint: str,
                        content_key: str) -> bytes:
    """One retrieved passage's K/V (``engine.passage_kv``) in the snapshot's tensor layout; the header names
    the model and the content address it was computed for."""
    tensors = {f"{kind}.{layer}": t.contiguous() for layer, pair in enumerate(zip(keys, values))
               for kind, t in zip("kv", pair)}
    metadata = {"format": "cagflow-kv", "format_version": FORMAT_VERSION, "kind": "passage",
                "model_fingerprint": model_fingerprint, "content_key": content_key, "n_layers": str(len(keys))}
    return st_save(tensors, metadata=metadata)


def passage_state_from_bytes(data: bytes | bytearray | memoryview, model_fingerprint: str,
                             content_key: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The K/V of ``passage_state_bytes``; refused unless it was computed by this model for this content."""
    metadata = read_metadata(data)
    if metadata.get("kind") != "passage" or metadata.get("model_fingerprint") != model_fingerprint \
            or metadata.get("content_key") != content_key:
        raise SnapshotFormatError(f"passage state {content_key[:16]} is not this model's state for that content")
    tensors = _tensor_views(data)
    try:
        layers = int(metadata["n_layers"])
        return [tensors[f"k.{i}"] for i in range(layers)], [tensors[f"v.{i}"] for i in range(layers)]
    except (KeyError, ValueError) as exc:
        raise SnapshotFormatError(f"passage state header incomplete or malformed: {exc}") from None
