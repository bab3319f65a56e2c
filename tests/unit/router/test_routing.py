"""The one orchestration behind ``answer`` and ``stream``, with Triton, OpenSearch and the scope detector in
memory: both paths route, fall back and decline alike, and the stream only delivers the text in pieces.
The real dependencies run in tests/integration/test_router.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from cagflow.config import Config
from cagflow.router.access import ApiError, Query
from cagflow.router.routing import Router
from cagflow.router.triton_client import TritonRejected, TritonUnavailable
from cagflow.search.retrieval import SearchHit
from cagflow.search.scope import ScopeMatch

PASSAGE = SearchHit("faq-1", "faq", "Backups run nightly at 02:00.", "variable", "1", "FAQ", "Backups", 0.91)
PIECES = ("Port", " 8443.")


class FakeTriton:
    """Answers "Port 8443." (in pieces when streamed); ``failures`` are raised by the next calls, in order."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.failures: list[Exception] = []

    def _outputs(self, inputs: dict) -> dict:
        self.calls.append(inputs)
        if self.failures:
            raise self.failures.pop(0)
        key = inputs.get("snapshot_key") or ""
        return {"ANSWER": "".join(PIECES), "ANSWERED": True, "CACHE_HIT": bool(key), "SNAPSHOT_KEY": key,
                "GEN_MS": 4.0, "TTFT_MS": 1.0, "TOKEN_IDS": [1, 2],
                "STAGES_MS": '{"prefix": 1.0, "answer": 2.5, "relevance": 0.5}'}

    def infer(self, **inputs) -> dict:
        return self._outputs(inputs)

    def stream(self, **inputs):
        outputs = self._outputs(inputs)
        yield from ({"TEXT": piece} for piece in PIECES)
        yield outputs


class FakeIndex:
    top_k = 3

    def __init__(self, hits: list[SearchHit]) -> None:
        self.hits = hits

    def search(self, question, vector=None, top_k=None, doc_id=None, tier=None) -> list[SearchHit]:
        return [] if tier else self.hits


class FakeScope:
    """Every question is ``score`` close to the fixed document ``manual``."""

    threshold = 0.83
    total_chunks = size = 10

    def __init__(self, score: float) -> None:
        self.score = score

    def match(self, vector, question=None, doc_id=None) -> ScopeMatch:
        return ScopeMatch("manual", self.score, self.score >= self.threshold)

    def cite(self, doc_id, vector):
        return None

    def candidates(self, doc_id, vector, count):
        return []

    def published(self, doc_id) -> str:
        return ""


def make_router(score: float = 0.9, hits=(PASSAGE,), **retrieval) -> tuple[Router, FakeTriton]:
    config = Config.model_validate({"retrieval": retrieval})
    triton = FakeTriton()
    embedder = SimpleNamespace(encode_query=lambda text: np.ones(4) / 2)
    router = Router(config, triton, FakeIndex(list(hits)), FakeScope(score), None, embedder)
    router.tracker.current = SimpleNamespace(release_id="R1", doc_ids=["manual"], snapshots=[])
    return router, triton


def both(router: Router, query: Query) -> tuple[dict, list[tuple[str, dict]]]:
    return router.answer(query, "r1"), list(router.stream(query, "r2"))


def same(answer: dict, streamed: dict) -> bool:
    """The same body but for the request id and the timings."""
    ignored = ("request_id", "timings_ms")
    return {k: v for k, v in answer.items() if k not in ignored} == \
        {k: v for k, v in streamed.items() if k not in ignored}


def test_an_in_scope_question_is_answered_from_the_snapshot_alike_whole_and_streamed():
    router, triton = make_router()
    answer, events = both(router, Query("Which port?", route="cache"))
    assert (answer["route"], answer["route_reason"], answer["cache_hit"]) == ("cache", "in_scope", True)
    assert events[:-1] == [("token", {"text": piece}) for piece in PIECES] and events[-1][0] == "answer"
    assert same(answer, events[-1][1]) and events[-1][1]["request_id"] == "r2"
    assert [call["snapshot_key"] for call in triton.calls] == ["manual", "manual"]


def test_timings_split_tritons_time_into_waiting_and_the_models_stages():
    router, _ = make_router()
    timings = router.answer(Query("Which port?", route="cache"), "r1")["timings_ms"]
    assert (timings["model_prefix"], timings["model_answer"], timings["model_relevance"]) == (1.0, 2.5, 0.5)
    assert timings["generate"] == 4.0 and timings["triton_wait"] == round(max(0.0, timings["triton"] - 4.0), 2)


@pytest.mark.parametrize("failure, reason", [
    (TritonRejected(500, "[snapshot_corrupt] bad checksum"), "snapshot_corrupt"),
    (TritonUnavailable("refused"), "triton_unavailable"),
])
def test_a_failed_cache_route_falls_back_to_retrieval_on_both_paths(failure, reason):
    router, triton = make_router()
    triton.failures = [failure]
    answer = router.answer(Query("Which port?"), "r1")
    triton.failures = [failure]
    *tokens, (_, streamed) = router.stream(Query("Which port?"), "r2")
    assert (answer["route"], answer["fallback_reason"]) == ("retrieval", reason) and same(answer, streamed)
    assert [call.get("snapshot_key") for call in triton.calls] == ["manual", None] * 2
    assert answer["citations"][0]["chunk_id"] == "faq-1" and len(tokens) == len(PIECES)


def test_without_fallback_a_failed_cache_route_is_the_requests_error():
    router, triton = make_router(fallback_enabled=False)
    triton.failures = [TritonRejected(500, "[snapshot_corrupt] bad checksum")]
    with pytest.raises(ApiError) as refused:
        router.answer(Query("Which port?"), "r1")
    assert (refused.value.status, refused.value.code) == (503, "snapshot_corrupt")
    triton.failures = [TritonUnavailable("refused")]
    with pytest.raises(ApiError) as unavailable:
        next(router.stream(Query("Which port?"), "r2"))  # before the first event: a plain JSON error
    assert (unavailable.value.status, unavailable.value.code) == (503, "triton_unavailable")


def test_a_question_far_from_every_document_is_declined_without_the_model_on_both_paths():
    router, triton = make_router(score=0.2)
    answer, events = both(router, Query("What is the capital of France?"))
    assert (answer["answered"], answer["decline_reason"], answer["route"]) == (False, "no_relevant_passage",
                                                                               "retrieval")
    assert events[0] == ("token", {"text": answer["answer"]}) and same(answer, events[1][1])
    assert answer["suggestions"][0]["chunk_id"] == "faq-1" and triton.calls == []


def test_an_unknown_document_is_404_before_any_event():
    router, _ = make_router(hits=())
    with pytest.raises(ApiError) as unknown:
        next(router.stream(Query("q", doc_id="nope"), "r1"))
    assert (unknown.value.status, unknown.value.code) == (404, "unknown_document")
