"""Rate limits shared by several routers through a real redis-server (Debian's, started here on a free port, no
persistence): two limiters, as two routers, draw on one bucket per key; it refills at the configured rate on
Redis's clock; an idle key's bucket expires; a Redis that stops and comes back empty is failed open over and
then used again; and two router apps behind one proxy answer the same key's request over the burst with 429."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Iterator

import pytest
import redis
from cagflow.config import Config
from cagflow.devstack.process import ServerProcess, free_port
from cagflow.router import access, create_app
from cagflow.router.access import KEY_PREFIX, RedisRateLimiter
from cagflow.router.apikeys import ApiKeyStore
from prometheus_client import REGISTRY

pytestmark = pytest.mark.integration


class RedisServer:
    """redis-server on 127.0.0.1:``port``, nothing written to disk; ``start`` again after ``stop`` gives an empty
    one on the same port, as a restarted Redis without persistence is."""

    def __init__(self, directory: Path) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.fail("redis-server is missing: apt-get install redis-server (make test does)")
        self.directory = directory
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.client = redis.Redis(port=self.port, socket_timeout=2)
        self.process = ServerProcess("redis-server", directory / "redis.log", RuntimeError)

    def start(self) -> None:
        self.process.launch([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(self.directory)])
        self.process.wait_ready(self.client.ping, timeout_s=30, interval_s=0.05, retry_on=(redis.ConnectionError,))

    def stop(self) -> None:
        self.process.stop()


@pytest.fixture()
def server(tmp_path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


def routers(url: str, per_s: float, burst: int, **options) -> tuple[RedisRateLimiter, RedisRateLimiter]:
    """The limiters of two routers sharing ``url``: two clients, two connection pools."""
    return RedisRateLimiter(url, per_s, burst, **options), RedisRateLimiter(url, per_s, burst, **options)


def store_errors() -> float:
    return REGISTRY.get_sample_value("cagflow_router_rate_limit_store_errors_total") or 0.0


def test_two_routers_share_one_bucket_per_key(server):
    first, second = routers(server.url, per_s=0.5, burst=5)
    admitted = [limiter.acquire("k1") for limiter in (first, second, first, second, first)]
    assert admitted == [0.0] * 5  # the burst in all, not per router
    wait_s = second.acquire("k1")
    assert 0 < wait_s <= 2.0  # one token at 0.5/s, less the moments since the burst
    assert 0 < first.acquire("k1") <= wait_s
    assert first.acquire("k2") == 0.0  # buckets are per key
    assert server.client.exists(f"{KEY_PREFIX}k1", f"{KEY_PREFIX}k2") == 2


def test_the_shared_bucket_refills_at_the_rate_up_to_the_burst(server):
    first, second = routers(server.url, per_s=5.0, burst=2)
    assert [first.acquire("k"), second.acquire("k")] == [0.0, 0.0]
    wait_s = first.acquire("k")
    assert 0 < wait_s <= 0.2
    time.sleep(wait_s + 0.02)
    assert second.acquire("k") == 0.0  # refilled by the time Redis said
    time.sleep(1.0)  # five tokens' time: the bucket holds two at most
    assert [second.acquire("k"), first.acquire("k")] == [0.0, 0.0] and first.acquire("k") > 0


def test_an_idle_keys_bucket_expires_once_it_would_be_full(server, monkeypatch):
    monkeypatch.setattr(access, "EXPIRY_MARGIN_MS", 100)
    limiter = RedisRateLimiter(server.url, per_s=10.0, burst=2)  # full again 200 ms after its last token
    limiter.acquire("idle")
    assert 0 < server.client.pttl(f"{KEY_PREFIX}idle") <= 300
    time.sleep(0.4)
    assert not server.client.exists(f"{KEY_PREFIX}idle")
    assert limiter.acquire("idle") == 0.0 and limiter.acquire("idle") == 0.0  # a full bucket, as before it went


def test_a_redis_outage_fails_open_then_limits_are_shared_again(server):
    first, second = routers(server.url, per_s=0.5, burst=2, retry_s=0.2)
    assert [first.acquire("k"), second.acquire("k")] == [0.0, 0.0] and first.acquire("k") > 0
    server.stop()
    before = store_errors()
    assert first.acquire("k") == 0.0  # fail open: this router's own bucket, full
    assert store_errors() == before + 1
    assert not first.readiness()["shared"] and first.readiness()["error"]
    server.start()  # empty: no buckets, no loaded script (EVALSHA finds none, the script is sent again)
    time.sleep(0.25)
    assert [first.acquire("k"), second.acquire("k")] == [0.0, 0.0] and second.acquire("k") > 0
    assert first.readiness() == {"store": server.url, "shared": True}


def test_two_router_apps_refuse_the_same_key_over_the_burst(server, tmp_path):
    class Answers:
        def answer(self, query, request_id):
            return {"answer": "ok", "request_id": request_id}

    keys = ApiKeyStore(tmp_path / "api-keys.json")
    _, user_key = keys.create("user")
    user = {"Authorization": f"Bearer {user_key}"}
    config = Config.model_validate({"service": {"rate_limit_redis_url": server.url, "rate_limit_per_s": 0.2,
                                                "rate_limit_burst": 3,
                                                "audit_log_file": str(tmp_path / "audit.jsonl")}})
    first, second = (create_app(config, router=Answers(), keys=keys).test_client() for _ in range(2))
    statuses = [client.post("/v1/query", json={"question": "q"}, headers=user).status_code
                for client in (first, second, first)]
    limited = second.post("/v1/query", json={"question": "q"}, headers=user)
    assert statuses == [200, 200, 200]
    assert limited.status_code == 429 and limited.mimetype == "application/json"
    assert limited.get_json()["error"]["code"] == "rate_limited"
    assert limited.headers["Retry-After"] == "5"  # one token at 0.2/s
