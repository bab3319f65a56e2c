"""``GET /readyz``: ``ready`` (200) while at least one route can answer, the cache route (a Triton replica's
model and an active release) or retrieval (a Triton replica's model and OpenSearch); 503 only when neither
can, so a load balancer keeps a router that still answers. ``degraded``: serving with less than it should
(a Triton replica down, OpenSearch down, no release, store unreachable, snapshots not preloaded, no fixed
chunks for scope detection, retrieval index missing)."""

from __future__ import annotations

from typing import Any

from ..search.retrieval import ChunkIndex, RetrievalError
from ..search.scope import ScopeDetector
from ..store.backends import SnapshotStore, StoreError
from ..store.manifests import Release
from . import metrics
from .releases import timed_store
from .replicas import TritonPool


def readiness(triton: TritonPool, release: Release | None, store: SnapshotStore, index: ChunkIndex,
              scope: ScopeDetector, max_resident_states: int) -> dict[str, Any]:
    reasons: list[str] = []  # why no route can answer
    degraded: list[str] = []
    replicas = triton.readiness()
    triton_ready = any(replica["ready"] for replica in replicas)
    if not triton_ready:
        reasons.append(f"triton: model cag_llm not ready at {triton.base}")
    if release is None:
        degraded.append("no active release: cache route off, every question goes to retrieval")
    expected = min(len(release.snapshots), max_resident_states) if release else 0
    degraded += _replica_problems(replicas, release, expected, triton_ready)
    known = [replica["resident_snapshots"] for replica in replicas if replica["resident_snapshots"] is not None]
    resident = sum(known) if known else None
    if resident is not None:
        metrics.RESIDENT_SNAPSHOTS.set(resident)
    store_report = _store(store, degraded)
    opensearch = _opensearch(index, release, reasons, degraded)
    if release is not None and scope.size == 0:
        degraded.append("scope detection has no fixed chunks: only doc_id requests take the cache route")
    ready = not reasons
    metrics.READY.set(1 if ready else 0)
    metrics.DEGRADED.set(1 if degraded else 0)
    return {
        "ready": ready, "degraded": bool(degraded), "reasons": reasons + degraded,
        "triton": {"url": triton.base, "ready": triton_ready, "resident_snapshots": resident, "replicas": replicas},
        "release": {"release_id": release.release_id if release else None,
                    "snapshots": len(release.snapshots) if release else 0},
        "opensearch": opensearch, "store": store_report,
        "scope": {"fixed_chunks": scope.size, "threshold": scope.threshold},
    }


def _replica_problems(replicas: list[dict[str, Any]], release: Release | None, expected: int,
                      triton_ready: bool) -> list[str]:
    """A replica down while another answers, or holding fewer snapshots than it should (preload incomplete)."""
    problems = []
    for replica in replicas:
        where = f"triton replica {replica['name']}" if len(replicas) > 1 else "triton"
        if not replica["ready"] and triton_ready:
            problems.append(f"{where}: model cag_llm not ready at {replica['url']}: its snapshots go to the "
                            "other replicas")
        elif release is not None and replica["resident_snapshots"] is not None \
                and replica["resident_snapshots"] < expected:
            problems.append(f"{where}: {replica['resident_snapshots']} of {expected} snapshots resident "
                            "(preload incomplete)")
    return problems


def _store(store: SnapshotStore, degraded: list[str]) -> dict[str, Any]:
    try:
        timed_store(store.ping)
    except StoreError as exc:
        degraded.append("store unreachable: release changes are not followed")
        return {"url": store.url, "reachable": False, "error": str(exc)}
    return {"url": store.url, "reachable": True}


def _opensearch(index: ChunkIndex, release: Release | None, reasons: list[str], degraded: list[str]) -> dict[str, Any]:
    """Without OpenSearch only the cache route answers: degraded with a release, not ready without one."""
    try:
        health = index.health()
    except RetrievalError as exc:
        if release is not None:
            degraded.append(f"opensearch: unreachable at {index.endpoint}: only the cache route answers")
        else:
            reasons.append(f"opensearch: unreachable at {index.endpoint}, and no release to answer from")
        return {"endpoint": index.endpoint, "reachable": False, "error": str(exc)}
    if not health["alias_exists"]:
        degraded.append(f"opensearch: index alias {index.alias!r} missing: retrieval finds nothing")
    return {"endpoint": index.endpoint, "reachable": True, "status": health["status"], "hybrid": health["hybrid"],
            "alias_exists": health["alias_exists"]}
