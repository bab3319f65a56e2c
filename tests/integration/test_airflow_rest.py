"""End to end through a real local Airflow: four components in one process group, the precompute DAG
triggered with ``POST /api/v2/dags/{dag_id}/dagRuns`` on the sample corpus, run to success by the
scheduler and LocalExecutor, a backfill planned at the configured cron, then everything stopped by the
command line."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest
from cagflow.devstack.airflow import LocalAirflow, main
from cagflow.store.backends import LocalStore
from cagflow.store.manifests import load_release

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DAG_ID = "cag_fixed_precompute"


def test_a_run_triggered_through_the_rest_api_succeeds(tmp_path, tiny_model_dir, opensearch_url, corpus):
    home, store_dir = tmp_path / "airflow", tmp_path / "store"
    settings = {
        "CAGFLOW__MODEL__PATH": str(tiny_model_dir),
        "CAGFLOW__CACHE__STATE_STORE": f"file://{store_dir}",
        "CAGFLOW__RETRIEVAL__ENDPOINT": opensearch_url,
        "CAGFLOW__RETRIEVAL__INDEX": "rest-run-chunks",
        "CAGFLOW__PRECOMPUTE__TRITON_URL": "127.0.0.1:9",  # serving is down: tolerated
    }
    airflow = LocalAirflow(home, REPO / "dags", env=settings, cwd=REPO)  # the manifest path is relative to cwd
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
        mapped = sorted(ti["rendered_map_index"] for ti in instances if ti["task_id"] == "precompute")
        assert mapped == sorted(entry.doc_id for entry in corpus.tier("fixed"))
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

        backfill = airflow.api("POST", "/backfills/dry_run", {"dag_id": DAG_ID, "from_date": "2026-11-20T00:00:00Z",
                                                              "to_date": "2026-11-23T00:00:00Z"})
        planned = [b["logical_date"] for b in backfill["backfills"]]
        assert planned == [f"2026-11-{day}T02:00:00Z" for day in (20, 21, 22)]  # at the default 02:00 cron

        assert main(["--home", str(home), "status"]) == 0
        assert len(airflow.processes()) >= 5  # a shell, the four components and their workers
        assert main(["--home", str(home), "down"]) == 0
        assert airflow.processes() == []  # every component and task process is gone
        assert main(["--home", str(home), "status"]) == 3
    finally:
        airflow.stop()
