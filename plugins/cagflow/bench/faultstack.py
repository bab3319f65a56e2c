"""The stack `cagflow bench faults` breaks: SeaweedFS (the S3 snapshot store), OpenSearch, Triton and the
router, each a real server on 127.0.0.1 owned by this process, in one work folder that is removed afterwards.

The release is made the way production makes it: `cagflow precompute` with the store's writer credentials;
Triton and the router get the reader credentials. Each server can be stopped, killed and started again on
the ports it had, which is what a client configured with an address needs to find it again.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import requests

from ..config import Config, load_config
from ..devstack.opensearch import LocalOpenSearch
from ..devstack.process import ServerProcess, free_port, group_members, hold_port
from ..devstack.seaweedfs import LocalSeaweedFS
from ..devstack.triton import LocalTriton
from ..errors import CagflowError
from ..router.apikeys import ApiKeyStore
from ..store.backends import ChecksumMismatch, NotFound, SnapshotStore, StoreError, open_store, s3_client
from ..store.layout import snapshot_object
from ..store.manifests import Release, load_release

BUCKET = "cagflow"
STORE_PREFIX = "serving"  # the serving release's objects: s3://BUCKET/STORE_PREFIX/<object name>
STORE_URL = f"s3://{BUCKET}/{STORE_PREFIX}"


class FaultStackError(CagflowError, RuntimeError):
    """A server of the fault bench did not start, or a step of its setup failed."""

    code = "fault_stack_failed"


def wait_until(condition: Callable[[], bool], timeout_s: float, interval_s: float = 0.5) -> bool:
    """Poll ``condition`` (exceptions count as "not yet") until true or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if condition():
                return True
        except Exception:  # a server on its way down or up answers with anything
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


def ports_free(ports: list[int]) -> bool:
    """True when every port can be bound now (a killed server's listeners are gone)."""
    try:
        with ExitStack() as held:
            for port in ports:
                hold_port(held, port)
        return True
    except OSError:
        return False


def kill_group(pid: int) -> None:
    """SIGKILL a process group: no handler runs, nothing is flushed or cleaned up."""
    for process in group_members(pid):
        try:
            process.send_signal(signal.SIGKILL)
        except OSError:
            pass


@dataclass
class Integrity:
    """Every snapshot object of the store re-hashed: against the release's sha256 for the release's
    objects, against its own recorded checksum for the rest."""

    release_id: str | None
    objects: int = 0
    verified: int = 0
    corrupt: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    @property
    def intact(self) -> bool:
        return self.release_id is not None and not self.corrupt and not self.missing

    def to_dict(self) -> dict:
        return {"release_id": self.release_id, "objects": self.objects, "verified": self.verified,
                "corrupt": self.corrupt, "missing": self.missing, "intact": self.intact}


def check_integrity(store: SnapshotStore) -> Integrity:
    try:
        release = load_release(store)
    except StoreError:
        release = None
    report = Integrity(release.release_id if release else None)
    expected = {snapshot_object(entry.key): entry.sha256 for entry in release.snapshots} if release else {}
    names = {info.name for info in store.list("snapshots/")} | set(expected)
    for name in sorted(names):
        report.objects += 1
        try:
            store.get(name, sha256=expected.get(name))
            report.verified += 1
        except NotFound:
            report.missing.append(name)
        except ChecksumMismatch:
            report.corrupt.append(name)
    return report


class FaultStack:
    """The four servers, a release of ``doc_ids`` in S3, and one user and one admin API key. With
    ``opensearch_url`` the stack indexes into that OpenSearch (an index of its own) instead of starting one;
    the scenario that restarts OpenSearch then needs a stack of its own."""

    def __init__(self, work_dir: Path, config: Config, model: str, doc_ids: list[str], max_new_tokens: int,
                 max_resident_states: int, say: Callable[[str], None] = print, opensearch_url: str = "") -> None:
        self.work_dir = work_dir
        self.config = config
        self.model = model
        self.doc_ids = doc_ids
        self.max_new_tokens = max_new_tokens
        self.max_resident_states = max_resident_states
        self.say = say
        self.s3 = LocalSeaweedFS(work_dir / "s3", access_key=secrets.token_hex(10), secret_key=secrets.token_hex(20),
                                 buckets=[BUCKET])
        self.opensearch = None if opensearch_url else LocalOpenSearch(work_dir / "opensearch")
        self.opensearch_url = opensearch_url
        self.triton: LocalTriton | None = None
        self.router: ServerProcess | None = None
        self.router_port = 0
        self.index = f"faults-{secrets.token_hex(4)}"
        self.user_key = self.admin_key = ""
        self.releases: list[str] = []

    # ---- settings ---------------------------------------------------------------------------------------

    def settings(self) -> dict[str, str]:
        """What every CAGFlow process of this stack is told (``CAGFLOW__*``), credentials aside."""
        return {"CAGFLOW__MODEL__PATH": self.model, "CAGFLOW__MODEL__MAX_NEW_TOKENS": str(self.max_new_tokens),
                "CAGFLOW__CORPUS__MANIFEST": str(Path(self.config.corpus.manifest).resolve()),
                "CAGFLOW__CACHE__STATE_STORE": STORE_URL, "CAGFLOW__CACHE__S3__ENDPOINT_URL": self.s3.endpoint_url,
                "CAGFLOW__CACHE__MAX_RESIDENT_STATES": str(self.max_resident_states),
                "CAGFLOW__CACHE__PRELOAD_ON_STARTUP": "false",
                "CAGFLOW__RETRIEVAL__ENDPOINT": self.opensearch_url, "CAGFLOW__RETRIEVAL__INDEX": self.index,
                "CAGFLOW__SERVICE__API_KEYS_FILE": str(self.work_dir / "api-keys.json"),
                "CAGFLOW__SERVICE__AUDIT_LOG_FILE": str(self.work_dir / "audit.jsonl"),
                "CAGFLOW__SERVICE__RATE_LIMIT_PER_S": "1000", "CAGFLOW__SERVICE__RATE_LIMIT_BURST": "1000",
                "CAGFLOW__SERVICE__RELEASE_POLL_S": "5", "HF_HUB_OFFLINE": "1"}

    def environment(self, role: str = "reader", **extra: str) -> dict[str, str]:
        clean = {key: value for key, value in os.environ.items()
                 if not key.startswith(("CAGFLOW__", "AWS_", "CAGFLOW_S3_"))}
        return {**clean, **self.settings(), **self.s3.role_environment(role), **extra}

    def store(self, role: str = "reader", url: str = STORE_URL) -> SnapshotStore:
        settings = load_config(environ=self.environment(role)).cache.s3
        client = s3_client(settings, *self.s3.role_keys[role]) if url.startswith("s3:") else None  # type: ignore[index]
        return open_store(url, settings, client, role=role)  # type: ignore[arg-type]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    # ---- setup ------------------------------------------------------------------------------------------

    def cagflow(self, *args: str, role: str = "writer", timeout_s: float = 1800, **extra: str
                ) -> subprocess.CompletedProcess:
        """Run the command line as an operator would, with this stack's settings."""
        return subprocess.run([sys.executable, "-m", "cagflow.cli", *args], env=self.environment(role, **extra),
                              capture_output=True, text=True, timeout=timeout_s)

    def precompute(self, doc_ids: list[str]) -> str:
        """Snapshots of ``doc_ids`` into the store and a new release; returns the active release id."""
        started = time.perf_counter()
        done = self.cagflow("precompute", "--quiet", *[arg for doc in doc_ids for arg in ("--doc-id", doc)])
        if done.returncode != 0:
            raise FaultStackError(f"cagflow precompute failed: {done.stderr.strip()[-2000:]}")
        release = load_release(self.store()).release_id
        self.say(f"  precomputed {', '.join(doc_ids)} in {time.perf_counter() - started:.0f} s: release {release}")
        return release

    def start(self) -> None:
        self.say("starting SeaweedFS (S3) and OpenSearch ...")
        self.s3.start()
        self.s3.create_bucket(BUCKET)
        if self.opensearch is not None:
            self.opensearch_url = self.opensearch.start(timeout_s=300)
        self.say("indexing the sample corpus ...")
        self._index_corpus()
        self.say(f"precomputing {len(self.doc_ids)} fixed documents with {self.model} ...")
        # Two releases: the first documents, then all of them; the release switch goes back and forth.
        self.releases = [self.precompute(self.doc_ids[:-1]), self.precompute(self.doc_ids[-1:])]
        keys = ApiKeyStore(self.work_dir / "api-keys.json")
        self.user_key = keys.create("fault-bench")[1]
        self.admin_key = keys.create("fault-bench-admin", admin=True)[1]
        self.say("starting Triton and the router ...")
        self.start_triton()
        self.start_router()

    def _index_corpus(self) -> None:
        from ..offline import pipeline

        config = load_config(environ=self.environment("writer"))
        for tier in ("fixed", "variable"):
            parsed = pipeline.parse_documents(pipeline.load_documents(tier, config=config))
            pipeline.index_chunks(pipeline.embed_chunks(pipeline.chunk_documents(parsed, config)), tier, False, config)

    def start_triton(self, ports: dict[str, int] | None = None) -> None:
        """Triton with the reader credentials; on ``ports`` (a restart) once the old listeners are gone."""
        if ports and not wait_until(lambda: ports_free(list(ports.values())), 120, 1.0):
            raise FaultStackError(f"Triton's ports {sorted(ports.values())} are still taken")
        run_dir = self.work_dir / f"triton-{time.monotonic_ns()}"
        settings = {key: value for key, value in self.environment().items() if key.startswith(("CAGFLOW", "AWS_"))}
        # The stack precomputes through the command line, never through Triton's cag_precompute.
        self.triton = LocalTriton(run_dir, models=["cag_llm", "cag_llm_stream"], environment=settings,
                                  ports=ports)  # type: ignore[arg-type]
        self.triton.start(timeout_s=600)

    def start_router(self) -> None:
        self.router_port = self.router_port or free_port()
        triton = self.triton
        assert triton is not None
        environment = self.environment(
            CAGFLOW__SERVICE__PORT=str(self.router_port), CAGFLOW__SERVICE__TRITON_URL=triton.http_url,
            CAGFLOW__SERVICE__TRITON_GRPC_URL=triton.grpc_url, CAGFLOW__SERVICE__TRITON_METRICS_URL=triton.metrics_url)
        self.router = ServerProcess("router", self.work_dir / "router.log", FaultStackError, leader_first=True)
        self.router.launch([sys.executable, "-m", "cagflow.cli", "serve"], cwd=self.work_dir, env=environment)
        self.router.wait_ready(lambda: requests.get(f"{self.url}/healthz", timeout=2).ok, 300, interval_s=0.5,
                               retry_on=(requests.RequestException,))

    def stop(self) -> None:
        for server in (self.router, self.triton, self.opensearch, self.s3):
            if server is not None:
                server.stop()

    def __enter__(self) -> "FaultStack":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ---- what the scenarios ask ---------------------------------------------------------------------------

    def ask(self, question: str, doc_id: str | None = None, timeout_s: float = 300, **body) -> tuple[int, dict]:
        """One request as an application sends it; (status, JSON body)."""
        payload = {"question": question, **({"doc_id": doc_id} if doc_id else {}), **body}
        reply = requests.post(f"{self.url}/v1/query", json=payload, timeout=timeout_s,
                              headers={"Authorization": f"Bearer {self.user_key}"})
        return reply.status_code, reply.json()

    def readiness(self) -> dict:
        return requests.get(f"{self.url}/readyz", timeout=60).json()

    def reload(self, release_id: str | None = None) -> dict:
        reply = requests.post(f"{self.url}/admin/reload", json={"release_id": release_id} if release_id else {},
                              headers={"Authorization": f"Bearer {self.admin_key}"}, timeout=300)
        body = reply.json()
        if reply.status_code != 200:
            raise FaultStackError(f"/admin/reload answered {reply.status_code}: {json.dumps(body)}")
        return body

    def release(self, release_id: str) -> Release:
        return load_release(self.store(), release_id)
