"""The local stack's command line: `cagflow router up|status|down` run the REST router as a real background
process and stop it cleanly; `cagflow keys` changes reach running routers at once; `cagflow demo` picks a mix of
sample questions and fails clearly without an API."""

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import pytest
import requests
from cagflow.client.demo import percentile, pick_mixed_questions
from cagflow.devstack.process import HOST, free_ports
from cagflow.devstack.triton import TritonError, choose_ports
from cagflow.router.apikeys import ApiKeyStore

QA_PATH = Path(__file__).resolve().parents[2] / "corpus" / "qa.jsonl"


def cagflow(env, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "cagflow.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def router_env(tmp_path):
    """The router's own state in tmp_path; Triton and OpenSearch addresses where nothing listens."""
    api_port, nothing_there, also_nothing = free_ports(3)
    env = {**os.environ, "CAGFLOW_HOME": str(tmp_path), "CAGFLOW__SERVICE__PORT": str(api_port),
           "CAGFLOW__SERVICE__TRITON_URL": f"127.0.0.1:{nothing_there}",
           "CAGFLOW__RETRIEVAL__ENDPOINT": f"http://127.0.0.1:{also_nothing}",
           "CAGFLOW__CACHE__STATE_STORE": f"file://{tmp_path / 'store'}"}
    return env, api_port


@pytest.mark.integration
def test_router_up_status_down_without_backends(router_env):
    env, port = router_env
    url = f"http://127.0.0.1:{port}"
    started = cagflow(env, "router", "up")
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        assert url in started.stdout and "stop with: cagflow router down" in started.stdout
        # Alive without Triton and OpenSearch; /readyz names what is missing.
        assert json.load(urllib.request.urlopen(f"{url}/healthz", timeout=10)) == {"status": "alive"}
        status = cagflow(env, "router", "status")
        assert status.returncode == 1 and "degraded" in status.stdout, status.stdout + status.stderr
        again = cagflow(env, "router", "up")
        assert again.returncode == 0 and "already running" in again.stdout  # reported, not restarted
    finally:
        stopped = cagflow(env, "router", "down")
    assert stopped.returncode == 0 and "stopped router" in stopped.stdout, stopped.stdout + stopped.stderr
    assert cagflow(env, "router", "status").returncode == 3
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{url}/healthz", timeout=3)
    assert "no router recorded" in cagflow(env, "router", "down").stdout


@pytest.mark.integration
def test_port_in_use_is_one_clear_line(router_env):
    env, port = router_env
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        result = cagflow(env, "router", "up", timeout=60)
    assert result.returncode == 2
    assert f"port {port} is already in use" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.integration
def test_invalid_configuration_is_reported_before_starting(router_env):
    env, _ = router_env
    result = cagflow({**env, "CAGFLOW__SERVICE__MAX_CONCURRENT_REQUESTS": "0"}, "router", "up", timeout=60)
    assert result.returncode == 2
    assert "service.max_concurrent_requests" in result.stderr and "Traceback" not in result.stderr
    assert cagflow(env, "router", "status").returncode == 3


@pytest.mark.integration
def test_two_routers_on_one_keys_file_follow_a_rotation_and_audit_admin_actions(router_env, tmp_path):
    """Two routers (gunicorn, each its own process) share the keys file and the audit log of CAGFLOW_HOME. A key
    rotated, revoked or expired is seen by both at once; neither writes a key to its log or the audit log."""
    env, port = router_env
    urls = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{free_ports(1)[0]}"]
    run_dirs = [tmp_path / "router", tmp_path / "router-2"]
    user = cagflow(env, "keys", "create", "--name", "billing-app").stdout.strip()
    admin = cagflow(env, "keys", "create", "--name", "ops", "--admin").stdout.strip()
    an_hour_ago = time.time() - 3600
    _, expired = ApiKeyStore(tmp_path / "api-keys.json", clock=lambda: an_hour_ago).create("contractor", expires_in_s=60)
    try:
        for url, run_dir in zip(urls, run_dirs):
            started = cagflow(env, "router", "--run-dir", str(run_dir), "up", "--port", url.rsplit(":", 1)[1])
            assert started.returncode == 0, started.stdout + started.stderr

        def codes(path, key, method="get"):
            replies = [getattr(requests, method)(f"{url}{path}", headers={"Authorization": f"Bearer {key}"},
                                                 timeout=30) for url in urls]
            return [reply.json()["error"]["code"] if reply.status_code >= 400 else reply.status_code
                    for reply in replies]

        rotated = cagflow(env, "keys", "rotate", "billing-app", "--overlap", "1h")
        assert rotated.returncode == 0, rotated.stderr
        new = rotated.stdout.strip()
        assert codes("/v1/releases", user) == codes("/v1/releases", new) == [200, 200]
        assert codes("/v1/releases", expired) == ["key_expired"] * 2
        assert codes("/v1/releases", user + "x") == ["invalid_api_key"] * 2
        old_id = user.split("_")[1]
        assert cagflow(env, "keys", "revoke", old_id).returncode == 0
        assert codes("/v1/releases", user) == ["invalid_api_key"] * 2 and codes("/v1/releases", new) == [200, 200]
        assert codes("/admin/reload", new, "post") == ["forbidden"] * 2
        assert codes("/admin/reload", expired, "post") == ["key_expired"] * 2
        assert codes("/admin/reload", admin, "post") == ["triton_unavailable"] * 2  # nothing listens there
    finally:
        for run_dir in run_dirs:
            cagflow(env, "router", "--run-dir", str(run_dir), "down")
    audit = (tmp_path / "audit.jsonl").read_text()
    events = [json.loads(line) for line in audit.splitlines()]
    assert [(event["action"], event["result"]) for event in events if event["via"] == "cli"] == [
        ("keys.create", "ok"), ("keys.create", "ok"), ("keys.rotate", "ok"), ("keys.revoke", "ok")]
    admin_events = sorted((event["result"], event["reason"], event["key_name"]) for event in events
                          if event["via"] == "rest")
    assert admin_events == sorted([("denied", "forbidden", "billing-app"), ("denied", "key_expired", "contractor"),
                                   ("error", "triton_unavailable", "ops")] * 2)
    assert {event["remote_addr"] for event in events if event["via"] == "rest"} == {"127.0.0.1"}
    logs = [(run_dir / "router.log").read_text() for run_dir in run_dirs]
    assert all('"action": "admin.reload"' in log and '"endpoint": "/v1/releases"' in log for log in logs)
    keys = (user, admin, expired, new)
    secrets = [key.split("_", 2)[2] for key in keys] + [hashlib.sha256(key.encode()).hexdigest() for key in keys]
    assert not [secret for secret in secrets for text in [audit, *logs] if secret in text]


def test_demo_mixes_fixed_variable_and_unanswerable_questions_in_each_language():
    picked = pick_mixed_questions(QA_PATH, 6)
    assert len(picked) == 12 and len({item.id for item in picked}) == 12
    assert [item.language for item in picked] == ["en"] * 6 + ["zh"] * 6
    for language in (picked[:6], picked[6:]):
        assert [item.in_scope for item in language] == [True, False] * 3
        assert len({item.doc_id for item in language if item.in_scope}) >= 2  # spread over the fixed documents
        others = [item for item in language if not item.in_scope]
        assert any(item.doc_id for item in others) and any(item.doc_id is None for item in others)


def test_percentile_is_a_measured_value():
    assert percentile([30.0, 10.0, 20.0], 0.5) == 20.0
    assert percentile([30.0, 10.0, 20.0], 0.95) == 30.0
    assert percentile([7.0], 0.95) == 7.0


def test_demo_without_api_or_key_says_what_to_do(tmp_path):
    port = free_ports(1)[0]
    env = {key: value for key, value in os.environ.items() if not key.startswith("CAGFLOW_")}
    env.update({"CAGFLOW_HOME": str(tmp_path), "CAGFLOW__SERVICE__PORT": str(port)})
    no_key = cagflow(env, "demo", timeout=120)
    assert no_key.returncode == 2 and "cagflow keys init-local" in no_key.stderr
    no_api = cagflow({**env, "CAGFLOW_API_KEY": "cgf_x_y"}, "demo", timeout=120)
    assert no_api.returncode == 2, no_api.stdout + no_api.stderr
    assert f"127.0.0.1:{port} does not answer" in no_api.stderr and "cagflow router up" in no_api.stderr
    assert "Traceback" not in no_key.stderr + no_api.stderr


def test_triton_ports_requested_and_taken():
    with ExitStack() as held:
        listener = held.enter_context(socket.create_server((HOST, 0)))
        taken = listener.getsockname()[1]
        with pytest.raises(TritonError, match=f"http port {taken} .* already in use"):
            choose_ports({"http": taken})
    wanted = free_ports(1)[0]
    ports = choose_ports({"metrics": wanted})
    assert ports["metrics"] == wanted and len(set(ports.values())) == 3
