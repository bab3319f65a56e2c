"""Run a local service in the background for `cagflow <service> up|down|status`.

``up`` launches ``python -m cagflow.devstack.<name> run ... --ready-file F`` as a process group of its own
(so it outlives the command and can be stopped as a whole), waits until the service writes its URL to
``F``, and records pid, URL and log path under ``~/.cache/cagflow/run/``. ``down`` stops the whole group.
"""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..config import CACHE_HOME
from ..errors import CagflowError
from .process import ServerProcess, record_group, running_record, stop_group

RUN_DIR = CACHE_HOME / "run"
# Longer than a service's own stop, so that it finishes stopping what it started before it is killed.
_STOP_TIMEOUT_S = 60.0


class ServiceError(CagflowError, RuntimeError):
    """A background service that did not start, or cannot be stopped."""

    code = "service_failed"


@dataclass(frozen=True)
class ServiceState:
    name: str
    pid: int
    url: str
    log: str
    started_at: float


def _state_file(name: str) -> Path:
    return RUN_DIR / f"{name}.json"


def status(name: str) -> ServiceState | None:
    """The running service's state, or None."""
    record = running_record(_state_file(name))
    return ServiceState(**record) if record else None


def up(name: str, run_args: list[str], ready_timeout_s: float = 180.0) -> ServiceState:
    """Start ``cagflow.devstack.<name> run <run_args>`` detached; return once it reports ready."""
    running = status(name)
    if running is not None:
        return running
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    log = RUN_DIR / f"{name}.log"
    ready = RUN_DIR / f"{name}.ready"
    ready.unlink(missing_ok=True)
    service = ServerProcess(name, log, ServiceError)
    service.launch([sys.executable, "-m", f"cagflow.devstack.{name}", "run", *run_args, "--ready-file", str(ready)])
    service.wait_ready(lambda: bool(ready.read_text().strip()), ready_timeout_s, interval_s=0.3,
                       retry_on=(FileNotFoundError,))
    service.detach()
    record = record_group(_state_file(name), service.pid, name=name, url=ready.read_text().strip(), log=str(log),
                          started_at=time.time())
    return ServiceState(**record)


def down(name: str) -> bool:
    """Stop the service and everything it started; False when it was not running."""
    state = status(name)
    if state is None:
        return False
    stop_group(state.pid, _STOP_TIMEOUT_S)
    _state_file(name).unlink(missing_ok=True)
    return True


def serve_until_stopped(announcement: str, ready_file: Path | None, is_running: Callable[[], bool]) -> None:
    """The tail of every ``run`` command: print ``announcement`` (and write it to ``ready_file``), then wait
    for SIGTERM/SIGINT or the service's end."""
    print(announcement, flush=True)
    stop_requested = False

    def request_stop(*_: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    if ready_file is not None:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(announcement)
        tmp.replace(ready_file)
    while not stop_requested and is_running():
        time.sleep(0.5)
