"""The servers' memory under load (``cagflow bench load``): the resident memory of the router's and Triton's
process groups, sampled in a thread of its own, its growth fitted over the soak and plotted."""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from ..devstack.process import group_members

MEMORY_INTERVAL_S = 5.0
MEMORY_FIELDS = {"rss_mib": "resident", "anon_mib": "not file-backed"}  # per sample, in memory_mib's order


def _processes(pid: int) -> list[psutil.Process]:
    """The process group ``pid`` leads, else ``pid`` and its descendants (a pid given by hand)."""
    members = group_members(pid)
    if members:
        return members
    try:
        leader = psutil.Process(pid)
        return [leader, *leader.children(recursive=True)]
    except psutil.Error:
        return []


def memory_mib(pid: int) -> tuple[float, float] | None:
    """Resident memory summed over the processes (shared pages count once per process), and the part of it
    no file backs (heap, stacks, arenas: what a leak would grow); None when gone. The rest are pages of
    mapped files, such as the embedding model's weights, read in as first used and bounded by the file."""
    total = anonymous = 0
    seen = False
    for process in _processes(pid):
        try:
            info = process.memory_info()
        except psutil.Error:
            continue  # exited while we looked
        total, anonymous, seen = total + info.rss, anonymous + info.rss - info.shared, True
    return (total / 2**20, anonymous / 2**20) if seen else None


class MemorySampler:
    """Resident memory of named process groups every ``interval_s``, in a thread of its own."""

    def __init__(self, pids: dict[str, int], interval_s: float = MEMORY_INTERVAL_S) -> None:
        self.pids = pids
        self.interval_s = interval_s
        self.samples: list[dict[str, Any]] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="memory-sampler", daemon=True)
        self._started_at = 0.0

    def start(self) -> MemorySampler:
        self._started_at = time.monotonic()
        self._thread.start()
        return self

    def elapsed_s(self) -> float:
        return time.monotonic() - self._started_at

    def stop(self) -> list[dict[str, Any]]:
        self._stopping.set()
        self._thread.join()
        return self.samples

    def _sample(self) -> None:
        while True:
            measured = {name: memory_mib(pid) for name, pid in self.pids.items()}
            self.samples.append({"t_s": round(self.elapsed_s(), 1), **{
                field: {name: None if value is None else round(value[column], 2) for name, value in measured.items()}
                for column, field in enumerate(MEMORY_FIELDS)}})
            if self._stopping.wait(self.interval_s):
                return


def memory_growth(samples: list[dict[str, Any]], since_s: float, field: str = "rss_mib") -> dict[str, float | None]:
    """MiB per 10 minutes per process, a least-squares line through the samples from ``since_s`` on."""
    growth: dict[str, float | None] = {}
    names = {name for sample in samples for name in sample[field]}
    for name in sorted(names):
        points = [(s["t_s"], s[field][name]) for s in samples
                  if s["t_s"] >= since_s and s[field].get(name) is not None]
        if len({t for t, _ in points}) < 2:
            growth[name] = None
            continue
        slope, _ = statistics.linear_regression([t for t, _ in points], [mib for _, mib in points])
        growth[name] = round(slope * 600, 2)
    return growth


def plot_memory(samples: list[dict[str, Any]], soak_from_s: float, path: Path) -> Path:
    """Memory (MiB) against minutes, one panel per process on its own scale (a few MiB of growth would be
    invisible next to gigabytes), the soak shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({name for sample in samples for name in sample["rss_mib"]})
    figure, panels = plt.subplots(len(names), 1, sharex=True, squeeze=False, figsize=(8, 1.2 + 2.2 * len(names)),
                                  dpi=100)
    for name, axes in zip(names, panels[:, 0]):
        for (field, label), color in zip(MEMORY_FIELDS.items(), ("tab:blue", "tab:orange")):
            points = [(s["t_s"] / 60, s[field][name]) for s in samples if s[field].get(name) is not None]
            axes.plot([t for t, _ in points], [mib for _, mib in points], color=color, label=label)
        axes.axvspan(soak_from_s / 60, samples[-1]["t_s"] / 60, color="0.92")
        axes.set_ylabel(f"{name}, MiB")
        axes.grid(True, alpha=0.3)
    panels[0, 0].legend(loc="center right", fontsize="small")
    panels[0, 0].set_title("memory (sum over the process group); soak shaded")
    panels[-1, 0].set_xlabel("minutes")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def service_pids(overrides: list[str] | None) -> dict[str, int]:
    """The local router's and Triton's process groups from their ``up`` records; ``NAME=PID`` overrides
    (or adds) one."""
    from ..devstack import router, triton
    from ..devstack.process import running_record

    pids = {}
    for name, module in (("router", router), ("triton", triton)):
        record = running_record(module.DEFAULT_RUN_DIR / module.STATE_FILE)
        if record:
            pids[name] = int(record["pid"])
    for override in overrides or []:
        name, _, pid = override.partition("=")
        if not name or not pid.isdigit():
            raise ValueError(f"--pid {override!r}: write NAME=PID, e.g. --pid router=12345")
        pids[name] = int(pid)
    return pids
