"""Time to first token from a snapshot vs from the full prompt, per fixed document of the sample corpus.

Usage: python bench/cache_vs_full.py [--repeats 3] [--store file:///tmp/bench-store]
Writes bench/results/cache-vs-full-<time>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from cagflow.config import load_config
from cagflow.engine.engine import Engine
from cagflow.inference.resident import load_snapshot
from cagflow.offline.precompute import plan_parts, precompute_part
from cagflow.store.backends import open_store
from cagflow.store.manifests import CorpusManifest

QUESTION = "What is this document about, in one sentence?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--store", default="file:///tmp/cagflow-bench-store")
    args = parser.parse_args()
    config = load_config()
    engine = Engine.from_config(config.model)
    store = open_store(args.store, config.cache.s3)
    manifest = CorpusManifest.load(config.corpus.manifest)
    engine.answer("Hello?", max_new_tokens=1)
    rows = []
    for part in plan_parts(engine, manifest):
        snapshot = load_snapshot(store, precompute_part(engine, store, part).entry)
        timings = {"cache": [], "full": [], "question_only": []}
        for _ in range(args.repeats):
            timings["cache"].append(engine.answer(QUESTION, snapshot=snapshot, max_new_tokens=1).ttft_s)
            timings["full"].append(engine.answer(QUESTION, snapshot=snapshot, max_new_tokens=1,
                                                 reuse_cache=False).ttft_s)
            timings["question_only"].append(engine.answer(QUESTION, max_new_tokens=1).ttft_s)
        medians = {name: statistics.median(values) for name, values in timings.items()}
        rows.append({"key": str(snapshot.key), "document_tokens": snapshot.n_tokens,
                     **{f"ttft_{name}_ms": round(value * 1000, 1) for name, value in medians.items()},
                     "full_over_cache": round(medians["full"] / medians["cache"], 1)})
    print(f"{'document':<52} {'tokens':>6} {'full ms':>8} {'cache ms':>9} {'q-only ms':>9} {'full/cache':>10}")
    for row in rows:
        print(f"{row['key']:<52} {row['document_tokens']:>6} {row['ttft_full_ms']:>8.0f} {row['ttft_cache_ms']:>9.0f} "
              f"{row['ttft_question_only_ms']:>9.0f} {row['full_over_cache']:>9.1f}x")
    out = Path(__file__).parent / "results" / f"cache-vs-full-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.write_text(json.dumps({"model": config.model.path, "fingerprint": engine.fingerprint, "repeats": args.repeats,
                               "rows": rows}, indent=2))
    print(f"written {out}")


if __name__ == "__main__":
    main()
