"""Two real Triton replicas (tiny model, one release) behind the router as deployed, with the sample corpus in
a real OpenSearch: each document's snapshot is answered by the replica rendezvous hashing gives it, one
replica SIGKILLed (with its model stubs) under load from 8 clients costs no request a retry could not serve,
its documents are answered by the other replica meanwhile, and once it is started again on its ports its
documents move back to it without a router restart."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from cagflow.bench.load import LoadGenerator
from cagflow.config import load_config
from cagflow.devstack.triton import LocalTriton
from cagflow.offline import pipeline
from cagflow.router.replicas import rank
from prometheus_client.parser import text_string_to_metric_families
from router_stack import (MAX_NEW_TOKENS, TRITON_MODELS, ask, router_settings, running_router, triton_environment,
                          wait_until_free)

pytestmark = pytest.mark.integration

NAMES = ("triton-a", "triton-b")
CLIENTS = 8
LOAD_S = 100  # the load's length at most
RESIDENT = 3  # cache.max_resident_states of each replica (router_stack.triton_environment)
# JSON 503s (or a stream's error event of the same code) that a retry serves
RETRIABLE = {"triton_unavailable", "overloaded", "retrieval_unavailable"}


@pytest.fixture(scope="module")
def corpus_index(opensearch_url, corpus_manifest_path, release_store):
    """The chunks of the release's documents, for scope detection to route questions to their snapshots.
    The rest of the corpus is left out (embedding it would be most of the setup here): its questions go to
    retrieval all the same."""
    _, release = release_store
    config = load_config(environ={"CAGFLOW__RETRIEVAL__ENDPOINT": opensearch_url,
                                  "CAGFLOW__RETRIEVAL__INDEX": f"replicas-{uuid.uuid4().hex[:8]}",
                                  "CAGFLOW__CORPUS__MANIFEST": str(corpus_manifest_path)})
    parsed = pipeline.parse_documents(pipeline.load_documents("fixed", release.doc_ids, config=config))
    pipeline.index_chunks(pipeline.embed_chunks(pipeline.chunk_documents(parsed, config)), "fixed", False, config)
    return config.retrieval.index


def local_triton(run_dir, tiny_model_dir, store, ports=None) -> LocalTriton:
    return LocalTriton(run_dir, models=TRITON_MODELS, ports=ports,
                       environment=triton_environment(tiny_model_dir, store.root))


@pytest.fixture(scope="module")
def replicas(release_store, tiny_model_dir, tmp_path_factory):
    """Two replicas started side by side; a test may replace one (``replicas[name] = ...``)."""
    store, _ = release_store
    servers = {name: local_triton(tmp_path_factory.mktemp(name), tiny_model_dir, store) for name in NAMES}
    try:
        with ThreadPoolExecutor(len(servers)) as starting:
            list(starting.map(LocalTriton.start, servers.values()))
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@pytest.fixture(scope="module")
def router(opensearch_url, corpus_index, replicas, release_store, keys, tmp_path_factory):
    store, _ = release_store
    listed = ", ".join(f"name={name} http_url={server.http_url} grpc_url={server.grpc_url} "
                       f"metrics_url={server.metrics_url}" for name, server in replicas.items())
    settings = {**router_settings(opensearch_url, corpus_index, replicas[NAMES[0]], store, keys[0]),
                "CAGFLOW__SERVICE__TRITON_REPLICAS": listed, "CAGFLOW__SERVICE__TRITON_REPROBE_S": "1",
                "CAGFLOW__SERVICE__MAX_CONCURRENT_REQUESTS": str(2 * CLIENTS)}
    with running_router(tmp_path_factory.mktemp("replicas-router"), settings) as running:
        yield running


def replica_metrics(url: str) -> dict[tuple[str, ...], float]:
    """The router's per-replica samples: (metric, replica[, outcome]) -> value."""
    found = {}
    for family in text_string_to_metric_families(requests.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if "replica" in sample.labels and not sample.name.endswith("_created"):
                found[(sample.name, sample.labels["replica"], *filter(None, [sample.labels.get("outcome")]))] = \
                    sample.value
    return found


def answered_by(url: str, ask_each) -> dict[str, float]:
    """How many Triton calls each replica answered while ``ask_each`` ran (nothing else may be asking)."""
    before = replica_metrics(url)
    ask_each()
    after = replica_metrics(url)
    metric = "cagflow_router_triton_replica_requests_total"
    return {name: after.get((metric, name, "ok"), 0) - before.get((metric, name, "ok"), 0) for name in NAMES}


def is_up(url: str, name: str) -> bool:
    """The router sends requests to replica ``name`` again (its probe found it ready)."""
    return replica_metrics(url)[("cagflow_router_triton_replica_up", name)] == 1


def wait_for(condition, timeout_s: float, what: str) -> None:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(0.25)


def test_a_killed_replica_costs_no_request_and_its_documents_move_back(router, replicas, release_store, keys,
                                                                     tiny_model_dir, corpus_manifest_path,
                                                                     tmp_path_factory):
    url, _ = router
    store, release = release_store
    documents = sorted({entry.doc_id for entry in release.snapshots})
    owned = {name: [doc for doc in documents if rank(doc, NAMES)[0] == name] for name in NAMES}
    assert all(owned.values()), f"every replica should own a document of the release: {owned}"
    victim, survivor = NAMES

    def ask_each(names=NAMES):
        for name in names:
            for doc in owned[name]:
                answer = ask(router, keys[1], question="What is this document about?", doc_id=doc, route="cache")
                assert answer["route"] == "cache" and answer["cache_hit"] and answer["fallback_reason"] is None, answer

    # Each document is answered by its own replica, which keeps only its own share resident.
    assert answered_by(url, ask_each) == {name: len(owned[name]) for name in NAMES}
    report = requests.get(f"{url}/readyz", timeout=30).json()
    assert report["ready"] and [replica["name"] for replica in report["triton"]["replicas"]] == list(NAMES), report
    assert {replica["name"]: replica["resident_snapshots"] for replica in report["triton"]["replicas"]} == {
        name: min(len(owned[name]), RESIDENT) for name in NAMES}, report

    questions = [json.loads(line) for line in (corpus_manifest_path.parent / "qa.jsonl").read_text().splitlines()]
    generator = LoadGenerator(url, keys[1]["Authorization"].split()[1], questions, CLIENTS, timeout_s=60,
                              max_new_tokens=MAX_NEW_TOKENS, stream_share=0.3, seed=17)
    load_ends, back_under_load = time.monotonic() + LOAD_S, False
    generator.start()
    with ThreadPoolExecutor(1) as background:
        try:
            time.sleep(8)
            ports = dict(replicas[victim].ports)
            os.killpg(replicas[victim].pid, signal.SIGKILL)  # the server and its model stubs: nothing cleaned up
            killed = time.monotonic()
            replicas[victim].stop(timeout_s=10)  # reaps the leader; the group is already gone

            # Its documents are answered by the other replica, from their snapshots, while it is down.
            down = answered_by(url, lambda: ask_each([victim]))
            assert down[victim] == 0 and down[survivor] >= len(owned[victim]), down
            seen = replica_metrics(url)
            assert seen[("cagflow_router_triton_replica_up", victim)] == 0
            assert seen.get(("cagflow_router_triton_failovers_total", victim), 0) >= 1, seen

            # Started again on its ports while the load goes on (a slow start is waited for after the load).
            wait_until_free(ports.values())
            replicas[victim] = local_triton(tmp_path_factory.mktemp(f"{victim}-again"), tiny_model_dir, store,
                                            ports)
            restart = background.submit(replicas[victim].start)
            while not restart.done() and time.monotonic() < load_ends:
                time.sleep(0.5)
            if restart.done():  # its documents move back under load
                wait_for(lambda: is_up(url, victim), 20, "the router finding the restarted replica")
                back_under_load = True
                time.sleep(max(0.0, min(3.0, load_ends - time.monotonic())))
        finally:
            summary = generator.stop(grace_s=60)
        restart.result()
    wait_for(lambda: is_up(url, victim), 20, "the router finding the restarted replica")
    load = summary.to_dict()
    print(f"\nload: {json.dumps({key: load[key] for key in ('wall_s', 'sent', 'answered', 'intended', 'by_code')})}"
          f"; the replica was back {'under load' if back_under_load else 'after the load'}")

    assert load["sent"] > 4 * CLIENTS and load["unintended"] == 0, load
    refused = [outcome for outcome in summary.outcomes if outcome.kind == "intended"]
    assert {outcome.code for outcome in refused} <= RETRIABLE, load["by_code"]
    assert any(outcome.started_s < killed < outcome.started_s + outcome.latency_s for outcome in summary.outcomes)
    by_id = {row["id"]: row for row in questions}
    for outcome in refused:  # a retry serves each refusal
        ask(router, keys[1], question=by_id[outcome.question_id]["question"])

    # Back in the ring: its documents move back to it, the other replica's stay where they are.
    assert answered_by(url, ask_each) == {name: len(owned[name]) for name in NAMES}
    report = requests.get(f"{url}/readyz", timeout=30).json()
    assert report["ready"] and all(replica["ready"] for replica in report["triton"]["replicas"]), report
