"""The audit log: one JSON line per admin action, done or refused (``cagflow keys`` changes and every
request to ``/admin/*``).

Each line says who (the key's id and name, or the CLI's OS user), what (action, target, result and the
reason of a refusal or error), when (``ts``, UTC) and from where (``remote_addr``). Callers pass key ids
and names only, never a key or its hash. Lines are appended to ``service.audit_log_file`` under an
exclusive lock, so CLI runs, gunicorn workers and several routers can share one file, and are also
written to the ``cagflow.router.audit`` logger (the router's stderr). A file that cannot be written never
fails the action: the logger says so, with the line.
"""

from __future__ import annotations

import fcntl
import getpass
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("cagflow.router.audit")


def local_user() -> str:
    """Who runs the CLI: the login name, or the uid where the account has no name (a container)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


class AuditLog:
    """Audit events to a JSON-lines file and the logger (``path`` None or empty: the logger only)."""

    def __init__(self, path: str | os.PathLike[str] | None, clock=time.time) -> None:
        self.path = Path(path).expanduser() if path else None
        self._clock = clock

    def record(self, action: str, result: str, *, via: str, target: str | None = None, reason: str | None = None,
               key_id: str | None = None, key_name: str | None = None, user: str | None = None,
               remote_addr: str | None = None, request_id: str | None = None, trace_id: str | None = None,
               detail: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write one event; ``result`` is ``ok``, ``denied`` (authentication or role) or ``error``."""
        now = self._clock()
        event = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z",
                 "via": via, "action": action, "target": target, "result": result, "reason": reason,
                 "key_id": key_id, "key_name": key_name, "user": user, "remote_addr": remote_addr,
                 "request_id": request_id, "trace_id": trace_id, "detail": detail}
        line = json.dumps(event)  # ASCII: a name holding a line separator cannot split the line
        log.info(line)
        if self.path is not None:
            try:
                self._append(line + "\n")
            except OSError as exc:
                log.error("cannot write audit log %s (%s); the event: %s", self.path, exc.strerror or exc, line)
        return event

    def _append(self, text: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)  # released by the close
            os.write(descriptor, text.encode("ascii"))
        finally:
            os.close(descriptor)
