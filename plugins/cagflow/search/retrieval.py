"""Chunk retrieval over OpenSearch: BM25, k-NN and hybrid search behind one small client.

Chunks live in a versioned physical index reached through an alias, so a full rebuild switches readers
atomically. The index records its schema (text analyzer, embedding model and vector size; see
``cagflow.search.index_schema``): when either changes, the next ingest builds a new index from the old one's
chunks, re-embedded when the model changed, and switches the alias to it, so vectors of two models never
meet in one index. Hybrid search runs server-side (``hybrid`` query plus a normalization or RRF search
pipeline) when the neural-search plugin is installed; otherwise a BM25 and a k-NN query are fused here with
the same arithmetic (``cagflow.search.fusion``). Request bodies are built in ``cagflow.search.queries``.

Every call has one time budget (``timeout_s``) that covers its retries: an unreachable cluster raises
``RetrievalUnavailable`` within that budget instead of hanging.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

from opensearchpy import OpenSearch
from opensearchpy.exceptions import ConnectionError as TransportConnectionError
from opensearchpy.exceptions import TransportError

from ..errors import CagflowError
from .capabilities import KNN_PLUGIN, NEURAL_SEARCH_PLUGIN, BackendInfo
from .embeddings import Embedder, get_embedder
from .fusion import Fusion, min_max_fusion, reciprocal_rank_fusion
from .index_schema import SOURCE_FIELDS, Chunk, chunk_from_source, chunk_source, embedding_text, index_body
from .queries import (bm25_query, filter_clauses, hybrid_query, knn_query, normalization_pipeline, pipeline_name,
                      rrf_pipeline)

log = logging.getLogger(__name__)

HYBRID_MODES = ("auto", "server", "client")
RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})

T = TypeVar("T")


class RetrievalError(CagflowError):
    """A retrieval request failed in a way retrying will not fix (bad request, missing index...)."""

    code = "retrieval_failed"


class RetrievalUnavailable(RetrievalError):
    """OpenSearch could not be reached, or kept failing, within the call's time budget."""

    code = "retrieval_unavailable"


class SearchMode(str, Enum):
    BM25 = "bm25"
    VECTOR = "vector"
    HYBRID = "hybrid"


@dataclass(frozen=True)
class SearchHit:
    chunk_id: str
    doc_id: str
    text: str
    tier: str
    version: str
    title: str
    section: str
    score: float
    published: str = ""


def _error_reason(error: TransportError) -> str:
    info = error.info
    if isinstance(info, dict) and isinstance(info.get("error"), dict):
        return str(info["error"].get("reason") or info["error"].get("type"))
    return str(info or error.error)


class ChunkIndex:
    """Index and search CAGFlow chunks in one OpenSearch alias."""

    def __init__(
        self,
        endpoint: str,
        index: str = "cagflow-chunks",
        *,
        top_k: int = 5,
        timeout_s: float = 5.0,
        max_retries: int = 2,
        backoff_s: float = 0.2,
        hybrid_weights: Sequence[float] = (0.3, 0.7),
        fusion: Fusion = Fusion.MIN_MAX,
        rank_constant: int = 60,
        candidates: int = 50,
        hybrid_mode: str = "auto",
        embedder: Embedder | None = None,
        replicas: int = 0,
    ) -> None:
        if top_k < 1 or candidates < 1:
            raise ValueError("top_k and candidates must be positive")
        if hybrid_mode not in HYBRID_MODES:
            raise ValueError(f"hybrid_mode must be one of {HYBRID_MODES}, got {hybrid_mode!r}")
        if len(hybrid_weights) != 2 or min(hybrid_weights) < 0 or sum(hybrid_weights) <= 0:
            raise ValueError("hybrid_weights are two non-negative numbers, not both zero: (BM25, k-NN)")
        self.endpoint = endpoint.rstrip("/")
        self.alias = index
        self.replicas = replicas  # of each shard, in the indexes this creates
        self.top_k = top_k
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.hybrid_weights = tuple(float(weight) for weight in hybrid_weights)
        self.fusion = Fusion(fusion)
        self.rank_constant = rank_constant
        self.candidates = candidates
        self.hybrid_mode = hybrid_mode
        self._embedder = embedder
        self._backend: BackendInfo | None = None
        self._pipelines_created: set[str] = set()
        self._client = OpenSearch(
            hosts=[self.endpoint], timeout=timeout_s, max_retries=0, retry_on_timeout=False
        )

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> ChunkIndex:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def embedder(self) -> Embedder:
        if self._embedder is None:
            self._embedder = get_embedder()
        return self._embedder

    def _call(self, operation: str, request: Callable[..., T], **arguments: Any) -> T:
        """Run an opensearch-py call with bounded retries and backoff, all inside ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        attempt = 0
        while True:
            attempt += 1
            try:
                return request(**arguments, request_timeout=max(deadline - time.monotonic(), 0.05))
            except TransportConnectionError as error:
                failure: TransportError = error
            except TransportError as error:
                if error.status_code not in RETRYABLE_STATUSES:
                    raise RetrievalError(f"{operation} failed ({error.status_code}): {_error_reason(error)}") from error
                failure = error
            pause = self.backoff_s * 2 ** (attempt - 1)
            if attempt > self.max_retries or time.monotonic() + pause >= deadline:
                raise RetrievalUnavailable(
                    f"{operation}: OpenSearch at {self.endpoint} unavailable after {attempt} attempt(s) "
                    f"within {self.timeout_s:g} s: {failure}"
                ) from failure
            time.sleep(pause)

    # --- capabilities and health

    def describe(self, refresh: bool = False) -> BackendInfo:
        """Version and plugins, probed once; decides whether hybrid search runs server-side."""
        if self._backend is None or refresh:
            root = self._call("probe version", self._client.info)
            plugins = self._call("probe plugins", self._client.cat.plugins, format="json")
            self._backend = BackendInfo(
                version=root["version"]["number"],
                plugins={row["component"]: row["version"] for row in plugins},
            )
        return self._backend

    def health(self) -> dict[str, Any]:
        cluster = self._call("cluster health", self._client.cluster.health)
        backend = self.describe()
        return {
            "endpoint": self.endpoint,
            "status": cluster["status"],
            "version": backend.version,
            "plugins": dict(backend.plugins),
            "hybrid": self.hybrid_runs_on(Fusion.MIN_MAX),
            "rrf": self.hybrid_runs_on(Fusion.RRF),
            "alias": self.alias,
            "alias_exists": self._alias_targets() != [],
        }

    # --- index lifecycle

    def _alias_targets(self) -> list[str]:
        rows = self._call("read alias", self._client.cat.aliases, name=self.alias, format="json")
        return sorted(row["index"] for row in rows)

    def generation(self) -> tuple:
        """What changes whenever a chunk behind the alias is written or removed: the physical indices and their
        primaries' document and write counters (each ingest ends with a refresh, which moves the document
        counts). Equal generations mean the same chunks, so a reader holding them can skip reading them again.
        Empty while no index exists."""
        targets = self._alias_targets()
        if not targets:
            return ()
        stats = self._call("index stats", self._client.indices.stats, index=",".join(targets), metric="docs,indexing")
        primaries = stats["_all"]["primaries"]
        return (tuple(targets), primaries["docs"]["count"], primaries["docs"]["deleted"],
                primaries["indexing"]["index_total"], primaries["indexing"]["delete_total"])

    def _create_physical_index(self, with_alias: bool) -> str:
        if not self.describe().has_knn:
            raise RetrievalError(f"OpenSearch at {self.endpoint} has no {KNN_PLUGIN} plugin; vectors cannot be indexed")
        name = f"{self.alias}-{time.strftime('%Y%m%d%H%M%S')}-{uuid.uuid4().hex[:6]}"
        body = self._index_body()
        if with_alias:
            body["aliases"] = {self.alias: {}}
        self._call("create index", self._client.indices.create, index=name, body=body)
        return name

    def _index_body(self) -> dict[str, Any]:
        return index_body(self.embedder.dimension, self.embedder.model_id, replicas=self.replicas)

    def _meta(self, index: str) -> dict[str, Any]:
        mapping = self._call("read mapping", self._client.indices.get_mapping, index=index)
        return mapping[index]["mappings"].get("_meta") or {}

    def ensure_index(self) -> str:
        """Create the first physical index behind the alias unless the alias exists; return its index. An
        index of another schema (an analyzer or embedding model since changed) is rebuilt first."""
        targets = self._alias_targets()
        if targets:
            meta = self._meta(targets[-1])
            wanted = self._index_body()["mappings"]["_meta"]
            if meta.get("schema") != wanted["schema"]:
                return self._migrate(reembed=meta.get("embedder") != wanted["embedder"])
            return targets[-1]
        if self._call("check index", self._client.indices.exists, index=self.alias):
            raise RetrievalError(f"'{self.alias}' is a concrete index, not an alias; delete it or pick another name")
        return self._create_physical_index(with_alias=True)

    def _migrate(self, reembed: bool) -> str:
        """The chunks of the current index, in a new index of the current schema; their vectors computed
        again when the embedding model differs (an index from before schemas were recorded counts as a
        different model)."""
        started = time.monotonic()
        chunks = [replace(chunk, embedding=None) if reembed else chunk for chunk in self.scan()]
        new_index = self.rebuild(chunks)
        log.info("rebuilt %s as %s for the current schema: %d chunk(s)%s in %.1f s", self.alias, new_index,
                 len(chunks), ", re-embedded" if reembed else "", time.monotonic() - started)
        return new_index

    def rebuild(self, chunks: Iterable[Chunk]) -> str:
        """Load all chunks into a fresh index, then switch the alias to it in one atomic step."""
        new_index = self._create_physical_index(with_alias=False)
        try:
            self._bulk_index(new_index, list(chunks), refresh=True)
        except BaseException:
            self._call("drop failed index", self._client.indices.delete, index=new_index)
            raise
        old_indices = self._alias_targets()
        actions = [{"remove": {"index": old, "alias": self.alias}} for old in old_indices]
        actions.append({"add": {"index": new_index, "alias": self.alias}})
        self._call("switch alias", self._client.indices.update_aliases, body={"actions": actions})
        for old in old_indices:
            self._call("drop old index", self._client.indices.delete, index=old)
        return new_index

    # --- writes

    def upsert(self, chunks: Iterable[Chunk], refresh: bool = True, batch_size: int = 256) -> int:
        """Index chunks with ``_id = chunk_id``: writing the same chunk again replaces it."""
        return self._bulk_index(self.alias, list(chunks), refresh=refresh, batch_size=batch_size)

    def _bulk_index(self, target: str, chunks: list[Chunk], refresh: bool, batch_size: int = 256) -> int:
        for start in range(0, len(chunks), batch_size):
            batch = chunks[start : start + batch_size]
            missing = [chunk for chunk in batch if chunk.embedding is None]
            computed = dict(zip((chunk.chunk_id for chunk in missing), self.embedder.encode(
                [embedding_text(c.title, c.section, c.text) for c in missing])))
            lines: list[dict[str, Any]] = []
            for chunk in batch:
                vector = chunk.embedding if chunk.embedding is not None else computed[chunk.chunk_id]
                lines.append({"index": {"_index": target, "_id": chunk.chunk_id}})
                lines.append(chunk_source(chunk, vector))
            response = self._call("bulk index", self._client.bulk, body=lines)
            if response.get("errors"):
                failed = [item["index"] for item in response["items"] if "error" in item["index"]]
                reasons = "; ".join(f"{item['_id']}: {item['error'].get('reason')}" for item in failed[:3])
                raise RetrievalError(f"bulk index rejected {len(failed)} of {len(batch)} chunks: {reasons}")
        if refresh and chunks:
            self._call("refresh", self._client.indices.refresh, index=target)
        return len(chunks)

    def delete_document(self, doc_id: str, refresh: bool = True) -> int:
        """Remove every chunk of one document; returns how many were deleted."""
        body = {"query": {"term": {"doc_id": doc_id}}}
        response = self._call(
            "delete document", self._client.delete_by_query, index=self.alias, body=body, refresh=refresh,
            conflicts="proceed",
        )
        return int(response["deleted"])

    def count(self, tier: str | None = None, doc_id: str | None = None) -> int:
        body = {"query": {"bool": {"filter": filter_clauses(tier, doc_id)}}}
        response = self._call("count", self._client.count, index=self.alias, body=body)
        return int(response["count"])

    def sources(self, tier: str) -> dict[str, set[str]]:
        """Each document of ``tier`` in the index → the source digests its chunks carry (one when its last
        ingest completed; an older index's chunks carry none). Empty before the index exists."""
        if not self._alias_targets():
            return {}
        body = {"size": 0, "query": {"term": {"tier": tier}},
                "aggs": {"docs": {"terms": {"field": "doc_id", "size": 65536},
                                  "aggs": {"sources": {"terms": {"field": "source_sha256", "size": 4,
                                                                 "missing": ""}}}}}}
        response = self._call("list documents", self._client.search, index=self.alias, body=body)
        return {bucket["key"]: {source["key"] for source in bucket["sources"]["buckets"]}
                for bucket in response["aggregations"]["docs"]["buckets"]}

    def scan(self, tier: str | None = None, page_size: int = 500) -> Iterator[Chunk]:
        """Every chunk with its embedding, paged with ``search_after`` on ``chunk_id`` (no scroll context
        to leak)."""
        body: dict[str, Any] = {
            "size": page_size, "query": {"bool": {"filter": filter_clauses(tier)}}, "sort": [{"chunk_id": "asc"}],
            "_source": [*SOURCE_FIELDS, "embedding", "source_sha256"],
        }
        while True:
            hits = self._call("scan", self._client.search, index=self.alias, body=body)["hits"]["hits"]
            for raw in hits:
                yield chunk_from_source(raw["_source"])
            if len(hits) < page_size:
                return
            body["search_after"] = hits[-1]["sort"]

    # --- search

    def search(
        self,
        query: str,
        *,
        mode: SearchMode | str = SearchMode.HYBRID,
        top_k: int | None = None,
        tier: str | None = None,
        doc_id: str | None = None,
        fusion: Fusion | str | None = None,
        vector: Sequence[float] | None = None,
    ) -> list[SearchHit]:
        """Best ``top_k`` chunks; ``vector`` is the query's embedding when the caller already has it."""
        if not query.strip():
            raise ValueError("query must not be empty")
        mode = SearchMode(mode)
        fusion = Fusion(fusion or self.fusion)
        top_k = top_k or self.top_k
        filters = filter_clauses(tier, doc_id)
        if mode is SearchMode.BM25:
            return self._run_search({"size": top_k, "query": bm25_query(query, filters)})
        if vector is None:
            vector = self.embedder.encode_query(query)
        depth = max(self.candidates, top_k)  # the graph search's beam: with k = top_k it misses close vectors
        if mode is SearchMode.VECTOR:
            return self._run_search({"size": top_k, "query": knn_query(vector, depth, filters)})
        runs_on = self.hybrid_runs_on(fusion)
        if runs_on == "missing":
            raise RetrievalError(
                f"server-side {fusion.value} hybrid search needs {NEURAL_SEARCH_PLUGIN} at {self.endpoint}"
            )
        if runs_on == "server":
            pipeline = self._ensure_pipeline(fusion)
            body = {"size": top_k, "query": hybrid_query(query, vector, depth, filters)}
            return self._run_search(body, search_pipeline=pipeline)
        return self._client_side_hybrid(query, vector, depth, top_k, filters, fusion)

    def hybrid_runs_on(self, fusion: Fusion | str) -> str:
        """"server", "client", or "missing" (server forced but the plugin is absent); "auto" follows the plugins."""
        if self.hybrid_mode == "client":
            return "client"
        backend = self.describe()
        available = backend.server_hybrid and (Fusion(fusion) is Fusion.MIN_MAX or backend.server_rrf)
        if available:
            return "server"
        return "missing" if self.hybrid_mode == "server" else "client"

    def _ensure_pipeline(self, fusion: Fusion) -> str:
        if fusion is Fusion.MIN_MAX:
            body = normalization_pipeline(self.hybrid_weights)
        else:
            body = rrf_pipeline(self.rank_constant)
        name = pipeline_name(body)
        if name not in self._pipelines_created:
            self._call("create search pipeline", self._client.search_pipeline.put, id=name, body=body)
            self._pipelines_created.add(name)
        return name

    def _run_search(self, body: dict[str, Any], **params: Any) -> list[SearchHit]:
        body = {**body, "_source": SOURCE_FIELDS}
        response = self._call("search", self._client.search, index=self.alias, body=body, **params)
        return [_hit(raw, raw["_score"]) for raw in response["hits"]["hits"]]

    def _client_side_hybrid(
        self, query: str, vector: Sequence[float], depth: int, top_k: int, filters: list[dict[str, Any]], fusion: Fusion
    ) -> list[SearchHit]:
        """One ``_msearch`` round trip for BM25 and k-NN, fused here."""
        lines: list[dict[str, Any]] = []
        for sub_query in (bm25_query(query, filters), knn_query(vector, depth, filters)):
            lines += [{"index": self.alias}, {"size": depth, "query": sub_query, "_source": SOURCE_FIELDS}]
        response = self._call("hybrid search", self._client.msearch, body=lines)
        result_lists: list[dict[str, float]] = []
        by_id: dict[str, dict[str, Any]] = {}
        for item in response["responses"]:
            if "error" in item:
                raise RetrievalError(f"hybrid search failed: {item['error'].get('reason', item['error'])}")
            hits = item["hits"]["hits"]
            result_lists.append({raw["_id"]: raw["_score"] for raw in hits})
            by_id.update({raw["_id"]: raw for raw in hits})
        if fusion is Fusion.MIN_MAX:
            fused = min_max_fusion(result_lists, self.hybrid_weights)
        else:
            rankings = [list(scores) for scores in result_lists]  # dicts keep the server's ranking order
            fused = reciprocal_rank_fusion(rankings, self.rank_constant)
        return [_hit(by_id[chunk_id], score) for chunk_id, score in fused[:top_k]]


def _hit(raw: Mapping[str, Any], score: float) -> SearchHit:
    source = raw["_source"]
    return SearchHit(
        chunk_id=source["chunk_id"], doc_id=source["doc_id"], text=source["text"], tier=source["tier"],
        version=source.get("version", ""), title=source.get("title", ""), section=source.get("section", ""),
        score=float(score), published=source.get("published", ""),
    )
