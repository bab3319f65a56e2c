"""Prompt lookup decoding: an answer from a document mostly copies the document's words, so the tokens that
followed the answer's last few tokens where they last occurred (in the prompt or in the answer so far) are a
good guess for its next ones. One block of the decoded token and up to ``DRAFT_TOKENS`` guesses checks them
all: each guess equal to the token greedy decoding picks at its place is kept, with the token after it, so one
pass over the weights (what a decode step costs on a CPU) can give up to 1 + ``DRAFT_TOKENS`` tokens.

It is exact, not approximate: a block of at most 4 rows is multiplied by ``mm_int8`` in one pass whose every
row is bitwise what a one-row step computes (fastlm_kernels.cpp), and attention's result for a query does not
depend on how many queries share its block, so the tokens and logits are those of one-token steps
(tests/unit/engine/test_lookup.py checks both backends). Guesses that fail cost that block's few extra rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

DRAFT_TOKENS = 3  # the decoded token and 3 guesses: 4 rows, mm_int8's widest one-pass block
# Tokens guessed after a match of the answer's last n tokens (the longest match wins). A 3-token match is
# mostly a phrase being copied; a shorter one is right less often, and a block of 4 costs ~1.7x a one-token
# step on this CPU, one of 2 only ~1.1x (bench/README "Prompt lookup": chosen on the calibration questions).
GUESSES = {3: DRAFT_TOKENS, 2: 1, 1: 1}


class PromptLookup:
    """Guesses from a growing token history: for each n-gram size, the position after its latest occurrence."""

    def __init__(self, history: Sequence[int]):
        self.history: list[int] = []
        self._after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in GUESSES}
        for token in history:
            self.append(token)

    def append(self, token: int) -> None:
        """Add the next token; the n-grams ending just before it now point at it."""
        history, end = self.history, len(self.history)
        for n, after in self._after.items():
            if end >= n:
                after[tuple(history[end - n:end])] = end
        history.append(token)

    def guess(self, limit: int = DRAFT_TOKENS) -> list[int]:
        """The tokens (``GUESSES``, at most ``limit``) that followed the latest earlier occurrence of the
        history's longest matching last tokens; a copy reaching the end of the history goes on copying itself
        (a repeat repeats)."""
        history = self.history
        for n, after in self._after.items():
            found = after.get(tuple(history[-n:])) if len(history) >= n else None
            if found is not None:
                limit = min(limit, GUESSES[n])
                copied = history[found:found + limit]
                while len(copied) < limit:
                    copied.append(copied[len(copied) - (len(history) - found)])
                return copied
        return []


def looked_up(block: Callable[[list[int], int], Any], length: int, history: list[int], budget: int,
              eos: set[int], take: Callable[[int, Any], tuple[int, Any]]) -> Iterator[dict[int, tuple[int, Any]]]:
    """One row's greedy steps (``FastLM.steps``'s items) from its last token, ``history[-1]`` (the prompt and
    the answer so far before it), which is not yet in the suffix buffers; they hold ``length`` tokens.
    ``block(tokens, at)`` runs tokens from suffix slot ``at`` and returns their logits; ``take`` picks a
    token from logits. Each block is the last token and its guesses; outputs are taken while they confirm the
    guesses, at most ``budget`` and up to an EOS token. Slots past the kept tokens are overwritten next."""
    guesser = PromptLookup(history)
    while True:
        guesses = guesser.guess(min(DRAFT_TOKENS, budget - 1))
        logits = block([guesser.history[-1], *guesses], length)
        for place in range(len(guesses) + 1):
            token, kept = take(0, logits[place])
            yield {0: (token, kept)}
            guesser.append(token)
            budget -= 1
            if token in eos or budget == 0:
                return
            if place == len(guesses) or token != guesses[place]:
                break
        length += place + 1
