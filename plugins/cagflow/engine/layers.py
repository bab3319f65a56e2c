"""The engine's weights per decoder layer (``Layer``) and how a checkpoint becomes them
(``quantise_checkpoint``): each linear as int8 rows, or, for the parts a GGUF stores in Q4_K blocks
(``q4k``), those blocks as they are."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch

from .lm_config import LMConfig
from .q4k import leading_blocks
from .weights_file import quantize_rows

NO_BLOCKS = torch.empty(0, dtype=torch.uint8)  # a linear without a Q4_K part


@dataclass
class Layer:
    """A linear is q_* (its first output channels in packed Q4_K blocks, ``q4k``; may be empty), then w_*, s_*
    (int8 rows and their scales; may be empty)."""

    ln1: torch.Tensor
    q_qkv: torch.Tensor
    w_qkv: torch.Tensor
    s_qkv: torch.Tensor
    b_qkv: torch.Tensor  # fp32, empty when the model has no q/k/v bias
    q_o: torch.Tensor
    w_o: torch.Tensor
    s_o: torch.Tensor
    ln2: torch.Tensor
    q_gu: torch.Tensor
    w_gu: torch.Tensor
    s_gu: torch.Tensor
    q_down: torch.Tensor
    w_down: torch.Tensor
    s_down: torch.Tensor

    def flat(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]  # the order run_layers reads them in


def quantise_checkpoint(config: LMConfig, tensors: Mapping[str, torch.Tensor], blocks: Mapping[str, torch.Tensor],
                        kernels, packed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                        list[Layer]]:
    """(embedding, lm_head rows, their scales, final norm, layers). ``blocks``: Q4_K tensors by checkpoint
    name (``q4k.read_blocks``; the native ``kernels`` pack them); ``packed``: int8 rows in the native kernels'
    blocks of 16 channels, else plain rows for the torch backend."""

    def get(name: str) -> torch.Tensor:
        # always a copy: a view would keep the whole checkpoint's file mapping alive (2.5 GB for Qwen2.5)
        return tensors[name].to(torch.float32, copy=True)

    def rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale = quantize_rows(weight)
        return (kernels.pack_int8(q) if packed else q), scale

    def linear(*names: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A fused linear: its leading parts held as Q4_K blocks, the others as int8 rows after them."""
        lead = leading_blocks(names, blocks)
        q4 = kernels.pack_q4k(torch.cat([blocks[n] for n in names[:lead]])) if lead else NO_BLOCKS
        if lead == len(names):
            return q4, torch.empty(0, dtype=torch.int8), torch.empty(0, dtype=torch.bfloat16)
        return q4, *rows(torch.cat([get(n) for n in names[lead:]]))

    embed = get("model.embed_tokens.weight").contiguous()
    lm_head = embed if config.tie_embeddings or "lm_head.weight" not in tensors else get("lm_head.weight")
    layers = []
    for i in range(config.layers):
        p = f"model.layers.{i}."
        if p + "self_attn.q_proj.bias" in tensors:
            bias = torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]).contiguous()
        else:
            bias = torch.empty(0)
        layers.append(Layer(get(p + "input_layernorm.weight").contiguous(),
                            *linear(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")), bias,
                            *linear(p + "self_attn.o_proj.weight"),
                            get(p + "post_attention_layernorm.weight").contiguous(),
                            *linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                            *linear(p + "mlp.down_proj.weight")))
    return (embed, *rows(lm_head), get("model.norm.weight").contiguous(), layers)
