"""Where each question goes, decided once for the answer and the stream paths alike.

1. ``doc_id`` given and in the active release: the cache route with that document's snapshot.
2. ``doc_id`` given but not in the release (a variable document, or one not precomputed): retrieval
   restricted to that document; 404 when the index holds nothing of it.
3. Otherwise the question is embedded once and matched against the fixed documents' chunks in memory;
   a best cosine similarity of at least ``service.in_scope_threshold``, with no chunk of another document
   closer, takes the cache route with the matching document's snapshot, unless the question names an
   identifier that document lacks and another holds (``identifier_elsewhere``); anything else goes to
   hybrid retrieval (the same vector feeds the k-NN half of the search). Which fixed document answers
   an in-scope question is the one hybrid search (BM25 + the same vector) ranks first, when that one is in
   scope too: a near tie of two documents' closest chunks is settled by their words.

``"route": "retrieval"`` in the query skips steps 1 and 3 (to compare routes, or to get passages).

cache+retrieval: a question on the cache route is also searched in the variable tier; passages of variable
documents published after the fixed document (where either date is unknown: passages at least as close to
the question as the document) that are close to the question — at least ``service.answerable_threshold``
and at most ``service.update_margin`` below the document's closest chunk — follow the snapshot, cut to their
sentences closest to the question (``retrieval.update_words``), so a release note that changed a fact of
the manual is answered with the newer fact. A question whose closest chunk belongs to
such a newer document, but whose fixed document is in scope too, takes this route rather than retrieval
(``route_reason`` ``newer_update``). ``"route": "cache"`` asks for the snapshot alone.

Declining: a question searched over the whole index whose closest chunk (of any document) is less similar
than ``service.answerable_threshold`` is declined without the model, with the closest passages as
``suggestions``.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from .. import tracing
from ..config import Config
from ..search.embeddings import Embedder
from ..search.retrieval import ChunkIndex, RetrievalError, SearchHit
from ..search.scope import ScopeDetector, ScopeMatch
from . import metrics
from .access import Query
from .excerpts import excerpts
from .releases import ReleaseTracker

log = logging.getLogger("cagflow.router")
QUESTION_VECTORS = 4096  # question embeddings remembered (1.5 KB each)


def milliseconds(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 2)


@dataclass
class Plan:
    """Where one question goes, and why; ``vector`` is computed at most once per request."""

    route: str  # "cache" | "cache+retrieval" | "retrieval"
    # "doc_id" | "in_scope" | "newer_update" | "out_of_scope" | "identifier_elsewhere" | "doc_not_in_release"
    # | "requested"
    reason: str
    doc_id: str | None  # the snapshot's document (cache) or the only document searched (retrieval)
    scope_score: float | None = None
    best_score: float | None = None  # cosine similarity to the closest chunk of any document
    vector: np.ndarray | None = None
    updates: list[SearchHit] = field(default_factory=list)  # newer passages after the snapshot (excerpts)
    timings_ms: dict[str, float] = field(default_factory=dict)
    rules_fired: list[str] = field(default_factory=list)  # the router's rules (cagflow.rules) that held

    @property
    def cached(self) -> bool:
        return self.route in ("cache", "cache+retrieval")

    def record(self, step: str, backend: str, started: float) -> None:
        """The step's time in the answer's ``timings_ms``, in the backend's latency metric and as a span."""
        self.timings_ms[step] = milliseconds(started)
        metrics.BACKEND_SECONDS.labels(backend).observe(self.timings_ms[step] / 1000)
        tracing.record_span(step, started, **{"cagflow.backend": backend})


class Planner:
    """The routing decisions: scope detection, newer passages, and whether anything can answer at all."""

    def __init__(self, config: Config, index: ChunkIndex, scope: ScopeDetector, embedder: Embedder,
                 releases: ReleaseTracker):
        self.config = config
        self.index = index
        self.scope = scope
        self.embedder = embedder
        self.releases = releases
        # Support questions repeat: a repeated question skips the embedder (the largest cost of routing).
        self._question_vector = functools.lru_cache(maxsize=QUESTION_VECTORS)(embedder.encode_query)

    def embed(self, plan: Plan, question: str) -> np.ndarray:
        if plan.vector is None:
            started = time.perf_counter()
            plan.vector = self._question_vector(question)
            plan.record("embed", "embedding", started)
        return plan.vector

    def plan(self, query: Query) -> Plan:
        """The route, and on the cache route the newer passages that follow the snapshot."""
        with tracing.TRACER.start_as_current_span("plan") as span:
            plan = self._route(query)
            if plan.route == "cache":
                self._find_updates(plan, query)
            span.set_attributes({"cagflow.route": plan.route, "cagflow.route_reason": plan.reason,
                                 **({"cagflow.doc_id": plan.doc_id} if plan.doc_id else {})})
        return plan

    def _route(self, query: Query) -> Plan:
        started = time.perf_counter()
        release = self.releases.current
        in_release = set(release.doc_ids) if release else set()
        if query.route == "retrieval":
            plan = Plan("retrieval", "requested", query.doc_id)
        elif query.doc_id is not None:
            plan = Plan("cache", "doc_id", query.doc_id) if query.doc_id in in_release else \
                Plan("retrieval", "doc_not_in_release", query.doc_id)
        else:
            plan = Plan("retrieval", "out_of_scope", None)
            match = self.scope.match(self.embed(plan, query.question), query.question)
            if match.in_scope:
                match = self._ranked_document(match, query, plan, in_release)
            plan.scope_score = round(float(match.score), 4)
            plan.best_score = round(match.best_score, 4)
            if match.elsewhere:
                plan.reason = "identifier_elsewhere"
            elif match.in_scope and match.doc_id in in_release:
                plan.route, plan.reason, plan.doc_id = "cache", "in_scope", match.doc_id
            elif (match.doc_id in in_release and match.newer_other and match.score >= self.scope.threshold
                  and match.score >= match.other_score - self.config.service.update_margin
                  and self._updates_wanted(query)):  # the newer text about as close as the document: an update
                plan.route, plan.reason, plan.doc_id = "cache", "newer_update", match.doc_id
        plan.timings_ms["route"] = milliseconds(started)
        return plan

    def _ranked_document(self, match: ScopeMatch, query: Query, plan: Plan, in_release: set[str]) -> ScopeMatch:
        """The in-scope fixed document that hybrid search ranks first, when that is another document in
        scope too. The closest chunk alone can be the wrong document's: e5 put a Chinese policy's chunk on
        security incidents (事件) over the manual's "每个数据源默认每秒最多接收 120 条事件" for a question on
        events per second (0.888 against 0.883), where BM25 finds 数据源, 每秒 and 接收 in the manual. A
        search failure keeps the closest chunk's document."""
        started = time.perf_counter()
        try:
            hits = self.index.search(query.question, vector=plan.vector, top_k=1, tier="fixed")
        except RetrievalError as exc:
            log.warning("fixed documents not ranked by hybrid search (%s): the closest chunk decides", exc)
            return match
        finally:
            metrics.BACKEND_SECONDS.labels("opensearch").observe(time.perf_counter() - started)
            tracing.record_span("rank", started, **{"cagflow.backend": "opensearch"})
        if not hits or hits[0].doc_id == match.doc_id or hits[0].doc_id not in in_release:
            return match
        ranked = self.scope.match(plan.vector, query.question, doc_id=hits[0].doc_id)
        return ranked if ranked.in_scope else match

    def _updates_wanted(self, query: Query) -> bool:
        return query.route != "cache" and self.config.retrieval.update_passages > 0

    def _is_update(self, hit: SearchHit, published: str, document_similarity: float, vector: np.ndarray) -> bool:
        """Newer than the cached document (with a date unknown: at least as close to the question as the
        document) and about as close to the question as the document: a passage only loosely related costs
        its prefill and distracts the model."""
        service = self.config.service
        similarity = self.scope.similarity(hit.chunk_id, vector)
        if similarity is None or similarity < max(service.answerable_threshold,
                                                  document_similarity - service.update_margin):
            return False
        if published and hit.published:
            return hit.published > published
        return similarity >= document_similarity

    def _find_updates(self, plan: Plan, query: Query) -> None:
        """Turn a cache plan into cache+retrieval when newer variable passages bear on the question. A plan
        routed only for such passages (``newer_update``) goes back to retrieval when none is found; a search
        failure leaves the snapshot alone to answer."""
        if not self._updates_wanted(query):
            return
        settings = self.config.retrieval
        vector = self.embed(plan, query.question)
        started = time.perf_counter()
        try:
            hits = self.index.search(query.question, vector=vector, top_k=settings.update_passages, tier="variable")
            published = self.scope.published(plan.doc_id)
            closest = self.scope.cite(plan.doc_id, vector)  # the document's chunk closest to the question
            document_similarity = closest.score if closest is not None else -1.0
            found = [hit for hit in hits if self._is_update(hit, published, document_similarity, vector)]
            if found:
                plan.updates = excerpts(found, vector, self.embedder.encode, settings.update_words,
                                        self.config.service.answerable_threshold)
                plan.route = "cache+retrieval"
        except RetrievalError as exc:
            log.warning("newer passages for %s not searched (%s): the snapshot answers alone", plan.doc_id, exc)
        finally:
            plan.record("updates", "opensearch", started)
        if not plan.updates and plan.reason == "newer_update":
            plan.route, plan.reason, plan.doc_id = "retrieval", "out_of_scope", None

    def unanswerable(self, plan: Plan, query: Query) -> bool:
        """A whole-index search whose question is far from every chunk: nothing can answer it. Not judged
        while the detector holds no chunks (OpenSearch unreachable at the last refresh)."""
        if plan.doc_id is not None or not self.scope.total_chunks:
            return False
        if plan.best_score is None:
            plan.best_score = round(self.scope.match(self.embed(plan, query.question)).best_score, 4)
        if plan.best_score >= self.config.service.answerable_threshold:
            return False
        plan.rules_fired.append("no_relevant_passage")
        return "no_relevant_passage" not in self.config.rules.disabled
