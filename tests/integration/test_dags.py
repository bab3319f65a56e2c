"""The three DAGs: their shape as parsed by Airflow, and full runs with ``dag.test()`` against real stores
(a directory, and S3 on SeaweedFS), a real OpenSearch node, and the tiny model.

``dag.test()`` runs every task in this process, so the configuration each task reads comes from the
environment set here. Airflow reads its own configuration once per process, at its first import: nothing
in this module imports it before ``airflow_env`` has set the home.
"""

from __future__ import annotations

import importlib.util
import json
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from cagflow.documents.keys import SnapshotKey
from cagflow.engine.model import prepare_model
from cagflow.offline import connections, maintenance_steps
from cagflow.store.backends import S3Store
from cagflow.store.layout import snapshot_object
from cagflow.store.manifests import CorpusManifest, list_releases, load_release

REPO = Path(__file__).resolve().parents[2]
DAGS = REPO / "dags"
SAMPLE = REPO / "corpus"
integration = pytest.mark.integration

INGEST_TASKS = {"load_manifest", "parse", "chunk", "validate_chunks", "embed", "index", "precompute_passage_states"}
FIXED_TASKS = INGEST_TASKS | {"plan_parts", "precompute", "validate_snapshots", "publish_release",
                              "request_serving_reload"}
MAINTENANCE_TASKS = {"verify_active_release", "collect_garbage"}


# ---- environment ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def airflow_env(tmp_path_factory, tiny_model_dir):
    """One Airflow home for the module, the tiny model, and a serving address where nothing listens."""
    home = tmp_path_factory.mktemp("airflow-home")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AIRFLOW_HOME", str(home))
        env.setenv("AIRFLOW__CORE__DAGS_FOLDER", str(DAGS))
        env.setenv("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
        env.setenv("CAGFLOW__MODEL__PATH", str(tiny_model_dir))
        env.setenv("CAGFLOW__PRECOMPUTE__TRITON_URL", "127.0.0.1:9")
        env.setenv("CAGFLOW__INGEST__PASSAGE_STATE_TIERS", "[fixed, variable]")  # the fixed runs store them too
        for name in ("CAGFLOW_CONFIG", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
            env.delenv(name, raising=False)
        yield home


def dag_bag():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(DAGS))
    assert bag.import_errors == {}
    return bag


@pytest.fixture(scope="module")
def airflow_db(airflow_env):
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True)


def run_dag(dag_id: str, conf: dict | None = None):
    """One ``dag.test()`` run of a freshly parsed DAG (a run's conf stays on the DAG object it ran);
    failures here are deliberate, so nothing waits for a retry."""
    dag = dag_bag().dags[dag_id]
    for task in dag.tasks:
        task.retries = 0
    return dag.test(run_conf=conf)


def states(run) -> dict[str, str]:
    """Task states, a mapped task as ``task[label]``."""
    return {ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.rendered_map_index}]": str(ti.state)
            for ti in run.get_task_instances()}


def returned(run, task_id: str):
    """What a task returned; for a mapped task, the list over its map indexes."""
    value = run.get_task_instances()[0].xcom_pull(task_ids=task_id)
    return value if isinstance(value, (dict, str, type(None))) else list(value)


@pytest.fixture
def use(monkeypatch, airflow_db, opensearch_url, tmp_path):
    """Point the pipeline at a store, an index and a manifest of the test's own (in a migrated Airflow)."""
    def configure(store_url: str | None = None, manifest: Path = SAMPLE / "manifest.yaml", index: str | None = None):
        store_url = store_url or f"file://{tmp_path / 'store'}"
        index = index or f"chunks-{secrets.token_hex(4)}"
        monkeypatch.setenv("CAGFLOW__CACHE__STATE_STORE", store_url)
        monkeypatch.setenv("CAGFLOW__RETRIEVAL__ENDPOINT", opensearch_url)
        monkeypatch.setenv("CAGFLOW__RETRIEVAL__INDEX", index)
        monkeypatch.setenv("CAGFLOW__CORPUS__MANIFEST", str(manifest))
        return connections.snapshot_store(), connections.chunk_index()
    return configure


def objects(store) -> dict[str, tuple[int, float]]:
    """Every object with its size and modification time (a rewrite changes the time)."""
    return {info.name: (info.size, info.modified) for info in store.list()}


def fingerprint16(tiny_model_dir) -> str:
    return prepare_model(str(tiny_model_dir), "int8")[2][:16]


def assert_release_verifies(store, expected_doc_ids):
    release = load_release(store)
    assert sorted(release.doc_ids) == sorted(expected_doc_ids)
    assert len({entry.key for entry in release.snapshots}) == len(release.snapshots)
    maintenance_steps.verify_active_release()  # re-reads every snapshot against its sha256 and header
    return release


# ---- shape -------------------------------------------------------------------------------------------


def test_dags_import_with_expected_tasks_dependencies_and_schedules(airflow_env):
    bag = dag_bag()
    assert set(bag.dag_ids) == {"cag_fixed_precompute", "cag_variable_ingest", "cag_snapshot_maintenance"}
    fixed, ingest, maintenance = (bag.dags[d] for d in ("cag_fixed_precompute", "cag_variable_ingest",
                                                        "cag_snapshot_maintenance"))
    assert set(fixed.task_ids) == FIXED_TASKS
    assert set(ingest.task_ids) == INGEST_TASKS
    assert set(maintenance.task_ids) == MAINTENANCE_TASKS
    chain = ["load_manifest", "parse", "chunk", "validate_chunks", "embed", "index", "plan_parts", "precompute",
             "validate_snapshots", "publish_release", "request_serving_reload"]
    for upstream, downstream in zip(chain, chain[1:]):
        assert downstream in fixed.get_task(upstream).downstream_task_ids, (upstream, downstream)
    assert fixed.get_task("precompute").is_mapped
    assert fixed.get_task("precompute").max_active_tis_per_dagrun == 1  # each part already uses every core
    assert {"precompute", "validate_snapshots"} <= fixed.get_task("publish_release").upstream_task_ids
    assert [o.name for o in fixed.get_task("publish_release").outlets] == ["cagflow_fixed_release"]
    assert "embed" in ingest.get_task("validate_chunks").downstream_task_ids
    assert "precompute_passage_states" in ingest.get_task("index").downstream_task_ids
    assert "collect_garbage" in maintenance.get_task("verify_active_release").downstream_task_ids
    assert (fixed.schedule, ingest.schedule, maintenance.schedule) == ("0 2 * * *", "@hourly", "@weekly")
    assert all(d.max_active_runs == 1 and not d.catchup for d in (fixed, ingest, maintenance))
    assert dict(fixed.params) == {"doc_ids": [], "force": False}
    assert dict(maintenance.params) == {"dry_run": True, "keep_releases": 3, "unused_days": 14.0}


def test_schedules_and_limits_follow_the_configuration(airflow_env, monkeypatch):
    monkeypatch.setenv("CAGFLOW__PRECOMPUTE__SCHEDULE", "30 3 * * 1-5")
    monkeypatch.setenv("CAGFLOW__INGEST__SCHEDULE", "45 * * * *")
    monkeypatch.setenv("CAGFLOW__PRECOMPUTE__PARALLEL_PARTS", "3")
    monkeypatch.setenv("CAGFLOW__MAINTENANCE__KEEP_RELEASES", "5")
    bag = dag_bag()
    assert bag.dags["cag_fixed_precompute"].schedule == "30 3 * * 1-5"
    assert bag.dags["cag_fixed_precompute"].get_task("precompute").max_active_tis_per_dagrun == 3
    assert bag.dags["cag_variable_ingest"].schedule == "45 * * * *"
    assert bag.dags["cag_snapshot_maintenance"].params["keep_releases"] == 5


# ---- the precompute DAG on the sample corpus ----------------------------------------------------------


@pytest.fixture(scope="module")
def sample_run(airflow_db, opensearch_url, tmp_path_factory):
    """The fixed DAG once over the whole sample corpus into a LocalStore."""
    root = tmp_path_factory.mktemp("sample-store")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CAGFLOW__CACHE__STATE_STORE", f"file://{root}")
        env.setenv("CAGFLOW__RETRIEVAL__ENDPOINT", opensearch_url)
        env.setenv("CAGFLOW__RETRIEVAL__INDEX", "sample-chunks")
        env.setenv("CAGFLOW__CORPUS__MANIFEST", str(SAMPLE / "manifest.yaml"))
        started = time.perf_counter()
        run = run_dag("cag_fixed_precompute")
        yield {"run": run, "seconds": time.perf_counter() - started, "root": root}


@integration
def test_precompute_publishes_verified_snapshots_and_searchable_chunks(sample_run, use, corpus, record_property):
    run = sample_run["run"]
    record_property("precompute_wall_s", round(sample_run["seconds"], 1))
    assert run.state == "success", states(run)
    store, index = use(f"file://{sample_run['root']}", index="sample-chunks")
    fixed_ids = [entry.doc_id for entry in corpus.tier("fixed")]
    mapped = [name for name in states(run) if name.startswith("precompute[")]  # "precompute[doc]" or "[doc#1]"
    assert sorted({name.split("#")[0].rstrip("]") + "]" for name in mapped}) == sorted(
        f"precompute[{doc_id}]" for doc_id in fixed_ids)

    release = assert_release_verifies(store, fixed_ids)
    # one snapshot per document, or per part of one too long for the tiny model's context (the Chinese ones)
    assert {entry.doc_id for entry in release.snapshots} == set(fixed_ids) and len(release.snapshots) >= len(mapped)
    assert returned(run, "publish_release")["release_id"] == release.release_id
    assert returned(run, "request_serving_reload")["requested"] is False  # serving is down: tolerated
    summary = returned(run, "validate_snapshots")
    assert summary["snapshots"] == len(release.snapshots)
    assert summary["bytes"] == sum(entry.bytes for entry in release.snapshots)

    indexed = returned(run, "index")
    assert indexed["tier_total"] == indexed["upserted"] == len(returned(run, "chunk"))
    passages = returned(run, "precompute_passage_states")
    assert passages["computed"] == indexed["upserted"]
    assert len(list(store.list("passages/"))) >= passages["computed"]
    hits = index.search("Which port do I open in my browser to reach the Skerry web console?", tier="fixed")
    assert hits[0].doc_id == "skerry-admin-manual" and "8443" in " ".join(hit.text for hit in hits)


@integration
def test_second_run_skips_every_unchanged_document_and_writes_nothing(sample_run, use, record_property):
    store, index = use(f"file://{sample_run['root']}", index="sample-chunks")
    before, chunks_before = objects(store), index.count(tier="fixed")
    lost = next(name for name in before if name.startswith("passages/"))  # a state lost since: computed again
    store.delete(lost)

    started = time.perf_counter()
    run = run_dag("cag_fixed_precompute")
    record_property("no_change_rerun_wall_s", round(time.perf_counter() - started, 1))

    assert run.state == "success", states(run)
    assert returned(run, "precompute_passage_states")["computed"] == 1
    after = objects(store)
    assert after.pop(lost)[0] == before.pop(lost)[0] and after == before
    assert index.count(tier="fixed") == chunks_before
    assert all(document["unchanged"] for document in returned(run, "load_manifest"))
    assert returned(run, "chunk") == [] and returned(run, "embed") == []
    assert returned(run, "plan_parts") == []
    assert states(run)["precompute"] == "skipped"  # nothing mapped: no model loaded, no snapshot read
    assert returned(run, "validate_snapshots")["snapshots"] == 0
    assert returned(run, "publish_release")["published"] is False


@integration
def test_an_edited_document_is_ingested_again_and_one_removed_leaves_the_release(use, tmp_path, tiny_model_dir,
                                                                                  sample_subset):
    """Incremental runs cost what changed: an edited file (same version) is chunked and embedded again while
    its snapshot, keyed by version, is kept; a document dropped from the manifest leaves the index and the
    release although nothing is computed."""
    doc_ids = ["support-faq", "data-retention-backup-guide", "security-access-policy"]
    manifest = sample_subset(tmp_path / "corpus", doc_ids)
    store, index = use(manifest=manifest)
    assert run_dag("cag_fixed_precompute").state == "success"
    first = load_release(store)

    faq = next((tmp_path / "corpus").rglob("support-faq.*"))
    faq.write_text(faq.read_text() + "\n\nThe support line is closed on public holidays.\n")
    edited = run_dag("cag_fixed_precompute")

    assert edited.state == "success", states(edited)
    assert {d["doc_id"] for d in returned(edited, "load_manifest") if not d["unchanged"]} == {"support-faq"}
    assert {c["doc_id"] for c in returned(edited, "embed")} == {"support-faq"}
    assert "public holidays" in " ".join(hit.text for hit in index.search("Is support open on public holidays?",
                                                                          doc_id="support-faq"))
    assert returned(edited, "plan_parts") == [] and load_release(store) == first

    documents = yaml.safe_load(manifest.read_text())
    documents["documents"] = [d for d in documents["documents"] if d["doc_id"] != "security-access-policy"]
    manifest.write_text(yaml.safe_dump(documents))
    dropped = run_dag("cag_fixed_precompute")

    assert dropped.state == "success", states(dropped)
    assert returned(dropped, "index")["removed"] == ["security-access-policy"]
    assert index.count(doc_id="security-access-policy") == 0
    assert returned(dropped, "publish_release")["published"] is True
    assert_release_verifies(store, ["support-faq", "data-retention-backup-guide"])
    assert load_release(store).for_doc("support-faq") == first.for_doc("support-faq")


# ---- failures, resume, versions -----------------------------------------------------------------------


@integration
def test_a_failed_part_publishes_nothing_and_a_rerun_completes_it(use, tiny_model_dir):
    """The second of three parts finds a damaged object under its key (as a killed upload elsewhere could
    leave): that task fails, the others store theirs, nothing is published. Once the object is removed the
    rerun computes only the missing part."""
    doc_ids = ["operations-incident-policy", "security-access-policy", "support-faq"]
    store, _ = use()
    corpus = CorpusManifest.load(SAMPLE / "manifest.yaml")
    versions = {entry.doc_id: entry.version for entry in corpus.documents}
    damaged = snapshot_object(SnapshotKey(doc_ids[1], versions[doc_ids[1]], fingerprint16(tiny_model_dir)))
    store.put(damaged, b"half a snapshot")

    failed = run_dag("cag_fixed_precompute", {"doc_ids": doc_ids})

    assert failed.state == "failed"
    expected = {f"precompute[{doc_ids[0]}]": "success", f"precompute[{doc_ids[1]}]": "failed",
                f"precompute[{doc_ids[2]}]": "success", "validate_snapshots": "upstream_failed",
                "publish_release": "upstream_failed"}
    assert {task: states(failed)[task] for task in expected} == expected
    assert list_releases(store) == []
    survivors = {name: stamp for name, stamp in objects(store).items()
                 if name != damaged and name.startswith("snapshots/")}  # passage states are stored too
    assert len(survivors) == 2

    store.delete(damaged)
    rerun = run_dag("cag_fixed_precompute", {"doc_ids": doc_ids})

    assert rerun.state == "success", states(rerun)
    after = objects(store)
    assert {name: after[name] for name in survivors} == survivors  # untouched, not rewritten
    assert [r["skipped"] for r in returned(rerun, "precompute")].count(False) == 1
    release = assert_release_verifies(store, doc_ids)
    assert len(release.snapshots) == 3 and len(list_releases(store)) == 1
    assert not [path for path in Path(store.root).rglob(".tmp-*")]  # no partial objects left behind


@integration
def test_version_bump_writes_a_new_key_and_keeps_the_old_one(use, tmp_path, tiny_model_dir, sample_subset):
    doc_ids = ["support-faq", "data-retention-backup-guide"]
    store, index = use(manifest=sample_subset(tmp_path / "v1", doc_ids))
    assert run_dag("cag_fixed_precompute").state == "success"
    first = load_release(store)
    old_faq = first.for_doc("support-faq")[0]
    before = objects(store)

    use(manifest=sample_subset(tmp_path / "v2", doc_ids, {"support-faq": "1.8.0"}), index=index.alias)
    run = run_dag("cag_fixed_precompute")

    assert run.state == "success", states(run)
    second = load_release(store)
    new_faq = second.for_doc("support-faq")[0]
    assert new_faq.key == f"support-faq/1.8.0/{fingerprint16(tiny_model_dir)}" != old_faq.key
    assert objects(store)[old_faq.object_name] == before[old_faq.object_name]  # old version untouched
    assert second.for_doc("data-retention-backup-guide") == first.for_doc("data-retention-backup-guide")
    assert second.release_id != first.release_id and list_releases(store) == sorted([first.release_id,
                                                                                     second.release_id])
    assert_release_verifies(store, doc_ids)
    hits = index.search("support plans response times", doc_id="support-faq", top_k=50)
    assert hits and {hit.version for hit in hits} == {"1.8.0"}  # the old version's chunks are gone
    assert index.count(doc_id="support-faq") == sum(c["doc_id"] == "support-faq" for c in returned(run, "chunk"))

    # Maintenance: nothing is deleted by default; with a window of one release and no grace period the
    # superseded version (and the release that held it) goes.
    # A heat object left by a replica that is gone goes too.
    store.put("heat/gone-replica.json", b'{"support-faq/1.7.0/0000000000000000": 3}')
    dry = run_dag("cag_snapshot_maintenance", {"keep_releases": 1, "unused_days": 0})
    assert dry.state == "success", states(dry)
    report = returned(dry, "collect_garbage")
    assert report["dry_run"] and report["snapshots"] == [old_faq.object_name]
    assert report["heat_objects"] == ["heat/gone-replica.json"] and "heat/gone-replica.json" in objects(store)
    assert report["releases"] == [first.object_name] and report["bytes_freed"] > old_faq.bytes
    assert old_faq.object_name in objects(store)

    wet = run_dag("cag_snapshot_maintenance", {"keep_releases": 1, "unused_days": 0, "dry_run": False})
    assert wet.state == "success", states(wet)
    assert returned(wet, "collect_garbage")["bytes_freed"] == report["bytes_freed"]
    assert old_faq.object_name not in objects(store) and list_releases(store) == [second.release_id]
    assert "heat/gone-replica.json" not in objects(store)
    assert returned(wet, "verify_active_release")["release_id"] == second.release_id
    assert_release_verifies(store, doc_ids)


@integration
def test_an_empty_document_fails_validation_readably_and_publishes_nothing(use, tmp_path, capfd, sample_subset):
    manifest = sample_subset(tmp_path / "corpus", ["support-faq"])
    (tmp_path / "corpus" / "fixed" / "release-checklist.md").write_text("# Release Checklist\n\n")
    documents = yaml.safe_load(manifest.read_text())
    documents["documents"].append({"doc_id": "release-checklist", "version": "1.0.0", "tier": "fixed",
                                   "title": "Release Checklist", "path": "fixed/release-checklist.md"})
    manifest.write_text(yaml.safe_dump(documents))
    store, index = use(manifest=manifest)

    run = run_dag("cag_fixed_precompute")

    assert run.state == "failed"
    task_states = states(run)
    assert task_states["validate_chunks"] == "failed"
    assert {task_states[t] for t in ("embed", "index", "precompute", "publish_release")} == {"upstream_failed"}
    assert objects(store) == {}
    assert index.health()["alias_exists"] is False
    report = capfd.readouterr().out
    assert "chunks validation failed: 1 of 10 checks" in report
    assert "every manifest document has chunks: missing: release-checklist (" in report
    assert "release-checklist.md: document has no text)" in report


# ---- S3 on SeaweedFS, settings from Airflow connections --------------------------------------------------


@pytest.fixture(scope="module")
def seaweedfs(tmp_path_factory):
    from cagflow.devstack.seaweedfs import LocalSeaweedFS

    server = LocalSeaweedFS(tmp_path_factory.mktemp("seaweedfs"), secrets.token_hex(10), secrets.token_hex(20))
    with server:
        server.create_bucket("cagflow-dags")
        yield server


@integration
def test_precompute_into_s3_with_settings_from_airflow_connections(use, seaweedfs, opensearch_url,
                                                                  monkeypatch, capfd, corpus, tmp_path):
    unused_local = tmp_path / "must-stay-empty"
    use(f"file://{unused_local}")
    monkeypatch.setenv("CAGFLOW__RETRIEVAL__ENDPOINT", "http://127.0.0.1:9")  # the connection must win
    monkeypatch.setenv("AIRFLOW_CONN_CAGFLOW_S3", json.dumps({
        "conn_type": "aws", "login": seaweedfs.access_key, "password": seaweedfs.secret_key,
        "extra": {"endpoint_url": seaweedfs.endpoint_url, "region_name": "us-east-1",
                  "state_store": "s3://cagflow-dags/sample"}}))
    host, port = opensearch_url.removeprefix("http://").split(":")
    monkeypatch.setenv("AIRFLOW_CONN_CAGFLOW_OPENSEARCH", json.dumps({
        "conn_type": "opensearch", "host": host, "port": int(port), "extra": {"index": "s3-run-chunks"}}))

    run = run_dag("cag_fixed_precompute")

    assert run.state == "success", states(run)
    assert not unused_local.exists()
    store = S3Store("cagflow-dags", "sample", client=seaweedfs.client())
    release = load_release(store)
    assert sorted(release.doc_ids) == sorted(e.doc_id for e in corpus.tier("fixed"))
    for entry in release.snapshots:
        assert store.get(entry.object_name, sha256=entry.sha256)  # re-read and verified
    assert returned(run, "index")["index"] == "s3-run-chunks"
    output = capfd.readouterr()
    assert seaweedfs.secret_key not in output.out + output.err


# ---- variable ingest -----------------------------------------------------------------------------------


@integration
def test_variable_ingest_indexes_documents_and_removes_dropped_ones(use, corpus, tmp_path, sample_subset):
    variable_ids = [entry.doc_id for entry in corpus.tier("variable")]
    _, index = use()

    run = run_dag("cag_variable_ingest")

    assert run.state == "success", states(run)
    chunks = returned(run, "chunk")
    assert index.count(tier="variable") == len(chunks)
    assert {chunk["doc_id"] for chunk in chunks} == set(variable_ids)
    hits = index.search("Which CVE was fixed in Skerry 5.1.2?", tier="variable")
    assert hits[0].doc_id == "skerry-5-1-2-release-notes"

    again = run_dag("cag_variable_ingest")
    assert again.state == "success", states(again)
    assert returned(again, "embed") == [] and index.count(tier="variable") == len(chunks)
    forced = run_dag("cag_variable_ingest", {"force": True})
    assert forced.state == "success", states(forced)
    assert len(returned(forced, "embed")) == len(chunks) and index.count(tier="variable") == len(chunks)

    dropped = "price-change-2025"
    use(manifest=sample_subset(tmp_path / "fewer", [d for d in variable_ids if d != dropped]), index=index.alias)
    rerun = run_dag("cag_variable_ingest")

    assert rerun.state == "success", states(rerun)
    assert returned(rerun, "index")["removed"] == [dropped]
    assert index.count(doc_id=dropped) == 0
    assert index.count(tier="variable") == len(chunks) - sum(c["doc_id"] == dropped for c in chunks)


# ---- serving on Triton ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def triton(tiny_model_dir, tmp_path_factory):
    """Triton with the answering and precompute models, on the tiny model and a store of its own."""
    from cagflow.devstack.triton import LocalTriton

    store = tmp_path_factory.mktemp("triton-store")
    environment = {"CAGFLOW__MODEL__PATH": str(tiny_model_dir), "CAGFLOW__CACHE__STATE_STORE": f"file://{store}"}
    with LocalTriton(tmp_path_factory.mktemp("triton-run"), models=["cag_llm", "cag_precompute"],
                     environment=environment) as server:
        yield server, store


@integration
def test_precompute_delegated_to_triton_then_serving_switches_to_the_release(triton, use, monkeypatch, tmp_path,
                                                                              sample_subset):
    from cagflow.devstack.triton import DEFAULT_MODEL_REPOSITORY

    server, triton_store = triton
    doc_ids = ["support-faq", "data-retention-backup-guide"]
    store, _ = use(f"file://{triton_store}", manifest=sample_subset(tmp_path / "corpus", doc_ids))
    monkeypatch.setenv("CAGFLOW__PRECOMPUTE__VIA", "triton")
    monkeypatch.setenv("CAGFLOW__PRECOMPUTE__TRITON_URL", server.http_url)

    run = run_dag("cag_fixed_precompute")

    assert run.state == "success", states(run)
    results = returned(run, "precompute")
    assert [(r["via"], r["skipped"]) for r in results] == [("triton", False)] * len(doc_ids)
    release = assert_release_verifies(store, doc_ids)
    reload = returned(run, "request_serving_reload")
    assert reload["requested"] is True and reload["release_id"] == release.release_id

    spec = importlib.util.spec_from_file_location("client_example", DEFAULT_MODEL_REPOSITORY / "client_example.py")
    client = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(client)
    answer = client.ask(server.http_url, "How long is each Skerry release supported?", snapshot_key="support-faq",
                        max_new_tokens=4)
    assert (answer["RELEASE_ID"], answer["CACHE_HIT"]) == (release.release_id, True)
