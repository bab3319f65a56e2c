"""The shared rate-limit store without a Redis server: its configuration (key, secret, validation, no password
in messages or dumps), the limiter the router builds from it, and what a router does while Redis cannot be
reached. The shared buckets themselves run against a real redis-server in
tests/integration/test_shared_rate_limit.py."""

from __future__ import annotations

import logging

import pytest
from cagflow.config import Config, ConfigError, load_config
from cagflow.devstack.process import free_port
from cagflow.router import create_app
from cagflow.router.access import RateLimiter, RedisRateLimiter, rate_limiter
from cagflow.router.apikeys import ApiKeyStore
from prometheus_client import REGISTRY

ENV_KEY = "CAGFLOW__SERVICE__RATE_LIMIT_REDIS_URL"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ReadyRouter:
    """Enough of ``Router`` for admission and /readyz: every route is up."""

    def answer(self, query, request_id):
        return {"answer": "ok", "request_id": request_id}

    def readiness(self):
        return {"ready": True, "degraded": False, "reasons": []}


def store_errors() -> float:
    return REGISTRY.get_sample_value("cagflow_router_rate_limit_store_errors_total") or 0.0


@pytest.fixture()
def router_log(caplog, monkeypatch):
    """The router's log lines, each once (the logger stops propagating once an app configured it)."""
    logger = logging.getLogger("cagflow.router")
    monkeypatch.setattr(logger, "propagate", False)
    logger.addHandler(caplog.handler)
    yield lambda: [(record.levelname, record.getMessage()) for record in caplog.records
                   if record.name == "cagflow.router"]
    logger.removeHandler(caplog.handler)


def test_the_store_url_comes_from_the_key_or_its_environment_override():
    assert load_config(environ={}).service.rate_limit_redis_url == ""  # per-router limits, as before
    config = load_config(environ={ENV_KEY: "rediss://10.0.0.7:6380/2"})
    assert config.service.rate_limit_store({}) == "rediss://10.0.0.7:6380/2"


@pytest.mark.parametrize("url", ["http://10.0.0.7:6379", "10.0.0.7:6379", "redis://", "redis://h:0",
                                 "redis://h:99999", "redis://h/db1", "unix:///run/redis.sock"])
def test_a_url_that_is_not_redis_is_refused_with_the_expected_form(url):
    with pytest.raises(ConfigError, match=r"service\.rate_limit_redis_url: .*must be redis://.*rediss://"):
        load_config(environ={ENV_KEY: url})


def test_a_password_never_shows_in_errors_or_the_printed_config():
    with pytest.raises(ConfigError) as error:
        load_config(environ={ENV_KEY: "redis://:hunter2@10.0.0.7:6379/x"})
    assert "hunter2" not in str(error.value) and ":***@10.0.0.7" in str(error.value)
    config = load_config(environ={ENV_KEY: "redis://ops:hunter2@10.0.0.7:6379/0"})
    assert config.service.rate_limit_redis_url == "redis://ops:hunter2@10.0.0.7:6379/0"  # what the client uses
    assert config.model_dump()["service"]["rate_limit_redis_url"] == "redis://ops:***@10.0.0.7:6379/0"


def test_the_secret_or_its_file_overrides_the_key(tmp_path):
    service = load_config(environ={ENV_KEY: "redis://plain:6379/0"}).service
    secret = tmp_path / "redis-url"
    secret.write_text("redis://:s3cr3t@10.0.0.7:6379/1\n")
    assert service.rate_limit_store({"CAGFLOW_RATE_LIMIT_REDIS_URL_FILE": str(secret)}) == \
        "redis://:s3cr3t@10.0.0.7:6379/1"
    assert service.rate_limit_store({"CAGFLOW_RATE_LIMIT_REDIS_URL": "redis://other/3"}) == "redis://other/3"
    with pytest.raises(ConfigError, match="CAGFLOW_RATE_LIMIT_REDIS_URL: must be redis://"):
        service.rate_limit_store({"CAGFLOW_RATE_LIMIT_REDIS_URL": "http://:s3cr3t@10.0.0.7"})


def test_the_router_builds_the_limiter_its_config_asks_for():
    assert isinstance(rate_limiter(load_config(environ={}).service, {}), RateLimiter)
    shared = rate_limiter(load_config(environ={ENV_KEY: "redis://:pw@127.0.0.1:6379/0"}).service, {})
    assert isinstance(shared, RedisRateLimiter) and shared.store == "redis://:***@127.0.0.1:6379/0"


def test_redis_unreachable_fails_open_to_this_routers_bucket(router_log):
    clock = Clock()
    limiter = RedisRateLimiter(f"redis://127.0.0.1:{free_port()}/0", per_s=1.0, burst=2, retry_s=5.0, clock=clock)
    before = store_errors()
    # Admitted by the in-memory bucket, which then limits as RateLimiter does: never a 5xx or an exception.
    assert [limiter.acquire("k1") for _ in range(3)] == [0.0, 0.0, pytest.approx(1.0)]
    assert store_errors() == before + 1  # later requests skip Redis until retry_s has passed
    clock.now += 5.0
    assert limiter.acquire("k1") == 0.0 and store_errors() == before + 2
    warnings = [message for level, message in router_log() if level == "WARNING"]
    assert len(warnings) == 1 and "127.0.0.1" in warnings[0] and "on its own" in warnings[0]


def test_readyz_reports_the_failing_store_as_degraded(tmp_path):
    keys = ApiKeyStore(tmp_path / "api-keys.json")
    port = free_port()
    config = Config.model_validate({"service": {"rate_limit_redis_url": f"redis://:pw@127.0.0.1:{port}/0",
                                                "audit_log_file": str(tmp_path / "audit.jsonl")}})
    report = create_app(config, router=ReadyRouter(), keys=keys).test_client().get("/readyz")
    body = report.get_json()
    assert report.status_code == 200 and body["degraded"]  # requests are still admitted: a load balancer keeps it
    assert body["rate_limit"]["store"] == f"redis://:***@127.0.0.1:{port}/0" and not body["rate_limit"]["shared"]
    assert body["rate_limit"]["error"] and any("rate limit store" in reason for reason in body["reasons"])
    assert "pw@" not in report.get_data(as_text=True)
    in_memory = Config.model_validate({"service": {"audit_log_file": str(tmp_path / "audit.jsonl")}})
    body = create_app(in_memory, router=ReadyRouter(), keys=keys).test_client().get("/readyz").get_json()
    assert body["rate_limit"] == {"store": "memory", "shared": False} and not body["degraded"]
