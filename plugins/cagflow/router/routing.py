"""Answering each question through Triton: one orchestration for ``POST /v1/query``'s answer and stream.

The question is routed (``planning``); the cache route asks Triton with the document's snapshot. When that
fails (snapshot not in Triton's release, unreadable or corrupt, Triton error) and
``retrieval.fallback_enabled``, the question is answered by retrieval and ``fallback_reason`` says why
(``failures``). A whole-index search that finds nothing close enough is declined without the model. The
answer and the stream differ only in how Triton delivers the model's text: whole, or piece by piece.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from typing import Any, Callable, Iterator

from ..answering.prompt import declined_answer
from ..config import Config
from ..search.embeddings import Embedder, get_embedder
from ..search.retrieval import ChunkIndex, RetrievalError, RetrievalUnavailable, SearchHit
from ..search.scope import ScopeDetector
from ..store.backends import SnapshotStore, open_store
from . import metrics
from .access import ApiError, Query
from .answers import AnswerAssembler
from .failures import fallback_reason, triton_failure
from .planning import Plan, Planner, milliseconds
from .readiness import readiness
from .releases import ReleaseTracker
from .replicas import TritonPool
from .triton_client import TritonRejected, TritonUnavailable

log = logging.getLogger("cagflow.router")

# Triton's answer as it arrives: text pieces (none when it comes whole), then the final outputs.
Pieces = Iterator[str | dict[str, Any]]


def _passages(hits: list[SearchHit]) -> str:
    return json.dumps([{"text": hit.text, "title": hit.title, "section": hit.section,
                        **({"published": hit.published} if hit.published else {})} for hit in hits])


def _triton_inputs(query: Query, request_id: str, plan: Plan, hits: list[SearchHit] | None) -> dict[str, Any]:
    """``hits`` None: the snapshot of ``plan.doc_id``, followed by the newer passages when there are any."""
    inputs: dict[str, Any] = {"question": query.question, "max_new_tokens": query.max_new_tokens,
                              "request_id": request_id}
    if hits is None:
        inputs["snapshot_key"] = plan.doc_id
        if plan.updates:
            inputs["context"] = _passages(plan.updates)
    elif hits:
        inputs["context"] = _passages(hits)
    return inputs


class Router:
    """The routing state of one process: release view, scope detector, Triton and OpenSearch clients."""

    def __init__(self, config: Config, triton: TritonPool, index: ChunkIndex, scope: ScopeDetector,
                 store: SnapshotStore, embedder: Embedder):
        self.config = config
        self.triton = triton
        self.index = index
        self.scope = scope
        self.store = store
        self.embedder = embedder
        self.tracker = ReleaseTracker(store, scope, triton, config.service.release_poll_s)
        self.planner = Planner(config, index, scope, embedder, self.tracker)
        self.assembler = AnswerAssembler(scope, embedder, self.tracker)

    @classmethod
    def from_config(cls, config: Config) -> "Router":
        service, retrieval = config.service, config.retrieval
        embedder = get_embedder()
        triton = TritonPool.from_config(service)
        index = ChunkIndex(retrieval.endpoint, retrieval.index, top_k=retrieval.top_k, timeout_s=retrieval.timeout_s,
                           max_retries=service.retries, embedder=embedder)
        scope = ScopeDetector(index, service.in_scope_threshold)
        store = open_store(config.cache.state_store, config.cache.s3, role="reader")
        return cls(config, triton, index, scope, store, embedder)

    def start(self) -> "Router":
        """Load the embedder, then the release and the fixed chunks (``ReleaseTracker.start``)."""
        self.embedder.encode_query("warm up")
        self.tracker.start()
        return self

    def close(self) -> None:
        self.tracker.close()
        self.triton.close()
        self.index.close()

    def releases(self) -> dict[str, Any]:
        return self.tracker.listing()

    def reload(self, release_id: str | None) -> dict[str, Any]:
        return self.tracker.reload(release_id)

    def readiness(self) -> dict[str, Any]:
        return readiness(self.triton, self.tracker.current, self.store, self.index, self.scope,
                         self.config.cache.max_resident_states)

    def answer(self, query: Query, request_id: str) -> dict[str, Any]:
        """The answer body; the steps of :meth:`stream`, with Triton's answer awaited whole."""
        *_, (_, body) = self._events(query, request_id, self._infer)
        return body

    def stream(self, query: Query, request_id: str) -> Iterator[tuple[str, dict[str, Any]]]:
        """Server-sent events as ``(event, data)``: ``token`` events, then ``answer`` with the same body as
        :meth:`answer`."""
        return self._events(query, request_id, self._open_stream)

    def _events(self, query: Query, request_id: str, deliver: Callable[[dict[str, Any]], Pieces]
                ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Route, try the cache route, fall back to retrieval, decline or answer; ``deliver`` calls Triton.
        Routing and Triton's first response come before the first event, so their errors are the request's."""
        started = time.perf_counter()
        plan = self.planner.plan(query)
        fallback, hits, pieces = None, None, None
        triton_started = time.perf_counter()
        if plan.cached:
            metrics.CACHE_ATTEMPTS.inc()
            try:
                pieces = self._cached_call(deliver, query, request_id, plan)
            except (TritonUnavailable, TritonRejected) as exc:
                fallback = self._cache_failed(plan, exc)
        if pieces is None:
            hits = self._search(plan, query)
            if self.planner.unanswerable(plan, query):
                yield "token", {"text": declined_answer(query.question)}
                yield "answer", self.assembler.declined(query, request_id, plan, hits, fallback, started)
                return
            triton_started = time.perf_counter()
            try:
                pieces = deliver(_triton_inputs(query, request_id, plan, hits))
            except (TritonUnavailable, TritonRejected) as exc:
                raise triton_failure(exc) from None
        for item in pieces:
            if isinstance(item, str):
                yield "token", {"text": item}
            else:
                plan.timings_ms["triton"] = milliseconds(triton_started)
                yield "answer", self.assembler.body(query, request_id, plan, item, hits, fallback, started)

    def _infer(self, inputs: dict[str, Any]) -> Pieces:
        return iter([self.triton.infer(**inputs)])

    def _open_stream(self, inputs: dict[str, Any]) -> Pieces:
        """The first response is awaited here, so a failure to start (unknown or corrupt snapshot) raises
        before a byte reaches the client and can still fall back."""
        started = time.perf_counter()
        responses = self.triton.stream(**inputs)
        first = next(responses, None)
        if first is None:
            raise TritonRejected(500, "Triton's stream ended without a response")
        metrics.BACKEND_SECONDS.labels("triton_stream_first_piece").observe(time.perf_counter() - started)
        return (outputs if "ANSWER" in outputs else outputs["TEXT"] for outputs in itertools.chain([first], responses))

    def _cached_call(self, deliver: Callable[[dict[str, Any]], Pieces], query: Query, request_id: str,
                     plan: Plan) -> Pieces:
        """The snapshot's answer; when the newer passages do not fit the model's context next to the
        document, again without them."""
        try:
            return deliver(_triton_inputs(query, request_id, plan, None))
        except TritonRejected as exc:
            if not plan.updates or exc.reason != "context_exceeded":
                raise
            log.info("newer passages for %s do not fit the context: the snapshot answers alone", plan.doc_id)
            plan.updates, plan.route = [], "cache"
            return deliver(_triton_inputs(query, request_id, plan, None))

    def _cache_failed(self, plan: Plan, error: TritonUnavailable | TritonRejected) -> str:
        """Record a cache-route failure; returns the fallback reason, or raises when there is no fallback."""
        if isinstance(error, TritonRejected) and error.status == 400:
            raise triton_failure(error)
        reason = fallback_reason(error)
        log.warning("cache route for %s failed (%s): %s", plan.doc_id, reason, error)
        if not self.config.retrieval.fallback_enabled:
            if isinstance(error, TritonUnavailable):
                raise triton_failure(error)
            raise ApiError(503, reason, f"cache route failed and retrieval fallback is off: {error}")
        metrics.FALLBACKS.labels(reason).inc()
        plan.route, plan.updates = "retrieval", []
        if plan.reason in ("in_scope", "newer_update"):
            plan.doc_id = None  # scope detection guessed the document: search everything
        return reason

    def _search(self, plan: Plan, query: Query) -> list[SearchHit]:
        vector = self.planner.embed(plan, query.question)
        started = time.perf_counter()
        try:
            hits = self.index.search(query.question, vector=vector, top_k=query.top_k or self.index.top_k,
                                     doc_id=plan.doc_id)
        except RetrievalUnavailable as exc:
            raise ApiError(503, "retrieval_unavailable", str(exc), {"Retry-After": "5"}) from None
        except RetrievalError as exc:
            raise ApiError(502, "retrieval_error", str(exc)) from None
        finally:
            plan.record("search", "opensearch", started)
        if not hits and plan.doc_id is not None:
            raise ApiError(404, "unknown_document",
                           f"document {plan.doc_id!r} is neither in the active release nor in the retrieval index")
        return hits
