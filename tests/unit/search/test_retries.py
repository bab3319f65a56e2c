"""ChunkIndex's retries stay inside its time budget, on a clock the test controls: no wall time is measured."""

import pytest
from cagflow.search import retrieval
from cagflow.search.retrieval import ChunkIndex, RetrievalError, RetrievalUnavailable
from opensearchpy.exceptions import ConnectionError as TransportConnectionError
from opensearchpy.exceptions import TransportError


class Clock:
    """``time.monotonic`` and ``time.sleep`` for the module under test: sleeping moves the clock."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(retrieval, "time", fake)
    return fake


def index(timeout_s: float, max_retries: int) -> ChunkIndex:
    return ChunkIndex("http://127.0.0.1:9", "unit-retries", timeout_s=timeout_s, max_retries=max_retries,
                      backoff_s=0.2)


def test_a_server_that_never_answers_costs_one_budget_not_one_per_retry(clock):
    """Each attempt may wait only for what is left of the budget, so a hanging server ends the call at its
    deadline with one attempt, not max_retries timeouts back to back."""
    timeouts = []

    def hangs(request_timeout: float) -> None:
        timeouts.append(request_timeout)
        clock.now += request_timeout
        raise TransportConnectionError("N/A", "read timed out", None)

    started = clock.now
    with pytest.raises(RetrievalUnavailable, match=r"count: .* unavailable after 1 attempt\(s\) within 1.5 s"):
        index(timeout_s=1.5, max_retries=5)._call("count", hangs)
    assert timeouts == [1.5] and clock.now - started == 1.5


def test_refused_connections_are_retried_with_backoff_until_the_retries_or_the_budget_run_out(clock):
    attempts = []

    def refused(request_timeout: float) -> None:
        attempts.append(request_timeout)
        raise TransportConnectionError("N/A", "connection refused", None)

    with pytest.raises(RetrievalUnavailable, match=r"after 4 attempt\(s\) within 60 s"):
        index(timeout_s=60, max_retries=3)._call("search", refused)
    assert clock.slept == [0.2, 0.4, 0.8]  # doubling pauses between the four attempts
    attempts.clear()
    clock.slept.clear()
    with pytest.raises(RetrievalUnavailable, match=r"after 3 attempt\(s\) within 1 s"):
        index(timeout_s=1.0, max_retries=10)._call("search", refused)
    assert clock.slept == [0.2, 0.4]  # the next pause (0.8) would end past the deadline: no attempt after it
    assert all(0 < timeout <= 1.0 for timeout in attempts)


def test_a_retryable_status_is_retried_and_a_client_error_is_not(clock):
    calls = []

    def busy_then_ok(request_timeout: float) -> str:
        calls.append(request_timeout)
        if len(calls) < 3:
            raise TransportError(503, "unavailable", {})
        return "ok"

    assert index(timeout_s=10, max_retries=5)._call("count", busy_then_ok) == "ok" and len(calls) == 3

    def bad_request(request_timeout: float) -> None:
        raise TransportError(400, "parsing_exception", {"error": {"reason": "bad query"}})

    with pytest.raises(RetrievalError, match="search failed \\(400\\)") as raised:
        index(timeout_s=10, max_retries=5)._call("search", bad_request)
    assert not isinstance(raised.value, RetrievalUnavailable) and clock.slept == [0.2, 0.4]
