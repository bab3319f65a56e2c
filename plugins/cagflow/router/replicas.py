"""Several Triton replicas behind one router (``service.triton_replicas``; README "Several Triton replicas").

A request on a snapshot goes to the replica that ranks first for the snapshot's key by rendezvous (highest
random weight) hashing, so each replica keeps its own share of the snapshots resident, and a replica
leaving or joining moves only the keys it ranks first for. A request without a snapshot (retrieval) goes
round robin. A connection failure marks the replica down and sends the request once more, to the next
replica of its ranking; a rejection (the request reached a model), a timeout (it may still be computing)
and a stream that has sent its first piece are never sent elsewhere. A replica marked down is probed
(``/v2/health/ready``) every ``service.triton_reprobe_s`` until it answers; then its keys move back.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence, TypeVar

from ..config import ServiceConfig
from . import metrics
from .triton_client import ANSWER_MODEL, STREAM_MODEL, TritonClient, TritonRejected, TritonTimeout, TritonUnavailable

log = logging.getLogger("cagflow.router")
ATTEMPTS = 2  # the first choice, and one failover to the next replica
Result = TypeVar("Result")


def rendezvous_score(key: str, replica_id: str) -> int:
    """The weight of ``replica_id`` for ``key``: a stable 64-bit hash of both (not Python's ``hash``, which
    differs between processes)."""
    return int.from_bytes(hashlib.blake2b(f"{replica_id}\0{key}".encode(), digest_size=8).digest(), "big")


def rank(key: str, replica_ids: Sequence[str]) -> list[str]:
    """``replica_ids`` in the order a request on ``key`` tries them: highest rendezvous score first."""
    return sorted(replica_ids, key=lambda replica_id: rendezvous_score(key, replica_id), reverse=True)


@dataclass(eq=False)
class Replica:
    id: str
    client: TritonClient
    up: bool = True  # False while marked down: tried only when every replica before it failed too

    @property
    def label(self) -> str:
        """How messages name it: its id, and its address when the id is a name."""
        return self.id if self.client.base.endswith(self.id) else f"{self.id} ({self.client.base})"


class TritonPool:
    """The router's Triton replicas, with the calls ``TritonClient`` offers routed among them."""

    def __init__(self, replicas: list[Replica], reprobe_s: float):
        if not replicas:
            raise ValueError("a Triton pool needs at least one replica")
        self.replicas = replicas
        self.reprobe_s = reprobe_s
        self._by_id = {replica.id: replica for replica in replicas}
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._prober: threading.Thread | None = None
        for replica in replicas:
            metrics.TRITON_REPLICA_UP.labels(replica.id).set(1)

    @classmethod
    def from_config(cls, service: ServiceConfig) -> "TritonPool":
        return cls([Replica(replica.id, TritonClient(replica.http_url, replica.grpc_url, service.triton_timeout_s,
                                                     service.retries, pool_size=service.max_concurrent_requests + 4,
                                                     metrics_url=replica.metrics_url))
                    for replica in service.replicas()], service.triton_reprobe_s)

    @property
    def base(self) -> str:
        """Every replica's HTTP address, for messages."""
        return ", ".join(replica.client.base for replica in self.replicas)

    def close(self) -> None:
        self._closed.set()
        prober = self._prober
        if prober is not None:
            prober.join(timeout=5)
        for replica in self.replicas:
            replica.client.close()

    # ---- where a request goes --------------------------------------------------------------------------

    def ranking(self, key: str | None) -> list[Replica]:
        """The replicas in the order a request tries them: by rendezvous score for a snapshot's ``key``,
        round robin without one; replicas marked down last, in the same order."""
        if key:
            ordered = [self._by_id[replica_id] for replica_id in rank(key, list(self._by_id))]
        else:
            start = next(self._turn) % len(self.replicas)
            ordered = self.replicas[start:] + self.replicas[:start]
        return sorted(ordered, key=lambda replica: not replica.up)

    def _call(self, key: str | None, call: Callable[[TritonClient], Result]) -> Result:
        """``call`` on the first replica of ``key``'s ranking; on a connection failure, once more on the next."""
        *first, last = self.ranking(key)[:ATTEMPTS]
        for replica in first:
            try:
                return self._attempt(replica, call)
            except TritonTimeout:
                raise
            except TritonUnavailable as exc:
                metrics.TRITON_FAILOVERS.labels(replica.id).inc()
                log.warning("Triton replica %s failed (%s): the request goes to %s", replica.label, exc, last.label)
        return self._attempt(last, call)

    def _attempt(self, replica: Replica, call: Callable[[TritonClient], Result]) -> Result:
        try:
            result = call(replica.client)
        except TritonRejected:
            metrics.TRITON_REPLICA_REQUESTS.labels(replica.id, "rejected").inc()
            raise
        except TritonTimeout:
            metrics.TRITON_REPLICA_REQUESTS.labels(replica.id, "timeout").inc()
            raise
        except TritonUnavailable as exc:
            metrics.TRITON_REPLICA_REQUESTS.labels(replica.id, "unavailable").inc()
            self.mark_down(replica, str(exc))
            raise
        metrics.TRITON_REPLICA_REQUESTS.labels(replica.id, "ok").inc()
        return result

    # ---- up and down -----------------------------------------------------------------------------------

    def mark_down(self, replica: Replica, reason: str) -> None:
        """Send nothing more to ``replica`` while another is up, and probe it until it is back."""
        with self._lock:
            if replica.up:
                replica.up = False
                metrics.TRITON_REPLICA_UP.labels(replica.id).set(0)
                log.warning("Triton replica %s marked down (%s): its snapshots go to the next replica until it "
                            "is ready again", replica.label, reason)
            if self._prober is None and not self._closed.is_set():
                self._prober = threading.Thread(target=self._reprobe, name="cagflow-triton-reprobe", daemon=True)
                self._prober.start()

    def mark_up(self, replica: Replica) -> None:
        with self._lock:
            if not replica.up:
                replica.up = True
                metrics.TRITON_REPLICA_UP.labels(replica.id).set(1)
                log.info("Triton replica %s is ready again: its snapshots move back to it", replica.label)

    def _reprobe(self) -> None:
        """Probe the replicas marked down every ``reprobe_s``; ends when none is left."""
        while not self._closed.wait(self.reprobe_s):
            with self._lock:
                down = [replica for replica in self.replicas if not replica.up]
                if not down:
                    self._prober = None
                    return
            for replica in down:
                if replica.client.server_ready():
                    self.mark_up(replica)

    # ---- the calls -------------------------------------------------------------------------------------

    def infer(self, model: str = ANSWER_MODEL, **values: Any) -> dict[str, Any]:
        return self._call(values.get("snapshot_key"), lambda client: client.infer(model, **values))

    def stream(self, model: str = STREAM_MODEL, **values: Any) -> Iterator[dict[str, Any]]:
        """Like ``TritonClient.stream``. Each replica tried is awaited up to its first response, so one that
        fails before it is replaced; from the first response on, the stream stays where it is."""
        def opened(client: TritonClient) -> tuple[dict[str, Any] | None, Iterator[dict[str, Any]]]:
            responses = client.stream(model, **values)
            return next(responses, None), responses

        first, responses = self._call(values.get("snapshot_key"), opened)
        if first is not None:
            yield first
            yield from responses

    def reload(self, release_id: str | None) -> list[tuple[Replica, dict[str, Any] | Exception]]:
        """``ACTION=reload`` on every replica at once; each one's outputs, or why it failed (a replica that
        is down reads the current release when it starts again)."""
        def reload_one(replica: Replica) -> tuple[Replica, dict[str, Any] | Exception]:
            try:
                return replica, replica.client.reload(release_id)
            except (TritonUnavailable, TritonRejected) as exc:
                if isinstance(exc, TritonUnavailable) and not isinstance(exc, TritonTimeout):
                    self.mark_down(replica, str(exc))
                return replica, exc

        with ThreadPoolExecutor(len(self.replicas), thread_name_prefix="cagflow-triton-reload") as executor:
            return list(executor.map(reload_one, self.replicas))

    def readiness(self) -> list[dict[str, Any]]:
        """Each replica's model readiness and resident snapshots (None when unknown); a replica found not
        ready is marked down, one found ready is marked up."""
        report = []
        for replica in self.replicas:
            ready = replica.client.model_ready()
            if ready:
                self.mark_up(replica)
            else:
                self.mark_down(replica, "model cag_llm not ready")
            resident = replica.client.resident_snapshots() if ready else None
            if resident is not None:
                metrics.TRITON_REPLICA_RESIDENT.labels(replica.id).set(resident)
            report.append({"name": replica.id, "url": replica.client.base, "ready": ready,
                           "resident_snapshots": resident})
        return report
