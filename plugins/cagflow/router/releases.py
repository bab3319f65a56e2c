"""The active release as this router sees it: re-read from the store every ``service.release_poll_s`` and on
``reload``, with the fixed chunks scope detection matches questions against."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from ..search.retrieval import RetrievalError
from ..search.scope import ScopeDetector
from ..store.backends import NotFound, SnapshotStore, StoreError, StoreForbidden
from ..store.layout import CURRENT_POINTER
from ..store.manifests import Release, activate_release, list_releases, load_release
from . import metrics
from .access import ApiError
from .failures import triton_failure
from .replicas import TritonPool

log = logging.getLogger("cagflow.router")


def timed_store(call, *args):
    """``call(*args)``, counted as time spent in the snapshot store."""
    started = time.perf_counter()
    try:
        return call(*args)
    finally:
        metrics.BACKEND_SECONDS.labels("store").observe(time.perf_counter() - started)


def store_unavailable(error: StoreError) -> ApiError:
    return ApiError(503, "store_unavailable", f"snapshot store unreachable: {error}")


class ReleaseTracker:
    """The release view of one process; ``current`` is read without a lock (one reference, swapped whole)."""

    def __init__(self, store: SnapshotStore, scope: ScopeDetector, triton: TritonPool, poll_s: float):
        self.store = store
        self.scope = scope
        self.triton = triton
        self.poll_s = poll_s
        self.current: Release | None = None
        self._scope_release_id: str | None = None
        self._stop = threading.Event()
        self._refresh_lock = threading.Lock()
        self._poller: threading.Thread | None = None

    def start(self) -> None:
        """Load the release and the fixed chunks; follow the release pointer from then on. A dependency that
        is down does not stop the start: readiness reports it and the poll retries."""
        self.refresh(force=True)
        if self.poll_s > 0:
            self._poller = threading.Thread(target=self._poll, name="cagflow-router-release-poll", daemon=True)
            self._poller.start()

    def close(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=5)

    def refresh(self, force: bool = False, rescan_scope: bool = False) -> Release | None:
        """Re-read the store's current release when its pointer moved (or ``force``), and reload the
        chunk vectors for scope detection when the release changed (or ``rescan_scope``: variable
        documents change with every ingest). Failures keep the previous state and are logged. One refresh
        at a time: the poller, /v1/releases and /admin/reload may ask together."""
        with self._refresh_lock:
            self._read_release(force)
            release = self.current
            if release is not None and (rescan_scope or self._scope_release_id != release.release_id):
                self._rescan_scope(release)
            return release

    def _read_release(self, force: bool) -> None:
        try:
            pointer = json.loads(timed_store(self.store.get, CURRENT_POINTER))["release_id"]
            if force or self.current is None or pointer != self.current.release_id:
                self.current = timed_store(load_release, self.store, None)
                metrics.RELEASE_SNAPSHOTS.set(len(self.current.snapshots))
                log.info("release %s: %d snapshots of %d documents", self.current.release_id,
                         len(self.current.snapshots), len(self.current.doc_ids))
        except NotFound:
            log.warning("no release published in %s: every question goes to retrieval", self.store.url)
        except (StoreError, ValueError, KeyError) as exc:
            log.warning("release refresh failed, keeping release %s: %s",
                        self.current.release_id if self.current else None, exc)

    def _rescan_scope(self, release: Release) -> None:
        try:
            chunks = self.scope.refresh(release.doc_ids, if_changed=self._scope_release_id == release.release_id)
            self._scope_release_id = release.release_id
            if chunks is not None:
                log.info("scope detection: %d fixed chunks of release %s", chunks, release.release_id)
        except RetrievalError as exc:
            log.warning("scope detection not refreshed: %s", exc)

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.refresh(rescan_scope=True)
            except Exception:  # the poller must outlive any one bad release or index
                log.exception("release poll failed; retrying in %g s", self.poll_s)

    def listing(self) -> dict[str, Any]:
        """``GET /v1/releases``: the store's releases and the active one's snapshots."""
        try:
            names = timed_store(list_releases, self.store)
        except StoreError as exc:
            raise store_unavailable(exc) from None
        active = self.refresh()
        return {"active": active.release_id if active else None, "releases": names,
                "documents": active.doc_ids if active else [],
                "snapshots": [{"key": entry.key, "doc_id": entry.doc_id, "doc_version": entry.doc_version,
                               "n_tokens": entry.n_tokens} for entry in active.snapshots] if active else []}

    def reload(self, release_id: str | None) -> dict[str, Any]:
        """Activate ``release_id`` in the store first when given (rollback), then switch every Triton replica
        and the router. Fails only when no replica switched; ``replicas`` reports each one."""
        if release_id is not None:
            self._activate(release_id)
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

    def _activate(self, release_id: str) -> None:
        try:
            timed_store(activate_release, self.store, release_id)
        except NotFound:
            raise ApiError(404, "unknown_release", f"release {release_id!r} is not in the store") from None
        except StoreForbidden as exc:
            raise ApiError(503, "store_read_only", f"{exc}; activate it with writer credentials "
                           f"(`cagflow releases --activate {release_id}`), then reload without a release") from None
        except StoreError as exc:
            raise store_unavailable(exc) from None
