"""`cagflow bench faults` on its real stack (SeaweedFS, OpenSearch, Triton, the router; the tiny model): the
scenarios that need no long outage hold — a precompute killed mid-write leaves nothing partial and its rerun
completes, flipped snapshot bytes are never served and are found, a full disk publishes nothing — with no
unintended error under load and an intact store afterwards. (The whole suite, with the default model, is
in bench/README.md.)"""

import os

import pytest
from cagflow.bench import faults
from cagflow.bench.faultstack import FaultStack
from cagflow.config import load_config

pytestmark = pytest.mark.integration

SCENARIOS = ("precompute-kill-local", "bit-flip", "disk-full")


def test_fault_scenarios_hold_under_load(tiny_model_dir, corpus_manifest_path, tmp_path, opensearch_url):
    config = load_config(environ={**os.environ, "CAGFLOW__CORPUS__MANIFEST": str(corpus_manifest_path)})
    questions, manifest = faults.sample_questions(config)
    # The session's OpenSearch (the stack's own index): none of these scenarios stops OpenSearch.
    stack = FaultStack(tmp_path, config, str(tiny_model_dir), faults.smallest_fixed(manifest, 3), max_new_tokens=8,
                       max_resident_states=1, opensearch_url=opensearch_url)
    with stack:
        bench = faults.Bench(stack, questions, clients=2)
        results = [faults.run_scenario(bench, name) for name in SCENARIOS]
    for result in results:
        if result.skipped:
            assert os.geteuid() != 0, result.skipped  # only a non-root run may skip mounting a small disk
            continue
        failed = [check for check in result.checks if not check.passed]
        assert not failed, (result.name, failed)
        assert result.load["sent"] > 0 and result.load["unintended"] == 0, (result.name, result.load)
        assert result.integrity["intact"], (result.name, result.integrity)
        assert result.passed
    assert "| bit-flip |" in faults.render(results)
