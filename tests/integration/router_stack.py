"""The router's integration stack, shared by the modules that run it (test_router, test_replicas): the sample
corpus indexed in a real OpenSearch, a release of its fixed documents' first parts, a real Triton (tiny model)
and the router as deployed (gunicorn via ``run_server``, in its own process), with their settings and the
helpers that ask them. The fixtures are module-scoped: each module that imports them gets its own stack."""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import requests
from cagflow.config import load_config
from cagflow.devstack.jaeger import LocalJaeger
from cagflow.devstack.process import ServerProcess, free_port, hold_port
from cagflow.devstack.triton import LocalTriton
from cagflow.offline import pipeline
from cagflow.router.apikeys import ApiKeyStore
from cagflow.store.backends import LocalStore

MAX_NEW_TOKENS = 8
IN_SCOPE = ("What is the minimum password length?", "security-access-policy")  # scope score ~0.68
OUT_OF_SCOPE = "On what date is the eu-west database upgrade maintenance scheduled?"  # a variable document
VARIABLE_DOC = "maintenance-2025-01-eu-west-database-upgrade"
CORRUPTED_DOC = "data-retention-backup-guide"  # never asked before its snapshot is corrupted
OFF_TOPIC = "Can you give me a recipe for banana bread?"  # far below every sample chunk on e5's scale
# The policy says 6 attempts; an amendment published after it says 5.
UPDATED = ("After how many consecutive failed sign-in attempts is an account locked?", "security-access-policy",
           "security-policy-amendment-2025-01")
DECLINE_BELOW = 0.5  # the relevance check's decline threshold for the tiny model's English answers
ANSWERABLE_THRESHOLD = 0.8  # e5 cosines: related text 0.85 and up
class RouterError(RuntimeError):
    pass


@pytest.fixture(scope="module")
def corpus_index(opensearch_url, corpus_manifest_path):
    """Every chunk of the sample corpus (both tiers) in an alias of its own, indexed by the pipeline's functions."""
    config = load_config(environ={"CAGFLOW__RETRIEVAL__ENDPOINT": opensearch_url,
                                  "CAGFLOW__RETRIEVAL__INDEX": f"router-{uuid.uuid4().hex[:8]}",
                                  "CAGFLOW__CORPUS__MANIFEST": str(corpus_manifest_path)})
    for tier in ("fixed", "variable"):
        parsed = pipeline.parse_documents(pipeline.load_documents(tier, config=config))
        pipeline.index_chunks(pipeline.embed_chunks(pipeline.chunk_documents(parsed, config)), tier, False, config)
    return config.retrieval.index


@pytest.fixture(scope="module")
def release_store(publish_first_parts, tmp_path_factory):
    """The first part (~600 tokens) of each fixed document, published as the active release."""
    store = LocalStore(tmp_path_factory.mktemp("router-store"))
    _, release = publish_first_parts(store, MAX_NEW_TOKENS)
    return store, release


def triton_environment(model_dir, store_root) -> dict[str, str]:
    """Nothing preloaded: a snapshot becomes resident when first asked for, so one can be corrupted unseen."""
    return {"CAGFLOW__MODEL__PATH": str(model_dir), "CAGFLOW__MODEL__MAX_CONTEXT_TOKENS": "2048",
            "CAGFLOW__MODEL__MAX_NEW_TOKENS": str(MAX_NEW_TOKENS), "CAGFLOW__MODEL__QUESTION_BUDGET_TOKENS": "128",
            "CAGFLOW__CACHE__STATE_STORE": f"file://{store_root}", "CAGFLOW__CACHE__MAX_RESIDENT_STATES": "3",
            "CAGFLOW__CACHE__PRELOAD_ON_STARTUP": "false",
            "CAGFLOW__MODEL__RELEVANCE__DECLINE_BELOW_EN": str(DECLINE_BELOW)}  # off by default: exercised here


TRITON_MODELS = ["cag_llm", "cag_llm_stream"]  # what the router asks; cag_precompute would only slow each start


@pytest.fixture(scope="module")
def jaeger(tmp_path_factory):
    """The trace collector the router and Triton below send their spans to, as ``make run TRACING=1`` has it."""
    with LocalJaeger(tmp_path_factory.mktemp("router-jaeger")) as collector:
        yield collector


def tracing_environment(jaeger) -> dict[str, str]:
    return {"CAGFLOW__TRACING__ENDPOINT": jaeger.otlp_endpoint, "CAGFLOW__TRACING__EXPORT_DELAY_MS": "100"}


@pytest.fixture(scope="module")
def triton(release_store, tiny_model_dir, tmp_path_factory, jaeger):
    store, _ = release_store
    with LocalTriton(tmp_path_factory.mktemp("router-triton"), models=TRITON_MODELS,
                     environment={**triton_environment(tiny_model_dir, store.root),
                                  **tracing_environment(jaeger)}) as server:
        yield server


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    path = tmp_path_factory.mktemp("router-keys") / "api-keys.json"
    store = ApiKeyStore(path)
    _, user = store.create("integration")
    _, admin = store.create("integration-admin", admin=True)
    return path, {"Authorization": f"Bearer {user}"}, {"Authorization": f"Bearer {admin}"}


def router_settings(opensearch_url, index, triton, store, keys_path) -> dict[str, str]:
    return {"CAGFLOW__RETRIEVAL__ENDPOINT": opensearch_url, "CAGFLOW__RETRIEVAL__INDEX": index,
            "CAGFLOW__SERVICE__TRITON_URL": triton.http_url, "CAGFLOW__SERVICE__TRITON_GRPC_URL": triton.grpc_url,
            "CAGFLOW__SERVICE__TRITON_METRICS_URL": triton.metrics_url,
            "CAGFLOW__SERVICE__API_KEYS_FILE": str(keys_path), "CAGFLOW__SERVICE__IN_SCOPE_THRESHOLD": "0.83",
            "CAGFLOW__SERVICE__AUDIT_LOG_FILE": str(keys_path.with_name("audit.jsonl")),
            "CAGFLOW__SERVICE__ANSWERABLE_THRESHOLD": str(ANSWERABLE_THRESHOLD),
            "CAGFLOW__SERVICE__UPDATE_MARGIN": "0.05",
            "CAGFLOW__SERVICE__RATE_LIMIT_PER_S": "1000", "CAGFLOW__SERVICE__RATE_LIMIT_BURST": "1000",
            "CAGFLOW__SERVICE__TRITON_TIMEOUT_S": "60", "CAGFLOW__SERVICE__RETRIES": "0",
            "CAGFLOW__CACHE__STATE_STORE": f"file://{store.root}", "CAGFLOW__CACHE__MAX_RESIDENT_STATES": "3",
            "CAGFLOW__RETRIEVAL__TIMEOUT_S": "5"}


@contextmanager
def running_router(run_dir: Path, settings: dict[str, str]) -> Iterator[tuple[str, Path]]:
    """The router process (``run_server``: gunicorn, one worker, threads) with ``settings`` on a free port;
    yields its base URL and log file, and stops it."""
    port = free_port()
    environment = {**os.environ, **settings, "CAGFLOW__SERVICE__PORT": str(port), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-c", "from cagflow.config import load_config\n"
               "from cagflow.router import run_server\nrun_server(load_config())"]
    server = ServerProcess("router", run_dir / "router.log", RouterError, leader_first=True)
    server.launch(command, cwd=run_dir, env=environment)
    url = f"http://127.0.0.1:{port}"
    try:
        server.wait_ready(lambda: requests.get(f"{url}/healthz", timeout=1).ok, 120, interval_s=0.3,
                          retry_on=(requests.RequestException,))
        yield url, run_dir / "router.log"
    finally:
        server.stop(30)


@pytest.fixture(scope="module")
def router(opensearch_url, corpus_index, triton, release_store, keys, tmp_path_factory, jaeger):
    store, _ = release_store
    settings = {**router_settings(opensearch_url, corpus_index, triton, store, keys[0]), **tracing_environment(jaeger)}
    with running_router(tmp_path_factory.mktemp("router-run"), settings) as running:
        yield running


def ask(router, headers, **body) -> dict:
    url, _ = router
    response = requests.post(f"{url}/v1/query", json={"max_new_tokens": MAX_NEW_TOKENS, **body}, headers=headers,
                             timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def sse_events(response) -> list[tuple[str, dict]]:
    events, event = [], None
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("event: "):
            event = line.removeprefix("event: ")
        elif line.startswith("data: "):
            events.append((event, json.loads(line.removeprefix("data: "))))
    return events


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(share * (len(ordered) - 1))))]


def trace_holding(jaeger, trace_id: str, names: set[str], timeout_s: float = 15.0) -> dict:
    """The trace once the collector holds a span of each of ``names`` (spans arrive in batches, each process's
    apart, and a stream's server span only ends with the stream)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = jaeger.trace(trace_id)
        if found and names <= {span["operationName"] for span in found["spans"]} or time.monotonic() > deadline:
            assert found, f"trace {trace_id} never reached the collector"
            return found
        time.sleep(0.2)


def span_tree(found: dict) -> dict[str, list[dict]]:
    """Spans by name, with their service and parent span id (the engine's ``answer`` stage comes twice when the
    relevance check runs between the answer's decoding and its rest)."""
    spans: dict[str, list[dict]] = {}
    for span in found["spans"]:
        parents = [ref["spanID"] for ref in span["references"] if ref["refType"] == "CHILD_OF"]
        spans.setdefault(span["operationName"], []).append(
            {**span, "service": found["processes"][span["processID"]]["serviceName"],
             "parent": parents[0] if parents else None})
    return spans


def within(child: dict, parent: dict, slack_us: int = 3000) -> bool:
    """``child`` starts and ends inside ``parent`` (clocks of two processes on one machine: a few ms of slack)."""
    return (parent["startTime"] - slack_us <= child["startTime"]
            and child["startTime"] + child["duration"] <= parent["startTime"] + parent["duration"] + slack_us)


def wait_until_free(ports, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with ExitStack() as held:
                for port in ports:
                    hold_port(held, port)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
