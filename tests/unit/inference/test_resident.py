"""The resident snapshot set: LRU by count and bytes, heat-ordered preload that survives restarts,
quarantine of corrupt snapshots, single-flight loads and atomic release switches."""

import json
import os
import shutil
import threading
import time

import pytest
from cagflow.documents.parsing import parse_file
from cagflow.engine.engine import Engine
from cagflow.inference.resident import (NoActiveRelease, ReleaseMismatch, ResidentListener, ResidentSet,
                                        SnapshotQuarantined, UnknownSnapshot)
from cagflow.offline.precompute import precompute_part
from cagflow.store.backends import LocalStore, StoreUnavailable
from cagflow.store.heat import HeatLog, prune_heat
from cagflow.store.manifests import Release


class CountingStore(LocalStore):
    """A LocalStore that counts snapshot reads, can hold them at a gate, or can pretend to be down."""

    def __init__(self, root):
        super().__init__(root)
        self.snapshot_reads: list[str] = []
        self.gate: threading.Event | None = None
        self.down = False

    def _reading(self, name):
        if name.startswith("snapshots/"):
            self.snapshot_reads.append(name)
            if self.down:
                raise StoreUnavailable(f"{self.url} unreachable")
            if self.gate is not None:
                self.gate.wait(10)

    def get(self, name, *, sha256=None):
        self._reading(name)
        return super().get(name, sha256=sha256)

    def get_view(self, name, *, sha256=None):
        self._reading(name)
        return super().get_view(name, sha256=sha256)


class Recorder(ResidentListener):
    def __init__(self):
        self.events: list[str] = []
        self.resident: tuple[int, int] = (0, 0)

    def on_hit(self):
        self.events.append("hit")

    def on_miss(self):
        self.events.append("miss")

    def on_evict(self):
        self.events.append("evict")

    def on_store_error(self):
        self.events.append("store_error")

    def on_resident(self, states, nbytes):
        self.resident = (states, nbytes)

    def on_evicted_in_use(self, nbytes):
        self.evicted_in_use = nbytes


@pytest.fixture(scope="module")
def parts(tiny_engine, corpus):
    """First parts of four fixed documents, cut small (~300 tokens) so that loads take milliseconds."""
    engine = Engine(tiny_engine.loaded, max_context_tokens=512, max_new_tokens=16, question_budget_tokens=64)
    chosen = []
    for entry in corpus.tier("fixed")[:4]:
        chosen.append(engine.split(entry.doc_id, entry.version, parse_file(corpus.file(entry), entry.title))[0])
    return engine, chosen


@pytest.fixture(scope="module")
def published_once(parts, tmp_path_factory):
    """A store holding the parts' snapshots and a release listing them (in doc_id order)."""
    engine, chosen = parts
    root = tmp_path_factory.mktemp("published") / "store"
    store = LocalStore(root)
    entries = [precompute_part(engine, store, part).entry for part in chosen]
    return root, Release.build(engine.fingerprint, entries)


@pytest.fixture
def published(parts, published_once, tmp_path):
    """A fresh copy of that store for each test (tests corrupt it, write heat, add snapshots)."""
    engine, _ = parts
    root, release = published_once
    shutil.copytree(root, tmp_path / "store")
    return engine, CountingStore(tmp_path / "store"), release


def resident_set(engine, store, release, max_states=8, max_bytes=1 << 40, heat=None, listener=None) -> ResidentSet:
    resident = ResidentSet(store, engine.fingerprint, max_states, max_bytes, heat, listener)
    resident.activate(release)
    return resident


def keys(release):
    return [entry.key for entry in release.snapshots]


def test_lru_by_count_evicts_the_least_recently_used(published):
    engine, store, release = published
    a, b, c, _ = keys(release)
    recorder = Recorder()
    resident = resident_set(engine, store, release, max_states=2, listener=recorder)
    assert not resident.acquire(a).resident_hit
    assert not resident.acquire(b).resident_hit
    assert resident.acquire(a).resident_hit  # a is now the most recently used
    assert not resident.acquire(c).resident_hit  # evicts b, not a
    assert resident.state().keys == [a, c]
    assert resident.acquire(a).resident_hit
    assert not resident.acquire(b).resident_hit
    assert recorder.events.count("evict") == 2 and recorder.resident[0] == 2
    assert recorder.events == ["miss", "miss", "hit", "miss", "evict", "hit", "miss", "evict"]


def test_lru_by_bytes_and_oversized_snapshots(published):
    engine, store, release = published
    a, b, c, _ = keys(release)
    sizes = {key: resident_set(engine, store, release).acquire(key).snapshot.nbytes for key in (a, b, c)}
    budget = sizes[a] + sizes[b]
    resident = resident_set(engine, store, release, max_states=8, max_bytes=budget)
    resident.acquire(a)
    resident.acquire(b)
    resident.acquire(c)
    state = resident.state()
    assert a not in state.keys and c in state.keys and state.nbytes <= budget
    assert state.nbytes == sum(sizes[key] for key in state.keys)

    tiny_budget = resident_set(engine, store, release, max_bytes=min(sizes.values()) - 1)
    served = tiny_budget.acquire(a)  # larger than the whole budget: served, never kept
    assert served.snapshot.n_tokens > 0 and tiny_budget.state().keys == []


def test_evicted_snapshots_still_in_use_count_toward_the_byte_budget(published):
    engine, store, release = published
    a, b, c, _ = keys(release)
    sizes = {key: resident_set(engine, store, release).acquire(key).snapshot.nbytes for key in (a, b, c)}
    recorder = Recorder()
    resident = resident_set(engine, store, release, max_bytes=sizes[a] + sizes[b], listener=recorder)
    held = resident.acquire(a)  # a request still answering from a
    resident.acquire(b)  # finished at once
    resident.acquire(c)  # evicts a (still in memory), so b must go too to stay within the budget
    state = resident.state()
    assert state.keys == [c] and state.evicted_in_use_bytes == sizes[a] == recorder.evicted_in_use
    del held  # the request finished: a's memory is released and no longer counted
    assert resident.state().evicted_in_use_bytes == 0 == recorder.evicted_in_use

    switched = resident_set(engine, store, release)
    in_flight = switched.acquire(a)
    other = release.model_copy(update={"release_id": "other", "snapshots": release.snapshots[1:]})
    switched.activate(other)  # a is dropped while a request holds it
    assert switched.state().evicted_in_use_bytes == sizes[a]
    del in_flight
    assert switched.state().evicted_in_use_bytes == 0


def test_unknown_key_and_no_release(published):
    engine, store, release = published
    resident = ResidentSet(store, engine.fingerprint, 2, 1 << 30)
    with pytest.raises(NoActiveRelease):
        resident.acquire(keys(release)[0])
    resident.activate(release)
    with pytest.raises(UnknownSnapshot, match="not in release"):
        resident.acquire("nope/1/0123456789abcdef")


def test_preload_follows_heat_kept_in_the_store_across_restarts(published):
    engine, store, release = published
    a, b, c, d = keys(release)
    first_life = HeatLog(store, "replica-1")
    first_life.load()
    resident = resident_set(engine, store, release, heat=first_life)
    for key, times in ((c, 5), (d, 3), (a, 1)):
        for _ in range(times):
            resident.acquire(key)
    resident.close()  # flushes the counts
    saved = json.loads(store.get("heat/replica-1.json"))
    assert saved["counts"] == {c: 5, d: 3, a: 1}

    other_replica = HeatLog(store, "replica-2")  # another process, no shared disk: counts come from the store
    other_replica.load()
    preloaded = resident_set(engine, store, release, max_states=2, heat=other_replica)
    report = preloaded.preload()
    assert report.loaded == [c, d] and not report.failed
    assert preloaded.state().keys == [c, d]
    assert report.nbytes == preloaded.state().nbytes

    second_life = HeatLog(store, "replica-1")
    second_life.load()
    second_life.record(b)
    second_life.flush()
    assert json.loads(store.get("heat/replica-1.json"))["counts"] == {c: 5, d: 3, a: 1, b: 1}


def test_heat_of_replicas_gone_quiet_is_ignored_and_pruned(published):
    engine, store, release = published
    a, b, _, _ = keys(release)
    for replica, key in (("gone", a), ("live", b)):
        log = HeatLog(store, replica)
        log.record(key)
        log.flush()
    month_ago = time.time() - 30 * 86400
    os.utime(store.root / "heat/gone.json", (month_ago, month_ago))

    fresh = HeatLog(store, "new", stale_after_days=14)
    fresh.load()
    assert fresh.counts() == {b: 1}
    assert prune_heat(store, 14, dry_run=True) == ["heat/gone.json"]
    assert store.exists_verified("heat/gone.json")
    assert prune_heat(store, 14) == ["heat/gone.json"]
    assert [info.name for info in store.list("heat/")] == ["heat/live.json"]


def test_preload_never_evicts_and_respects_the_byte_budget(published):
    engine, store, release = published
    first = release.snapshots[0]
    resident = resident_set(engine, store, release, max_bytes=first.bytes + 1)
    report = resident.preload()
    assert report.loaded == [first.key]
    assert resident.state().keys == [first.key]


def test_corrupt_snapshot_is_quarantined_until_the_release_changes(published):
    engine, store, release = published
    victim = release.snapshots[1]
    path = store.root / victim.object_name
    path.write_bytes(path.read_bytes()[:-64] + b"\0" * 64)
    resident = resident_set(engine, store, release)
    with pytest.raises(SnapshotQuarantined, match="corrupt.*quarantined until the release changes"):
        resident.acquire(victim.key)
    reads = len(store.snapshot_reads)
    for _ in range(3):
        with pytest.raises(SnapshotQuarantined, match="quarantined"):
            resident.acquire(victim.key)
    assert len(store.snapshot_reads) == reads  # no retry loop: the store is not read again
    assert victim.key in resident.state().quarantined

    report = resident.preload()
    assert victim.key not in report.loaded and len(store.snapshot_reads) == reads + len(report.loaded)

    renewed = Release.build(engine.fingerprint, list(release.snapshots))
    renewed = renewed.model_copy(update={"release_id": renewed.release_id + "-b"})
    resident.activate(renewed)
    assert resident.state().quarantined == {}
    with pytest.raises(SnapshotQuarantined):
        resident.acquire(victim.key)  # tried once more under the new release, then quarantined again
    assert store.snapshot_reads[-1] == victim.object_name


def test_unreachable_store_is_an_error_but_not_a_quarantine(published):
    engine, store, release = published
    key = keys(release)[0]
    recorder = Recorder()
    resident = resident_set(engine, store, release, listener=recorder)
    store.down = True
    for _ in range(2):
        with pytest.raises(StoreUnavailable):
            resident.acquire(key)
    assert recorder.events.count("store_error") == 2 and resident.state().quarantined == {}
    store.down = False
    assert resident.acquire(key).snapshot.n_tokens == release.snapshots[0].n_tokens


def test_single_flight_loads_a_missing_key_once(published):
    engine, store, release = published
    key = keys(release)[2]
    resident = resident_set(engine, store, release)
    store.gate = threading.Event()
    results = []
    threads = [threading.Thread(target=lambda: results.append(resident.acquire(key))) for _ in range(4)]
    for thread in threads:
        thread.start()
    while not store.snapshot_reads:
        threading.Event().wait(0.01)
    threading.Event().wait(0.1)  # let the other three join the load in progress
    store.gate.set()
    for thread in threads:
        thread.join()
    assert store.snapshot_reads == [release.snapshots[2].object_name]
    assert len(results) == 4 and len({id(r.snapshot) for r in results}) == 1
    assert not any(r.resident_hit for r in results)
    assert resident.acquire(key).resident_hit


def test_release_switch_is_atomic_and_in_flight_requests_finish_on_the_old_one(published, parts):
    engine, store, release = published
    _, chosen = parts
    a, b, c, d = keys(release)
    resident = resident_set(engine, store, release)
    for key in (a, b):
        resident.acquire(key)
    in_flight = resident.pin()  # a request that started on the first release

    # The new release: documents a and b unchanged (same objects), c and d at a new version.
    new_entries = list(release.snapshots[:2])
    for part in chosen[2:]:
        bumped = type(part)(part.doc_id, part.doc_version + "-2", part.title, part.sections, part.part)
        new_entries.append(precompute_part(engine, store, bumped).entry)
    second = Release.build(engine.fingerprint, new_entries)
    switch = resident.activate(second)
    assert (switch.previous, switch.current) == (release.release_id, second.release_id)
    assert (switch.kept, switch.dropped) == (2, 0)

    old_snapshot = in_flight.acquire(c)  # still answerable on the release it started with
    assert old_snapshot.release_id == release.release_id
    assert old_snapshot.snapshot.doc_version == release.snapshots[2].doc_version
    assert c not in resident.state().keys  # ... but not admitted into the new release's resident set
    with pytest.raises(UnknownSnapshot):
        resident.acquire(c)
    assert resident.acquire(a).resident_hit and resident.acquire(a).release_id == second.release_id
    assert resident.acquire(second.snapshots[3].key).release_id == second.release_id

    back = resident.activate(release)
    assert back.dropped == 1 and set(resident.state().keys) == {a, b}


def test_release_for_another_model_is_refused(published):
    engine, store, release = published
    resident = resident_set(engine, store, release)
    foreign = release.model_copy(update={"model_fingerprint": "f" * 64, "release_id": "other"})
    with pytest.raises(ReleaseMismatch, match="built for model ffffffffffffffff"):
        resident.activate(foreign)
    assert resident.release.release_id == release.release_id


def test_shared_resident_snapshot_is_never_mutated_by_concurrent_answers(published):
    engine, store, release = published
    key = keys(release)[0]
    resident = resident_set(engine, store, release)
    snapshot = resident.acquire(key).snapshot
    before = [t.clone() for t in snapshot.keys + snapshot.values]
    answers = []

    def ask():
        acquired = resident.acquire(key)
        answers.append(engine.answer("Which port does the web console use?", snapshot=acquired.snapshot).token_ids)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(answers) == 4 and all(tokens == answers[0] for tokens in answers)
    assert all((x == y).all() for x, y in zip(before, snapshot.keys + snapshot.values))

