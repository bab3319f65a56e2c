"""The answer body clients get, from Triton's outputs and the plan, and the answer metrics it implies.

Triton's ``ANSWERED`` says whether the model declined, stated figures its source lacks
(``cagflow.answering.grounding``) or, asked whether its text answers the question, said no (``RELEVANCE``);
a declined answer is replaced by the prompt's decline sentence, and the model's words are kept as
``model_answer``. A cache answer cites the chunk of its document closest to the question and answer together.
"""

from __future__ import annotations

import json
import time
from typing import Any

from .. import tracing
from ..answering.prompt import declined_answer
from ..answering.quotes import best_supported, quote
from ..answering.record import answer_record
from ..search.embeddings import Embedder
from ..search.retrieval import SearchHit
from ..search.scope import ScopeDetector
from . import metrics
from .access import Query
from .planning import Plan, milliseconds
from .releases import ReleaseTracker


CITATION_CANDIDATES = 3  # a cache answer's citation: the best supported of the document's 3 closest chunks


def _citations(hits: list[SearchHit], answer: str | None = None, question: str = "") -> list[dict[str, Any]]:
    """The passages as citations; with the ``answer`` they support, each with its ``quote`` (else null)."""
    return [{"doc_id": hit.doc_id, "chunk_id": hit.chunk_id, "title": hit.title, "section": hit.section,
             "score": round(hit.score, 4), "quote": quote(answer, question, hit.text) if answer else None}
            for hit in hits]


def _timings(plan: Plan, outputs: dict[str, Any], started: float) -> dict[str, float]:
    """Where the answer's time went; ``overhead`` is all but the model's own compute."""
    total_ms = milliseconds(started)
    generate_ms = round(float(outputs.get("GEN_MS", 0.0)), 2)
    ttft_ms = round(float(outputs.get("TTFT_MS", 0.0)), 2)
    triton_ms = plan.timings_ms.get("triton", 0.0)
    if outputs.get("ANSWER_SOURCE", "computed") != "computed":
        # Kept or merged: Triton reports the run that computed the answer; this request got it whole
        # when the call returned.
        generate_ms = ttft_ms = triton_ms
    # The model's own compute: GEN_MS, unless Triton answered faster than that; none for a kept answer.
    compute_ms = 0.0 if outputs.get("ANSWER_SOURCE") == "answer-cache" else min(generate_ms, triton_ms)
    steps = plan.timings_ms
    timings = {"route": steps.get("route", 0.0), "embed": steps.get("embed", 0.0), "search": steps.get("search", 0.0),
               "updates": steps.get("updates", 0.0), "triton": triton_ms, "cite": steps.get("cite", 0.0),
               "ttft": ttft_ms, "generate": generate_ms, "overhead": round(total_ms - compute_ms, 2), "total": total_ms}
    if outputs.get("ANSWER_SOURCE", "computed") == "computed" and outputs.get("STAGES_MS"):
        # Triton's part, split: waiting (queue, snapshot load, transfer), then the model's stages (GEN_MS)
        timings["triton_wait"] = round(max(0.0, triton_ms - generate_ms), 2)
        timings.update({f"model_{stage}": ms for stage, ms in json.loads(outputs["STAGES_MS"]).items()})
    return timings


def _count(route: str, timings: dict[str, float], outputs: dict[str, Any], decline_reason: str | None,
           rules_fired: list[str]) -> None:
    metrics.ANSWERS.labels(route).inc()
    metrics.ANSWER_SECONDS.labels(route).observe(timings["total"] / 1000)
    metrics.OVERHEAD_SECONDS.labels(route).observe(timings["overhead"] / 1000)
    if outputs.get("CACHE_HIT", False):
        metrics.CACHE_HITS.inc()
    if outputs.get("ANSWER_SOURCE"):
        metrics.ANSWER_SOURCES.labels(outputs["ANSWER_SOURCE"]).inc()
    if decline_reason:
        metrics.DECLINED.labels(decline_reason).inc()
    for rule in rules_fired:
        metrics.RULES_FIRED.labels(rule).inc()


class AnswerAssembler:
    """Builds answer bodies; needs the scope detector and the embedder for a cache answer's citation."""

    def __init__(self, scope: ScopeDetector, embedder: Embedder, releases: ReleaseTracker):
        self.scope = scope
        self.embedder = embedder
        self.releases = releases

    def body(self, query: Query, request_id: str, plan: Plan, outputs: dict[str, Any], hits: list[SearchHit] | None,
             fallback: str | None, started: float, decline_reason: str | None = None) -> dict[str, Any]:
        """``hits`` None: the cache route answered (the snapshot, and ``plan.updates`` when they followed it)."""
        model_answer = outputs.get("ANSWER", "")
        unsupported = json.loads(outputs.get("UNSUPPORTED") or "[]")
        answered = bool(outputs.get("ANSWERED", True))
        if answered and plan.route == "cache+retrieval" and outputs.get("ROUTE") == "cache":
            plan.route, plan.updates = "cache", []  # declined with the newer passages, answered by the snapshot alone
        relevance = float(outputs.get("RELEVANCE", -1.0))
        rules_fired = plan.rules_fired + json.loads(outputs.get("RULES_FIRED") or "[]")
        if not answered:
            decline_reason = (decline_reason or outputs.get("DECLINE_REASON")
                              or ("unsupported_figures" if unsupported else "model_declined"))
            citations = []
        elif hits is None:
            citations = self._cite(plan, query, model_answer) if plan.doc_id else []
            citations += _citations(plan.updates, model_answer, query.question)
        else:
            citations = _citations(hits, model_answer, query.question)
        timings = _timings(plan, outputs, started)
        _count(plan.route, timings, outputs, decline_reason, rules_fired)
        return answer_record(
            question=query.question, model_answer=model_answer, answered=answered, decline_reason=decline_reason,
            route=plan.route, route_reason=plan.reason, cache_hit=bool(outputs.get("CACHE_HIT", False)),
            fallback_reason=fallback, snapshot=self._snapshot_info(outputs.get("SNAPSHOT_KEY", "")),
            citations=citations, suggestions=[] if answered else _citations(hits or plan.updates),
            unsupported_figures=unsupported, scope_score=plan.scope_score, best_score=plan.best_score,
            relevance=relevance if relevance >= 0 else None, answer_source=outputs.get("ANSWER_SOURCE"),
            release_id=outputs.get("RELEASE_ID") or None, finish_reason=outputs.get("FINISH_REASON"),
            timings_ms=timings, prompt_tokens=int(outputs.get("PROMPT_TOKENS", 0)),
            reused_tokens=int(outputs.get("REUSED_TOKENS", 0)),
            generated_tokens=len(outputs.get("TOKEN_IDS", ())), request_id=request_id, trace_id=tracing.trace_id(),
            rules_fired=rules_fired)

    def declined(self, query: Query, request_id: str, plan: Plan, hits: list[SearchHit], fallback: str | None,
                 started: float) -> dict[str, Any]:
        """Declined without the model: nothing in the index is close enough to the question."""
        plan.timings_ms["triton"] = 0.0
        outputs = {"ANSWER": declined_answer(query.question), "ANSWERED": False}
        return self.body(query, request_id, plan, outputs, hits, fallback, started,
                         decline_reason="no_relevant_passage")

    def _cite(self, plan: Plan, query: Query, answer: str) -> list[dict[str, Any]]:
        """Of the cached document's chunks closest to question and answer together, the one holding the
        sentence that supports the answer most, with that sentence as its quote."""
        started = time.perf_counter()
        candidates = self.scope.candidates(plan.doc_id, self.embedder.encode_query(f"{query.question}\n{answer}"),
                                           CITATION_CANDIDATES)
        plan.record("cite", "embedding", started)
        if not candidates:
            return []
        citation = candidates[best_supported(answer, [candidate.text for candidate in candidates])]
        return [{**citation.to_dict(), "quote": quote(answer, query.question, citation.text)}]

    def _snapshot_info(self, key: str) -> dict[str, Any] | None:
        release = self.releases.current
        entry = next((entry for entry in release.snapshots if entry.key == key), None) if release and key else None
        if entry is None:
            return {"key": key, "doc_id": key.split("/")[0], "doc_version": None} if key else None
        return {"key": entry.key, "doc_id": entry.doc_id, "doc_version": entry.doc_version}
