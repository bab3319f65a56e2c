"""`cagflow bench engine`'s serving workload on the tiny model: every request is accounted for once, and
a skewed workload is mostly served without recomputing."""

from __future__ import annotations

from cagflow.bench import engine as engine_bench
from cagflow.config import load_config


def test_serving_workload_counts_every_request_once(tiny_engine, corpus_manifest_path):
    part = engine_bench.synthetic_part(tiny_engine, corpus_manifest_path.parent / "fixed", 300)
    report = engine_bench.measure_serving(tiny_engine, tiny_engine.precompute(part), load_config(environ={}), rounds=3)
    assert report["requests"] == 3 * engine_bench.BATCH_SIZES[-1]
    assert report["computed"] + report["merged"] + report["answer-cache"] == report["requests"]
    assert 1 <= report["computed"] <= report["distinct_questions"]  # each question is computed at most once
    assert report["answer-cache"] > 0 and report["merge_rate"] + report["answer_cache_hit_rate"] > 0.5
