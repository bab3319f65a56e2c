"""Several Triton replicas: rendezvous hashing places each snapshot key on one replica (stable, balanced,
and only a leaving or joining replica's keys move), and the pool fails over to the next replica on a
connection failure only, marks the failed one down and moves its keys back once it is ready again. The
replicas here are small in-memory stand-ins (one is a real client of a closed port); the real failover, with
Triton killed under load, is tests/integration/test_replicas.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest
from cagflow.config import load_config
from cagflow.devstack.process import free_ports
from cagflow.router import metrics
from cagflow.router.access import ApiError
from cagflow.router.replicas import Replica, TritonPool, rank
from cagflow.router.routing import Router
from cagflow.router.triton_client import (TritonClient, TritonRejected, TritonTimeout, TritonUnavailable,
                                          _stream_error)
from cagflow.store.backends import LocalStore

KEYS = [f"doc-{number}" for number in range(1000)]


def owners(replica_ids: list[str], keys: list[str] = KEYS) -> dict[str, str]:
    return {key: rank(key, replica_ids)[0] for key in keys}


def test_the_ranking_is_the_same_in_every_process():
    """Not Python's salted ``hash``: two routers (or a router after a restart) place every key alike."""
    code = ("import json\nfrom cagflow.router.replicas import rank\n"
            f"print(json.dumps([rank(key, ['a', 'b', 'c']) for key in {KEYS[:50]!r}]))")
    rankings = [json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                                          env={**os.environ, "PYTHONHASHSEED": seed}).stdout)
                for seed in ("1", "2")]
    assert rankings[0] == rankings[1] == [rank(key, ["a", "b", "c"]) for key in KEYS[:50]]
    assert rank("doc-1", ["c", "a", "b"]) == rank("doc-1", ["a", "b", "c"])  # the listing order does not matter


@pytest.mark.parametrize("replica_ids", [["a", "b"], ["a", "b", "c"], ["10.0.0.5:8000", "10.0.0.6:8000",
                                                                        "10.0.0.7:8000", "10.0.0.8:8000"]])
def test_keys_spread_evenly(replica_ids):
    """Each replica's share of 10,000 keys is within four standard deviations of a fair split (a few %)."""
    keys = [f"doc-{number}/{number % 7}/snapshot" for number in range(10_000)]
    shares = Counter(owners(replica_ids, keys).values())
    share = 1 / len(replica_ids)
    deviation = (len(keys) * share * (1 - share)) ** 0.5
    assert set(shares) == set(replica_ids)
    assert all(abs(count - len(keys) * share) < 4 * deviation for count in shares.values()), shares


def test_only_the_keys_of_a_leaving_or_joining_replica_move():
    before = owners(["a", "b", "c"])
    without_c = owners(["a", "b"])
    moved = {key for key in KEYS if before[key] != without_c[key]}
    assert moved == {key for key in KEYS if before[key] == "c"}
    with_d = owners(["a", "b", "c", "d"])
    joined = {key for key in KEYS if before[key] != with_d[key]}
    assert joined == {key for key in KEYS if with_d[key] == "d"} and 150 < len(joined) < 350
    # a key whose replica left goes where its ranking's second place was
    assert all(without_c[key] == rank(key, ["a", "b", "c"])[1] for key in moved)


class FakeTriton:
    """A replica's client: answers with its own name, or fails as told (``failure``), counting the calls."""

    def __init__(self, name: str):
        self.base = f"http://{name}"
        self.calls: list[dict] = []
        self.failure: Exception | None = None
        self.stream_failure_after_first: Exception | None = None
        self.ready = True

    def infer(self, model, **values):
        self.calls.append(values)
        if self.failure is not None:
            raise self.failure
        return {"ANSWER": self.base, "STATUS": json.dumps({"replica": self.base})}

    def stream(self, model, **values):
        self.calls.append(values)
        if self.failure is not None:
            raise self.failure
        yield {"TEXT": "piece"}
        if self.stream_failure_after_first is not None:
            raise self.stream_failure_after_first
        yield {"ANSWER": self.base}

    def reload(self, release_id):
        return self.infer("cag_llm", action="reload", release_id=release_id)

    def server_ready(self, timeout_s: float = 1.0) -> bool:
        return self.ready

    def model_ready(self, timeout_s: float = 2.0) -> bool:
        return self.ready

    def resident_snapshots(self):
        return 2 if self.ready else None

    def close(self):
        pass


@pytest.fixture()
def pool(request):
    """Two stand-in replicas named after the test (metrics are process-wide), re-probed every 50 ms."""
    prefix = request.node.name[:40]
    fakes = {f"{prefix}-a": FakeTriton(f"{prefix}-a"), f"{prefix}-b": FakeTriton(f"{prefix}-b")}
    pool = TritonPool([Replica(name, fake) for name, fake in fakes.items()], reprobe_s=0.05)
    yield pool, fakes
    pool.close()


def counter(metric, *labels) -> float:
    return metric.labels(*labels)._value.get()


def key_owned_by(pool: TritonPool, replica_id: str) -> str:
    return next(key for key in KEYS if rank(key, [replica.id for replica in pool.replicas])[0] == replica_id)


def test_a_snapshot_goes_to_its_replica_and_fails_over_once_to_the_next(pool):
    pool, fakes = pool
    first, second = list(fakes)
    key = key_owned_by(pool, first)
    assert pool.infer(snapshot_key=key, question="q")["ANSWER"] == fakes[first].base
    assert len(fakes[first].calls) == 1 and fakes[second].calls == []

    fakes[first].failure = TritonUnavailable("refused")
    assert pool.infer(snapshot_key=key, question="q")["ANSWER"] == fakes[second].base
    assert counter(metrics.TRITON_FAILOVERS, first) == 1
    assert counter(metrics.TRITON_REPLICA_UP, first) == 0 and counter(metrics.TRITON_REPLICA_UP, second) == 1
    assert counter(metrics.TRITON_REPLICA_REQUESTS, first, "unavailable") == 1
    # marked down: the next request on its keys goes straight to the other replica
    pool.infer(snapshot_key=key, question="q")
    assert len(fakes[first].calls) == 2 and len(fakes[second].calls) == 2

    fakes[second].failure = TritonUnavailable("refused")  # both down: one failover, then the error
    with pytest.raises(TritonUnavailable):
        pool.infer(snapshot_key=key, question="q")
    assert len(fakes[first].calls) == 3 and len(fakes[second].calls) == 3


@pytest.mark.parametrize("failure", [TritonRejected(400, "[invalid_request] too long"),
                                     TritonRejected(503, "[snapshot_unavailable] not in the release"),
                                     TritonTimeout("did not answer within 60 s")])
def test_a_rejection_or_a_timeout_is_not_sent_to_another_replica(pool, failure):
    pool, fakes = pool
    first, second = list(fakes)
    fakes[first].failure = failure
    with pytest.raises(type(failure)):
        pool.infer(snapshot_key=key_owned_by(pool, first), question="q")
    assert fakes[second].calls == [] and all(replica.up for replica in pool.replicas)


def test_a_replica_that_is_back_gets_its_keys_again(pool):
    pool, fakes = pool
    first, second = list(fakes)
    key = key_owned_by(pool, first)
    fakes[first].failure, fakes[first].ready = TritonUnavailable("refused"), False
    pool.infer(snapshot_key=key, question="q")
    time.sleep(0.2)  # several probes: still not ready, still down
    assert not pool.replicas[0].up and pool.ranking(key)[0].id == second
    fakes[first].failure, fakes[first].ready = None, True
    deadline = time.monotonic() + 5
    while not pool.replicas[0].up and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pool.infer(snapshot_key=key, question="q")["ANSWER"] == fakes[first].base
    assert counter(metrics.TRITON_REPLICA_UP, first) == 1


def test_requests_without_a_snapshot_take_turns_among_the_replicas_up(pool):
    pool, fakes = pool
    first, second = list(fakes)
    for _ in range(6):
        pool.infer(question="q", context="[]")
    assert len(fakes[first].calls) == len(fakes[second].calls) == 3
    pool.mark_down(pool.replicas[0], "test")
    fakes[first].ready = False
    for _ in range(4):
        pool.infer(question="q", context="[]")
    assert len(fakes[first].calls) == 3 and len(fakes[second].calls) == 7


def test_a_stream_fails_over_before_its_first_piece_never_after(pool):
    pool, fakes = pool
    first, second = list(fakes)
    key = key_owned_by(pool, first)
    fakes[first].failure = TritonUnavailable("gRPC unreachable")
    assert [piece.get("ANSWER") for piece in pool.stream(snapshot_key=key, question="q")] == [None, fakes[second].base]

    pool.mark_up(pool.replicas[0])
    fakes[first].failure = None
    fakes[first].stream_failure_after_first = TritonUnavailable("went away")
    pieces = pool.stream(snapshot_key=key, question="q")
    assert next(pieces) == {"TEXT": "piece"}
    with pytest.raises(TritonUnavailable, match="went away"):
        next(pieces)
    assert len(fakes[second].calls) == 1  # only the first stream's failover


def test_a_replica_that_refuses_connections_is_skipped(request):
    """A real client of a port nothing listens on: the refusal is what moves the request on."""
    http_port, grpc_port = free_ports(2)
    name = request.node.name[:40]
    dead = TritonClient(f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", timeout_s=5, retries=0, pool_size=2)
    alive = FakeTriton(f"{name}-alive")
    pool = TritonPool([Replica(f"{name}-dead", dead), Replica(alive.base, alive)], reprobe_s=60)
    try:
        key = key_owned_by(pool, f"{name}-dead")
        assert pool.infer(snapshot_key=key, question="q")["ANSWER"] == alive.base
        assert [piece.get("ANSWER") for piece in pool.stream(snapshot_key=key, question="q")][-1] == alive.base
        assert not pool.replicas[0].up and counter(metrics.TRITON_FAILOVERS, f"{name}-dead") == 1
    finally:
        pool.close()


def test_reload_goes_to_every_replica_and_reports_each(pool, tmp_path):
    pool, fakes = pool
    first, second = list(fakes)
    router = Router(load_config(environ={}), pool, None, None, LocalStore(tmp_path), SimpleNamespace(encode_query=str))
    reloaded = router.reload(None)
    assert [entry["name"] for entry in reloaded["replicas"]] == [first, second]
    assert all(entry["reloaded"] for entry in reloaded["replicas"])
    assert [call["action"] for call in fakes[first].calls + fakes[second].calls] == ["reload", "reload"]

    fakes[second].failure = TritonUnavailable("refused")
    partly = router.reload(None)
    assert partly["triton"] == {"replica": fakes[first].base}
    assert partly["replicas"][1] == {"name": second, "reloaded": False,
                                     "error": {"code": "triton_unavailable", "message": "refused"}}
    fakes[first].failure = TritonRejected(500, "[internal] broken")
    with pytest.raises(ApiError) as failed:  # no replica switched: the request fails as with one replica
        router.reload(None)
    assert (failed.value.status, failed.value.code) == (502, "triton_error")


def test_readiness_marks_replicas_up_and_down(pool):
    pool, fakes = pool
    first, second = list(fakes)
    fakes[second].ready = False
    report = pool.readiness()
    assert [(entry["name"], entry["ready"], entry["resident_snapshots"]) for entry in report] == [
        (first, True, 2), (second, False, None)]
    assert [replica.up for replica in pool.replicas] == [True, False]
    fakes[second].ready = True
    pool.readiness()
    assert all(replica.up for replica in pool.replicas)


def test_a_grpc_stream_cut_by_the_server_going_away_or_its_stub_dying_is_a_replica_failure():
    def grpc_error(status: str, message: str):
        return SimpleNamespace(status=lambda: status, message=lambda: message)

    gone = _stream_error(grpc_error("StatusCode.UNAVAILABLE", "Socket closed"), "127.0.0.1:8001")
    assert isinstance(gone, TritonUnavailable)
    refused = _stream_error(grpc_error("StatusCode.UNAVAILABLE", "[store_unavailable] store down"), "127.0.0.1:8001")
    assert isinstance(refused, TritonRejected) and (refused.status, refused.reason) == (503, "store_unavailable")
    stub_died = _stream_error(grpc_error("StatusCode.INTERNAL", "Stub process 'cag_llm_stream_0_0' is not healthy."),
                              "127.0.0.1:8001")
    assert isinstance(stub_died, TritonUnavailable)
    failed = _stream_error(grpc_error("StatusCode.INTERNAL", "[internal] request r1: IndexError"), "127.0.0.1:8001")
    assert isinstance(failed, TritonRejected) and (failed.status, failed.reason) == (500, "internal")


def test_one_replica_is_always_tried_even_when_marked_down(request):
    """With one replica (the triton_*_url keys) nothing changes: a request after a failure still goes to it."""
    only = FakeTriton(request.node.name[:40])
    pool = TritonPool([Replica(only.base, only)], reprobe_s=60)
    try:
        only.failure = TritonUnavailable("refused")
        with pytest.raises(TritonUnavailable):
            pool.infer(snapshot_key="doc-1", question="q")
        only.failure = None
        assert pool.infer(snapshot_key="doc-1", question="q")["ANSWER"] == only.base
        assert len(only.calls) == 2
    finally:
        pool.close()


def test_concurrent_failovers_start_one_prober(pool):
    pool, fakes = pool
    first, _ = list(fakes)
    fakes[first].failure, fakes[first].ready = TritonUnavailable("refused"), False
    key = key_owned_by(pool, first)
    threads = [threading.Thread(target=pool.infer, kwargs={"snapshot_key": key, "question": "q"}) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(thread.name == "cagflow-triton-reprobe" for thread in threading.enumerate()) == 1
