"""Static checks of the compose scale-out profile (docker/docker-compose.scale.yml, with docker-compose.small.yml
and docker-compose.scale.small.yml on a small machine), without a Docker daemon: it renders, and what it renders
is the profile `make test-containers` relies on: the Celery executor everywhere with two workers, two routers on
both Triton replicas behind nginx, limits shared through Redis, two OpenSearch nodes that name each other, every
image buildable by docker/build-local.sh, and memory limits that fit the small machine. Every test reads what Docker
Compose (from `make tools`) renders, so the module is marked ``tools``."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from cagflow.config import ServiceConfig

pytestmark = pytest.mark.tools

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
BASE = ["docker/docker-compose.yml", "docker/docker-compose.scale.yml"]
SMALL = ["docker/docker-compose.yml", "docker/docker-compose.small.yml", "docker/docker-compose.scale.yml",
         "docker/docker-compose.scale.small.yml"]
AIRFLOW = ("airflow-init", "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer",
           "airflow-worker-1", "airflow-worker-2")
SMALL_LIMIT_GIB = 15  # the scale stack on a 24 GiB machine, room left for the host (limits: 14.5)


def _container_tests():
    spec = importlib.util.spec_from_file_location("scale_container_files",
                                                  Path(__file__).with_name("test_container_files.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


static_tool = _container_tests().static_tool  # where docker/static-tools.sh keeps a tool


def _render(files: list[str], tmp_path: Path) -> dict:
    """`docker compose config` of ``files`` with env.example (its empty Fernet key filled in), as YAML."""
    docker = shutil.which("docker")
    if docker is None:
        pytest.fail("the docker CLI is not on PATH (the compose check needs the client only, no daemon)")
    env_file = tmp_path / "env"
    env_file.write_text(re.sub(r"(?m)^AIRFLOW_FERNET_KEY=$", "AIRFLOW_FERNET_KEY=a-generated-key",
                               (DOCKER / "env.example").read_text()))
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/"),
           "DOCKER_CONFIG": str(static_tool("docker-config"))}
    command = [docker, "compose", *[arg for file in files for arg in ("-f", file)], "--env-file", str(env_file),
               "config"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{' '.join(command)} exited with {result.returncode}:\n{result.stderr}"
    return yaml.safe_load(result.stdout)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, dict]:
    return {"scale": _render(BASE, tmp_path_factory.mktemp("scale"))["services"],
            "small": _render(SMALL, tmp_path_factory.mktemp("small"))["services"]}


@pytest.mark.parametrize("variant", ["scale", "small"])
def test_airflow_runs_the_celery_executor_on_two_workers(rendered, variant):
    services = rendered[variant]
    for name in AIRFLOW:
        env = services[name]["environment"]
        assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor", name
        assert env["AIRFLOW__CELERY__BROKER_URL"].startswith("redis://redis:6379/"), name
        assert env["AIRFLOW__CELERY__RESULT_BACKEND"].startswith("db+postgresql+psycopg2://"), name
        # A killed worker's task is failed and retried well within 2 minutes.
        assert int(env["AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT"]) <= 60, name
        assert int(env["CAGFLOW__PRECOMPUTE__PARALLEL_PARTS"]) == 2, name
    workers = [services[name] for name in ("airflow-worker-1", "airflow-worker-2")]
    assert [worker["command"] for worker in workers] == [["airflow", "celery", "worker"]] * 2
    assert {worker["hostname"] for worker in workers} == {"airflow-worker-1", "airflow-worker-2"}
    assert all(worker["restart"] == "unless-stopped" for worker in workers)
    assert all(worker["environment"]["AIRFLOW__CELERY__WORKER_CONCURRENCY"] == "1" for worker in workers)
    assert services["redis"]["image"] == "redis:7.0"


@pytest.mark.parametrize("variant", ["scale", "small"])
def test_both_routers_route_to_both_triton_replicas_and_share_keys_and_limits(rendered, variant):
    services = rendered[variant]
    assert "triton-2" in services and not services["triton-2"].get("ports")
    for name in ("router", "router-2"):
        env = services[name]["environment"]
        replicas = ServiceConfig(triton_replicas=env["CAGFLOW__SERVICE__TRITON_REPLICAS"]).replicas()
        assert [replica.id for replica in replicas] == ["triton", "triton-2"], name
        for replica in replicas:
            assert replica.http_url.split(":")[0] in services and replica.metrics_url, name
        assert env["CAGFLOW__SERVICE__RATE_LIMIT_REDIS_URL"] == "redis://redis:6379/1", name
        volumes = {volume["target"]: volume.get("source") for volume in services[name]["volumes"]}
        assert volumes["/var/lib/cagflow/keys"] == "api-keys", name
    published = [port["published"] for name in ("nginx", "router", "router-2") for port in services[name]["ports"]]
    assert len(set(published)) == 3, published


def test_nginx_balances_both_routers_with_failover_and_unbuffered_streams(rendered):
    nginx = rendered["scale"]["nginx"]
    assert nginx["image"] == "nginx:1.22"
    mounts = {volume["target"]: Path(volume["source"]) for volume in nginx["volumes"]}
    conf = mounts["/etc/nginx/conf.d/default.conf"].read_text()
    code = "\n".join(line.split("#")[0] for line in conf.splitlines())
    upstream = re.search(r"upstream\s+(\w+)\s*\{([^}]*)\}", code)
    assert upstream and re.findall(r"server\s+([\w.-]+:\d+)", upstream.group(2)) == ["router:8080", "router-2:8080"]
    assert re.search(rf"proxy_pass\s+http://{upstream.group(1)};", code)
    next_upstream = re.search(r"proxy_next_upstream\s+([^;]+);", code).group(1).split()
    assert {"error", "timeout", "http_502"} <= set(next_upstream) and "non_idempotent" not in next_upstream
    assert re.search(r"proxy_buffering\s+off;", code)
    assert re.search(r"listen\s+8080;", code) and nginx["ports"][0]["target"] == 8080


@pytest.mark.parametrize("variant", ["scale", "small"])
def test_opensearch_runs_two_nodes_that_name_each_other(rendered, variant):
    services = rendered[variant]
    nodes = [services["opensearch"]["environment"], services["opensearch-2"]["environment"]]
    names = [env["node.name"] for env in nodes]
    assert len(set(names)) == 2
    for env in nodes:
        assert "discovery.type" not in env
        assert env["cluster.initial_cluster_manager_nodes"].split(",") == names
        assert len(env["discovery.seed_hosts"].split(",")) == 2
        assert env["cluster.name"] == nodes[0]["cluster.name"]
    volumes = [services[name]["volumes"][0]["source"] for name in ("opensearch", "opensearch-2")]
    assert len(set(volumes)) == 2, "the nodes share a data volume"
    assert services["airflow-worker-1"]["environment"]["CAGFLOW__RETRIEVAL__INDEX_REPLICAS"] == "1"


def test_the_small_variant_fits_the_small_machine(rendered):
    services = rendered["small"]
    one_shot = {"create-bucket", "airflow-init"}
    limits = {name: int(service.get("deploy", {}).get("resources", {}).get("limits", {}).get("memory", 0))
              for name, service in services.items() if name not in one_shot}
    assert all(limits.values()), [name for name, limit in limits.items() if not limit]
    assert sum(limits.values()) <= SMALL_LIMIT_GIB * 2**30, f"{sum(limits.values()) / 2**30:.2f} GiB of limits"
    assert all(service["image"] == "cagflow:local" for name, service in services.items()
               if name.startswith(("airflow", "triton", "router")))


def test_build_local_builds_every_third_party_image(rendered):
    script = (DOCKER / "build-local.sh").read_text()
    built = set(re.findall(r"(?m)^step\s+(\S+)\s", script))
    images = {service["image"] for service in rendered["small"].values()} - {"cagflow:local"}
    assert images <= built, f"not built by docker/build-local.sh: {sorted(images - built)}"
    for name in ("redis", "nginx"):
        assert (DOCKER / "local" / name / "Dockerfile").is_file()


def test_prometheus_scrapes_both_routers_and_replicas(rendered):
    mounts = {volume["target"]: volume.get("source") for volume in rendered["scale"]["prometheus"]["volumes"]}
    config = Path(mounts["/etc/prometheus/prometheus.yml"])
    assert config.name == "prometheus.scale.yml"
    result = subprocess.run([str(static_tool("promtool")), "check", "config", "--lint-fatal", str(config)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = {job["job_name"]: job["static_configs"][0]["targets"]
            for job in yaml.safe_load(config.read_text())["scrape_configs"]}
    assert jobs == {"router": ["router:8080", "router-2:8080"], "triton": ["triton:8002", "triton-2:8002"]}
