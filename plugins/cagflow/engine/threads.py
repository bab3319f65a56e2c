"""Threads for a block: the configured count, or more when other cores sit idle as the block starts.

Serving runs one thread per request (README "Thread policy"): two OpenMP threads stall when another task
takes the second core. A prefill block or a decode step lasts a fraction of a second, so it can look at the
machine first, and the next one looks again:
Linux's count of runnable tasks (``/proc/loadavg``, the calling thread included) says how many of the cores
this process may use are busy right now. Results do not depend on the thread count, so this changes time only.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

_LOADAVG = Path("/proc/loadavg")


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def idle_cores() -> int:
    """Cores this process may use that no runnable task holds, counting the calling thread's own as idle."""
    try:
        running = int(_LOADAVG.read_text().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return 1
    return max(1, usable_cores() - max(0, running - 1))


@contextmanager
def at_least_threads(wanted: int) -> Iterator[None]:
    """Run the block with ``wanted`` OpenMP threads on the calling thread when that is more than its count."""
    threads = torch.get_num_threads()
    if wanted <= threads:
        yield
        return
    torch.set_num_threads(wanted)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
