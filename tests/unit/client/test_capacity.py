"""``cagflow capacity`` against a real release: documents of the sample corpus precomputed with the tiny
model into a local store, the prediction set against the stored objects; and the headroom and replica
arithmetic with worked numbers."""

from __future__ import annotations

import json

import pytest
import yaml
from cagflow.client.capacity import (HEADROOM, Estimate, KVRecipe, SnapshotSize, bench_seconds, estimate,
                                     replicas_needed, resident_bytes, with_headroom)
from cagflow.cli import main
from cagflow.config import load_config
from cagflow.engine.engine import Engine
from cagflow.inference.resident import load_snapshot
from cagflow.offline.precompute import precompute_and_publish
from cagflow.store.backends import LocalStore
from cagflow.store.manifests import CorpusManifest

DOCUMENTS = ("support-faq", "security-access-policy")  # Markdown and HTML, each split into several parts


@pytest.fixture(scope="module")
def published(tmp_path_factory, tiny_model, corpus):
    """A release of two fixed documents, split to fit a 900-token context, in a local store."""
    root = tmp_path_factory.mktemp("capacity")
    manifest = root / "manifest.yaml"
    manifest.write_text(yaml.safe_dump({"documents": [
        {**entry.model_dump(), "path": str(corpus.file(entry))} for entry in corpus.documents
        if entry.doc_id in DOCUMENTS]}))
    engine = Engine(tiny_model, max_context_tokens=900, max_new_tokens=16, question_budget_tokens=64)
    store = LocalStore(root / "store")
    release, _, _ = precompute_and_publish(engine, store, CorpusManifest.load(manifest))
    assert len(release.snapshots) > len(DOCUMENTS)
    return engine, store, manifest, release


def stored_total(store: LocalStore) -> int:
    return sum(info.size for info in store.list("snapshots/"))


def test_the_corpus_prediction_matches_the_stored_release_within_one_percent(published):
    engine, store, manifest, release = published

    found = estimate(load_config(environ={}), store, manifest=str(manifest), engine=engine)

    assert {size.key: size.tokens for size in found.snapshots} == {e.key: e.n_tokens for e in release.snapshots}
    predicted, stored = found.compared()
    assert stored == stored_total(store)
    assert abs(predicted - stored) / stored < 0.01
    assert abs(predicted - stored) / stored < 0.0002  # only the digits of the tensors' shapes and offsets differ
    assert found.recipe == KVRecipe("bfloat16", 2, 2, 64, 2 * 2 * 2 * 64 * 2)  # the tiny model under int8


def test_the_release_estimate_reads_its_recipe_and_sizes_from_the_store(published):
    engine, store, manifest, release = published

    found = estimate(load_config(environ={}), store, copies=2)
    report = found.to_dict()

    assert report["source"] == {"kind": "release", "release_id": release.release_id, "store": store.url}
    resident = [load_snapshot(store, entry).nbytes for entry in release.snapshots]
    assert [size.tensor_bytes for size in found.snapshots] == resident
    assert report["total"]["stored"]["stored_bytes"] == stored_total(store)
    # Without the text the headers are not predicted: they are what the stored files hold beyond the tensors.
    headers = estimate(load_config(environ={}), store, manifest=str(manifest), engine=engine)
    missing = sum(size.header_bytes for size in headers.snapshots)
    assert abs(report["total"]["stored"]["stored_bytes"] - sum(resident) - missing) / sum(resident) < 0.0002
    assert report["store"]["bytes"] == 2 * sum(resident)
    assert report["replica"]["resident_bytes"] == sum(resident)  # fewer snapshots than max_resident_states


def test_headroom_and_replicas_with_worked_numbers():
    assert HEADROOM == 1.3
    assert with_headroom(100) == 130 and with_headroom(1001) == 1302  # 1301.3, rounded up
    assert replicas_needed(10, 1.0) == 13  # 13.000000000000002 in floats
    assert replicas_needed(10, 0.25) == 4  # 3.25 busy replicas
    assert replicas_needed(20, 2.1) == 55  # 54.6
    assert replicas_needed(0.01, 0.1) == 1
    assert resident_bytes([500, 300, 200, 100], max_states=2, max_bytes=10_000) == 800  # the 2 largest
    assert resident_bytes([500, 300, 200], max_states=3, max_bytes=900) == 900  # the byte budget caps them
    assert resident_bytes([2000, 300, 200], max_states=2, max_bytes=1000) == 500  # too large to keep: never resident

    mb = 10**6
    sizes = [SnapshotSize(f"doc{n}/1/{'0' * 16}", f"doc{n}", tokens, tokens * 28_672, 10 * tokens, None)
             for n, tokens in enumerate((3000, 2000, 1000))]
    report = Estimate({"kind": "release"}, "f" * 64, KVRecipe("bfloat16", 28, 2, 128, 28_672), sizes, copies=3,
                      copies_meaning="", max_resident_states=2, max_resident_bytes=4096 * mb,
                      weights_bytes=1700 * mb, target_qps=5, seconds_per_request=2.0).to_dict()
    assert report["total"]["predicted_bytes"] == 6000 * 28_682 == 172_092_000
    assert report["store"] == {"copies": 3, "copies_meaning": "", "bytes": 516_276_000,
                               "with_headroom_bytes": 671_158_800}
    assert report["replica"]["resident_bytes"] == 5000 * 28_672 == 143_360_000  # the 2 largest, tensors only
    assert report["replica"]["bytes"] == 1_843_360_000
    assert report["replica"]["with_headroom_bytes"] == 2_396_368_000
    assert report["replicas"]["needed"] == 13  # 5 × 2.0 × 1.3
    assert report["replicas"]["qps_per_replica"] == 0.5
    assert report["replicas"]["memory_bytes"] == 13 * 2_396_368_000


def test_the_cost_of_a_request_from_benchmark_reports(tmp_path):
    answers = tmp_path / "answers.json"
    answers.write_text(json.dumps({"rows": [
        {"auto": {"seconds": 2.0, "computed": True}}, {"auto": {"seconds": 0.01, "computed": False}},
        {"auto": {"seconds": 3.0, "computed": True}}, {"auto": {"seconds": 9.0, "computed": True, "error": "x"}},
        {"auto": {"seconds": 5.0, "computed": True}}]}))
    engine = tmp_path / "engine.json"
    engine.write_text(json.dumps({"documents": [{"document_tokens": 511, "hit_answer_s": 1.5},
                                                {"document_tokens": 2048, "hit_answer_s": 1.6},
                                                {"document_tokens": 7800, "hit_answer_s": 2.0}]}))

    assert bench_seconds(answers, 3000)[0] == 3.0  # the API's computed answers only
    assert bench_seconds(engine, 3000)[0] == 1.6  # the measured snapshot closest to 3000 tokens
    assert bench_seconds(engine, 6000)[0] == 2.0


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def configured(published, monkeypatch, tiny_model_dir):
    engine, store, manifest, release = published
    monkeypatch.setenv("CAGFLOW__CACHE__STATE_STORE", store.url)
    monkeypatch.setenv("CAGFLOW__MODEL__PATH", str(tiny_model_dir))
    monkeypatch.setenv("CAGFLOW__CORPUS__MANIFEST", str(manifest))
    return published


def test_cli_table_json_and_replicas(capsys, configured, tmp_path):
    _, store, _, release = configured
    bench = tmp_path / "answers.json"
    bench.write_text(json.dumps({"rows": [{"auto": {"seconds": 0.8, "computed": True}}]}))

    code, out, _ = run(capsys, "capacity", "--target-qps", "10", "--from-bench", str(bench))
    assert code == 0 and f"capacity of release {release.release_id}" in out
    assert "replicas for 10 requests/s: 10 × 0.8 s × 1.3 = 11 replicas" in out
    code, out, _ = run(capsys, "capacity", "--json", "--copies", "1")
    report = json.loads(out)
    assert report["store"]["copies"] == 1 and report["replicas"] is None
    assert {row["doc_id"] for row in report["documents"]} == set(DOCUMENTS)
    assert report["replica"]["weights_bytes"] > 0

    # The configured model splits the documents for its own context: other keys than the release's.
    code, out, _ = run(capsys, "capacity", "--manifest")
    assert code == 0 and f"holds 0 of the {len(DOCUMENTS)} snapshots planned here" in out


@pytest.mark.parametrize("argv, message", [
    (["--target-qps", "5"], "--target-qps needs the cost of a request"),
    (["--target-qps", "5", "--seconds-per-request", "0"], "--seconds-per-request must be positive"),
    (["--copies", "0"], "--copies must be at least 1"),
    (["--seconds-per-request", "1", "--from-bench", "x.json"], "not both"),
    (["--target-qps", "1", "--from-bench", "/nonexistent/bench.json"], "No such file or directory"),
])
def test_bad_arguments_are_one_line(capsys, configured, argv, message):
    code, _, err = run(capsys, "capacity", *argv)
    assert code == 2 and message in err and "Traceback" not in err


def test_no_release_and_no_store_are_clear_errors(capsys, tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("CAGFLOW__CACHE__STATE_STORE", f"file://{tmp_path / 'empty'}")
    code, _, err = run(capsys, "capacity")
    assert code == 2 and "no release published" in err and "--manifest" in err
    code, _, err = run(capsys, "capacity", "--store", f"file://{tmp_path / 'gone'}")
    assert code == 2 and "no such folder" in err and "Traceback" not in err


@pytest.mark.parametrize("content", [{"thresholds": [0.8, 0.9]}, [1, 2], {"rows": [1]}, {"documents": [{}]}])
def test_a_report_without_timings_is_a_clear_error(capsys, configured, tmp_path, content):
    bench = tmp_path / "routing.json"
    bench.write_text(json.dumps(content))
    code, _, err = run(capsys, "capacity", "--target-qps", "1", "--from-bench", str(bench))
    assert code == 2 and "neither a `cagflow bench answers` nor a `cagflow bench engine` report" in err
