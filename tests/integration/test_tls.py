"""The REST router over TLS as `make run` starts it: `cagflow router up --self-signed` runs gunicorn on
127.0.0.1 with a throwaway self-signed certificate (under a temporary CAGFLOW_HOME), and real TLS clients
verify it: requests, the API client, `cagflow router status` (urllib) and `cagflow ask`. Plain HTTP to the
TLS port and a certificate the client does not trust fail, and plain HTTP on a non-loopback address is
refused before anything starts. Triton and OpenSearch addresses point where nothing listens."""

from __future__ import annotations

import os
import re
import socket
import stat
import subprocess
import sys

import pytest
import requests
from cagflow.client.api_client import ApiClient, ApiError
from cagflow.devstack.process import free_ports
from cagflow.devstack.tls import ensure_local_certificate

pytestmark = pytest.mark.integration


def cagflow(env, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "cagflow.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def isolated_env(home, api_port: int) -> dict[str, str]:
    """This test's own cache home (keys, run records, certificate) and backends that are not there."""
    triton, grpc, metrics, opensearch = free_ports(4)
    return {**os.environ, "CAGFLOW_HOME": str(home), "HF_HUB_OFFLINE": "1",
            "CAGFLOW__SERVICE__PORT": str(api_port), "CAGFLOW__SERVICE__TRITON_URL": f"127.0.0.1:{triton}",
            "CAGFLOW__SERVICE__TRITON_GRPC_URL": f"127.0.0.1:{grpc}",
            "CAGFLOW__SERVICE__TRITON_METRICS_URL": f"http://127.0.0.1:{metrics}/metrics",
            "CAGFLOW__RETRIEVAL__ENDPOINT": f"http://127.0.0.1:{opensearch}",
            "CAGFLOW__CACHE__STATE_STORE": f"file://{home / 'store'}"}


@pytest.fixture(scope="module")
def https_router(tmp_path_factory):
    """``cagflow router up --self-signed``: yields (environment, port, certificate, what `up` printed)."""
    home = tmp_path_factory.mktemp("tls-home")
    [port] = free_ports(1)
    env = isolated_env(home, port)
    started = cagflow(env, "router", "up", "--self-signed")
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield env, port, home / "tls" / "cert.pem", started.stdout
    finally:
        stopped = cagflow(env, "router", "down")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr


def test_the_api_answers_over_https_verified_against_the_local_certificate(https_router):
    env, port, cert, printed = https_router
    url = f"https://127.0.0.1:{port}"
    assert f"api     {url}" in printed and f"trust   {cert}" in printed
    assert stat.S_IMODE(os.stat(cert.with_name("key.pem")).st_mode) == 0o600
    reply = requests.get(f"{url}/healthz", verify=str(cert), timeout=10)
    assert reply.json() == {"status": "alive"}
    with ApiClient(url, None, ca_file=str(cert)) as client:
        assert client.health() == {"status": "alive"}
        assert client.ready()[0] == 503  # no Triton, no OpenSearch: an answer, over verified TLS
    status = cagflow(env, "router", "status", timeout=60)  # the record names the certificate to verify
    assert status.returncode == 1 and f"at {url}: degraded" in status.stdout, status.stdout + status.stderr
    asked = cagflow(env, "ask", "Which port does the web console use?", timeout=60)  # found through the record
    assert asked.returncode == 2 and "HTTP 401 unauthenticated" in asked.stderr, asked.stderr


def test_plain_http_to_the_tls_port_gets_no_answer(https_router):
    _, port, _, _ = https_router
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{port}/healthz", timeout=10)
    with ApiClient(f"http://127.0.0.1:{port}", None, timeout_s=10) as client, pytest.raises(ApiError) as raised:
        client.health()
    assert raised.value.code == "unreachable"


def test_a_certificate_the_client_does_not_trust_fails_verification(https_router, tmp_path):
    env, port, _, _ = https_router
    url = f"https://127.0.0.1:{port}"
    stranger = ensure_local_certificate(tmp_path).cert_file  # same names, another key
    for trusted in (str(stranger), True):  # another self-signed certificate; the system's CAs
        with pytest.raises(requests.exceptions.SSLError, match="certificate verify failed"):
            requests.get(f"{url}/healthz", verify=trusted, timeout=10)
    with ApiClient(url, None, ca_file=str(stranger)) as client, pytest.raises(ApiError) as raised:
        client.health()
    assert (raised.value.status, raised.value.code) == (0, "tls_failed")
    asked = cagflow({**env, "CAGFLOW__SERVICE__TLS_CA_FILE": str(stranger)}, "ask", "Which port?", "--url", url,
                    timeout=60)
    assert asked.returncode == 2 and "Traceback" not in asked.stderr
    assert re.fullmatch(rf"cagflow ask: error: TLS with {url}/v1/query failed: .*certificate verify failed: "
                        r"self-signed certificate.*; the client trusts service.tls_ca_file .*\n", asked.stderr)


def test_plain_http_on_a_non_loopback_address_is_refused_with_one_line(tmp_path):
    [port] = free_ports(1)
    result = cagflow(isolated_env(tmp_path, port), "serve", "--host", "0.0.0.0", timeout=120)
    assert result.returncode == 2
    assert result.stderr == ("cagflow serve: error: refusing to serve plain HTTP on 0.0.0.0: set "
                             "service.tls_cert_file and service.tls_key_file, or service.allow_plaintext: true "
                             "behind a proxy that terminates TLS\n")
    with socket.socket() as probe:  # nothing was bound
        assert probe.connect_ex(("127.0.0.1", port)) != 0
