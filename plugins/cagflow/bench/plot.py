"""`cagflow bench plot RESULTS...`: time to first token per route against prompt tokens, from the result files
of `cagflow bench answers --dataset` (every answer record there keeps its route, prompt tokens and TTFT).

A prompt token is either computed for this request or reused (a snapshot, a passage state): the x axis is
the whole prompt, so a point low on the right is a long prompt that was mostly reused."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Iterator

from ..config import Config

ROUTE_COLORS = {"cache": "tab:blue", "retrieval": "tab:orange", "auto": "tab:green"}
FILE_MARKERS = "osD^vP*X"


def points(report: dict[str, Any]) -> Iterator[tuple[str, int, float]]:
    """(route, prompt tokens, TTFT seconds) of every answer in a saved dataset report that reached the model."""
    for row in report.get("rows", []):
        for route in ROUTE_COLORS:
            record = row.get(route)
            if not record or record.get("ttft_s") is None or not record.get("tokens", {}).get("prompt"):
                continue
            yield route, int(record["tokens"]["prompt"]), float(record["ttft_s"])


def plot_ttft(reports: dict[str, dict[str, Any]], path: Path) -> Path:
    """One scatter: a colour per route, a marker per result file (both named in the legend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=100)
    for index, (name, report) in enumerate(reports.items()):
        by_route: dict[str, list[tuple[int, float]]] = {}
        for route, tokens, ttft in points(report):
            by_route.setdefault(route, []).append((tokens, ttft))
        for route, xy in sorted(by_route.items()):
            axes.scatter([x for x, _ in xy], [y for _, y in xy], s=18, alpha=0.7, color=ROUTE_COLORS[route],
                         marker=FILE_MARKERS[index % len(FILE_MARKERS)], label=f"{route}: {name} ({len(xy)})")
    axes.set_xlabel("prompt tokens (computed + reused)")
    axes.set_ylabel("time to first token, s")
    axes.set_title("time to first token per route, through the REST API")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def main(config: Config, args: argparse.Namespace) -> int:
    del config  # the plot reads saved results only
    reports = {}
    for name in args.results:
        path = Path(name)
        try:
            reports[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{name}: not a readable result file of `cagflow bench answers --dataset` ({exc})") \
                from None
    if not any(True for report in reports.values() for _ in points(report)):
        raise ValueError("no answer with a route, prompt tokens and a time to first token in these files: "
                         "give result files of `cagflow bench answers --dataset`")
    print(f"saved {plot_ttft(reports, Path(args.out))}")
    return 0
