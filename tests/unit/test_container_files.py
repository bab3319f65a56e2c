"""Static checks of the container files, without a Docker daemon: the compose file renders, the Dockerfiles pass
hadolint and keep their dependency layer apart from the code, and Prometheus' configuration and alert rules load
in Prometheus 3 and fire when they should. The tools come from `make tools` (docker/static-tools.sh), which
`make test` runs first; the tests that run one are marked ``tools`` (`make test-unit` leaves them out, so it needs
no Go build), and a missing tool fails its test rather than skipping it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
PROMETHEUS = DOCKER / "prometheus"


def _dockerfiles() -> list[Path]:
    """Every Dockerfile of the checkout, without walking hidden folders (.git, a .venv)."""
    found = []
    for root, folders, files in os.walk(REPO):
        folders[:] = [folder for folder in folders if not folder.startswith(".")]
        found += [Path(root) / name for name in files if name.startswith("Dockerfile")]
    return sorted(found)


DOCKERFILES = _dockerfiles()


def static_tool(name: str) -> Path:
    """Where docker/static-tools.sh keeps ``name``: the script owns the versions and the cache folder."""
    path = Path(subprocess.run(["bash", str(DOCKER / "static-tools.sh"), "path", name], check=True,
                               capture_output=True, text=True).stdout.strip())
    if not path.exists():
        pytest.fail(f"{name} is not installed at {path}: run `make tools` (docker/static-tools.sh)")
    return path


def _run(command: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def _passes(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, (f"{' '.join(map(str, result.args))} exited with {result.returncode}:\n"
                                    f"{result.stdout}{result.stderr}")


def _compose_config(env_file: Path) -> subprocess.CompletedProcess:
    """`docker compose config` in a clean environment, so that nothing but ``env_file`` fills the variables."""
    docker = shutil.which("docker")
    if docker is None:
        pytest.fail("the docker CLI is not on PATH (the compose check needs the client only, no daemon)")
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/"),
           "DOCKER_CONFIG": str(static_tool("docker-config"))}
    return _run([docker, "compose", "-f", "docker/docker-compose.yml", "--env-file", str(env_file), "config",
                 "--quiet"], env=env)


@pytest.mark.tools
def test_compose_file_renders_with_the_example_env(tmp_path):
    """env.example leaves only the Fernet key to generate; with it filled in, every variable resolves."""
    env_file = tmp_path / "env"
    env_file.write_text(re.sub(r"(?m)^AIRFLOW_FERNET_KEY=$", "AIRFLOW_FERNET_KEY=a-generated-key",
                               (DOCKER / "env.example").read_text()))
    _passes(_compose_config(env_file))


@pytest.mark.tools
def test_compose_file_names_a_secret_left_empty():
    result = _compose_config(DOCKER / "env.example")
    assert result.returncode != 0 and "set AIRFLOW_FERNET_KEY in docker/.env" in result.stderr, result.stderr


def test_there_are_dockerfiles_to_lint():
    assert DOCKER / "Dockerfile" in DOCKERFILES


@pytest.mark.tools
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: str(path.relative_to(REPO)))
def test_dockerfile_passes_hadolint(dockerfile):
    _passes(_run([str(static_tool("hadolint")), "--no-color", str(dockerfile)]))


def _instructions(dockerfile: Path) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined and comments dropped."""
    lines = [line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")]
    return [step.strip() for step in re.sub(r"\\\n", " ", "\n".join(lines)).splitlines() if step.strip()]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: str(path.relative_to(REPO)))
def test_dockerfile_adds_no_package_index(dockerfile):
    """Indexes are build arguments without a default: pip retries an unreachable index for every package."""
    for step in _instructions(dockerfile):
        assert not re.search(r"PIP_(EXTRA_)?INDEX_URL=|PIP_FIND_LINKS=", step), step
        for command in re.split(r"&&|;|\|\|", step):
            if re.search(r"\bpip3?\b.*\binstall\b", command):
                assert not re.search(r"--(extra-)?index-url|--find-links|\s-[if](\s|$)", command), command


def test_dependencies_install_before_the_code_is_copied():
    """Only the requirements files reach the image before the dependencies install, so that a code change
    rebuilds from the COPY of the code on and never reinstalls torch."""
    steps = _instructions(DOCKER / "Dockerfile")
    install = next(i for i, step in enumerate(steps) if step.startswith("RUN") and "-r requirements.txt" in step)
    for step in steps[:install]:
        if step.split()[0] in ("COPY", "ADD"):
            sources = [word for word in step.split()[1:-1] if not word.startswith("--")]
            assert set(sources) <= {"requirements.txt", "requirements-nodeps.txt"}, step


@pytest.mark.tools
def test_prometheus_config_loads():
    """Prometheus 3's own check of prometheus.yml, which also loads the rule files it names."""
    _passes(_run([str(static_tool("promtool")), "check", "config", "--lint-fatal", str(PROMETHEUS / "prometheus.yml")]))


@pytest.mark.tools
def test_alert_rules_load():
    _passes(_run([str(static_tool("promtool")), "check", "rules", "--lint-fatal", str(PROMETHEUS / "alerts.yml")]))


@pytest.mark.tools
def test_alert_rules_fire_when_they_should():
    _passes(_run([str(static_tool("promtool")), "test", "rules", str(PROMETHEUS / "alerts.test.yml")]))


def test_every_alert_has_a_firing_and_a_quiet_case():
    alerts = {rule["alert"] for group in yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
              for rule in group["rules"] if "alert" in rule}
    cases = [case for test in yaml.safe_load((PROMETHEUS / "alerts.test.yml").read_text())["tests"]
             for case in test.get("alert_rule_test", [])]
    fired = {case["alertname"] for case in cases if case.get("exp_alerts")}
    quiet = {case["alertname"] for case in cases if not case.get("exp_alerts")}
    assert alerts and not alerts - fired, f"no test where these fire: {sorted(alerts - fired)}"
    assert not alerts - quiet, f"no test where these stay quiet: {sorted(alerts - quiet)}"
