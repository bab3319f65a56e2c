"""The resident snapshot set of one serving process: which snapshots stay in memory, and for which release.

- Bounded LRU: at most ``cache.max_resident_states`` snapshots and ``cache.max_resident_bytes`` of tensors;
  this module is the only place that evicts.
- Every load goes through ``load_snapshot`` (sha256 against the release, header names the key).
- Single flight: concurrent requests for a missing key wait for one load instead of each reading the store.
- A snapshot that fails verification is quarantined: later requests fail at once, without touching the
  store, until another release is activated. An unreachable store is not a property of the snapshot, so
  it is not quarantined.
- A request pins the release it started on (``pin()``); ``activate`` swaps releases atomically, and
  requests in flight keep using the old one's snapshots (they hold references; nothing is mutated).
- A snapshot evicted (or dropped by a release switch) while requests still use it stays in memory until
  they finish. Its bytes are tracked (``evicted_in_use_bytes``) and count toward ``max_bytes`` when the
  next snapshot is admitted, so the budget is exceeded only while every resident snapshot is in use.
- Preload starts with the snapshots the fleet asked for most (``store.heat``).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..documents.text import best_part
from ..documents.keys import SnapshotFormatError
from ..documents.snapshot import Snapshot
from ..errors import CagflowError
from ..store.backends import ChecksumMismatch, NotFound, SnapshotStore, StoreError, StoreUnavailable
from ..store.heat import HeatLog
from ..store.manifests import Release, ReleaseEntry, SnapshotUnusable

log = logging.getLogger("cagflow.resident")


class NoActiveRelease(CagflowError, RuntimeError):
    """No release is active yet: nothing can be answered from a snapshot."""

    code = "no_active_release"


class UnknownSnapshot(CagflowError, LookupError):
    """The key (or document) is not part of the active release."""

    code = "snapshot_not_in_release"


class SnapshotQuarantined(SnapshotUnusable):
    """The snapshot failed verification under the active release; it is not retried until the release changes."""


class ReleaseMismatch(CagflowError, ValueError):
    """The release was built for another model: none of its snapshots could be used."""

    code = "release_mismatch"


class ResidentListener:
    """Receives what the resident set does, e.g. to export metrics. Called from request threads; the
    default implementation ignores everything."""

    def on_hit(self) -> None: ...

    def on_miss(self) -> None: ...

    def on_load(self, seconds: float, nbytes: int) -> None: ...

    def on_evict(self) -> None: ...

    def on_store_error(self) -> None: ...

    def on_quarantine(self, quarantined: int) -> None: ...

    def on_resident(self, states: int, nbytes: int) -> None: ...

    def on_evicted_in_use(self, nbytes: int) -> None: ...


@dataclass(frozen=True)
class Acquired:
    """A snapshot handed to one request, with how it was obtained."""

    snapshot: Snapshot
    entry: ReleaseEntry
    release_id: str
    resident_hit: bool
    load_s: float  # time spent loading or waiting for another request's load; 0 on a hit


@dataclass(frozen=True)
class ReleaseSwitch:
    previous: str | None
    current: str
    kept: int  # resident snapshots that the new release shares (same key and sha256)
    dropped: int

    @property
    def changed(self) -> bool:
        return self.previous != self.current


@dataclass
class PreloadReport:
    release_id: str
    loaded: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    nbytes: int = 0
    seconds: float = 0.0


@dataclass
class ResidentState:
    release_id: str | None
    keys: list[str]  # least recently used first
    nbytes: int
    quarantined: dict[str, str]
    evicted_in_use_bytes: int = 0  # evicted snapshots that requests still hold (see the module docstring)


@dataclass
class _Resident:
    sha256: str
    snapshot: Snapshot
    nbytes: int


class _Generation:
    """One activated release with its own quarantine and in-progress loads; replaced whole on a switch."""

    def __init__(self, release: Release):
        self.release = release
        self.entries = {entry.key: entry for entry in release.snapshots}
        self.quarantine: dict[str, SnapshotUnusable] = {}
        self.loading: dict[str, Future] = {}


class ReleaseView:
    """The release a request started on; all its lookups stay on that release even if another one is
    activated meanwhile."""

    def __init__(self, owner: "ResidentSet", generation: _Generation):
        self._owner = owner
        self._generation = generation

    @property
    def release(self) -> Release:
        return self._generation.release

    def entries_for_doc(self, doc_id: str) -> list[ReleaseEntry]:
        return self.release.for_doc(doc_id)

    def acquire(self, key: str) -> Acquired:
        return self._owner._acquire(self._generation, key, count=True)


class ResidentSet:
    """The snapshots kept in memory by one serving process, for the active release."""

    def __init__(self, store: SnapshotStore, model_fingerprint: str, max_states: int, max_bytes: int,
                 heat: HeatLog | None = None, listener: ResidentListener | None = None):
        if max_states < 1 or max_bytes < 1:
            raise ValueError("max_states and max_bytes must be at least 1")
        self.store = store
        self.model_fingerprint = model_fingerprint
        self.max_states = max_states
        self.max_bytes = max_bytes
        self.heat = heat
        self.listener = listener or ResidentListener()
        self._lock = threading.Lock()
        self._resident: OrderedDict[str, _Resident] = OrderedDict()
        self._bytes = 0
        self._generation: _Generation | None = None
        self._evicted_lock = threading.Lock()
        self._evicted_in_use = 0
        # Bytes of evicted snapshots since freed. Finalizers only append here (atomic, no lock): they can run
        # during any allocation on any thread, even one that holds a lock they would need.
        self._freed: deque[int] = deque()

    # ---- release -----------------------------------------------------------------------------------

    @property
    def release(self) -> Release | None:
        generation = self._generation
        return generation.release if generation is not None else None

    def pin(self) -> ReleaseView:
        generation = self._generation
        if generation is None:
            raise NoActiveRelease("no release is active: publish one (`cagflow precompute`) and reload")
        return ReleaseView(self, generation)

    def activate(self, release: Release) -> ReleaseSwitch:
        """Make ``release`` the one new requests use; resident snapshots it shares stay, the rest go.

        Requests already running hold their own references, so they finish on the old release.
        """
        if release.model_fingerprint != self.model_fingerprint:
            raise ReleaseMismatch(f"release {release.release_id} was built for model "
                                  f"{release.model_fingerprint[:16]}, this server runs {self.model_fingerprint[:16]}")
        with self._lock:
            previous = self._generation
            if previous is not None and previous.release.release_id == release.release_id:
                return ReleaseSwitch(release.release_id, release.release_id, len(self._resident), 0)
            self._generation = _Generation(release)
            wanted = {(entry.key, entry.sha256) for entry in release.snapshots}
            dropped = [key for key, item in self._resident.items() if (key, item.sha256) not in wanted]
            for key in dropped:
                self._retire(self._resident.pop(key))
            states, nbytes, kept = len(self._resident), self._bytes, len(self._resident)
        self.listener.on_resident(states, nbytes)
        self.listener.on_quarantine(0)
        return ReleaseSwitch(previous.release.release_id if previous else None, release.release_id, kept, len(dropped))

    # ---- lookups -----------------------------------------------------------------------------------

    def acquire(self, key: str) -> Acquired:
        """The snapshot ``key`` of the active release; see ``pin`` to keep several lookups consistent."""
        return self.pin().acquire(key)

    def _acquire(self, generation: _Generation, key: str, count: bool) -> Acquired:
        release_id = generation.release.release_id
        with self._lock:
            entry = generation.entries.get(key)
            if entry is None:
                raise UnknownSnapshot(f"snapshot {key!r} is not in release {release_id} "
                                      f"({len(generation.entries)} snapshots)")
            if count and self.heat is not None:
                self.heat.record(key)
            failure = generation.quarantine.get(key)
            if failure is not None:
                raise SnapshotQuarantined(f"{failure}; quarantined until the release changes (now {release_id})",
                                          code=failure.code)
            resident = self._resident.get(key)
            if resident is not None and resident.sha256 == entry.sha256:
                self._resident.move_to_end(key)
                hit = Acquired(resident.snapshot, entry, release_id, True, 0.0)
            else:
                hit = None
                pending = generation.loading.get(key)
                owner = pending is None
                if owner:
                    pending = generation.loading[key] = Future()
        if hit is not None:
            if count:
                self.listener.on_hit()
            return hit
        if count:
            self.listener.on_miss()
        started = time.perf_counter()
        if owner:
            self._load(generation, entry, pending)
        snapshot = pending.result()
        return Acquired(snapshot, entry, release_id, False, time.perf_counter() - started)

    def _load(self, generation: _Generation, entry: ReleaseEntry, pending: Future) -> None:
        """Load and verify once for every waiter; admit the result if the release still wants it."""
        started = time.perf_counter()
        try:
            snapshot = load_snapshot(self.store, entry)
            if snapshot.model_fingerprint != self.model_fingerprint:
                raise SnapshotUnusable(f"snapshot {entry.key} was built by model {snapshot.model_fingerprint[:16]}",
                                       code="snapshot_mismatch")
        except SnapshotUnusable as exc:
            with self._lock:
                generation.quarantine[entry.key] = exc
                generation.loading.pop(entry.key, None)
                quarantined = len(generation.quarantine) if generation is self._generation else None
            log.error("%s; quarantined until the release changes", exc)
            if quarantined is not None:
                self.listener.on_quarantine(quarantined)
            pending.set_exception(SnapshotQuarantined(f"{exc}; quarantined until the release changes", code=exc.code))
            return
        except BaseException as exc:  # store down, out of memory...: waiters get the error, nothing is cached
            with self._lock:
                generation.loading.pop(entry.key, None)
            if isinstance(exc, StoreError):
                self.listener.on_store_error()
            pending.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        seconds = time.perf_counter() - started
        self.listener.on_load(seconds, snapshot.nbytes)
        with self._lock:
            generation.loading.pop(entry.key, None)
            current = self._generation
            wanted = current is not None and (entry.key in current.entries and
                                              current.entries[entry.key].sha256 == entry.sha256)
            admitted = self._admit(entry.key, entry.sha256, snapshot) if wanted else None
        if admitted is not None:
            evicted, states, nbytes = admitted
            for _ in range(evicted):
                self.listener.on_evict()
            self.listener.on_resident(states, nbytes)
        pending.set_result(snapshot)

    def _admit(self, key: str, sha256: str, snapshot: Snapshot) -> tuple[int, int, int] | None:
        """Insert as most recently used, evicting least recently used ones to fit; caller holds the lock."""
        nbytes = snapshot.nbytes
        if nbytes > self.max_bytes:
            log.warning("snapshot %s (%d bytes) exceeds cache.max_resident_bytes=%d: served but not kept",
                        key, nbytes, self.max_bytes)
            return None
        evicted = 0
        previous = self._resident.pop(key, None)
        if previous is not None:
            self._retire(previous)
        while self._resident and (len(self._resident) >= self.max_states or
                                  self._bytes + self.evicted_in_use_bytes + nbytes > self.max_bytes):
            self._retire(self._resident.popitem(last=False)[1])
            evicted += 1
        self._resident[key] = _Resident(sha256, snapshot, nbytes)
        self._bytes += nbytes
        return evicted, len(self._resident), self._bytes

    def _retire(self, resident: _Resident) -> None:
        """Take a snapshot out of the resident set; its bytes count as evicted-in-use until the last
        request holding it lets go (at once when none does). Caller holds the lock."""
        self._bytes -= resident.nbytes
        with self._evicted_lock:
            self._evicted_in_use += resident.nbytes
        weakref.finalize(resident.snapshot, self._freed.append, resident.nbytes).atexit = False
        self.listener.on_evicted_in_use(self.evicted_in_use_bytes)

    @property
    def evicted_in_use_bytes(self) -> int:
        with self._evicted_lock:
            while self._freed:
                self._evicted_in_use -= self._freed.popleft()
            return self._evicted_in_use

    # ---- preload and state -------------------------------------------------------------------------

    def preload(self) -> PreloadReport:
        """Load the active release's snapshots, most asked-for first, until the budget is full.

        Preloading never evicts: it stops at ``max_states`` and skips snapshots that would exceed
        ``max_bytes``. A corrupt snapshot is quarantined and skipped; an unreachable store ends it.
        """
        generation = self._generation
        if generation is None:
            raise NoActiveRelease("no release is active: nothing to preload")
        started = time.perf_counter()
        report = PreloadReport(generation.release.release_id)
        heat = self.heat.counts() if self.heat is not None else {}
        order = sorted(enumerate(generation.release.snapshots),
                       key=lambda item: (-heat.get(item[1].key, 0), item[0]))
        for _, entry in order:
            with self._lock:
                if len(self._resident) >= self.max_states:
                    break
                if entry.key in self._resident or \
                        self._bytes + self.evicted_in_use_bytes + entry.bytes > self.max_bytes:
                    continue
            try:
                acquired = self._acquire(generation, entry.key, count=False)
            except SnapshotUnusable as exc:
                report.failed[entry.key] = str(exc)
                continue
            except StoreUnavailable as exc:
                report.failed[entry.key] = str(exc)
                log.error("preload stopped: %s", exc)
                break
            report.loaded.append(entry.key)
            report.nbytes += acquired.snapshot.nbytes
        report.seconds = time.perf_counter() - started
        return report

    def state(self) -> ResidentState:
        with self._lock:
            generation = self._generation
            state = ResidentState(generation.release.release_id if generation else None, list(self._resident),
                                  self._bytes, {key: str(failure) for key, failure in generation.quarantine.items()} if generation else {},
                                  self.evicted_in_use_bytes)
        self.listener.on_evicted_in_use(state.evicted_in_use_bytes)
        return state

    def close(self) -> None:
        """Save the heat counts; resident snapshots are simply released with the process."""
        if self.heat is not None:
            self.heat.close()


def load_snapshot(store: SnapshotStore, entry: ReleaseEntry) -> Snapshot:
    """Read, verify against the release's sha256, and check the header names the same key."""
    try:
        snapshot = Snapshot.from_bytes(store.get_view(entry.object_name, sha256=entry.sha256))
    except NotFound:
        raise SnapshotUnusable(f"snapshot {entry.key} is missing from {store.url}", code="snapshot_missing") from None
    except (ChecksumMismatch, SnapshotFormatError) as exc:
        raise SnapshotUnusable(f"snapshot {entry.key} is corrupt: {exc}", code="snapshot_corrupt") from None
    if str(snapshot.key) != entry.key:
        raise SnapshotUnusable(f"object for {entry.key} holds snapshot {snapshot.key}", code="snapshot_corrupt")
    return snapshot


def snapshot_for_question(store: SnapshotStore, entries: list[ReleaseEntry], question: str) -> Snapshot:
    """The snapshot of a document to answer ``question`` from; for a split document, the part that
    shares the most words with the question."""
    if not entries:
        raise SnapshotUnusable("the release has no snapshot for that document")
    snapshots = [load_snapshot(store, entry) for entry in entries]
    return snapshots[best_part(question, [s.system_prompt for s in snapshots])]
