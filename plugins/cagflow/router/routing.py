"""Choosing a route for each question and answering it through Triton.

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

When the cache route fails (snapshot not in Triton's release, unreadable or corrupt, Triton error) and
``retrieval.fallback_enabled``, the question is answered by retrieval and ``fallback_reason`` says why.

Declining: a question searched over the whole index whose closest chunk (of any document) is less similar
than ``service.answerable_threshold`` is declined without the model, with the closest passages as
``suggestions``. Triton's ``ANSWERED`` says whether the model declined, stated figures its source lacks
(``cagflow.answering.grounding``) or, asked whether its text answers the question, said no (``RELEVANCE``);
a declined answer is replaced by the prompt's decline sentence, and the model's words are kept as
``model_answer``. A cache answer cites the chunk of its document closest to the question and answer
together.
The active release is re-read from the store every ``service.release_poll_s`` and on ``reload``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from ..config import Config
from ..answering.prompt import declined_answer
from ..answering.record import answer_record
from ..documents.text import sentences, word_count
from ..search.embeddings import Embedder, get_embedder
from ..search.retrieval import ChunkIndex, RetrievalError, RetrievalUnavailable, SearchHit
from ..search.scope import ScopeDetector, ScopeMatch
from ..store.backends import NotFound, SnapshotStore, StoreError, StoreForbidden, open_store
from ..store.layout import CURRENT_POINTER
from ..store.manifests import Release, activate_release, list_releases, load_release
from . import metrics
from .access import ApiError, Query
from .replicas import TritonPool
from .triton_client import TritonRejected, TritonUnavailable

log = logging.getLogger("cagflow.router")
QUESTION_VECTORS = 4096  # question embeddings remembered (1.5 KB each)


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


# The serving side's error codes (``cagflow.errors``) that mean the snapshot cannot be used right now.
SNAPSHOT_CORRUPT = frozenset({"snapshot_corrupt", "checksum_mismatch", "snapshot_format"})
SNAPSHOT_UNAVAILABLE = frozenset({"snapshot_missing", "snapshot_mismatch", "snapshot_unusable", "snapshot_not_in_release",
                                  "no_active_release", "release_mismatch", "invalid_manifest", "store_unavailable",
                                  "store_forbidden", "store_failed", "not_found"})


def fallback_reason(error: Exception) -> str:
    """Why the cache route failed, in the words clients and dashboards see; from the serving side's error
    code (or Triton's status when it sent none), never from a message's wording."""
    if isinstance(error, TritonUnavailable):
        return "triton_unavailable"
    if isinstance(error, TritonRejected):
        if error.reason in SNAPSHOT_CORRUPT:
            return "snapshot_corrupt"
        if error.reason in SNAPSHOT_UNAVAILABLE or (error.reason is None and error.status in (404, 503)):
            return "snapshot_unavailable"
    return "triton_error"


def _milliseconds(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 2)


def _passages(hits: list[SearchHit]) -> str:
    return json.dumps([{"text": hit.text, "title": hit.title, "section": hit.section,
                        **({"published": hit.published} if hit.published else {})} for hit in hits])


# Markup, and a list item's bold title sentence ("- **Longer-lived codes.** Codes now expire…": the sentence
# says it; a bold identifier such as "**E-407** —" stays).
_MARKUP = re.compile(r"^\s*[-*]\s+(?:\*\*[^*\n]{1,80}\.\*\*\s*)?|\*\*|__|`", re.MULTILINE)
# Where a sentence may be cut: before a clause that explains or adds to the fact.
_CLAUSE = re.compile(r"(?<=[,;])\s+(?=(?:so|which|because|while|but|and then)\b)|(?<=;)\s+")


def _units(text: str) -> list[str]:
    """Sentences without markup or title lead-ins (another short one joined to the next), cut before their
    explaining clauses ("…, so a code can be handed over the day before"): the fact stays, the reason may go."""
    units = []
    for sentence in sentences(_MARKUP.sub("", text), min_words=8):
        clauses = _CLAUSE.split(sentence)
        units += [clause.rstrip(",;") + ("." if clause is not clauses[-1] else "") for clause in clauses]
    return units


def excerpts(hits: list[SearchHit], question: np.ndarray, sentence_vectors, max_words: int,
             min_similarity: float = -1.0) -> list[SearchHit]:
    """Each passage cut to its sentences (or clauses) closest to the question (unit vectors;
    ``sentence_vectors`` embeds a list of texts), kept in reading order: every passage's best one first, then
    the next best of any that is at least ``min_similarity`` close, while ``max_words`` allow. A passage's
    prefill is paid on every request, so it brings only what bears on the question."""
    pieces = [(number, text) for number, hit in enumerate(hits) for text in _units(hit.text)]
    if not pieces:
        return hits
    scores = sentence_vectors([text for _, text in pieces]) @ question
    ranked = sorted(range(len(pieces)), key=lambda piece: -scores[piece])
    best_of_each = sorted({pieces[piece][0]: piece for piece in reversed(ranked)}.values(), key=lambda p: -scores[p])
    chosen: set[int] = set()
    words = 0
    further = [piece for piece in ranked if scores[piece] >= min_similarity]
    for piece in [*best_of_each, *further]:
        size = word_count(pieces[piece][1])
        if piece in chosen or (chosen and words + size > max_words):
            continue
        chosen.add(piece)
        words += size
    return [dataclasses.replace(hit, text=" ".join(pieces[piece][1] for piece in sorted(chosen)
                                                   if pieces[piece][0] == number))
            for number, hit in enumerate(hits) if any(pieces[piece][0] == number for piece in chosen)]


def _citations(hits: list[SearchHit]) -> list[dict[str, Any]]:
    return [{"doc_id": hit.doc_id, "chunk_id": hit.chunk_id, "title": hit.title, "section": hit.section,
             "score": round(hit.score, 4)} for hit in hits]


def triton_failure(error: TritonUnavailable | TritonRejected) -> ApiError:
    """A Triton failure on the answering path as the client's error."""
    if isinstance(error, TritonUnavailable):
        return ApiError(503, "triton_unavailable", str(error), {"Retry-After": "5"})
    if error.status == 400:
        return ApiError(400, "invalid_request", error.message)
    return ApiError(502, "triton_error", error.message)


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
        self._release: Release | None = None
        self._scope_release_id: str | None = None
        # Support questions repeat: a repeated question skips the embedder (the largest cost of routing).
        self._question_vector = functools.lru_cache(maxsize=QUESTION_VECTORS)(embedder.encode_query)
        self._stop = threading.Event()
        self._refresh_lock = threading.Lock()
        self._poller: threading.Thread | None = None

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

    # ---- lifecycle and releases ------------------------------------------------------------------------

    def start(self) -> "Router":
        """Load the embedder, the release and the fixed chunks; follow the release pointer from then on.

        A dependency that is down does not stop the start: readiness reports it and the poll retries.
        """
        self.embedder.encode_query("warm up")
        self.refresh(force=True)
        if self.config.service.release_poll_s > 0:
            self._poller = threading.Thread(target=self._poll, name="cagflow-router-release-poll", daemon=True)
            self._poller.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=5)
        self.triton.close()
        self.index.close()

    def _timed_store(self, call, *args):
        started = time.perf_counter()
        try:
            return call(*args)
        finally:
            metrics.BACKEND_SECONDS.labels("store").observe(time.perf_counter() - started)

    def refresh(self, force: bool = False, rescan_scope: bool = False) -> Release | None:
        """Re-read the store's current release when its pointer moved (or ``force``), and reload the
        chunk vectors for scope detection when the release changed (or ``rescan_scope``: variable
        documents change with every ingest). Failures keep the previous state and are logged. One refresh
        at a time: the poller, /v1/releases and /admin/reload may ask together."""
        with self._refresh_lock:
            return self._refresh(force, rescan_scope)

    def _refresh(self, force: bool, rescan_scope: bool) -> Release | None:
        try:
            pointer = json.loads(self._timed_store(self.store.get, CURRENT_POINTER))["release_id"]
            if force or self._release is None or pointer != self._release.release_id:
                self._release = self._timed_store(load_release, self.store, None)
                metrics.RELEASE_SNAPSHOTS.set(len(self._release.snapshots))
                log.info("release %s: %d snapshots of %d documents", self._release.release_id,
                         len(self._release.snapshots), len(self._release.doc_ids))
        except NotFound:
            log.warning("no release published in %s: every question goes to retrieval", self.store.url)
        except (StoreError, ValueError, KeyError) as exc:
            log.warning("release refresh failed, keeping release %s: %s",
                        self._release.release_id if self._release else None, exc)
        release = self._release
        if release is not None and (rescan_scope or self._scope_release_id != release.release_id):
            try:
                chunks = self.scope.refresh(release.doc_ids,
                                            if_changed=self._scope_release_id == release.release_id)
                self._scope_release_id = release.release_id
                if chunks is not None:
                    log.info("scope detection: %d fixed chunks of release %s", chunks, release.release_id)
            except RetrievalError as exc:
                log.warning("scope detection not refreshed: %s", exc)
        return release

    def _poll(self) -> None:
        while not self._stop.wait(self.config.service.release_poll_s):
            try:
                self.refresh(rescan_scope=True)
            except Exception:  # the poller must outlive any one bad release or index
                log.exception("release poll failed; retrying in %g s", self.config.service.release_poll_s)

    def releases(self) -> dict[str, Any]:
        try:
            names = self._timed_store(list_releases, self.store)
        except StoreError as exc:
            raise ApiError(503, "store_unavailable", f"snapshot store unreachable: {exc}") from None
        active = self.refresh()
        return {"active": active.release_id if active else None, "releases": names,
                "documents": active.doc_ids if active else [],
                "snapshots": [{"key": entry.key, "doc_id": entry.doc_id, "doc_version": entry.doc_version,
                               "n_tokens": entry.n_tokens} for entry in active.snapshots] if active else []}

    def reload(self, release_id: str | None) -> dict[str, Any]:
        """Activate ``release_id`` in the store first when given (rollback), then switch every Triton replica
        and the router. Fails only when no replica switched; ``replicas`` reports each one."""
        if release_id is not None:
            try:
                self._timed_store(activate_release, self.store, release_id)
            except NotFound:
                raise ApiError(404, "unknown_release", f"release {release_id!r} is not in the store") from None
            except StoreForbidden as exc:
                raise ApiError(503, "store_read_only", f"{exc}; activate it with writer credentials "
                               f"(`cagflow releases --activate {release_id}`), then reload without a release") from None
            except StoreError as exc:
                raise ApiError(503, "store_unavailable", f"snapshot store unreachable: {exc}") from None
        report, failures = [], []
        for replica, outcome in self.triton.reload(release_id):
            if isinstance(outcome, dict):
                report.append({"name": replica.id, "reloaded": True,
                               "triton": json.loads(outcome.get("STATUS") or "{}")})
                continue
            failures.append(failure := triton_failure(outcome))
            log.warning("reload of Triton replica %s failed: %s", replica.label, outcome)
            report.append({"name": replica.id, "reloaded": False,
                           "error": {"code": failure.code, "message": failure.message}})
        switched = [entry["triton"] for entry in report if entry["reloaded"]]
        if not switched:
            raise failures[0]
        release = self.refresh(force=True)
        return {"release_id": release.release_id if release else None, "triton": switched[0], "replicas": report}

    # ---- readiness ----------------------------------------------------------------------------------

    def readiness(self) -> dict[str, Any]:
        """``ready`` (200): at least one route can answer — the cache route (a Triton replica's model and an
        active release) or retrieval (a Triton replica's model and OpenSearch); 503 only when neither can, so
        a load balancer keeps a router that still answers. ``degraded``: serving with less than it should
        (a Triton replica down, OpenSearch down, no release, store unreachable, snapshots not preloaded, no
        fixed chunks for scope detection, retrieval index missing)."""
        reasons: list[str] = []
        degraded: list[str] = []
        replicas = self.triton.readiness()
        several = len(replicas) > 1
        triton_ready = any(replica["ready"] for replica in replicas)
        if not triton_ready:
            reasons.append(f"triton: model cag_llm not ready at {self.triton.base}")
        release = self._release
        expected = min(len(release.snapshots), self.config.cache.max_resident_states) if release else 0
        if release is None:
            degraded.append("no active release: cache route off, every question goes to retrieval")
        for replica in replicas:
            where = f"triton replica {replica['name']}" if several else "triton"
            if not replica["ready"] and triton_ready:
                degraded.append(f"{where}: model cag_llm not ready at {replica['url']}: its snapshots go to the "
                                "other replicas")
            elif release is not None and replica["resident_snapshots"] is not None \
                    and replica["resident_snapshots"] < expected:
                degraded.append(f"{where}: {replica['resident_snapshots']} of {expected} snapshots resident "
                                "(preload incomplete)")
        known = [replica["resident_snapshots"] for replica in replicas if replica["resident_snapshots"] is not None]
        resident = sum(known) if known else None
        if resident is not None:
            metrics.RESIDENT_SNAPSHOTS.set(resident)
        store = {"url": self.store.url, "reachable": True}
        try:
            self._timed_store(self.store.ping)
        except StoreError as exc:
            store = {"url": self.store.url, "reachable": False, "error": str(exc)}
            degraded.append("store unreachable: release changes are not followed")
        opensearch: dict[str, Any] = {"endpoint": self.index.endpoint, "reachable": False}
        try:
            health = self.index.health()
            opensearch = {"endpoint": self.index.endpoint, "reachable": True, "status": health["status"],
                          "hybrid": health["hybrid"], "alias_exists": health["alias_exists"]}
            if not health["alias_exists"]:
                degraded.append(f"opensearch: index alias {self.index.alias!r} missing: retrieval finds nothing")
        except RetrievalError as exc:
            opensearch["error"] = str(exc)
            if release is not None:
                degraded.append(f"opensearch: unreachable at {self.index.endpoint}: only the cache route answers")
            else:
                reasons.append(f"opensearch: unreachable at {self.index.endpoint}, and no release to answer from")
        if release is not None and self.scope.size == 0:
            degraded.append("scope detection has no fixed chunks: only doc_id requests take the cache route")
        ready = not reasons
        metrics.READY.set(1 if ready else 0)
        metrics.DEGRADED.set(1 if degraded else 0)
        return {
            "ready": ready, "degraded": bool(degraded), "reasons": reasons + degraded,
            "triton": {"url": self.triton.base, "ready": triton_ready, "resident_snapshots": resident,
                       "replicas": replicas},
            "release": {"release_id": release.release_id if release else None,
                        "snapshots": len(release.snapshots) if release else 0},
            "opensearch": opensearch, "store": store, "scope": {"fixed_chunks": self.scope.size,
                                                               "threshold": self.scope.threshold},
        }

    # ---- routing ------------------------------------------------------------------------------------

    def _embed(self, plan: Plan, question: str) -> np.ndarray:
        if plan.vector is None:
            started = time.perf_counter()
            plan.vector = self._question_vector(question)
            plan.timings_ms["embed"] = _milliseconds(started)
            metrics.BACKEND_SECONDS.labels("embedding").observe(plan.timings_ms["embed"] / 1000)
        return plan.vector

    def plan(self, query: Query) -> Plan:
        started = time.perf_counter()
        release = self._release
        in_release = set(release.doc_ids) if release else set()
        if query.route == "retrieval":
            plan = Plan("retrieval", "requested", query.doc_id)
        elif query.doc_id is not None:
            plan = Plan("cache", "doc_id", query.doc_id) if query.doc_id in in_release else \
                Plan("retrieval", "doc_not_in_release", query.doc_id)
        else:
            plan = Plan("retrieval", "out_of_scope", None)
            match = self.scope.match(self._embed(plan, query.question), query.question)
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
        plan.timings_ms["route"] = _milliseconds(started)
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
        vector = self._embed(plan, query.question)
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
            plan.timings_ms["updates"] = _milliseconds(started)
            metrics.BACKEND_SECONDS.labels("opensearch").observe(plan.timings_ms["updates"] / 1000)
        if not plan.updates and plan.reason == "newer_update":
            plan.route, plan.reason, plan.doc_id = "retrieval", "out_of_scope", None

    def _search(self, plan: Plan, query: Query) -> list[SearchHit]:
        vector = self._embed(plan, query.question)
        started = time.perf_counter()
        try:
            hits = self.index.search(query.question, vector=vector, top_k=query.top_k or self.index.top_k,
                                     doc_id=plan.doc_id)
        except RetrievalUnavailable as exc:
            raise ApiError(503, "retrieval_unavailable", str(exc), {"Retry-After": "5"}) from None
        except RetrievalError as exc:
            raise ApiError(502, "retrieval_error", str(exc)) from None
        finally:
            plan.timings_ms["search"] = _milliseconds(started)
            metrics.BACKEND_SECONDS.labels("opensearch").observe(plan.timings_ms["search"] / 1000)
        if not hits and plan.doc_id is not None:
            raise ApiError(404, "unknown_document",
                           f"document {plan.doc_id!r} is neither in the active release nor in the retrieval index")
        return hits

    def _unanswerable(self, plan: Plan, query: Query) -> bool:
        """A whole-index search whose question is far from every chunk: nothing can answer it. Not judged
        while the detector holds no chunks (OpenSearch unreachable at the last refresh)."""
        if plan.doc_id is not None or not self.scope.total_chunks:
            return False
        if plan.best_score is None:
            plan.best_score = round(self.scope.match(self._embed(plan, query.question)).best_score, 4)
        if plan.best_score >= self.config.service.answerable_threshold:
            return False
        plan.rules_fired.append("no_relevant_passage")
        return "no_relevant_passage" not in self.config.rules.disabled

    def _declined(self, query: Query, request_id: str, plan: Plan, hits: list[SearchHit], fallback: str | None,
                  started: float) -> dict[str, Any]:
        plan.timings_ms["triton"] = 0.0
        return self._body(query, request_id, plan, {"ANSWER": declined_answer(query.question), "ANSWERED": False}, hits, fallback,
                          started, decline_reason="no_relevant_passage")

    def _cite(self, plan: Plan, query: Query, answer: str) -> list[dict[str, Any]]:
        """The chunk of the cached document closest to question and answer together."""
        started = time.perf_counter()
        citation = self.scope.cite(plan.doc_id, self.embedder.encode_query(f"{query.question}\n{answer}"))
        plan.timings_ms["cite"] = _milliseconds(started)
        metrics.BACKEND_SECONDS.labels("embedding").observe(plan.timings_ms["cite"] / 1000)
        return [citation.to_dict()] if citation is not None else []

    def _snapshot_info(self, key: str) -> dict[str, Any] | None:
        release = self._release
        entry = next((entry for entry in release.snapshots if entry.key == key), None) if release and key else None
        if entry is None:
            return {"key": key, "doc_id": key.split("/")[0], "doc_version": None} if key else None
        return {"key": entry.key, "doc_id": entry.doc_id, "doc_version": entry.doc_version}

    def _triton_inputs(self, query: Query, request_id: str, plan: Plan, hits: list[SearchHit] | None) -> dict:
        inputs: dict[str, Any] = {"question": query.question, "max_new_tokens": query.max_new_tokens,
                                  "request_id": request_id}
        if hits is None:
            inputs["snapshot_key"] = plan.doc_id
            if plan.updates:
                inputs["context"] = _passages(plan.updates)
        elif hits:
            inputs["context"] = _passages(hits)
        return inputs

    def _cached_call(self, call, query: Query, request_id: str, plan: Plan):
        """``call`` (infer or stream) on the snapshot; when the newer passages do not fit the model's context
        next to the document, again without them."""
        try:
            return call(**self._triton_inputs(query, request_id, plan, None))
        except TritonRejected as exc:
            if not plan.updates or exc.reason != "context_exceeded":
                raise
            log.info("newer passages for %s do not fit the context: the snapshot answers alone", plan.doc_id)
            plan.updates, plan.route = [], "cache"
            return call(**self._triton_inputs(query, request_id, plan, None))

    def _body(self, query: Query, request_id: str, plan: Plan, outputs: dict[str, Any], hits: list[SearchHit] | None,
              fallback: str | None, started: float, decline_reason: str | None = None) -> dict[str, Any]:
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
            citations += _citations(plan.updates)
        else:
            citations = _citations(hits)
        total_ms = _milliseconds(started)
        generate_ms = round(float(outputs.get("GEN_MS", 0.0)), 2)
        ttft_ms = round(float(outputs.get("TTFT_MS", 0.0)), 2)
        triton_ms = plan.timings_ms.get("triton", 0.0)
        if outputs.get("ANSWER_SOURCE", "computed") != "computed":
            # Kept or merged: Triton reports the run that computed the answer; this request got it whole
            # when the call returned.
            generate_ms = ttft_ms = triton_ms
        # The model's own compute: GEN_MS, unless Triton answered faster than that; none for a kept answer.
        compute_ms = 0.0 if outputs.get("ANSWER_SOURCE") == "answer-cache" else min(generate_ms, triton_ms)
        route = plan.route
        timings = {"route": plan.timings_ms.get("route", 0.0), "embed": plan.timings_ms.get("embed", 0.0),
                   "search": plan.timings_ms.get("search", 0.0), "updates": plan.timings_ms.get("updates", 0.0),
                   "triton": triton_ms,
                   "cite": plan.timings_ms.get("cite", 0.0),
                   "ttft": ttft_ms, "generate": generate_ms,
                   "overhead": round(total_ms - compute_ms, 2), "total": total_ms}
        cache_hit = bool(outputs.get("CACHE_HIT", False))
        metrics.ANSWERS.labels(route).inc()
        metrics.ANSWER_SECONDS.labels(route).observe(total_ms / 1000)
        metrics.OVERHEAD_SECONDS.labels(route).observe(timings["overhead"] / 1000)
        if cache_hit:
            metrics.CACHE_HITS.inc()
        if outputs.get("ANSWER_SOURCE"):
            metrics.ANSWER_SOURCES.labels(outputs["ANSWER_SOURCE"]).inc()
        if decline_reason:
            metrics.DECLINED.labels(decline_reason).inc()
        for rule in rules_fired:
            metrics.RULES_FIRED.labels(rule).inc()
        return answer_record(
            question=query.question, model_answer=model_answer, answered=answered, decline_reason=decline_reason, route=route,
            route_reason=plan.reason, cache_hit=cache_hit, fallback_reason=fallback,
            snapshot=self._snapshot_info(outputs.get("SNAPSHOT_KEY", "")), citations=citations,
            suggestions=[] if answered else _citations(hits or plan.updates), unsupported_figures=unsupported,
            scope_score=plan.scope_score, best_score=plan.best_score, relevance=relevance if relevance >= 0 else None,
            answer_source=outputs.get("ANSWER_SOURCE"),
            release_id=outputs.get("RELEASE_ID") or None, finish_reason=outputs.get("FINISH_REASON"),
            timings_ms=timings, prompt_tokens=int(outputs.get("PROMPT_TOKENS", 0)),
            reused_tokens=int(outputs.get("REUSED_TOKENS", 0)),
            generated_tokens=len(outputs.get("TOKEN_IDS", ())), request_id=request_id, rules_fired=rules_fired)

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

    def answer(self, query: Query, request_id: str) -> dict[str, Any]:
        started = time.perf_counter()
        plan = self.plan(query)
        fallback = None
        if plan.route == "cache":
            self._find_updates(plan, query)
        if plan.cached:
            metrics.CACHE_ATTEMPTS.inc()
            rpc_started = time.perf_counter()
            try:
                outputs = self._cached_call(self.triton.infer, query, request_id, plan)
                plan.timings_ms["triton"] = _milliseconds(rpc_started)
                return self._body(query, request_id, plan, outputs, None, None, started)
            except (TritonUnavailable, TritonRejected) as exc:
                fallback = self._cache_failed(plan, exc)
        hits = self._search(plan, query)
        if self._unanswerable(plan, query):
            return self._declined(query, request_id, plan, hits, fallback, started)
        rpc_started = time.perf_counter()
        try:
            outputs = self.triton.infer(**self._triton_inputs(query, request_id, plan, hits))
        except (TritonUnavailable, TritonRejected) as exc:
            raise triton_failure(exc) from None
        plan.timings_ms["triton"] = _milliseconds(rpc_started)
        return self._body(query, request_id, plan, outputs, hits, fallback, started)

    def _open_stream(self, inputs: dict[str, Any], plan: Plan) -> Iterator[str | dict[str, Any]]:
        """Text pieces, then the final outputs. The first response is awaited here, so a failure to start
        (unknown or corrupt snapshot) raises before a byte reaches the client and can still fall back."""
        started = time.perf_counter()
        responses = self.triton.stream(**inputs)
        first = next(responses, None)
        if first is None:
            raise TritonRejected(500, "Triton's stream ended without a response")
        metrics.BACKEND_SECONDS.labels("triton_stream_first_piece").observe(time.perf_counter() - started)

        def items() -> Iterator[str | dict[str, Any]]:
            for outputs in itertools.chain([first], responses):
                if "ANSWER" in outputs:
                    plan.timings_ms["triton"] = _milliseconds(started)
                    yield outputs
                else:
                    yield outputs["TEXT"]

        return items()

    def stream(self, query: Query, request_id: str) -> Iterator[tuple[str, dict[str, Any]]]:
        """Server-sent events as ``(event, data)``: ``token`` events, then ``answer`` with the same body as
        :meth:`answer`."""
        started = time.perf_counter()
        plan = self.plan(query)
        fallback = None
        hits: list[SearchHit] | None = None
        pieces: Iterator[str | dict[str, Any]] | None = None
        if plan.route == "cache":
            self._find_updates(plan, query)
        if plan.cached:
            metrics.CACHE_ATTEMPTS.inc()
            try:
                pieces = self._cached_call(lambda **inputs: self._open_stream(inputs, plan), query, request_id, plan)
            except (TritonUnavailable, TritonRejected) as exc:
                fallback = self._cache_failed(plan, exc)
        if pieces is None:
            hits = self._search(plan, query)
            if self._unanswerable(plan, query):
                yield "token", {"text": declined_answer(query.question)}
                yield "answer", self._declined(query, request_id, plan, hits, fallback, started)
                return
            try:
                pieces = self._open_stream(self._triton_inputs(query, request_id, plan, hits), plan)
            except (TritonUnavailable, TritonRejected) as exc:
                raise triton_failure(exc) from None
        for item in pieces:
            if isinstance(item, str):
                yield "token", {"text": item}
            else:
                yield "answer", self._body(query, request_id, plan, item, hits, fallback, started)
