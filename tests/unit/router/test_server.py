"""The router worker's memory setting: request threads share two glibc heaps (arenas) instead of one each."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Threads allocate in their arena (each a 64 MiB-aligned mapping); counted from /proc/self/maps.
COUNT_ARENAS = r"""
import sys, threading
from cagflow.router.server import limit_malloc_arenas
limited = limit_malloc_arenas() if sys.argv[1] == "limit" else None
start = threading.Barrier(8)
def allocate():
    start.wait()
    keep = [bytes(64 * 1024) for _ in range(32)]
    start.wait()
threads = [threading.Thread(target=allocate) for _ in range(8)]
[thread.start() for thread in threads]
[thread.join() for thread in threads]
arenas = 0
for line in open("/proc/self/maps"):
    begin, end = (int(value, 16) for value in line.split()[0].split("-"))
    arenas += begin % (64 << 20) == 0 and end - begin <= 64 << 20 and len(line.split()) == 5
print(limited, arenas)
"""


def arenas(mode: str, **environment: str) -> tuple[str, int]:
    env = {key: value for key, value in os.environ.items() if key != "MALLOC_ARENA_MAX"}
    result = subprocess.run([sys.executable, "-c", COUNT_ARENAS, mode], capture_output=True, text=True, timeout=60,
                            env={**env, **environment}, check=True)
    limited, count = result.stdout.split()
    return limited, int(count)


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                    reason="glibc arenas")
def test_request_threads_share_two_heaps_unless_the_operator_says_otherwise():
    limited, shared = arenas("limit")
    assert limited == "True" and shared <= 2
    _, unlimited = arenas("default")
    assert unlimited > shared
    overridden, count = arenas("limit", MALLOC_ARENA_MAX="4")
    assert overridden == "False" and 2 < count <= 4
