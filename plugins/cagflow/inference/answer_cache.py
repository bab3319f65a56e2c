"""Answers already given, and answers being computed, keyed by what determines them.

Greedy decoding is deterministic: the same question on the same snapshot with the same budget gives the
same tokens. So a serving process

- computes identical questions that are in flight at the same time once (single flight): the first
  request leads, later ones follow and get the leader's answer or its error;
- keeps finished answers in a bounded LRU (``max_entries``, 0 = off) until the release changes.

The key holds the release, so an answer can never outlive the release it was computed on, even when it
is stored just after a switch; ``clear()`` on a switch frees the memory.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, Hashable, TypeVar

Value = TypeVar("Value")

COMPUTED, MERGED, ANSWER_CACHE = "computed", "merged", "answer-cache"


def normalise_question(question: str) -> str:
    """Questions that render the same prompt share answers: only the surrounding whitespace, which the
    prompt drops, is ignored; case and inner spacing change the tokens, and so maybe the answer."""
    return question.strip()


def context_digest(passages: Any) -> str:
    """A short stable name for a list of retrieved passages (their repr is deterministic)."""
    return "context:" + hashlib.sha256(repr(passages).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class AnswerKey:
    release_id: str  # empty for answers that depend on no release (retrieved context)
    scope: str  # the snapshot key or doc_id as requested, or a context digest
    question: str  # normalised
    max_new_tokens: int

    @classmethod
    def of(cls, release_id: str, scope: str, question: str, max_new_tokens: int) -> "AnswerKey":
        return cls(release_id, scope, normalise_question(question), max_new_tokens)


@dataclass(frozen=True)
class Claim(Generic[Value]):
    """What ``AnswerCache.claim`` found: a stored value (``source`` answer-cache), another request's
    computation to wait for (merged), or the duty to compute and ``finish`` (computed)."""

    key: Hashable | None
    source: str
    future: Future

    @property
    def leads(self) -> bool:
        return self.source == COMPUTED


class AnswerCacheListener:
    """Receives one call per answer request; the default ignores them."""

    def on_answer(self, source: str, looked_up: bool) -> None: ...


class AnswerCache(Generic[Value]):
    """Single flight plus a bounded LRU of finished values; thread-safe."""

    def __init__(self, max_entries: int, listener: AnswerCacheListener | None = None):
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self.listener = listener or AnswerCacheListener()
        self._lock = threading.Lock()
        self._done: OrderedDict[Hashable, Value] = OrderedDict()
        self._running: dict[Hashable, Future] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._done)

    def claim(self, key: Hashable | None) -> Claim[Value]:
        """Never blocks: the caller waits on ``claim.future`` (or computes, when it leads). A request
        without a key (an answer that is not kept) always leads, alone."""
        if key is None:
            self.listener.on_answer(COMPUTED, looked_up=False)
            return Claim(None, COMPUTED, Future())
        with self._lock:
            if key in self._done:
                self._done.move_to_end(key)
                future: Future = Future()
                future.set_result(self._done[key])
                source = ANSWER_CACHE
            elif key in self._running:
                future, source = self._running[key], MERGED
            else:
                future = self._running[key] = Future()
                source = COMPUTED
        self.listener.on_answer(source, looked_up=self.max_entries > 0)
        return Claim(key, source, future)

    def finish(self, claim: Claim[Value], value: Value | None = None, error: BaseException | None = None,
               keep: bool = True) -> None:
        """The leader's result (or error) goes to every follower; a value is kept for later requests unless
        ``keep`` is false (it no longer matches its key)."""
        if not claim.leads:
            raise ValueError("only the request that leads a computation finishes it")
        if claim.key is not None:
            with self._lock:
                self._running.pop(claim.key, None)
                if error is None and keep:
                    self._keep(claim.key, value)
        if error is not None:
            claim.future.set_exception(error)
        else:
            claim.future.set_result(value)

    def store(self, key: Hashable, value: Value) -> None:
        """Keep a value computed outside single flight (a streamed answer)."""
        with self._lock:
            self._keep(key, value)

    def _keep(self, key: Hashable, value: Value) -> None:
        """Insert as most recently used and drop the least recently used beyond the bound; caller holds the lock."""
        if self.max_entries == 0:
            return
        self._done[key] = value
        self._done.move_to_end(key)
        while len(self._done) > self.max_entries:
            self._done.popitem(last=False)

    def get(self, key: Hashable) -> Value | None:
        """A stored value or None; counted like a claim, without joining computations in flight."""
        with self._lock:
            value = self._done.get(key)
            if value is not None:
                self._done.move_to_end(key)
        self.listener.on_answer(ANSWER_CACHE if value is not None else COMPUTED, looked_up=self.max_entries > 0)
        return value

    def clear(self) -> None:
        """Forget stored values (a release switch); computations in flight finish for their waiters."""
        with self._lock:
            self._done.clear()
