"""Admission rules of the router without a server: token buckets, the concurrency cap, request ids and
strict parsing of query bodies."""

from __future__ import annotations

import pytest
from cagflow.config import ServiceConfig
from cagflow.router.access import ApiError, ConcurrencyGate, RateLimiter, parse_query, parse_reload, request_id_from
from cagflow.router.failures import fallback_reason
from cagflow.router.triton_client import TritonRejected, TritonUnavailable

LIMITS = ServiceConfig(max_question_chars=100)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_allows_a_burst_then_refills_at_the_rate():
    clock = Clock()
    limiter = RateLimiter(per_s=2.0, burst=3, clock=clock)
    assert [limiter.acquire("k1") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.acquire("k1") == pytest.approx(0.5)  # one token takes 1/2 s at 2/s
    assert limiter.acquire("k2") == 0.0  # buckets are per key
    clock.now += 0.5
    assert limiter.acquire("k1") == 0.0
    clock.now += 100
    assert [limiter.acquire("k1") for _ in range(4)][-1] > 0  # refills up to the burst, never beyond


def test_concurrency_gate_refuses_instead_of_queueing():
    gate = ConcurrencyGate(2)
    assert gate.try_enter() and gate.try_enter()
    assert not gate.try_enter() and gate.in_flight == 2
    gate.leave()
    assert gate.try_enter() and gate.in_flight == 2


@pytest.mark.parametrize("header, kept", [("abc-123", True), ("trace:1.2_x", True), ("", False), (None, False),
                                          ("has space", False), ("x" * 129, False), ("ünïcode", False),
                                          ("a\nb", False)])
def test_request_ids_are_kept_only_when_safe_to_log(header, kept):
    request_id = request_id_from(header)
    assert (request_id == header) is kept
    assert 1 <= len(request_id) <= 128


def test_a_valid_query_parses_with_defaults():
    query = parse_query({"question": "  Which port?  "}, LIMITS)
    assert (query.question, query.doc_id, query.top_k, query.max_new_tokens, query.stream, query.route) == (
        "Which port?", None, None, None, False, "auto")
    full = parse_query({"question": "q", "doc_id": "skerry-admin-manual", "top_k": 3, "max_new_tokens": 16,
                        "stream": True, "route": "retrieval"}, LIMITS)
    assert (full.doc_id, full.top_k, full.max_new_tokens, full.stream, full.route) == (
        "skerry-admin-manual", 3, 16, True, "retrieval")
    assert parse_query({"question": "مرحبا 👋 \u202eRTL"}, LIMITS).question == "مرحبا 👋 \u202eRTL"


@pytest.mark.parametrize("body, fragment", [
    ([], "JSON object"),
    ("question", "JSON object"),
    ({}, "question is required"),
    ({"question": None}, "question is required"),
    ({"question": 42}, "question is required"),
    ({"question": ["a"]}, "question is required"),
    ({"question": "   "}, "question is empty"),
    ({"question": "x" * 101}, "more than the limit of 100"),
    ({"question": "bad \ud800 surrogate"}, "lone surrogate"),
    ({"question": "nul\x00byte"}, "control characters"),
    ({"question": "q", "extra": 1}, "unknown fields: extra"),
    ({"question": "q", "doc_id": 7}, "doc_id"),
    ({"question": "q", "doc_id": "../etc"}, "doc_id"),
    ({"question": "q", "top_k": True}, "top_k must be an integer"),
    ({"question": "q", "top_k": 0}, "between 1 and 50"),
    ({"question": "q", "top_k": 10**6}, "between 1 and 50"),
    ({"question": "q", "top_k": 2.5}, "top_k must be an integer"),
    ({"question": "q", "max_new_tokens": -1}, "between 1 and 4096"),
    ({"question": "q", "max_new_tokens": "8"}, "max_new_tokens must be an integer"),
    ({"question": "q", "stream": "yes"}, "stream must be true or false"),
    ({"question": "q", "stream": 1}, "stream must be true or false"),
    ({"question": "q", "route": "cache+retrieval"}, "route must be one of auto, cache, retrieval"),
    ({"question": "q", "route": None}, "route must be one of auto, cache, retrieval"),
])
def test_malformed_queries_are_400_with_a_message_that_says_what_is_wrong(body, fragment):
    with pytest.raises(ApiError) as caught:
        parse_query(body, LIMITS)
    assert caught.value.status == 400 and caught.value.code == "invalid_request"
    assert fragment in caught.value.message


def test_reload_body_is_empty_or_a_release_id():
    assert parse_reload(None) is None and parse_reload({}) is None
    assert parse_reload({"release_id": "20261202T101500Z-1a2b3c4d"}) == "20261202T101500Z-1a2b3c4d"
    for bad in ({"release_id": 5}, {"release_id": "../x"}, {"other": 1}, [1]):
        with pytest.raises(ApiError):
            parse_reload(bad)


@pytest.mark.parametrize("error, reason", [
    (TritonUnavailable("refused"), "triton_unavailable"),
    (TritonRejected(503, "[snapshot_corrupt] request r: snapshot 'a/1/0123456789abcdef' is corrupt; quarantined"),
     "snapshot_corrupt"),
    (TritonRejected(503, "[store_unavailable] store unreachable"), "snapshot_unavailable"),
    (TritonRejected(404, "[snapshot_not_in_release] snapshot 'a/1/0123456789abcdef' is not in release R"),
     "snapshot_unavailable"),
    (TritonRejected(500, "[internal] internal error (RuntimeError): boom"), "triton_error"),
    # the code decides, not the wording: a reworded message keeps its reason, a stray word changes nothing
    (TritonRejected(503, "[snapshot_corrupt] bytes differ from the release's record"), "snapshot_corrupt"),
    (TritonRejected(503, "[snapshot_missing] the corrupt-looking name is missing"), "snapshot_unavailable"),
    (TritonRejected(500, "[internal] snapshot corrupt? no: a bug"), "triton_error"),
    (TritonRejected(503, "no code from an older server"), "snapshot_unavailable"),
])
def test_cache_failures_name_their_fallback_reason(error, reason):
    assert fallback_reason(error) == reason


def test_a_rejection_keeps_the_serving_code_apart_from_the_message():
    error = TritonRejected(503, "[snapshot_corrupt] request r: snapshot is corrupt")
    assert (error.reason, error.message, error.code) == ("snapshot_corrupt", "request r: snapshot is corrupt",
                                                         "triton_error")
