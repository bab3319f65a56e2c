"""File helpers every layer may use: a lock that lets one process at a time prepare a file, and the atomic
0600 writer for secrets (API keys, TLS keys)."""

from __future__ import annotations

import fcntl
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def prepare_lock(target: Path) -> Iterator[None]:
    """Hold the lock that lets one process at a time prepare ``target`` (an exclusive ``flock``; the
    kernel releases it when a holder dies, so a crashed preparer never blocks the next one)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(f".{target.name}.lock"), "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[cagflow] another process is preparing {target.name}; waiting for it...", file=sys.stderr,
                  flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_private_file(path: Path, text: str) -> None:
    """Replace ``path`` atomically with a 0600 file holding ``text`` (the parent is created 0700)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, 0o600)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
