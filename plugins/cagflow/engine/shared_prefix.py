"""Decoding on top of a shared, read-only KV prefix (a resident snapshot) without copying it.

Building a transformers ``DynamicCache`` from a snapshot makes every request concatenate onto the
document's tensors, copying the whole snapshot each step, and sdpa repeats the grouped KV heads. Here
each layer's attention is split in two ("cascade" attention):

- the prefix: every query of every row against the snapshot's ``[kv_heads, n, head_dim]`` tensors,
  unmasked; queries are grouped per KV head, so one matmul per layer reads the prefix once for the
  whole batch and no KV head is ever repeated;
- the suffix: each row's own question and answer tokens, in a buffer preallocated per request (its size
  depends on the question and the answer budget, never on the document), causally masked.

The two partial softmaxes share one running maximum and are merged exactly, so the result equals
attention over the concatenated keys. The decoder layers are driven here directly with the model's own
modules (projections, norms, rotary embedding, MLP): at this model size transformers' per-layer
bookkeeping costs as much as the arithmetic. Only Llama-family architectures with full attention in
every layer (Llama, Qwen2) qualify; ``supports`` says which, and the engine keeps the transformers path
for the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


def supports(model) -> bool:
    """True for a Llama-family decoder whose every layer attends to the whole context."""
    config = model.config
    layer_types = getattr(config, "layer_types", None) or ()
    return config.model_type in SUPPORTED_MODEL_TYPES and all(kind == "full_attention" for kind in layer_types)


@dataclass
class SuffixCache:
    """Per-request state: the rows' own keys and values after the shared prefix.

    ``keys[layer]`` / ``values[layer]`` are ``[rows, kv_heads, capacity, head_dim]``; ``lengths[row]``
    tokens of each row are filled in. The prefix tensors are only ever read.
    """

    prefix_keys: Sequence[torch.Tensor]
    prefix_values: Sequence[torch.Tensor]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lengths: torch.Tensor

    @property
    def prefix_len(self) -> int:
        return self.prefix_keys[0].shape[1]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Drop finished rows so later steps compute only the rows still decoding."""
        index = torch.tensor(rows, dtype=torch.long)
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]
        self.lengths = self.lengths.index_select(0, index)


class SharedPrefixDecoder:
    """Forward passes of a Llama-family causal LM over a shared prefix plus per-row suffixes."""

    def __init__(self, model):
        self.model = model
        self.decoder = model.model
        attention = self.decoder.layers[0].self_attn
        self.head_dim = attention.head_dim
        self.groups = attention.num_key_value_groups
        self.scaling = attention.scaling
        self.kv_heads = model.config.num_key_value_heads
        self.dtype = self.decoder.embed_tokens.weight.dtype

    def start(self, prefix_keys: Sequence[torch.Tensor], prefix_values: Sequence[torch.Tensor], rows: int,
              capacity: int) -> SuffixCache:
        """A suffix cache for ``rows`` requests of at most ``capacity`` tokens each after the prefix."""
        shape = (rows, self.kv_heads, capacity, self.head_dim)
        layers = len(self.decoder.layers)
        # zeros, not empty: a masked slot still meets its value in ``weights @ values`` (0 * NaN is NaN)
        return SuffixCache(prefix_keys, prefix_values, [torch.zeros(shape, dtype=self.dtype) for _ in range(layers)],
                           [torch.zeros(shape, dtype=self.dtype) for _ in range(layers)],
                           torch.zeros(rows, dtype=torch.long))

    @torch.inference_mode()
    def step(self, cache: SuffixCache, rows: Sequence[Sequence[int]], all_positions: bool = False) -> torch.Tensor:
        """Feed each row its next tokens (rows may differ in length); return the logits of each row's last
        token ``[rows, vocab]``, or with ``all_positions`` every fed position ``[rows, longest, vocab]``
        (positions past a shorter row's end are padding)."""
        widths = torch.tensor([len(ids) for ids in rows])
        longest = int(widths.max())
        if int((cache.lengths + longest).max()) > cache.capacity:
            raise ValueError(f"suffix cache of {cache.capacity} tokens is full")
        input_ids = torch.zeros(len(rows), longest, dtype=torch.long)
        for row, ids in enumerate(rows):
            input_ids[row, :len(ids)] = torch.tensor(ids)
        offsets = torch.arange(longest)
        slots = cache.lengths[:, None] + offsets  # [rows, longest]: where each new token's K/V go
        hidden = self.decoder.embed_tokens(input_ids)
        cos_sin = self.decoder.rotary_emb(hidden, position_ids=slots + cache.prefix_len)
        used = int(slots.max()) + 1
        visible = torch.arange(used) <= slots[:, :, None]  # [rows, longest, used]: causal within the suffix
        for index, layer in enumerate(self.decoder.layers):
            residual = hidden
            hidden = self._attend(layer.self_attn, layer.input_layernorm(hidden), cos_sin, cache, index, slots,
                                  visible)
            hidden = residual + hidden
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        cache.lengths += widths
        if all_positions:
            return self.model.lm_head(self.decoder.norm(hidden))
        last = hidden[torch.arange(len(rows)), widths - 1]
        return self.model.lm_head(self.decoder.norm(last))

    def _attend(self, attention, hidden: torch.Tensor, cos_sin, cache: SuffixCache, index: int,
                slots: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        rows, width, _ = hidden.shape
        shape = (rows, width, -1, self.head_dim)
        query = attention.q_proj(hidden).view(shape).transpose(1, 2)
        key = attention.k_proj(hidden).view(shape).transpose(1, 2)
        value = attention.v_proj(hidden).view(shape).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, *cos_sin)
        row_index = torch.arange(rows)[:, None]
        cache.keys[index][row_index, :, slots] = key.transpose(1, 2)
        cache.values[index][row_index, :, slots] = value.transpose(1, 2)
        used = visible.shape[-1]
        suffix_keys = cache.keys[index][:, :, :used]
        suffix_values = cache.values[index][:, :, :used]

        # queries grouped by KV head: [rows, kv_heads, groups * width, head_dim] (heads of one KV head are adjacent)
        grouped = (query * self.scaling).reshape(rows, self.kv_heads, self.groups * width, self.head_dim)
        suffix_scores = grouped @ suffix_keys.transpose(2, 3)
        suffix_scores = suffix_scores.view(rows, self.kv_heads, self.groups, width, used)
        suffix_scores.masked_fill_(~visible[:, None, None], float("-inf"))
        suffix_scores = suffix_scores.view(rows, self.kv_heads, self.groups * width, used)
        peak = suffix_scores.amax(-1, keepdim=True)

        if cache.prefix_len:
            # all rows' queries against the shared prefix at once: [kv_heads, rows * groups * width, n]
            stacked = grouped.transpose(0, 1).reshape(self.kv_heads, -1, self.head_dim)
            prefix_scores = stacked @ cache.prefix_keys[index].transpose(1, 2)
            prefix_peak = prefix_scores.amax(-1, keepdim=True).view(self.kv_heads, rows, -1, 1).transpose(0, 1)
            peak = torch.maximum(peak, prefix_peak)
            prefix_weights = prefix_scores.sub_(peak.transpose(0, 1).reshape(self.kv_heads, -1, 1)).exp_()
            prefix_sum = prefix_weights.sum(-1, keepdim=True)
            prefix_out = prefix_weights @ cache.prefix_values[index]

        suffix_weights = suffix_scores.sub_(peak).exp_()
        total = suffix_weights.sum(-1, keepdim=True)
        output = suffix_weights @ suffix_values
        if cache.prefix_len:
            total = total + prefix_sum.view(self.kv_heads, rows, -1, 1).transpose(0, 1)
            output = output + prefix_out.view(self.kv_heads, rows, -1, self.head_dim).transpose(0, 1)
        output = (output / total).reshape(rows, self.kv_heads * self.groups, width, self.head_dim)
        return attention.o_proj(output.transpose(1, 2).reshape(rows, width, -1))
