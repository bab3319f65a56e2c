"""The answer cache: single flight across threads (values and errors), the LRU bound, keys that
normalise questions, and forgetting on a release switch."""

import threading

import pytest
from cagflow.inference.answer_cache import ANSWER_CACHE, COMPUTED, MERGED, AnswerCache, AnswerCacheListener, AnswerKey


class Counter(AnswerCacheListener):
    """Counts claims; ``claimed`` is set once ``expected`` requests have claimed."""

    def __init__(self, expected: int = 0):
        self.sources: list[str] = []
        self.lookups = 0
        self.expected = expected
        self.claimed = threading.Event()
        self._lock = threading.Lock()

    def on_answer(self, source, looked_up):
        with self._lock:
            self.sources.append(source)
            self.lookups += looked_up
            if len(self.sources) >= self.expected:
                self.claimed.set()


def run(cache: AnswerCache, key, compute) -> tuple:
    """How a caller uses the cache: compute when leading, else wait; (value, source)."""
    claim = cache.claim(key)
    if claim.leads:
        try:
            value = compute()
        except Exception as exc:
            cache.finish(claim, error=exc)
            raise
        cache.finish(claim, value)
    return claim.future.result(), claim.source


def run_together(cache: AnswerCache, key, compute, count: int) -> list:
    """``count`` threads ask for ``key``; (value or error, source) of each."""
    results: list = [None] * count

    def ask(slot: int) -> None:
        try:
            results[slot] = run(cache, key, compute)
        except Exception as exc:
            results[slot] = (exc, None)

    threads = [threading.Thread(target=ask, args=(slot,)) for slot in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    return results


def gated(listener: Counter, value=None, error: Exception | None = None):
    """A computation that counts its calls and waits until every asker has claimed."""
    calls = []

    def compute():
        calls.append(1)
        assert listener.claimed.wait(10)
        if error is not None:
            raise error
        return value

    return compute, calls


def test_identical_requests_in_flight_are_computed_once():
    listener = Counter(expected=8)
    cache: AnswerCache[str] = AnswerCache(16, listener)
    compute, calls = gated(listener, "42")
    results = run_together(cache, "k", compute, 8)
    assert calls == [1]
    assert [value for value, _ in results] == ["42"] * 8
    assert sorted(source for _, source in results) == [COMPUTED] + [MERGED] * 7
    assert run(cache, "k", compute) == ("42", ANSWER_CACHE) and calls == [1]
    assert listener.sources.count(MERGED) == 7 and listener.sources.count(ANSWER_CACHE) == 1
    assert listener.lookups == 9


def test_an_error_reaches_every_waiter_and_is_not_kept():
    listener = Counter(expected=5)
    cache: AnswerCache[str] = AnswerCache(16, listener)
    compute, calls = gated(listener, error=ValueError("question is too long"))
    results = run_together(cache, "k", compute, 5)
    assert calls == [1]
    assert all(isinstance(error, ValueError) and str(error) == "question is too long" for error, _ in results)
    assert len(cache) == 0
    assert run(cache, "k", lambda: "fine") == ("fine", COMPUTED)  # the next request computes again


def test_lru_bound_drops_the_least_recently_used():
    cache: AnswerCache[int] = AnswerCache(2)
    for key in ("a", "b"):
        run(cache, key, lambda: 1)
    assert run(cache, "a", lambda: 2) == (1, ANSWER_CACHE)  # a is now the most recently used
    run(cache, "c", lambda: 3)  # drops b
    assert len(cache) == 2
    assert run(cache, "b", lambda: 4) == (4, COMPUTED)
    assert run(cache, "c", lambda: 5) == (3, ANSWER_CACHE)


def test_size_zero_keeps_nothing_but_still_merges():
    listener = Counter(expected=3)
    cache: AnswerCache[str] = AnswerCache(0, listener)
    compute, calls = gated(listener, "x")
    results = run_together(cache, "k", compute, 3)
    assert calls == [1] and sorted(source for _, source in results) == [COMPUTED, MERGED, MERGED]
    assert run(cache, "k", lambda: "y") == ("y", COMPUTED) and len(cache) == 0
    assert listener.lookups == 0
    cache.store("k", "z")
    assert cache.get("k") is None


def test_clear_forgets_answers_and_keys_separate_releases():
    cache: AnswerCache[str] = AnswerCache(8)
    first = AnswerKey.of("release-1", "doc/1/abc", "  Which port does the console use?\n", 24)
    assert first == AnswerKey.of("release-1", "doc/1/abc", "Which port does the console use?", 24)
    assert first != AnswerKey.of("release-1", "doc/1/abc", "which PORT does the console use?", 24)  # other tokens
    assert first != AnswerKey.of("release-1", "doc/1/abc", "Which port does  the console use?", 24)
    assert first != AnswerKey.of("release-2", "doc/1/abc", "Which port does the console use?", 24)
    assert first != AnswerKey.of("release-1", "doc/1/abc", "Which port does the console use?", 25)
    run(cache, first, lambda: "8443")
    assert cache.get(first) == "8443"
    cache.clear()
    assert cache.get(first) is None and len(cache) == 0


def test_only_the_leader_finishes():
    cache: AnswerCache[str] = AnswerCache(8)
    leader = cache.claim("k")
    follower = cache.claim("k")
    with pytest.raises(ValueError, match="only the request that leads"):
        cache.finish(follower, "x")
    cache.finish(leader, "x")
    assert follower.future.result(1) == "x"


def test_requests_without_a_key_are_never_merged_or_kept():
    cache: AnswerCache[str] = AnswerCache(8)
    first, second = cache.claim(None), cache.claim(None)
    assert first.leads and second.leads and first.future is not second.future
    cache.finish(first, "a")
    assert len(cache) == 0


def test_a_value_that_no_longer_matches_its_key_is_given_but_not_kept():
    cache: AnswerCache[str] = AnswerCache(8)
    claim = cache.claim("k")
    cache.finish(claim, "computed on another release", keep=False)
    assert claim.future.result() == "computed on another release" and cache.get("k") is None
