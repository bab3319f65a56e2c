"""Airflow 3 on this machine: SQLite metadata, LocalExecutor, the UI and REST API on 127.0.0.1.

The api-server, scheduler, dag-processor and triggerer run as separate processes, all in one process group
of their own, so ``stop`` (or ``cagflow airflow down`` from another shell) ends every
one of them and their task processes together, and an interrupt in the caller's terminal ends none.
Example DAGs are off and DAGs start paused; ``trigger`` unpauses the DAG it runs. Cron schedules are off
unless asked for (``schedules=True``, ``up --schedules``): otherwise unpausing a DAG would also start a run
for its latest cron tick, next to the one asked for.

State lives in the Airflow home (``~/.cache/cagflow/airflow`` unless told otherwise): ``airflow.cfg``
and its generated secrets, the SQLite database, logs, the admin password, and ``cagflow-airflow.json``
naming the running group so a later command can find it.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable

import psutil

from ..config import CACHE_HOME, TracingConfig, load_config
from .background import ServiceError
from .process import HOST, ServerContext, ServerProcess, free_port, log_tail, record_group, running_record

ADMIN_USER = "admin"
COMPONENTS = {
    "api-server": ["api-server", "--host", HOST],
    "scheduler": ["scheduler"],
    "dag-processor": ["dag-processor"],
    "triggerer": ["triggerer"],
}
HEALTH_COMPONENTS = ("metadatabase", "scheduler", "triggerer", "dag_processor")
STATE_FILE = "cagflow-airflow.json"
PASSWORDS_FILE = "simple_auth_manager_passwords.json.generated"
FINISHED_RUN_STATES = ("success", "failed")


class AirflowServiceError(ServiceError):
    """Airflow did not start, stop or answer as expected."""


def default_home() -> Path:
    return CACHE_HOME / "airflow"


def tracing_environment(settings: TracingConfig) -> dict[str, str]:
    """With ``tracing.endpoint`` set, Airflow's own OpenTelemetry traces go there too: a span per DAG run and
    one per task, under which the library's spans of that task nest (README "Tracing")."""
    if not settings.endpoint:
        return {}
    return {"AIRFLOW__TRACES__OTEL_ON": "True", "OTEL_EXPORTER_OTLP_ENDPOINT": settings.endpoint,
            "OTEL_TRACES_EXPORTER": "otlp_proto_http",  # Airflow's default, "otlp", is gRPC
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "cagflow-airflow",
            "OTEL_BSP_SCHEDULE_DELAY": "1000"}  # ms: a finished task's spans leave within a second


class LocalAirflow(ServerContext):
    """One local Airflow deployment rooted at ``home``.

    ``env`` is added to the components' environment (e.g. ``CAGFLOW__*`` settings or ``AIRFLOW_CONN_*``
    connections for the tasks); ``cwd`` is where tasks resolve relative paths such as the corpus manifest.
    """

    def __init__(self, home: str | os.PathLike[str], dags_folder: str | os.PathLike[str] | None = None,
                 port: int | None = None, parallelism: int = 4, schedules: bool = False,
                 env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None):
        self.home = Path(home).expanduser().resolve()
        self.dags_folder = Path(dags_folder).resolve() if dags_folder else None
        self.port = port
        self.parallelism = parallelism
        self.schedules = schedules
        self.extra_env = dict(env or {})
        self.cwd = Path(cwd).resolve() if cwd else Path.cwd()
        self._group = ServerProcess("Airflow", self.log_dir / "launcher.log", AirflowServiceError,
                                    failure_report=lambda: f"see {self.log_dir}\n{self._log_tails()}")
        self._token: str | None = None

    # ---- locations -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self._group.http_url(self.port)

    @property
    def state_file(self) -> Path:
        return self.home / STATE_FILE

    @property
    def log_dir(self) -> Path:
        return self.home / "logs" / "components"

    def environment(self) -> dict[str, str]:
        """Everything the components need, on top of the caller's environment."""
        env = {key: value for key, value in os.environ.items() if not key.startswith("AIRFLOW__")}
        env.update({
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_folder),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": str(self.parallelism),
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{ADMIN_USER}:admin",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            "AIRFLOW__API__HOST": HOST,
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__BASE_URL": self.url,
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "30",
            "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": str(self.schedules),
        })
        env.update(self.extra_env)
        env.update(tracing_environment(load_config(environ=env).tracing))
        return env

    # ---- lifecycle ------------------------------------------------------------------------------

    def _airflow(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "airflow", *args]

    def _prepare(self) -> None:
        """Create the home, the database and the admin password (kept across restarts)."""
        if self.dags_folder is None or not self.dags_folder.is_dir():
            raise AirflowServiceError(f"DAGs folder not found: {self.dags_folder}")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        passwords = self.home / PASSWORDS_FILE
        if not passwords.exists():
            passwords.write_text(json.dumps({ADMIN_USER: secrets.token_urlsafe(12)}))
            passwords.chmod(0o600)
        result = subprocess.run(self._airflow("db", "migrate"), env=self.environment(), cwd=self.cwd,
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise AirflowServiceError(f"airflow db migrate failed:\n{(result.stdout + result.stderr)[-3000:]}")

    def start(self, timeout_s: float = 240.0) -> str:
        """Start the four components and return the UI URL once every one of them reports healthy."""
        running = self.running_state()
        if running is not None:
            raise AirflowServiceError(f"Airflow already runs from {self.home} at {running['url']} "
                                      f"(process group {running['pid']}); stop it first")
        self.port = self.port or free_port()
        self._prepare()
        # One shell starts the components as its background jobs: without job control they share its
        # process group, which is therefore the whole deployment.
        lines = [f"{shlex.join(self._airflow(*args))} >{shlex.quote(str(self.log_dir / name))}.log 2>&1 &"
                 for name, args in COMPONENTS.items()]
        self._group.launch(["/bin/sh", "-c", "\n".join([*lines, "wait"])], cwd=self.cwd, env=self.environment())
        record_group(self.state_file, self.pgid, port=self.port, url=self.url, dags_folder=str(self.dags_folder),
                     started_at=time.time())
        self._group.wait_ready(self._all_healthy, timeout_s, interval_s=1.0,
                               retry_on=(OSError, ValueError, AirflowServiceError))
        return self.url

    @property
    def pgid(self) -> int | None:
        return self._group.pid

    def processes(self) -> list[psutil.Process]:
        """The live processes of the deployment's group (zombies waiting to be reaped do not count)."""
        return self._group.members()

    def detach(self) -> None:
        """Leave Airflow running after this process exits, for ``down`` to stop."""
        self._group.detach()

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``timeout_s``; forget the state."""
        if not self._group.launched:
            running = self.running_state()
            if running is not None:
                self._group.attach(running["pid"])
        survivors = self._group.stop(timeout_s)
        if survivors:
            raise AirflowServiceError(f"processes of the Airflow group survived SIGKILL: {survivors}")
        self.state_file.unlink(missing_ok=True)
        self._token = None

    def running_state(self) -> dict[str, Any] | None:
        """The recorded deployment if its process group is still alive."""
        return running_record(self.state_file)

    @classmethod
    def attach(cls, home: str | os.PathLike[str]) -> "LocalAirflow":
        """The deployment already running from ``home``."""
        airflow = cls(home)
        state = airflow.running_state()
        if state is None:
            raise AirflowServiceError(f"no Airflow is running from {airflow.home} (start it with `up`)")
        airflow.port, airflow.dags_folder = state["port"], Path(state["dags_folder"])
        airflow._group.attach(state["pid"])
        return airflow

    # ---- REST -----------------------------------------------------------------------------------

    def credentials(self) -> tuple[str, str]:
        passwords = json.loads((self.home / PASSWORDS_FILE).read_text())
        return ADMIN_USER, passwords[ADMIN_USER]

    def _http(self, method: str, path: str, body: dict | None = None, token: str | None = None,
              timeout_s: float = 30.0) -> Any:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise AirflowServiceError(f"{method} {path}: HTTP {exc.code}: {detail}") from None

    def token(self) -> str:
        """A JWT for the REST API, from ``POST /auth/token`` with the admin credentials."""
        if self._token is None:
            user, password = self.credentials()
            self._token = self._http("POST", "/auth/token", {"username": user, "password": password})["access_token"]
        return self._token

    def api(self, method: str, path: str, body: dict | None = None) -> Any:
        """An authenticated call to ``/api/v2{path}``."""
        return self._http(method, f"/api/v2{path}", body, self.token())

    def health(self) -> dict[str, str]:
        """Status of each component as the api-server reports it."""
        report = self._http("GET", "/api/v2/monitor/health", timeout_s=5.0)
        return {name: (report.get(name) or {}).get("status", "unknown") for name in HEALTH_COMPONENTS}

    def _all_healthy(self) -> bool:
        """True once every component reports healthy; until then it raises, naming those that do not, so
        that a start that times out says which ones."""
        waiting = {name: status for name, status in self.health().items() if status != "healthy"}
        if waiting:
            raise AirflowServiceError(f"not healthy yet: {waiting}")
        return True

    def _log_tails(self, lines: int = 8) -> str:
        return "\n".join(f"--- {name}\n{log_tail(self.log_dir / f'{name}.log', lines)}" for name in COMPONENTS)

    def wait_for_dag(self, dag_id: str, timeout_s: float = 120.0) -> dict:
        """The DAG's details once the dag-processor has parsed it; import errors fail fast."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.api("GET", f"/dags/{dag_id}")
            except AirflowServiceError as exc:
                if "HTTP 404" not in str(exc):
                    raise
            errors = self.api("GET", "/importErrors").get("import_errors", [])
            if errors:
                raise AirflowServiceError("DAG import errors:\n" + "\n".join(e["stack_trace"] for e in errors))
            if time.monotonic() > deadline:
                raise AirflowServiceError(f"DAG {dag_id} did not appear within {timeout_s:.0f} s")
            time.sleep(1.0)

    def trigger(self, dag_id: str, conf: dict | None = None) -> str:
        """Unpause ``dag_id`` and start a run through ``POST /api/v2/dags/{dag_id}/dagRuns``; return its run id."""
        self.wait_for_dag(dag_id)
        self.api("PATCH", f"/dags/{dag_id}", {"is_paused": False})
        run = self.api("POST", f"/dags/{dag_id}/dagRuns", {"logical_date": None, "conf": conf or {}})
        return run["dag_run_id"]

    def backfill(self, dag_id: str, from_date: str, to_date: str, timeout_s: float = 900.0) -> list[dict]:
        """Run a real backfill (``POST /api/v2/backfills``, one run at a time) over the schedule's dates from
        ``from_date`` to ``to_date`` (ISO, UTC) and wait until it completes; returns its runs."""
        self.wait_for_dag(dag_id)
        self.api("PATCH", f"/dags/{dag_id}", {"is_paused": False})
        backfill = self.api("POST", "/backfills", {"dag_id": dag_id, "from_date": from_date, "to_date": to_date,
                                                   "max_active_runs": 1, "reprocess_behavior": "none"})
        deadline = time.monotonic() + timeout_s
        while not self.api("GET", f"/backfills/{backfill['id']}").get("completed_at"):
            if time.monotonic() > deadline:
                raise AirflowServiceError(f"backfill {backfill['id']} of {dag_id} not complete after {timeout_s:.0f} s")
            time.sleep(2.0)
        runs = self.api("GET", f"/dags/{dag_id}/dagRuns?run_type=backfill&limit=1000")["dag_runs"]
        return sorted((run for run in runs if run["run_type"] == "backfill"
                       and from_date <= run["logical_date"] <= to_date), key=lambda run: run["logical_date"])

    def wait_for_run(self, dag_id: str, run_id: str, timeout_s: float = 900.0,
                     on_change: Callable[[dict, str | None], None] | None = None) -> dict:
        """The finished run with its task instances (``state``, ``duration`` each). ``on_change(task_instance,
        old_state)`` hears every task state change seen while waiting (polled every 2 s), so a person sees
        progress."""
        path = f"/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id, safe='')}"
        deadline = time.monotonic() + timeout_s
        states: dict[tuple[str, int], str | None] = {}
        while True:
            run = self.api("GET", path)
            finished = run["state"] in FINISHED_RUN_STATES
            if finished or on_change is not None:
                run["task_instances"] = self.api("GET", f"{path}/taskInstances?limit=1000")["task_instances"]
            if on_change is not None:
                for ti in run["task_instances"]:
                    key = (ti["task_id"], ti["map_index"])  # a mapped task's label appears once it runs
                    if states.get(key) != ti["state"]:  # not yet scheduled (no state) is not news
                        on_change(ti, states.get(key))
                        states[key] = ti["state"]
            if finished:
                return run
            if time.monotonic() > deadline:
                raise AirflowServiceError(f"run {run_id} of {dag_id} still {run['state']} after {timeout_s:.0f} s")
            time.sleep(2.0)


# ---- command line ----------------------------------------------------------------------------------


def _task_label(ti: dict) -> str:
    """``task_id``, with the mapped item for a mapped task (``precompute[support-faq]``)."""
    return ti["task_id"] + (f"[{ti.get('rendered_map_index') or ti['map_index']}]" if ti["map_index"] >= 0 else "")


def _describe_run(run: dict) -> str:
    lines = [f"run {run['dag_run_id']}: {run['state']} ({run.get('start_date')} -> {run.get('end_date')})"]
    for ti in sorted(run["task_instances"], key=lambda ti: (ti.get("start_date") or "", ti["map_index"])):
        lines.append(f"  {_task_label(ti):<48} {ti['state']:<16} {ti.get('duration') or 0:7.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cagflow airflow", description=__doc__.split("\n")[0])
    parser.add_argument("--home", type=Path, default=default_home(), help="Airflow home (default: %(default)s)")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start Airflow in the background and print its URL and admin login")
    up.add_argument("--dags-folder", type=Path, default=Path("dags"), help="default: ./dags")
    up.add_argument("--port", type=int, help="UI/API port (default: a free one)")
    up.add_argument("--parallelism", type=int, default=4, help="task slots (default: %(default)s)")
    up.add_argument("--schedules", action="store_true", help="run DAGs on their cron schedules once unpaused")
    commands.add_parser("down", help="stop every Airflow process started by `up`")
    commands.add_parser("status", help="print whether Airflow runs and how its components are")
    trigger = commands.add_parser("trigger", help="start a DAG run through the REST API and wait for it")
    trigger.add_argument("dag_id")
    trigger.add_argument("--conf", type=json.loads, default={}, help="run conf as JSON, e.g. '{\"force\": true}'")
    trigger.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            airflow = LocalAirflow(args.home, args.dags_folder, args.port, args.parallelism, args.schedules)
            home = "" if airflow.home == default_home().resolve() else f" --home {shlex.quote(str(airflow.home))}"
            stop_hint = f"stop with: cagflow airflow{home} down"
            running = airflow.running_state()
            if running is not None:
                print(f"Airflow already running at {running['url']} (home {airflow.home}, process group "
                      f"{running['pid']}); {stop_hint}")
                return 0
            started = time.monotonic()
            url = airflow.start()
            airflow.detach()
            user, password = airflow.credentials()
            print(f"Airflow {url} ready in {time.monotonic() - started:.0f} s (home {airflow.home}, "
                  f"process group {airflow.pgid})\nlogin: {user} / {password}\n{stop_hint}", flush=True)
        elif args.command == "down":
            airflow = LocalAirflow(args.home)
            state = airflow.running_state()
            airflow.stop()
            print(f"stopped Airflow at {state['url']}" if state else f"no Airflow was running from {airflow.home}")
        elif args.command == "status":
            airflow = LocalAirflow(args.home)
            if airflow.running_state() is None:
                print(f"stopped (home {airflow.home})")
                return 3
            airflow = LocalAirflow.attach(args.home)
            health = ", ".join(f"{name} {status}" for name, status in airflow.health().items())
            print(f"running at {airflow.url} (process group {airflow.pgid}): {health}")
        else:
            airflow = LocalAirflow.attach(args.home)
            run_id = airflow.trigger(args.dag_id, args.conf)
            print(f"triggered {args.dag_id} run {run_id}; task states as they change:", flush=True)
            started = time.monotonic()

            def show(ti: dict, old: str | None) -> None:
                print(f"  {time.monotonic() - started:6.0f} s  {_task_label(ti):<48} {old or '-'} -> {ti['state']}",
                      flush=True)

            run = airflow.wait_for_run(args.dag_id, run_id, args.timeout, on_change=show)
            print(_describe_run(run))
            return 0 if run["state"] == "success" else 1
    except (AirflowServiceError, OSError, urllib.error.URLError) as exc:
        print(f"airflow {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
