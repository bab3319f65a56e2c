"""Reused keys and values of retrieved passages: the retrieval route without prefilling its passages.

Each passage's K/V is computed once, after the instruction that opens the retrieval route's system turn
(``PromptBuilder.passage_layout``), offline by the ingest DAG or on first use, and kept content-addressed: the
key is a hash of the model fingerprint, the instruction's ids and the passage's ids. At query time the
passages' states are placed one after another behind the instruction's, each key re-rotated by RoPE to its new
position (``k' = R(delta) k``: rotations compose), and only the question is prefilled. A passage then attends
to the instruction and to itself but not to the passages placed before it, so this is an approximation of a
full prefill (CacheBlend's setting without its recomputed tokens). ``model.passage_kv_recompute`` trailing
passages are prefilled in context instead, behind the others' states; accuracy is measured by ``cagflow bench
passages`` (bench/README "Reused passage states"), and ``model.passage_kv: prefill`` turns reuse off.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from ..answering.prompt import PassageLayout
from ..errors import CagflowError
from .fastlm import FastLM, PrefixKV

FORMAT = "cagflow-passage-kv-v1"


class PassageStateError(CagflowError, ValueError):
    """A stored passage state that does not belong to this model or is damaged."""

    code = "passage_state_unusable"


def passage_key(fingerprint: str, header: Sequence[int], piece: Sequence[int]) -> str:
    """The content address of one passage's state."""
    digest = hashlib.sha256(f"{FORMAT}\n{fingerprint}\n".encode())
    digest.update(b",".join(str(token).encode() for token in header) + b"\n")
    digest.update(b",".join(str(token).encode() for token in piece))
    return digest.hexdigest()


def state_bytes(state: PrefixKV) -> int:
    keys, values = state
    return sum(t.numel() * t.element_size() for t in (*keys, *values))


def rerotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Keys [kv_heads, T, head_dim] rotated further by one position's angles (``cos``/``sin`` [head_dim]),
    in the half-split layout the forward pass uses; fp32 arithmetic, bf16 result."""
    half = keys.shape[-1] // 2
    k = keys.float()
    turned = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
    return (k * cos + turned * sin).to(keys.dtype)


class PassageStates:
    """Passage states of one int8 engine: computed, loaded (``load(key)``: a stored state or None) and kept
    in memory up to ``max_bytes`` (least recently used first out)."""

    def __init__(self, fast: FastLM, fingerprint: str, max_bytes: int,
                 load: Callable[[str], PrefixKV | None] | None = None, recompute_last: int = 0):
        if float(fast.cos[0].abs().max()) != 1.0 or float(fast.sin[0].abs().max()) != 0.0:
            raise ValueError("passage states need plain RoPE (position 0 must be the identity rotation)")
        self.fast = fast
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        self._load = load
        self.recompute_last = recompute_last  # trailing passages prefilled in context, behind the others' states
        self._kept: OrderedDict[str, PrefixKV] = OrderedDict()
        self._kept_bytes = 0
        self._lock = threading.Lock()

    def key(self, header: Sequence[int], piece: Sequence[int]) -> str:
        return passage_key(self.fingerprint, header, piece)

    def compute(self, header: Sequence[int], piece: Sequence[int]) -> PrefixKV:
        """The passage's K/V at positions len(header)..: prefilled behind the instruction's state (kept, so
        each passage costs only its own tokens), which is then dropped."""
        after = self.state([], header)[0] if header else None
        keys, values = self.fast.prefill_prefix(piece, after=after)
        start = len(header)
        return [k[:, start:].contiguous() for k in keys], [v[:, start:].contiguous() for v in values]

    def _remember(self, key: str, state: PrefixKV) -> None:
        size = state_bytes(state)
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._kept:
                return
            self._kept[key] = state
            self._kept_bytes += size
            while self._kept_bytes > self.max_bytes:
                _, dropped = self._kept.popitem(last=False)
                self._kept_bytes -= state_bytes(dropped)

    def _kept_state(self, key: str) -> PrefixKV | None:
        with self._lock:
            state = self._kept.get(key)
            if state is not None:
                self._kept.move_to_end(key)
            return state

    def state(self, header: Sequence[int], piece: Sequence[int]) -> tuple[PrefixKV, bool]:
        """(state, whether it was reused): kept, else stored, else computed now (and kept)."""
        key = self.key(header, piece)
        state = self._kept_state(key)
        if state is not None:
            return state, True
        state = self._load(key) if self._load is not None else None
        reused = state is not None and state[0][0].shape[1] == len(piece)
        if not reused:
            state = self.compute(header, piece)
        self._remember(key, state)
        return state, reused

    def compose(self, layout: PassageLayout) -> tuple[PrefixKV, int]:
        """The prefix K/V of ``layout`` (instruction, then every passage) and how many of its tokens were
        reused rather than computed for this request. The last ``recompute_last`` passages are prefilled
        behind the others' states, so they attend to every passage before them as in a full prefill."""
        header_state, header_reused = self.state([], layout.header)
        parts = [header_state]
        reused = len(layout.header) if header_reused else 0
        position = len(layout.header)
        placed = max(0, len(layout.pieces) - self.recompute_last)
        for piece in layout.pieces[:placed]:
            (keys, values), was_reused = self.state(layout.header, piece)
            shift = position - len(layout.header)
            if shift:
                cos, sin = self.fast.cos[shift], self.fast.sin[shift]
                keys = [rerotate(k, cos, sin) for k in keys]
            parts.append((keys, values))
            reused += len(piece) if was_reused else 0
            position += len(piece)
        layers = len(header_state[0])
        composed = ([torch.cat([part[0][i] for part in parts], dim=1) for i in range(layers)],
                    [torch.cat([part[1][i] for part in parts], dim=1) for i in range(layers)])
        rest = [token for piece in layout.pieces[placed:] for token in piece]
        return (self.fast.prefill_prefix(rest, after=composed) if rest else composed), reused
