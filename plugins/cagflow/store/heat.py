"""Access counts ("heat") per snapshot key, kept in the store so that preload can start with the snapshots
the whole fleet asked for most, on any replica, after a restart. Nothing assumes a shared disk.

Each replica writes only its own object (replicas never overwrite each other's counts). Objects of replicas
that stopped writing (not updated for ``stale_after_days``) are ignored, and ``prune_heat`` deletes them.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time

from .backends import NotFound, SnapshotStore, StoreError, StoreForbidden
from .layout import HEAT_PREFIX, heat_object

log = logging.getLogger("cagflow.heat")

_REPLICA = re.compile(r"[^A-Za-z0-9._-]+")


def stale_heat(store: SnapshotStore, max_age_days: float, now: float | None = None) -> list[str]:
    """Heat objects not written for ``max_age_days``: their replicas are gone (a live one flushes every
    minute or so while it serves), and counts that old say little about what is asked now."""
    cutoff = (time.time() if now is None else now) - max_age_days * 86400
    return sorted(info.name for info in store.list(HEAT_PREFIX) if info.modified < cutoff)


def prune_heat(store: SnapshotStore, max_age_days: float, now: float | None = None,
               dry_run: bool = False) -> list[str]:
    """Delete (or, in a dry run, only list) the stale heat objects; the maintenance run calls this."""
    names = stale_heat(store, max_age_days, now)
    if not dry_run:
        for name in names:
            store.delete(name)
    for name in names:
        log.info("%s stale heat object %s", "would delete" if dry_run else "deleted", name)
    return names


class HeatLog:
    """This replica's access counts, stored in its own heat object, and the fleet's, read from all of
    them except stale ones, to rank snapshots: a new replica preloads what the fleet asks for most."""

    def __init__(self, store: SnapshotStore, replica_id: str, flush_interval_s: float = 60.0,
                 stale_after_days: float = float("inf")):
        self.store = store
        self.stale_after_days = stale_after_days
        self.replica_id = _REPLICA.sub("-", replica_id).strip("-.") or "replica"
        self.object_name = heat_object(self.replica_id)
        self.flush_interval_s = flush_interval_s
        self._lock = threading.Lock()
        self._own: dict[str, int] = {}
        self._others: dict[str, int] = {}
        self._dirty = False
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None

    def load(self) -> None:
        """Read every live replica's counts; this replica's own become its running totals."""
        own: dict[str, int] = {}
        others: dict[str, int] = {}
        try:
            stale = set(stale_heat(self.store, self.stale_after_days)) - {self.object_name}
            for info in self.store.list(HEAT_PREFIX):
                if info.name in stale:
                    continue
                counts = self._read(info.name)
                target = own if info.name == self.object_name else others
                for key, count in counts.items():
                    target[key] = target.get(key, 0) + count
        except StoreError as exc:
            log.warning("heat counts unavailable (%s); preloading in release order", exc)
        with self._lock:
            self._own, self._others = own, others

    def _read(self, name: str) -> dict[str, int]:
        try:
            data = json.loads(self.store.get(name))
            return {str(k): int(v) for k, v in data["counts"].items() if int(v) > 0}
        except NotFound:
            return {}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("ignoring unreadable heat object %s: %s", name, exc)
            return {}

    def record(self, key: str) -> None:
        with self._lock:
            self._own[key] = self._own.get(key, 0) + 1
            self._dirty = True

    def counts(self) -> dict[str, int]:
        """Fleet-wide counts: every replica's at load time plus this replica's since."""
        with self._lock:
            merged = dict(self._others)
            for key, count in self._own.items():
                merged[key] = merged.get(key, 0) + count
            return merged

    def flush(self) -> bool:
        """Write this replica's counts if they changed; False (and logged) when the store refused."""
        with self._lock:
            if not self._dirty:
                return True
            payload = {"replica": self.replica_id, "updated_at": time.time(), "counts": dict(self._own)}
            self._dirty = False
        try:
            self.store.put(self.object_name, json.dumps(payload, sort_keys=True).encode(), overwrite=True)
            return True
        except StoreForbidden as exc:  # read-only (serving) credentials: retrying every interval cannot help
            self._stop.set()
            log.warning("heat counts kept in memory only: %s", exc)
            return False
        except (StoreError, ValueError) as exc:
            with self._lock:
                self._dirty = True
            log.warning("could not save heat counts to %s: %s", self.store.url, exc)
            return False

    def start(self) -> None:
        """Flush in the background every ``flush_interval_s`` so a crash loses at most that much."""
        if self._flusher is None and self.flush_interval_s > 0:
            self._flusher = threading.Thread(target=self._flush_periodically, name="cagflow-heat", daemon=True)
            self._flusher.start()

    def _flush_periodically(self) -> None:
        while not self._stop.wait(self.flush_interval_s):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        if self._flusher is not None:
            self._flusher.join(timeout=5)
            self._flusher = None
        self.flush()
