"""`cagflow <service> up|down|status` start real services in the background and stop them cleanly."""

import json
import os
import subprocess
import sys
import urllib.request

import pytest
from cagflow.devstack.opensearch import free_port

pytestmark = pytest.mark.integration


def cagflow(env, *args):
    return subprocess.run([sys.executable, "-m", "cagflow.cli", *args], env=env, capture_output=True, text=True,
                          timeout=300)


def test_opensearch_up_status_down(tmp_path):
    port = free_port()
    env = {**os.environ, "CAGFLOW_HOME": str(tmp_path), "CAGFLOW__RETRIEVAL__ENDPOINT": f"http://127.0.0.1:{port}"}
    started = cagflow(env, "opensearch", "up")
    try:
        assert started.returncode == 0, started.stderr
        assert f"http://127.0.0.1:{port}" in started.stdout
        health = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/_cluster/health", timeout=10))
        assert health["status"] in ("green", "yellow")
        again = cagflow(env, "opensearch", "up")
        assert again.returncode == 0 and str(port) in again.stdout  # already running: reported, not restarted
        assert cagflow(env, "opensearch", "status").returncode == 0
    finally:
        stopped = cagflow(env, "opensearch", "down")
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert cagflow(env, "opensearch", "status").returncode == 3
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=3)


def test_remote_endpoint_is_refused(tmp_path):
    env = {**os.environ, "CAGFLOW_HOME": str(tmp_path), "CAGFLOW__RETRIEVAL__ENDPOINT": "http://search.internal:9200"}
    result = cagflow(env, "opensearch", "up")
    assert result.returncode == 2 and "not local" in result.stderr and "Traceback" not in result.stderr
