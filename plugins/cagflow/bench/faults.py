"""`cagflow bench faults`: faults injected into a real local stack while requests are in flight.

Each scenario runs with a small load generator asking the sample questions through the router, and
reports what the clients saw — requests sent, answered, intended errors (429/503 with a JSON body),
unintended ones (any other error, a reset, a hang) and p95 — the checks of what the scenario must show,
and the snapshot store's integrity afterwards (every object re-hashed against the active release).

The stack (`faultstack.FaultStack`) is SeaweedFS, OpenSearch, Triton and the router on 127.0.0.1 with a
release of a few fixed documents made by `cagflow precompute`; Triton keeps one snapshot resident, so that
"resident" and "not resident" are both there to break. Everything runs in a temporary folder and stops by
itself. A benchmark: it reports, it never asserts on time; the exit code says whether every scenario held.
The scenarios are in ``fault_scenarios``, what each runs with (load, checks) in ``fault_harness``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

from ..config import Config
from ..store.manifests import CorpusManifest
from .fault_harness import Bench, ScenarioResult
from .fault_scenarios import SCENARIOS
from .faultstack import FaultStack, check_integrity
from .report import save_report

MAX_NEW_TOKENS = 24
LOAD_CLIENTS = 4  # two cores: more clients only queue behind the model


def sample_questions(config: Config) -> tuple[list[dict], CorpusManifest]:
    manifest = CorpusManifest.load(config.corpus.manifest)
    tiers = {entry.doc_id: entry.tier for entry in manifest.documents}
    rows = [json.loads(line) for line in (Path(config.corpus.manifest).parent / "qa.jsonl").read_text().splitlines()
            if line.strip()]
    return [{**row, "tier": tiers.get(row.get("doc_id", ""))} for row in rows if row.get("doc_id") in tiers], manifest


def smallest_fixed(manifest: CorpusManifest, count: int) -> list[str]:
    fixed = [entry for entry in manifest.tier("fixed") if not entry.doc_id.startswith("zh-")]
    return [entry.doc_id for entry in sorted(fixed, key=lambda entry: manifest.file(entry).stat().st_size)[:count]]


def run_scenario(bench: Bench, name: str) -> ScenarioResult:
    what, scenario = SCENARIOS[name]
    bench.result = result = ScenarioResult(name, what)
    bench.stack.say(f"\n== {name}: {what}")
    started = time.perf_counter()
    try:
        scenario(bench)
    except Exception as exc:  # a scenario that breaks is a failed check, and the next one still runs
        bench.check("scenario ran to its end", False, f"{type(exc).__name__}: {exc}")
    result.seconds = time.perf_counter() - started
    result.integrity = check_integrity(bench.stack.store()).to_dict()
    return result


def render(results: list[ScenarioResult]) -> str:
    lines = ["| scenario | sent | answered | intended errors | unintended errors | p95 s | checks | store |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    for result in results:
        load = result.load
        checks = f"{sum(c.passed for c in result.checks)}/{len(result.checks)}" if not result.skipped else \
            f"skipped: {result.skipped}"
        store = f"{result.integrity.get('verified', 0)}/{result.integrity.get('objects', 0)} verified" \
            if result.integrity.get("intact") else "NOT INTACT"
        p95 = load.get("p95_s")
        lines.append(f"| {result.name} | {load.get('sent', 0)} | {load.get('answered', 0)} | "
                     f"{load.get('intended', 0)} | {load.get('unintended', 0)} | "
                     f"{'-' if p95 is None else f'{p95:.1f}'} | {checks} | {store} |")
    return "\n".join(lines)


def main(config: Config, args: argparse.Namespace) -> int:
    names = args.scenario or list(SCENARIOS)
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        print(f"cagflow bench faults: unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}",
              file=sys.stderr)
        return 2
    questions, manifest = sample_questions(config)
    doc_ids = args.fault_doc_id or smallest_fixed(manifest, 3)
    if len(doc_ids) != 3:
        print("cagflow bench faults: give three fixed documents (--fault-doc-id, three times)", file=sys.stderr)
        return 2
    model = args.model or config.model.path
    clients = args.clients or LOAD_CLIENTS
    logging.getLogger("opensearch").setLevel(logging.WARNING)  # one line per request otherwise
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cagflow-faults-") as work:
        stack = FaultStack(Path(work), config, model, doc_ids, args.max_new_tokens or MAX_NEW_TOKENS,
                           max_resident_states=1, say=lambda line: print(line, flush=True))
        with stack:
            setup_s = time.perf_counter() - started
            bench = Bench(stack, questions, clients)
            results = [run_scenario(bench, name) for name in names]
    report = {"model": model, "documents": doc_ids, "clients": clients, "setup_s": round(setup_s, 1),
              "wall_s": round(time.perf_counter() - started, 1), "scenarios": [r.to_dict() for r in results]}
    print("\n" + render(results))
    print(f"\nset-up {setup_s:.0f} s, all {report['wall_s']:.0f} s ({model}, {clients} clients)")
    saved = save_report("faults", report)
    if saved:
        print(f"report: {saved}")
    return 0 if all(result.passed for result in results) else 1
