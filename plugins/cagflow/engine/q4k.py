"""The GGUF's own Q4_K blocks as engine weights (``model.precision: q4k``): a decode step on one core is bound
by the bytes of weights it reads, and a Q4_K weight is 4.5 bits where an int8 row is 8. The blocks are taken
as the file stores them, so the engine computes with exactly the weights the file holds (``mm_q4k`` in
``fastlm_q4k.h``), not with a requantisation of them."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("cagflow.engine")

# a decoder layer's linear in a llama.cpp GGUF -> its Hugging Face name
_HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def read_blocks(gguf: Path, checkpoint: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The Q4_K tensors of ``gguf`` by the checkpoint name of the linear they are: uint8 [rows, blocks * 144].
    A tensor is taken only where its dequantised values equal the checkpoint's tensor exactly, which the
    checkpoint converted from this file has; one stored otherwise (llama.cpp permutes some models' q/k rows)
    keeps int8 rows, and the log says so."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    blocks, skipped = {}, []
    for tensor in GGUFReader(str(gguf)).tensors:
        match = _TENSOR.fullmatch(tensor.name)
        if tensor.tensor_type != GGMLQuantizationType.Q4_K or not match or match[2] not in _HF_NAMES:
            continue
        name = f"model.layers.{match[1]}.{_HF_NAMES[match[2]]}.weight"
        raw = np.asarray(tensor.data)
        expected = checkpoint[name] if name in checkpoint else None
        if (expected is None or raw.shape[0] % 16
                or not np.array_equal(dequantize(raw, GGMLQuantizationType.Q4_K), expected.float().numpy())):
            skipped.append(tensor.name)
            continue
        blocks[name] = torch.from_numpy(raw.copy())
    if skipped:
        log.warning("%s: %d Q4_K tensors do not match the checkpoint as stored and keep int8 rows (%s...)",
                    gguf.name, len(skipped), ", ".join(skipped[:3]))
    return blocks


def leading_blocks(names: Sequence[str], blocks: Mapping[str, torch.Tensor]) -> int:
    """How many of a fused linear's parts, from the first, are held as Q4_K blocks: those parts' channels come
    first in the product's output, the rest are int8 rows after them (Q4_K_M keeps q and k in Q4_K and v,
    last, often in Q6_K)."""
    count = 0
    while count < len(names) and names[count] in blocks:
        count += 1
    return count
