"""Local servers as process groups of their own: launch one, wait until it answers, stop all of it.

A server runs in a new session, so an interrupt in the caller's terminal never reaches it and a signal to
its group reaches every process it started. Its output goes to a console log, whose tail explains a
failed start. A server left running for a later command (``up`` then ``down``) is found again through a
small JSON record naming its group.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import time
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any, Callable, Self, Sequence

import psutil

HOST = "127.0.0.1"
# How long processes that ignored SIGTERM get to disappear after SIGKILL.
_KILL_GRACE_S = 10.0
_POLL_S = 0.2


def hold_port(stack: ExitStack, port: int = 0) -> int:
    """Bind ``port`` (0: any free one) on HOST until ``stack`` closes, so that ports chosen together are
    distinct; OSError when it is taken."""
    probe = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
    if port:
        # Like the servers themselves: a named port whose old connections linger in TIME_WAIT is free, one
        # with a listener is not. (Not for port 0, where it could hand out a port another probe holds.)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    probe.bind((HOST, port))
    return probe.getsockname()[1]


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports of HOST that are free now."""
    with ExitStack() as held:
        return [hold_port(held) for _ in range(count)]


def free_port() -> int:
    return free_ports(1)[0]


def log_tail(path: Path, lines: int = 40) -> str:
    """The end of a log, for an error message."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def group_members(pgid: int) -> list[psutil.Process]:
    """The live processes of group ``pgid``; an exited child not yet reaped (a zombie) is not one."""
    members = []
    for process in psutil.process_iter(["status"]):
        try:
            if os.getpgid(process.pid) == pgid and process.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(process)
        except (ProcessLookupError, psutil.Error):
            continue  # exited while we looked
    return members


def _signal(pgid: int, signum: int, leader_only: bool = False) -> None:
    with suppress(ProcessLookupError, PermissionError):  # gone already, or just now
        if not leader_only:
            os.killpg(pgid, signum)
        elif os.getpgid(pgid) == pgid:  # still the leader, not a recycled pid
            os.kill(pgid, signum)


def _wait_until_gone(pgid: int, timeout_s: float, leader_only: bool = False) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = [member for member in group_members(pgid) if not leader_only or member.pid == pgid]
        if not remaining or time.monotonic() >= deadline:
            return remaining
        time.sleep(_POLL_S)


def stop_group(pgid: int, timeout_s: float, *, leader_first: bool = False) -> list[int]:
    """SIGTERM process group ``pgid`` and wait up to ``timeout_s`` for it to exit, then SIGKILL what is
    left. With ``leader_first`` only the leader gets SIGTERM, for a server that shuts down its children
    itself (and any it leaves behind are killed). Returns the pids that survived even SIGKILL."""
    _signal(pgid, signal.SIGTERM, leader_only=leader_first)
    _wait_until_gone(pgid, timeout_s, leader_only=leader_first)
    if group_members(pgid):
        _signal(pgid, signal.SIGKILL)
    return [survivor.pid for survivor in _wait_until_gone(pgid, _KILL_GRACE_S)]


def record_group(path: Path, pid: int, **details: Any) -> dict[str, Any]:
    """Write what a later command needs to find a detached group: its leader's pid (the group id) and
    ``details``."""
    record = {"pid": pid, **details}
    path.write_text(json.dumps(record, indent=2))
    return record


def read_record(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def running_record(path: Path) -> dict[str, Any] | None:
    """The record at ``path`` while its group still has a live process; a stale one counts as none."""
    record = read_record(path)
    return record if record and group_members(record["pid"]) else None


def stop_recorded(path: Path, timeout_s: float, *, leader_first: bool = False) -> tuple[dict[str, Any] | None, bool]:
    """Stop the group recorded at ``path`` (see ``stop_group``) and forget the record, for a ``down``
    command. Returns the record (None when there was none) and whether its group was still running."""
    record = read_record(path)
    if record is None:
        return None, False
    was_running = bool(group_members(record["pid"]))
    if was_running:
        stop_group(record["pid"], timeout_s, leader_first=leader_first)
    path.unlink(missing_ok=True)
    return record, was_running


class ServerProcess:
    """One server command in a process group of its own, its output appended to ``console_log``.

    Once launched it is stopped when the interpreter exits, unless ``detach`` leaves it to a later command.
    ``error`` is the exception a failed start raises; ``on_stopped`` cleans up what the server leaves behind.
    """

    def __init__(self, name: str, console_log: Path, error: type[Exception], *, leader_first: bool = False,
                 on_stopped: Callable[[], None] | None = None,
                 failure_report: Callable[[], str] | None = None) -> None:
        self.name = name
        self.console_log = console_log
        self.error = error
        self.leader_first = leader_first
        self.on_stopped = on_stopped
        self.failure_report = failure_report or (lambda: f"last lines of {console_log}:\n{log_tail(console_log)}")
        self.pid: int | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def launched(self) -> bool:
        return self.pid is not None

    def http_url(self, port: int | None) -> str:
        """``http://HOST:port``, for a server whose port is chosen when it starts (``error`` until then)."""
        if port is None:
            raise self.error(f"{self.name} has no port until it is started")
        return f"http://{HOST}:{port}"

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def members(self) -> list[psutil.Process]:
        return group_members(self.pid) if self.pid is not None else []

    def launch(self, command: Sequence[str], *, cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
        with open(self.console_log, "ab") as console:
            self._process = subprocess.Popen(list(command), cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                             stdout=console, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self._process.pid
        atexit.register(self.stop)

    def attach(self, pid: int) -> None:
        """Take over a group an earlier process launched and detached, so that ``stop`` ends it."""
        self.pid = pid

    def detach(self) -> None:
        """Leave the server running after this interpreter exits; a later command stops it by its group id."""
        atexit.unregister(self.stop)

    def wait_ready(self, probe: Callable[[], bool], timeout_s: float, interval_s: float,
                   retry_on: tuple[type[Exception], ...] = ()) -> None:
        """Poll ``probe`` until it returns true, taking ``retry_on`` errors for "not yet". If the server exits
        first, time runs out or the wait is interrupted, stop the server and raise: a half-started server is
        never left behind."""
        deadline = time.monotonic() + timeout_s
        last_error: Exception | None = None
        try:
            while time.monotonic() < deadline:
                code = self._process.poll()
                if code is not None:
                    raise self.error(f"{self.name} exited with code {code} while starting; {self.failure_report()}")
                try:
                    if probe():
                        return
                except retry_on as exc:
                    last_error = exc
                time.sleep(interval_s)
            cause = f" (last error: {last_error})" if last_error else ""
            raise self.error(f"{self.name} was not ready within {timeout_s:.0f} s{cause}; {self.failure_report()}")
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = 30.0) -> list[int]:
        """Stop the whole group (see ``stop_group``) and clean up after it; returns the pids that survived."""
        if self.pid is None:
            return []
        survivors = stop_group(self.pid, timeout_s, leader_first=self.leader_first)
        atexit.unregister(self.stop)
        if self._process is not None:
            # Reap the leader. It counts as gone once it is a zombie, which for a multithreaded process can be
            # a moment before its last threads have exited and it can be reaped.
            with suppress(subprocess.TimeoutExpired):
                self._process.wait(_KILL_GRACE_S)
        self.pid = self._process = None
        if self.on_stopped is not None:
            self.on_stopped()
        return survivors


class ServerContext:
    """``with server:`` starts a server (any class with ``start`` and ``stop``) and stops it on the way out."""

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
