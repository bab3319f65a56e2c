"""Run a local service in the background for `cagflow <service> up|down|status`.

``up`` launches ``python -m cagflow.services.<name> run ... --ready-file F`` in a new session (so it
outlives the command and can be stopped as a group), waits until the service writes its URL to ``F``,
and records pid, URL and log path under ``~/.cache/cagflow/run/``. ``down`` stops the whole group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from ..config import CACHE_HOME

RUN_DIR = CACHE_HOME / "run"


class ServiceError(RuntimeError):
    """A background service that did not start, or cannot be stopped."""


@dataclass(frozen=True)
class ServiceState:
    name: str
    pid: int
    url: str
    log: str
    started_at: float


def _state_file(name: str) -> Path:
    return RUN_DIR / f"{name}.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def status(name: str) -> ServiceState | None:
    """The running service's state, or None (a stale record of a dead process is removed)."""
    path = _state_file(name)
    try:
        state = ServiceState(**json.loads(path.read_text()))
    except (FileNotFoundError, ValueError, TypeError):
        return None
    if _alive(state.pid):
        return state
    path.unlink(missing_ok=True)
    return None


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def up(name: str, run_args: list[str], ready_timeout_s: float = 180.0) -> ServiceState:
    """Start ``cagflow.services.<name> run <run_args>`` detached; return once it reports ready."""
    running = status(name)
    if running is not None:
        return running
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    log = RUN_DIR / f"{name}.log"
    ready = RUN_DIR / f"{name}.ready"
    ready.unlink(missing_ok=True)
    command = [sys.executable, "-m", f"cagflow.services.{name}", "run", *run_args, "--ready-file", str(ready)]
    with open(log, "ab") as output:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if ready.exists() and ready.read_text().strip():
            state = ServiceState(name, process.pid, ready.read_text().strip(), str(log), time.time())
            _state_file(name).write_text(json.dumps(asdict(state)))
            return state
        if process.poll() is not None:
            raise ServiceError(f"{name} exited with status {process.returncode} before it was ready; "
                               f"last lines of {log}:\n{_tail(log)}")
        time.sleep(0.3)
    _stop_group(process.pid)
    raise ServiceError(f"{name} was not ready within {ready_timeout_s:.0f} s; last lines of {log}:\n{_tail(log)}")


def _stop_group(pid: int, timeout_s: float = 30.0) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def down(name: str) -> bool:
    """Stop the service and everything it started; False when it was not running."""
    state = status(name)
    if state is None:
        return False
    _stop_group(state.pid)
    _state_file(name).unlink(missing_ok=True)
    return True


def serve_until_stopped(url: str, ready_file: Path | None, is_running: Callable[[], bool]) -> None:
    """The tail of every ``run`` command: announce the URL, then wait for SIGTERM/SIGINT or the service's end."""
    print(url, flush=True)
    stop_requested = False

    def request_stop(*_: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    if ready_file is not None:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(url)
        tmp.replace(ready_file)
    while not stop_requested and is_running():
        time.sleep(0.5)
