"""The int8 engine's weights on disk: quantising a checkpoint's rows, reading a checkpoint one tensor at a
time, and the prepared-weights file that every process of a machine maps read-only (one copy in the page
cache)."""

from __future__ import annotations

import json
import mmap
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

WEIGHTS_FORMAT = "cagflow-fastlm-weights-v2"  # v2: each linear has a Q4_K part (q_*), maybe empty
WEIGHT_ALIGN = 64  # bytes: each tensor starts on a cache line


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: (int8 [N, K], bf16 scales [N]); scale = absmax / 127 (rounded to bf16
    first, and the weights quantised against the rounded scale)."""
    weight = weight.float()
    scale = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(torch.bfloat16)
    q = torch.round(weight / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


class CheckpointTensors(Mapping):
    """A checkpoint's tensors, read when asked for: loading holds the int8 model and one fp32 tensor at a
    time, not the whole fp32 checkpoint (2.5 GB for Qwen2.5-0.5B) in every serving process."""

    def __init__(self, sources: dict):
        self._sources = sources  # name -> the safetensors handle holding it

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._sources[name].get_tensor(name)

    def __contains__(self, name: object) -> bool:
        return name in self._sources  # without reading the tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)


def write_weights(path: Path, named: Mapping[str, torch.Tensor], recipe: str) -> None:
    """Write prepared tensors as one file: an 8-byte header length, a JSON header (format, recipe, each
    tensor's dtype, shape and offset) and the tensors' bytes, page-aligned, so ``map_weights`` maps them
    without copying. Written to a temporary name and renamed: readers see a whole file or none."""
    index, end = [], 0
    for name, tensor in named.items():
        nbytes = tensor.numel() * tensor.element_size()
        index.append({"name": name, "dtype": str(tensor.dtype).removeprefix("torch."),
                      "shape": list(tensor.shape), "offset": end, "nbytes": nbytes})
        end = round_up(end + nbytes, WEIGHT_ALIGN)
    header = json.dumps({"format": WEIGHTS_FORMAT, "recipe": recipe, "tensors": index}).encode()
    start = round_up(8 + len(header), mmap.PAGESIZE)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as out:
            out.write(len(header).to_bytes(8, "little") + header)
            for entry, tensor in zip(index, named.values()):
                out.seek(start + entry["offset"])
                out.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            out.truncate(start + end)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def map_weights(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], str, mmap.mmap]:
    """The tensors of a file ``write_weights`` wrote, as read-only views of one mapping (the pages are the
    page cache's, shared by every process that maps the file), the recipe they were prepared for, and the
    mapping itself, which must stay open as long as the tensors are used."""
    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    size = int.from_bytes(mapped[:8], "little")
    header = json.loads(mapped[8:8 + size])
    if header.get("format") != WEIGHTS_FORMAT:
        raise ValueError(f"{path}: not a {WEIGHTS_FORMAT} file")
    start = round_up(8 + size, mmap.PAGESIZE)
    tensors = {}
    with warnings.catch_warnings():  # read-only on purpose: weights are never written
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for entry in header["tensors"]:
            dtype = getattr(torch, entry["dtype"])
            count = entry["nbytes"] // dtype.itemsize
            tensors[entry["name"]] = (torch.frombuffer(mapped, dtype=dtype, count=count,
                                                       offset=start + entry["offset"]).view(entry["shape"])
                                      if count else torch.empty(entry["shape"], dtype=dtype))
    return tensors, header["recipe"], mapped


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m
