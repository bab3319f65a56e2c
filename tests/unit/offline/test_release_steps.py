"""Release and maintenance steps that need no Airflow and no server: which superseded snapshots garbage
collection takes, the serving reload request when nothing listens, and precompute delegated to Triton with
no address, and that connections apply under Airflow only."""

import json
import os
import subprocess
import sys
import time

import pytest
from cagflow.documents.keys import SnapshotKey
from cagflow.offline import maintenance_steps, release_steps, snapshot_steps
from cagflow.store.backends import LocalStore
from cagflow.store.layout import snapshot_object
from cagflow.store.manifests import Release, ReleaseEntry, activate_release, publish_release


def test_a_superseded_snapshot_is_kept_until_unread_for_the_configured_days(tmp_path):
    """Serving reads snapshots only through releases: a snapshot counts as read until the release holding
    it is superseded, and the active release's snapshots always stay."""
    store = LocalStore(tmp_path / "store")
    fingerprint = "ab" * 32
    published_at = time.time()
    for version, created_at in (("1.0.0", published_at - 30 * 86400), ("2.0.0", published_at)):
        key = SnapshotKey("guide", version, fingerprint[:16])
        info = store.put(snapshot_object(key), f"snapshot {version}".encode())
        entry = ReleaseEntry(key=str(key), doc_id="guide", doc_version=version, part=None, n_tokens=3,
                             bytes=info.size, sha256=info.sha256, created_at=created_at)
        publish_release(store, Release(release_id=f"r-{version}", created_at=created_at,
                                       model_fingerprint=fingerprint, snapshots=[entry]))
    old = snapshot_object(SnapshotKey("guide", "1.0.0", fingerprint[:16]))

    def doomed(days_later: float, keep: int = 1, unused_days: float = 7):
        plan = maintenance_steps.plan_garbage(store, keep, unused_days, now=published_at + days_later * 86400)
        return sorted(plan.snapshots), sorted(plan.releases)

    assert doomed(6) == ([], [])
    assert doomed(8) == ([old], ["releases/r-1.0.0.json"])
    assert doomed(400, keep=2) == ([], [])
    activate_release(store, "r-1.0.0")  # rolled back: the old version is served again
    assert doomed(400) == ([], [])


def test_serving_down_is_tolerated(monkeypatch):
    monkeypatch.setenv("CAGFLOW__PRECOMPUTE__TRITON_URL", "127.0.0.1:9")
    result = release_steps.request_serving_reload({"release_id": "r1", "published": True})
    assert result["requested"] is False and result["reason"].startswith("unreachable")
    unchanged = release_steps.request_serving_reload({"release_id": "r1", "published": False})
    assert unchanged["reason"] == "release unchanged"


def test_precompute_via_triton_without_an_address_fails_before_loading_anything(monkeypatch):
    monkeypatch.setenv("CAGFLOW__PRECOMPUTE__VIA", "triton")
    monkeypatch.setenv("CAGFLOW__PRECOMPUTE__TRITON_URL", "")
    with pytest.raises(snapshot_steps.PrecomputeUnavailable, match="needs precompute.triton_url"):
        snapshot_steps.plan_snapshot_parts()


def test_outside_airflow_the_steps_read_the_project_configuration_without_importing_airflow(tmp_path):
    """A connection in the environment applies to Airflow's tasks only: the command line, which runs the same
    steps, reads the project configuration and never loads Airflow (nor an Airflow home it may not have)."""
    script = ("import json, sys\n"
              "from cagflow.offline import connections\n"
              "store = connections.snapshot_store()\n"
              "print(json.dumps([connections.airflow_connection('cagflow_s3'), type(store).__name__,\n"
              "                  any(name.split('.')[0] == 'airflow' for name in sys.modules)]))\n")
    connection = json.dumps({"conn_type": "aws", "extra": {"state_store": "s3://elsewhere/snapshots"}})
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env={
        **os.environ, "AIRFLOW_CONN_CAGFLOW_S3": connection, "AIRFLOW_HOME": str(tmp_path / "no-airflow-here"),
        "CAGFLOW__CACHE__STATE_STORE": f"file://{tmp_path / 'store'}"})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [None, "LocalStore", False]
    assert not (tmp_path / "no-airflow-here").exists()
