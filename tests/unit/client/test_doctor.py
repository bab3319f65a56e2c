"""``cagflow doctor`` against deliberately broken setups: each row of the troubleshooting table must notice
its own fault, say what it saw and give the fix, and pass once the fault is gone."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading

import pytest
import yaml
from cagflow.client import doctor
from cagflow.cli import main
from cagflow.config import load_config
from cagflow.documents.keys import SnapshotKey
from cagflow.engine import model
from cagflow.engine.model import identify_model
from cagflow.devstack.process import free_port
from cagflow.router.apikeys import ApiKeyStore
from cagflow.store.backends import LocalStore
from cagflow.store.layout import heat_object, snapshot_object
from cagflow.store.manifests import Release, ReleaseEntry, publish_release


@pytest.fixture
def setup(tmp_path, monkeypatch, tiny_model_dir):
    """A working setup on disk: the tiny model, a manifest of two fixed documents, their snapshots in a
    published release, a keys file; Triton, the router and OpenSearch are not running."""
    fingerprint = identify_model(str(tiny_model_dir), "int8")[2]
    manifest = tmp_path / "manifest.yaml"
    versions = {"faq": "1.0.0", "guide": "2.0.0"}
    manifest.write_text(yaml.safe_dump({"documents": [
        {"doc_id": doc_id, "version": version, "tier": "fixed", "title": doc_id, "path": f"{doc_id}.md"}
        for doc_id, version in versions.items()]}))
    store = LocalStore(tmp_path / "store")
    entries = []
    for doc_id, version in versions.items():
        key = SnapshotKey.for_model(doc_id, version, fingerprint)
        data = f"snapshot of {key}".encode() * 1000
        store.put(snapshot_object(key), data)
        entries.append(ReleaseEntry(key=str(key), doc_id=doc_id, doc_version=version, part=None, n_tokens=100,
                                    bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), created_at=1.0))
    publish_release(store, Release.build(fingerprint, entries))
    ApiKeyStore(tmp_path / "keys.json").create("ops")
    closed = free_port()
    for name, value in {"MODEL__PATH": str(tiny_model_dir), "CORPUS__MANIFEST": str(manifest),
                        "CACHE__STATE_STORE": f"file://{tmp_path / 'store'}",
                        "SERVICE__API_KEYS_FILE": str(tmp_path / "keys.json"), "SERVICE__PORT": str(closed),
                        "SERVICE__TRITON_METRICS_URL": f"http://127.0.0.1:{closed}/metrics",
                        "RETRIEVAL__ENDPOINT": f"http://127.0.0.1:{closed}", "RETRIEVAL__TIMEOUT_S": "1"}.items():
        monkeypatch.setenv(f"CAGFLOW__{name}", value)
    return {"store": store, "manifest": manifest, "fingerprint": fingerprint, "tmp": tmp_path, "entries": entries}


def verdict(check):
    found = check(load_config())
    assert found.symptom == check.__name__.replace("_", " ")
    return found


class Metrics:
    """A real HTTP endpoint serving Prometheus text, where the router or Triton would."""

    def __init__(self, text: str):
        body = text.encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def test_the_working_setup_passes_the_rows_it_can_see(setup):
    assert verdict(doctor.service_does_not_start).status == "ok"
    slow = verdict(doctor.slow_first_requests)
    assert slow.status == "ok" and "checksum verified" in slow.detail
    hits = verdict(doctor.hit_rate_far_below_expectation)
    assert hits.status == "ok" and "no router at port" in hits.detail
    assert verdict(doctor.stale_answers).status == "ok"
    memory = verdict(doctor.memory_grows)
    assert memory.status == "skip" and "cagflow triton up" in memory.fix


def test_no_api_key_or_no_model_means_the_service_cannot_start(setup, monkeypatch):
    (setup["tmp"] / "keys.json").unlink()
    found = verdict(doctor.service_does_not_start)
    assert found.status == "fail" and "401" in found.detail and "keys init-local" in found.fix
    monkeypatch.setenv("CAGFLOW__MODEL__PATH", str(setup["tmp"] / "no-such-model"))
    found = verdict(doctor.service_does_not_start)
    assert found.status == "fail" and "does not exist" in found.detail


def test_a_preset_named_by_an_earlier_name_is_looked_for_in_its_own_folder(setup, monkeypatch):
    monkeypatch.setattr(model, "CACHE_HOME", setup["tmp"])
    monkeypatch.setenv("CAGFLOW__MODEL__PATH", "qwen2.5-1.5b")
    found = verdict(doctor.service_does_not_start)
    assert found.status == "fail" and f"({setup['tmp'] / 'models' / 'qwen2.5-1.5b'} missing)" in found.detail


def test_preload_off_is_why_first_requests_are_slow(setup, monkeypatch):
    monkeypatch.setenv("CAGFLOW__CACHE__PRELOAD_ON_STARTUP", "false")
    found = verdict(doctor.slow_first_requests)
    assert found.status == "warn" and "preload_on_startup is off" in found.detail
    assert "MB/s" in found.detail and found.fix == "set cache.preload_on_startup: true"


def test_a_release_of_another_model_explains_a_hit_rate_of_zero(setup):
    rebuilt = [entry.model_copy(update={"created_at": 2.0}) for entry in setup["entries"]]  # another release id
    publish_release(setup["store"], Release.build("f" * 64, rebuilt))
    found = verdict(doctor.hit_rate_far_below_expectation)
    assert found.status == "fail" and "no snapshot can be used" in found.detail
    assert "cag_fixed_precompute" in found.fix


def test_requests_for_versions_the_release_lacks_and_a_low_router_hit_rate(setup, monkeypatch):
    old = str(SnapshotKey.for_model("faq", "0.9.0", setup["fingerprint"]))
    other_model = str(SnapshotKey.for_model("faq", "0.1.0", "e" * 64))  # history of another model: ignored
    setup["store"].put(heat_object("replica-a"), json.dumps({"counts": {old: 7, other_model: 3}}).encode())
    found = verdict(doctor.hit_rate_far_below_expectation)
    assert found.status == "warn" and old in found.detail and other_model not in found.detail

    text = "cagflow_router_cache_attempts_total 40.0\ncagflow_router_cache_hits_total 4.0\n"
    with Metrics(text) as router:
        monkeypatch.setenv("CAGFLOW__SERVICE__PORT", str(router.port))
        found = verdict(doctor.hit_rate_far_below_expectation)
    assert found.status == "fail" and "router hit rate 10% of 40 cache attempts" in found.detail
    assert old in found.detail and "GET /v1/releases" in found.fix


def test_resident_bytes_over_the_budget_is_memory_growth(setup, monkeypatch):
    text = 'cagflow_resident_bytes{model="cag_llm",version="1"} 9000000.0\n'
    with Metrics(text) as triton:
        monkeypatch.setenv("CAGFLOW__SERVICE__TRITON_METRICS_URL", f"http://127.0.0.1:{triton.port}/metrics")
        monkeypatch.setenv("CAGFLOW__CACHE__MAX_RESIDENT_BYTES", "20000000")
        assert verdict(doctor.memory_grows).status == "ok"
        monkeypatch.setenv("CAGFLOW__CACHE__MAX_RESIDENT_BYTES", "5000000")
        found = verdict(doctor.memory_grows)
    assert found.status == "fail" and "9 MB of a 5 MB budget" in found.detail


def test_a_newer_manifest_version_or_a_new_document_means_stale_answers(setup):
    documents = yaml.safe_load(setup["manifest"].read_text())
    documents["documents"][0]["version"] = "1.1.0"
    documents["documents"].append({"doc_id": "policy", "version": "1.0.0", "tier": "fixed", "title": "policy",
                                   "path": "policy.md"})
    setup["manifest"].write_text(yaml.safe_dump(documents))
    found = verdict(doctor.stale_answers)
    assert found.status == "fail" and "faq (release 1.0.0, manifest 1.1.0)" in found.detail
    assert "not in the release: policy" in found.detail and "cag_fixed_precompute" in found.fix


def test_opensearch_down_means_the_retrieval_fallback_fails(setup):
    found = verdict(doctor.retrieval_fallback_fails)
    assert found.status == "fail" and "cagflow opensearch up" in found.fix


def test_the_command_prints_a_verdict_per_row_and_fails_when_one_fails(setup, capsys):
    code = main(["doctor", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert code == 1  # OpenSearch is not running here
    assert [row["symptom"] for row in rows] == [check.__name__.replace("_", " ") for check in doctor.CHECKS]
    assert {row["symptom"]: row["status"] for row in rows}["retrieval fallback fails"] == "fail"
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  retrieval fallback fails:" in out and "      fix: " in out
