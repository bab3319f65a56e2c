"""End to end through a real local Airflow: four components in one process group, the precompute DAG
triggered with ``POST /api/v2/dags/{dag_id}/dagRuns`` on two sample documents (one English, one Chinese),
run to success by the scheduler and LocalExecutor, a backfill planned at the configured cron, then
everything stopped by the command line."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from cagflow.devstack import webdriver
from cagflow.devstack.airflow import LocalAirflow, main
from cagflow.devstack.jaeger import LocalJaeger
from cagflow.store.backends import LocalStore
from cagflow.store.manifests import load_release

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DAG_ID = "cag_fixed_precompute"
DAG_IDS = {"cag_fixed_precompute": ("plan_parts", "publish_release"),  # each DAG with tasks its page must show
           "cag_snapshot_maintenance": ("verify_active_release", "collect_garbage"),
           "cag_variable_ingest": ("embed", "index")}
FIXED_DOCS = ["support-faq", "yunfan-ops-manual"]  # a run's tasks are the same for two documents as for seven


@pytest.fixture
def artifacts() -> Path:
    """Where screenshots are kept after the run: $CAGFLOW_TEST_ARTIFACTS, else test-artifacts/ here."""
    path = Path(os.environ.get("CAGFLOW_TEST_ARTIFACTS", REPO / "test-artifacts")) / "airflow-ui"
    path.mkdir(parents=True, exist_ok=True)
    return path


def look_at_the_ui(airflow: LocalAirflow, artifacts: Path, profile: Path) -> list[Path]:
    """Log in as an operator would, open the DAG list and each DAG; a screenshot of every page."""
    if not webdriver.installed():
        pytest.fail(webdriver.MISSING)
    user, password = airflow.credentials()
    browser = webdriver.Browser(profile)
    try:
        browser.open(f"{airflow.url}/")
        browser.wait_for_text("Sign into Airflow")
        browser.type("input[name=username]", user)
        browser.type("input[name=password]", password)
        browser.click("button[type=submit]")
        browser.wait_for_text("Health", "Scheduler")
        browser.open(f"{airflow.url}/dags")
        browser.wait_for_text("3 Dags", *DAG_IDS)
        shots = [browser.screenshot(artifacts / "dags.png")]
        for dag_id, tasks in DAG_IDS.items():
            browser.open(f"{airflow.url}/dags/{dag_id}")
            browser.wait_for_text(dag_id, "Schedule", "Latest Run", *tasks)
            shots.append(browser.screenshot(artifacts / f"{dag_id}.png"))
        return shots
    finally:
        browser.close()


def task_span_name(ti: dict, kind: str = "task_run") -> str:
    return f"{kind}.{ti['task_id']}" + (f"[{ti['map_index']}]" if ti["map_index"] >= 0 else "")


def run_trace(jaeger: LocalJaeger, instances: list[dict], timeout_s: float = 30.0) -> tuple[dict, dict[str, dict]]:
    """The DAG run's trace in the collector, once it holds the run's own span and one per task instance: the run's
    span, and every span by name."""
    expected = {task_span_name(ti, kind) for ti in instances for kind in ("task_run", "worker")}
    deadline = time.monotonic() + timeout_s
    while True:
        for found in jaeger.traces("cagflow-airflow"):
            spans = {span["operationName"]: span for span in found["spans"]}
            roots = [span for span in found["spans"] if not span["references"]]
            if expected <= spans.keys() and roots:
                return roots[0], spans
        if time.monotonic() > deadline:
            held = [[span["operationName"] for span in found["spans"]] for found in jaeger.traces("cagflow-airflow")]
            pytest.fail(f"no trace with a DAG run span and {sorted(expected)} in {timeout_s:.0f} s: {held}")
        time.sleep(0.5)


def test_a_run_triggered_through_the_rest_api_succeeds(tmp_path, tiny_model_dir, opensearch_url, artifacts,
                                                      record_property, sample_subset):
    home, store_dir = tmp_path / "airflow", tmp_path / "store"
    manifest = sample_subset(tmp_path / "corpus", FIXED_DOCS)
    jaeger = LocalJaeger(tmp_path / "jaeger")
    jaeger.start()
    settings = {
        "CAGFLOW__TRACING__ENDPOINT": jaeger.otlp_endpoint,  # Airflow's own traces, as `make run TRACING=1` has them
        "CAGFLOW__CORPUS__MANIFEST": str(manifest),
        "CAGFLOW__MODEL__PATH": str(tiny_model_dir),
        "CAGFLOW__CACHE__STATE_STORE": f"file://{store_dir}",
        "CAGFLOW__RETRIEVAL__ENDPOINT": opensearch_url,
        "CAGFLOW__RETRIEVAL__INDEX": "rest-run-chunks",
        "CAGFLOW__PRECOMPUTE__TRITON_URL": "127.0.0.1:9",  # serving is down: tolerated
    }
    airflow = LocalAirflow(home, REPO / "dags", env=settings, cwd=REPO)
    try:
        airflow.start()
        assert airflow.url.startswith("http://127.0.0.1:")
        assert airflow.health() == dict.fromkeys(("metadatabase", "scheduler", "triggerer", "dag_processor"),
                                                 "healthy")
        with pytest.raises(urllib.error.HTTPError) as refused:  # the API wants a token
            urllib.request.urlopen(f"{airflow.url}/api/v2/dags", timeout=10)
        assert refused.value.code == 401

        run_id = airflow.trigger(DAG_ID)
        changes: list[tuple[tuple[str, int], str | None, str]] = []
        run = airflow.wait_for_run(DAG_ID, run_id, timeout_s=600, on_change=lambda ti, old: changes.append(
            ((ti["task_id"], ti["map_index"]), old, ti["state"])))

        assert run["state"] == "success", run["task_instances"]
        assert run["run_type"] == "manual" and run["conf"] == {}
        instances = run["task_instances"]
        assert {ti["state"] for ti in instances} == {"success"}
        # one precompute task per document, or per part ("doc#1") of one too long for the tiny model's context
        mapped = sorted({ti["rendered_map_index"].split("#")[0] for ti in instances if ti["task_id"] == "precompute"})
        assert mapped == sorted(FIXED_DOCS)
        # progress was reported while waiting: every task was seen, each ending in success, and every task
        # state change appears once, in order (old state = the previous new state)
        last: dict[tuple[str, int], str | None] = {}
        for task, old, new in changes:
            assert old == last.get(task) and new != old, changes
            last[task] = new
        assert last == {(ti["task_id"], ti["map_index"]): "success" for ti in instances}
        assert any(old is not None for _, old, _ in changes)  # seen before it finished, not only at the end
        release = load_release(LocalStore(store_dir))
        assert sorted(release.doc_ids) == mapped
        run_span, spans = run_trace(jaeger, instances)
        for ti in instances:  # each task a span under the run's, its work in the worker a span under the task's
            task = spans[task_span_name(ti)]
            assert task["references"][0]["spanID"] == run_span["spanID"] and task["duration"] > 0
            assert spans[task_span_name(ti, "worker")]["references"][0]["spanID"] == task["spanID"]
        assert run_id in json.dumps(run_span["tags"]), run_span

        backfill = airflow.api("POST", "/backfills/dry_run", {"dag_id": DAG_ID, "from_date": "2026-11-20T00:00:00Z",
                                                              "to_date": "2026-11-23T00:00:00Z"})
        planned = [b["logical_date"] for b in backfill["backfills"]]
        assert planned == [f"2026-11-{day}T02:00:00Z" for day in (20, 21, 22)]  # at the default 02:00 cron

        # A real backfill of one date: nothing changed, so its run plans nothing and publishes nothing.
        objects = {info.name: info.modified for info in LocalStore(store_dir).list()}
        runs = airflow.backfill(DAG_ID, "2026-11-20T00:00:00Z", "2026-11-20T23:59:59Z")
        assert [(run["logical_date"], run["state"]) for run in runs] == [("2026-11-20T02:00:00Z", "success")]
        assert load_release(LocalStore(store_dir)) == release
        assert {info.name: info.modified for info in LocalStore(store_dir).list()} == objects

        screenshots = look_at_the_ui(airflow, artifacts, tmp_path / "chromium-profile")
        record_property("airflow_ui_screenshots", ", ".join(str(path) for path in screenshots))

        assert main(["--home", str(home), "status"]) == 0
        assert len(airflow.processes()) >= 5  # a shell, the four components and their workers
        assert main(["--home", str(home), "down"]) == 0
        assert airflow.processes() == []  # every component and task process is gone
        assert main(["--home", str(home), "status"]) == 3
    finally:
        airflow.stop()
        jaeger.stop()
