"""The engine: a small, fast CPU forward pass for Llama-family decoders (Llama, Qwen2), used for every route
(precompute, cache hit, full prompt, retrieval, batches, streams) when ``model.precision`` is q4k or int8.

Numeric recipe (``FastLM.recipe`` names it; it is part of what a snapshot means):

- Weights: int8, symmetric, one scale per output row (``scale = absmax / 127``, rounded to bf16, weights
  quantised against the rounded scale), for every linear including the (tied) lm_head. q/k/v are one
  matmul, gate/up are one matmul. Activations entering a matmul are bf16, accumulation is fp32, outputs are
  bf16: ``y = bf16(scale[n] * sum_k w[n, k] * x[k])``, computed by ``matmul="int8pack"`` (torch's
  ``_weight_int8pack_mm``; bf16 inputs only, else a ~25x slower fallback), ``"native"`` (``mm_int8`` of
  ``fastlm_kernels.cpp`` with dpbf16 on weights packed in blocks of 16 channels, 2-2.5x faster) or ``"amx"``
  (where the CPU has AMX-BF16: blocks of ``AMX_MIN_WIDTH`` tokens a row or more on AMX tiles, ``mm_int8_amx``,
  4-10x ``mm_int8`` on many rows; narrower ones, decoding, with ``mm_int8``). Only the summation order
  differs, and a kernel is chosen by a block's width only. Under q4k (``q4k``, native backend) the linears
  the model's GGUF stores as Q4_K are those blocks, as the file holds them, ``mm_q4k`` at every width.
- The embedding, residual stream, RMSNorm statistics, Qwen2's q/k/v biases, RoPE and SiLU are fp32.
- K/V are stored in bf16. Attention: bf16 q (pre-scaled) against bf16 K, fp32 scores and softmax statistics,
  weights rounded to bf16 against bf16 V with fp32 accumulation. Keys come from two places that are never
  concatenated: a read-only shared prefix (the snapshot, ``[kv_heads, T, head_dim]`` per layer, never copied
  or written) and the request's own suffix buffer (question + generated tokens, causal). Their softmaxes
  are merged exactly (log-sum-exp over fixed 256-key chunks, in order). GQA: query heads are grouped per
  KV head, K/V heads are never repeated.
- A prefix is prefilled in blocks of ``prefill_block`` tokens from position 0; a question is one block after
  it; a decode step is one token, or (prompt lookup, ``lookup``) the last token and up to 3 guesses, whose
  rows are bitwise one-token steps. A full-prompt answer runs exactly these blocks (``answer_full``): bitwise
  the cache hit (tokens and logits). A batched answer prefills each question alone, then decodes the rows
  together with kernels whose every output row is independent of the batch: bitwise a single answer too.

Backends: ``native`` (C++/AVX-512-BF16 kernels from ``fastlm_kernels.cpp``, compiled once with torch's
cpp_extension, cached under ``$CAGFLOW_HOME/kernels``) and ``torch`` (pure PyTorch, for CPUs without
avx512_bf16 or a compiler: slower, close to but not bitwise equal to ``native``). Each is deterministic and
self-consistent; a snapshot must be used with the recipe that produced it. The torch backend's
``matmul="f32"`` (its default where MKL is torch's BLAS) runs attention in fp32 on the bf16 K/V and blocks of
at least ``WIDE_BLOCK`` tokens a row with fp32 GEMMs on int8 weights widened per block (exact; on AVX2 2.7x the
prefill speed of ``int8pack``), with MKL switched to strict reproducibility on import (``kernels``) so results
do not depend on the thread count; where that is impossible ``f32`` is refused and ``auto`` picks ``int8pack``.

Weights: the first load quantises the checkpoint into one file every process maps read-only (``weights_file``);
the kernels and MKL's mode live in ``kernels``, the configuration and recipe names in ``lm_config``.
Entry points: ``FastLM.from_pretrained``, ``FastLM.load``, ``prefill_prefix``, ``steps`` (greedy tokens step by
step, for streams and batches), ``answer``, ``answer_batch``, ``answer_full``, ``logits``. Threads: the caller's
``torch.set_num_threads``; ``block_threads`` may widen each block (README "Thread policy").
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from .kernels import MKL_STRICT_ERROR, amx_ready, native_error, native_kernels
from .lm_config import (Q4K_SUFFIX, LMConfig, config_from_hf, folder_config, native_matmul, recipe_name,
                        rope_tables, shapes_fit_amx, shapes_fit_native, torch_matmul)
from .layers import Layer, quantise_checkpoint
from .q4k import read_blocks
from .lookup import DRAFT_TOKENS, looked_up
from .threads import at_least_threads
from .weights_file import CheckpointTensors, map_weights, round_up, write_weights

log = logging.getLogger("cagflow.engine")

WIDE_BLOCK = 64  # tokens a row from which the torch backend's f32 matmul computes a block with fp32 GEMMs
AMX_MIN_WIDTH = 8  # tokens a row from which matmul "amx" computes a block with AMX tiles (rows are padded to 32)

PrefixKV = tuple[list[torch.Tensor], list[torch.Tensor]]  # (keys, values): per layer [kv_heads, T, head_dim] bf16


@dataclass
class Generation:
    """One greedy answer: generated ids (the EOS that stopped it included), the logits [vocab] (fp32) that
    chose each of them, and timings from the start of the call."""

    tokens: list[int]
    logits: list[torch.Tensor] = field(default_factory=list)
    finish_reason: str = "length"  # "eos" | "length"
    ttft_s: float = 0.0
    total_s: float = 0.0


class FastLM:
    """An int8/bf16 forward pass of a Llama-family causal LM with shared-prefix (snapshot) attention."""

    def __init__(self, config: LMConfig, tensors: Mapping[str, torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
                 backend: str = "auto", prefill_block: int = 512, matmul: str = "auto", prepared: bool = False,
                 q4k_blocks: Mapping[str, torch.Tensor] | None = None, q4k: bool = False):
        """``tensors``: a checkpoint's (quantised here), or with ``prepared`` the tensors ``save_weights``
        wrote (used as they are). ``q4k_blocks`` (``q4k.read_blocks``, native backend only): the linears to
        keep in the GGUF's Q4_K blocks; ``q4k`` says a prepared file holds such weights."""
        self.config = config
        self.prefill_block = prefill_block
        shapes_ok = shapes_fit_native(config)
        if backend == "auto":
            backend = "native" if shapes_ok and native_kernels() is not None else "torch"
        if backend == "native" and native_kernels() is None:
            raise RuntimeError(f"native kernels unavailable: {native_error()}")
        if backend == "native" and not shapes_ok:
            raise ValueError("the native backend needs head_dim 64 or 128 and hidden / intermediate sizes "
                             "that are multiples of 16")
        if backend not in ("native", "torch"):
            raise ValueError(f"backend must be auto, native or torch, not {backend!r}")
        self.backend = backend
        self._k = native_kernels() if backend == "native" else None
        if matmul == "auto":
            matmul = native_matmul(config) if self._k is not None else torch_matmul()
        if matmul not in ("native", "amx", "int8pack", "f32") or (matmul in ("native", "amx")) != (self._k is not None):
            raise ValueError("matmul must be native or amx with the native backend, int8pack or f32 with torch")
        if matmul == "amx" and not (amx_ready() and shapes_fit_amx(config)):
            raise ValueError("matmul amx needs a CPU with AMX-BF16 whose tile state the OS grants, and hidden and "
                             "intermediate sizes that are multiples of 32")
        if matmul == "f32" and MKL_STRICT_ERROR:
            raise ValueError(f"matmul f32 needs MKL's strict reproducible mode: {MKL_STRICT_ERROR}")
        self.matmul = matmul
        self._native_mm = matmul in ("native", "amx")
        self.q4k = q4k or q4k_blocks is not None
        if self.q4k and self._k is None:
            raise ValueError("Q4_K weights need the native backend")
        # threads for each block (a prefill block or one decode step), asked as it starts: None keeps the caller's
        self.block_threads: Callable[[], int] | None = None
        self.cos, self.sin = rope
        self.scaling = config.head_dim ** -0.5
        if prepared:
            self._adopt(tensors)
        else:
            self._quantise(tensors, q4k_blocks or {})
        self._flat = [t for layer in self.layers for t in layer.flat()]

    def _adopt(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.embed, self.w_lm, self.s_lm, self.norm = (tensors[name] for name in ("embed", "w_lm", "s_lm", "norm"))
        self.layers = [Layer(**{f.name: tensors[f"layers.{i}.{f.name}"] for f in fields(Layer)})
                       for i in range(self.config.layers)]

    def _quantise(self, tensors: Mapping[str, torch.Tensor], blocks: Mapping[str, torch.Tensor]) -> None:
        self.embed, self.w_lm, self.s_lm, self.norm, self.layers = quantise_checkpoint(
            self.config, tensors, blocks, self._k, self._native_mm)

    def _named_weights(self) -> dict[str, torch.Tensor]:
        named = {"embed": self.embed, "w_lm": self.w_lm, "s_lm": self.s_lm, "norm": self.norm}
        for i, layer in enumerate(self.layers):
            named.update({f"layers.{i}.{f.name}": getattr(layer, f.name) for f in fields(Layer)})
        return named

    def save_weights(self, path: Path) -> None:
        """Write the prepared tensors to ``path`` (``weights_file.write_weights``), for ``load`` to map."""
        write_weights(path, self._named_weights(), self.recipe)

    @classmethod
    def load(cls, folder: str | os.PathLike, weights_file: str | os.PathLike, **kwargs) -> "FastLM":
        """The model of ``folder`` with the tensors of ``weights_file`` (from ``save_weights``) mapped
        read-only: the pages are the page cache's, shared by every process that maps the file."""
        config, rope = folder_config(Path(folder))
        tensors, recipe, mapped = map_weights(weights_file)
        model = cls(config, tensors, rope, prepared=True, q4k=recipe.endswith(Q4K_SUFFIX), **kwargs)
        if model.recipe != recipe:
            raise ValueError(f"{weights_file} holds weights for {recipe}, this engine runs {model.recipe}")
        model._mapped = mapped  # the tensors are views of this mapping: keep it open as long as the model
        return model

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, gguf: Path | None = None, **kwargs) -> "FastLM":
        """Load an HF safetensors folder (config.json + *.safetensors), quantising on the fly; with ``gguf``
        (the file the folder was converted from), its Q4_K linears are kept as they are (``q4k``)."""
        from safetensors import safe_open

        folder = Path(folder)
        config, rope = folder_config(folder)
        handles = [safe_open(str(path), framework="pt") for path in sorted(folder.glob("*.safetensors"))]
        tensors = CheckpointTensors({name: handle for handle in handles for name in handle.keys()})
        if not tensors:
            raise FileNotFoundError(f"{folder}: no *.safetensors")
        return cls(config, tensors, rope, q4k_blocks=read_blocks(gguf, tensors) if gguf else None, **kwargs)

    @classmethod
    def from_hf_model(cls, model, **kwargs) -> "FastLM":
        """From an in-memory transformers model (tests: tiny random models)."""
        config = config_from_hf(model.config)
        tensors = {name: t.detach() for name, t in model.state_dict().items()}
        return cls(config, tensors, rope_tables(model.config, config.max_positions), **kwargs)

    @property
    def recipe(self) -> str:
        """What a snapshot depends on besides the model weights: put it into the snapshot fingerprint."""
        return recipe_name(self.backend, self.matmul, self.prefill_block, self.q4k)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.eos_token_ids

    # ---- the forward pass ----

    def _new_suffix(self, rows: int, capacity: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        c = self.config
        shape = (rows, c.kv_heads, capacity, c.head_dim)
        # zeros, not empty: the torch backend multiplies masked (zero) weights by unused slots
        return ([torch.zeros(shape, dtype=torch.bfloat16) for _ in range(c.layers)],
                [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(c.layers)])

    def _block(self, ids: torch.Tensor, prefix: PrefixKV | None, sk: list[torch.Tensor], sv: list[torch.Tensor],
               start: torch.Tensor) -> torch.Tensor:
        """Run ``ids`` [R, W] through every layer; row r's tokens go to suffix slots start[r] + w (positions
        prefix_len + slot). Returns the final hidden states fp32 [R, W, hidden] (before the final norm)."""
        c = self.config
        rows, width = ids.shape
        prefix_len = prefix[0][0].shape[1] if prefix is not None else 0
        slots = start[:, None] + torch.arange(width)
        positions = (slots + prefix_len).reshape(-1)
        if int(positions.max()) >= self.cos.shape[0]:
            raise ValueError(f"position {int(positions.max())} beyond the model's {self.cos.shape[0]} positions")
        x = self.embed.index_select(0, ids.reshape(-1))
        cos = self.cos.index_select(0, positions)
        sin = self.sin.index_select(0, positions)
        pk, pv = prefix if prefix is not None else ([], [])
        with at_least_threads(self.block_threads() if self.block_threads is not None else 0):
            if self._k is not None:
                kernel = 2 if self.matmul == "amx" and width >= AMX_MIN_WIDTH else 1  # mm_int8_amx or mm_int8
                self._k.run_layers(x, self._flat, cos, sin, pk, pv, sk, sv, start, rows, width, c.kv_heads,
                                   c.groups, c.head_dim, c.eps, self.scaling, kernel)
            else:
                self._torch_layers(x, cos, sin, pk, pv, sk, sv, start, rows, width)
        return x.view(rows, width, c.hidden)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head: fp32 [M, hidden] -> fp32 logits [M, vocab]."""
        h = self._rmsnorm(hidden.contiguous(), self.norm)
        if self._native_mm:
            return self._k.mm_int8(h, self.w_lm, self.s_lm).float()
        return torch.ops.aten._weight_int8pack_mm(h, self.w_lm, self.s_lm).float()

    def _rmsnorm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._k is not None:
            return self._k.rmsnorm_bf16(x, weight, self.config.eps)
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.eps) * weight).to(torch.bfloat16)

    # ---- torch backend (reference implementation of the same recipe) ----

    def _torch_layers(self, x, cos, sin, pk, pv, sk, sv, start, rows, width) -> None:
        c = self.config
        f32 = self.matmul == "f32"
        mm = _widened_mm if f32 and width >= WIDE_BLOCK else torch.ops.aten._weight_int8pack_mm
        half = c.head_dim // 2
        q_width, kv_width = c.heads * c.head_dim, c.kv_heads * c.head_dim
        row_index = torch.arange(rows)[:, None]
        slots = start[:, None] + torch.arange(width)
        cos, sin = cos[:, None, :], sin[:, None, :]
        for index, layer in enumerate(self.layers):
            qkv = mm(self._rmsnorm(x, layer.ln1), layer.w_qkv, layer.s_qkv).float()
            if layer.b_qkv.numel():
                qkv += layer.b_qkv
            q = qkv[:, :q_width].view(-1, c.heads, c.head_dim)
            k = qkv[:, q_width:q_width + kv_width].view(-1, c.kv_heads, c.head_dim)
            v = qkv[:, q_width + kv_width:].view(-1, c.kv_heads, c.head_dim)

            def rotate(t):
                return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin

            q = (rotate(q) * self.scaling).to(torch.bfloat16).view(rows, width, c.kv_heads, c.groups, c.head_dim)
            sk[index][row_index, :, slots] = rotate(k).to(torch.bfloat16).view(rows, width, c.kv_heads, c.head_dim)
            sv[index][row_index, :, slots] = v.to(torch.bfloat16).view(rows, width, c.kv_heads, c.head_dim)
            # one row at a time: a bf16 matmul's summation order can depend on its length, so a row's keys are
            # never padded to a longer row's (batched rows stay bitwise equal to single answers)
            out = torch.cat([self._torch_attend(q[r:r + 1], pk[index] if pk else None, pv[index] if pv else None,
                                                sk[index][r:r + 1], sv[index][r:r + 1], start[r:r + 1], f32)
                             for r in range(rows)])
            x += mm(out.view(rows * width, -1), layer.w_o, layer.s_o).float()
            gu = mm(self._rmsnorm(x, layer.ln2), layer.w_gu, layer.s_gu).float()
            act = (F.silu(gu[:, :c.intermediate]) * gu[:, c.intermediate:]).to(torch.bfloat16)
            x += mm(act, layer.w_down, layer.s_down).float()

    def _torch_attend(self, q, pk, pv, sk, sv, start, f32: bool) -> torch.Tensor:
        """q [R, W, KV, G, D] bf16 -> [R, W, KV, G, D] bf16: prefix (unmasked) and suffix (causal) softmaxes
        merged by log-sum-exp, statistics in fp32. Scores come out of bf16 bmm (rounded to bf16), or with
        ``f32`` out of fp32 bmm on the same bf16 values (exact products, fp32 sums: MKL's fp32 GEMM is many
        times faster than its bf16 one on CPUs without avx512_bf16)."""
        if f32:
            q, sk, sv = q.float(), sk.float(), sv.float()
            pk, pv = (pk.float(), pv.float()) if pk is not None else (pk, pv)
        rows, width, kv, groups, dim = q.shape
        grouped = q.permute(0, 2, 1, 3, 4).reshape(rows, kv, width * groups, dim)  # query n = w * G + g
        used = int(start.max()) + width
        keys, values = sk[:, :, :used], sv[:, :, :used]
        scores = torch.matmul(grouped, keys.transpose(2, 3)).float()  # [R, KV, W*G, used]
        limit = (start[:, None] + torch.arange(width) + 1).repeat_interleave(groups, dim=1)  # [R, W*G]
        visible = torch.arange(used) < limit[:, :, None]
        scores.masked_fill_(~visible[:, None], float("-inf"))
        peak = scores.amax(-1, keepdim=True)
        if pk is not None and pk.shape[1]:
            stacked = grouped.transpose(0, 1).reshape(kv, rows * width * groups, dim)
            prefix_scores = torch.bmm(stacked, pk.transpose(1, 2)).float()
            prefix_peak = prefix_scores.amax(-1, keepdim=True).view(kv, rows, -1, 1).transpose(0, 1)
            peak = torch.maximum(peak, prefix_peak)
            prefix_weights = prefix_scores.sub_(peak.transpose(0, 1).reshape(kv, -1, 1)).exp_()
            prefix_sum = prefix_weights.sum(-1, keepdim=True).view(kv, rows, -1, 1).transpose(0, 1)
            prefix_out = torch.bmm(_bf16_values(prefix_weights, f32), pv).float()
            prefix_out = prefix_out.view(kv, rows, -1, dim).transpose(0, 1)
        weights = scores.sub_(peak).exp_()
        total = weights.sum(-1, keepdim=True)
        out = torch.matmul(_bf16_values(weights, f32), values).float()
        if pk is not None and pk.shape[1]:
            total = total + prefix_sum
            out = out + prefix_out
        out = (out / total).view(rows, kv, width, groups, dim).permute(0, 2, 1, 3, 4)
        return out.to(torch.bfloat16).contiguous()

    @property
    def lookup_exact(self) -> bool:
        """Whether each row of a lookup block is bitwise a one-token step (mm_int8 up to 4 rows; not torch's)."""
        return self._native_mm and 1 + DRAFT_TOKENS < AMX_MIN_WIDTH

    # ---- public API ----

    @torch.inference_mode()
    def prefill_prefix(self, token_ids: Sequence[int], on_block: Callable[[int, int], None] | None = None,
                       after: PrefixKV | None = None) -> PrefixKV:
        """The snapshot of a document prefix: per layer K and V ``[kv_heads, T, head_dim]`` bf16 (contiguous),
        computed in blocks of ``prefill_block`` tokens from position 0; ``on_block(done, total)`` hears each.
        With ``after`` (a prefix's K/V), the tokens follow it: the result is ``after`` and then theirs."""
        c = self.config
        start = after[0][0].shape[1] if after is not None else 0
        n = start + len(token_ids)
        if n == start:
            raise ValueError("empty prefix")
        keys = [torch.empty(c.kv_heads, n, c.head_dim, dtype=torch.bfloat16) for _ in range(c.layers)]
        values = [torch.empty(c.kv_heads, n, c.head_dim, dtype=torch.bfloat16) for _ in range(c.layers)]
        if after is not None:
            for mine, theirs in zip(keys + values, after[0] + after[1]):
                mine[:, :start] = theirs
        ids = torch.tensor([0] * start + list(token_ids), dtype=torch.long)
        zero = torch.zeros(1, dtype=torch.long)
        for begin in range(start, n, self.prefill_block):
            end = min(n, begin + self.prefill_block)
            prefix = ([k[:, :begin] for k in keys], [v[:, :begin] for v in values]) if begin else None
            self._block(ids[None, begin:end], prefix, [k[None, :, begin:end] for k in keys],
                        [v[None, :, begin:end] for v in values], zero)
            if on_block is not None:
                on_block(end, n)
        return keys, values

    @torch.inference_mode()
    def logits(self, prefix: PrefixKV | None, suffix_ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Logits fp32 [len(suffix_ids), vocab] at every suffix position (the exactness check), or [1, vocab] at
        the last one (the vocabulary projection of every position costs more than the block itself)."""
        sk, sv = self._new_suffix(1, round_up(len(suffix_ids), 16))
        hidden = self._block(torch.tensor([list(suffix_ids)]), prefix, sk, sv, torch.zeros(1, dtype=torch.long))
        return self._head(hidden[0, -1:] if last_only else hidden[0])

    def answer(self, prefix: PrefixKV | None, suffix_ids: Sequence[int], max_new_tokens: int,
               eos_token_ids: Iterable[int] | None = None, keep_logits: bool = True) -> Generation:
        """Greedy answer to ``suffix_ids`` (question tokens) after ``prefix`` (a snapshot, or None)."""
        return self.answer_batch(prefix, [suffix_ids], max_new_tokens, eos_token_ids, keep_logits)[0]

    def answer_full(self, prompt_ids: Sequence[int], prefix_len: int, max_new_tokens: int,
                    eos_token_ids: Iterable[int] | None = None, keep_logits: bool = True) -> Generation:
        """The full-prompt route: the same blocks as a cache hit (prefix blocks, then the question block),
        computed from scratch. Bitwise identical to ``answer(prefill_prefix(ids[:p]), ids[p:], ...)``."""
        started = time.perf_counter()
        prefix = self.prefill_prefix(prompt_ids[:prefix_len]) if prefix_len else None
        prefill_s = time.perf_counter() - started
        result = self.answer(prefix, prompt_ids[prefix_len:], max_new_tokens, eos_token_ids, keep_logits)
        result.ttft_s += prefill_s  # timings from this call's start
        result.total_s += prefill_s
        return result

    def answer_batch(self, prefix: PrefixKV | None, suffixes: Sequence[Sequence[int]], max_new_tokens: int,
                     eos_token_ids: Iterable[int] | None = None, keep_logits: bool = True) -> list[Generation]:
        """Greedy answers to several questions over one prefix (see ``steps``)."""
        started = time.perf_counter()
        results = [Generation([]) for _ in suffixes]
        for step in self.steps(prefix, suffixes, max_new_tokens, eos_token_ids, keep_logits):
            now = time.perf_counter() - started
            for row, (token, logits) in step.items():
                result = results[row]
                result.tokens.append(token)
                if logits is not None:
                    result.logits.append(logits)
                result.ttft_s = result.ttft_s or now
                result.total_s = now
        eos = set(self.eos_token_ids if eos_token_ids is None else eos_token_ids)
        for result in results:
            result.finish_reason = "eos" if result.tokens[-1] in eos else "length"
        return results

    @torch.inference_mode()
    def steps(self, prefix: PrefixKV | None, suffixes: Sequence[Sequence[int]], max_new_tokens: int,
              eos_token_ids: Iterable[int] | None = None, keep_logits: bool = False,
              lookup: Sequence[int] | None = None) -> Iterator[dict[int, tuple[int, torch.Tensor | None]]]:
        """Greedy decoding of several questions over one prefix, one step at a time: yields ``{row: (token,
        logits or None)}`` for the rows still running. A row stops after an EOS token (yielded) or
        ``max_new_tokens`` tokens. Each question block is prefilled on its own (so it computes exactly what a
        single answer computes), then the rows decode together, one token per row per step, reading the prefix
        once per step for all rows. ``lookup``: one question's whole prompt (prefix tokens included), to
        decode it with prompt lookup (``engine.lookup``: the same tokens, often several per pass)."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if any(len(s) == 0 for s in suffixes):
            raise ValueError("every question needs at least one token")
        eos = set(self.eos_token_ids if eos_token_ids is None else eos_token_ids)
        rows = len(suffixes)
        capacity = round_up(max(map(len, suffixes)) + max_new_tokens, 16)
        sk, sv = self._new_suffix(rows, capacity)
        lengths = torch.zeros(rows, dtype=torch.long)
        feed = torch.zeros(rows, dtype=torch.long)
        produced = [0] * rows
        zero = torch.zeros(1, dtype=torch.long)

        def take(row: int, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
            produced[row] += 1
            return int(logits.argmax()), logits.clone() if keep_logits else None

        for row, ids in enumerate(suffixes):
            hidden = self._block(torch.tensor([list(ids)]), prefix, [k[row:row + 1] for k in sk],
                                 [v[row:row + 1] for v in sv], zero)
            token, logits = take(row, self._head(hidden[0, -1:])[0])
            yield {row: (token, logits)}
            lengths[row] = len(ids)
            feed[row] = token
        running = [row for row in range(rows) if int(feed[row]) not in eos and produced[row] < max_new_tokens]
        if running and lookup is not None and rows == 1 and self.lookup_exact:
            def block(tokens: list[int], length: int) -> torch.Tensor:
                hidden = self._block(torch.tensor([tokens]), prefix, sk, sv, torch.tensor([length]))
                return self._head(hidden[0])
            yield from looked_up(block, len(suffixes[0]), [*lookup, int(feed[0])], max_new_tokens - produced[0],
                                 eos, take)
            return
        if len(running) < rows:
            sk, sv, lengths, feed = _keep(sk, sv, lengths, feed, running)
        while running:
            hidden = self._block(feed[:, None], prefix, sk, sv, lengths)
            logits = self._head(hidden[:, 0])
            lengths += 1
            step = {row: take(row, logits[position]) for position, row in enumerate(running)}
            yield step
            keep = [position for position, row in enumerate(running)
                    if step[row][0] not in eos and produced[row] < max_new_tokens]
            for position in keep:
                feed[position] = step[running[position]][0]
            if len(keep) < len(running):
                sk, sv, lengths, feed = _keep(sk, sv, lengths, feed, keep)
                running = [running[position] for position in keep]


def _widened_mm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The recipe's ``bf16(scale[n] * sum_k w[n, k] * x[k])`` as an fp32 GEMM: int8 weights and bf16 inputs
    are exact in fp32, only the summation order differs from _weight_int8pack_mm."""
    return (torch.mm(x.float(), weight.float().t()) * scales.float()).to(torch.bfloat16)


def _bf16_values(weights: torch.Tensor, f32: bool) -> torch.Tensor:
    """Attention weights rounded to bf16, in the dtype of that block's bmm."""
    rounded = weights.to(torch.bfloat16)
    return rounded.float() if f32 else rounded


def _keep(sk, sv, lengths, feed, rows: list[int]):
    """Keep only the rows still decoding (copies the suffix buffers, never the prefix)."""
    index = torch.tensor(rows, dtype=torch.long)
    return ([k.index_select(0, index) for k in sk], [v.index_select(0, index) for v in sv],
            lengths.index_select(0, index), feed.index_select(0, index))


