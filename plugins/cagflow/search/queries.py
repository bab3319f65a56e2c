"""OpenSearch request bodies for chunk search, kept pure so they are tested without a cluster: filters,
BM25, k-NN and hybrid queries, and the search pipelines that fuse a hybrid query's scores server-side."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping, Sequence

from .index_schema import TIERS


def filter_clauses(tier: str | None = None, doc_id: str | None = None) -> list[dict[str, Any]]:
    clauses = []
    if tier is not None:
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        clauses.append({"term": {"tier": tier}})
    if doc_id is not None:
        clauses.append({"term": {"doc_id": doc_id}})
    return clauses


def bm25_query(text: str, filters: list[dict[str, Any]]) -> dict[str, Any]:
    match = {"multi_match": {"query": text, "fields": ["text", "title^2", "section"]}}
    return {"bool": {"must": [match], "filter": filters}}


def knn_query(vector: Sequence[float], k: int, filters: list[dict[str, Any]]) -> dict[str, Any]:
    """Lucene-engine k-NN; filters apply during the graph search, so k hits survive filtering."""
    clause: dict[str, Any] = {"vector": [float(value) for value in vector], "k": k}
    if filters:
        clause["filter"] = {"bool": {"filter": filters}}
    return {"knn": {"embedding": clause}}


def hybrid_query(text: str, vector: Sequence[float], depth: int, filters: list[dict[str, Any]]) -> dict[str, Any]:
    """Filters go into each sub-query: the hybrid query's own ``filter`` only exists from 3.0."""
    return {
        "hybrid": {
            "queries": [bm25_query(text, filters), knn_query(vector, depth, filters)],
            "pagination_depth": depth,
        }
    }


def normalization_pipeline(weights: Sequence[float]) -> dict[str, Any]:
    return {
        "description": "CAGFlow hybrid search: min-max normalisation, weighted arithmetic mean (BM25, k-NN)",
        "phase_results_processors": [
            {
                "normalization-processor": {
                    "normalization": {"technique": "min_max"},
                    "combination": {"technique": "arithmetic_mean", "parameters": {"weights": list(weights)}},
                }
            }
        ],
    }


def rrf_pipeline(rank_constant: int) -> dict[str, Any]:
    return {
        "description": "CAGFlow hybrid search: reciprocal rank fusion (BM25, k-NN)",
        "phase_results_processors": [
            {"score-ranker-processor": {"combination": {"technique": "rrf", "rank_constant": rank_constant}}}
        ],
    }


def pipeline_name(body: Mapping[str, Any]) -> str:
    """Named after its content, so clients with different settings never overwrite each other."""
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]
    return f"cagflow-hybrid-{digest}"
