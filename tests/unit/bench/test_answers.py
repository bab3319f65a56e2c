"""`cagflow bench answers --precisions` on the tiny model: both precisions answer the same questions from
snapshots, and the report counts what it says it counts. (Through the API: tests/integration/test_router.py.)"""

from __future__ import annotations

import argparse
import json

from cagflow.bench import answers
from cagflow.config import load_config
from cagflow.core.qa import load_qa


def test_answers_bench_compares_both_precisions(tiny_model_dir, corpus_manifest_path, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(answers, "MAX_NEW_TOKENS", 4)
    monkeypatch.setattr(answers, "save_report", lambda name, report: (tmp_path / "r.json").write_text(json.dumps(report)))
    config = load_config(environ={"CAGFLOW__CORPUS__MANIFEST": str(corpus_manifest_path)})
    assert answers.main(config, argparse.Namespace(model=str(tiny_model_dir), precisions=True)) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    int8, fp32 = report["precisions"]["int8"], report["precisions"]["fp32"]
    assert int8["recipe"].startswith("fastlm") and fp32["recipe"] == "fp32"
    fixed = [item for item in load_qa(corpus_manifest_path.parent / "qa.jsonl") if item.in_scope and item.kind != "conflict"]
    assert int8["questions"] == fp32["questions"] == len(fixed)  # the sample questions a fixed document answers
    assert [r["id"] for r in int8["rows"]] == [r["id"] for r in fp32["rows"]]
    for result in (int8, fp32):
        assert result["found"] == sum(r["found"] for r in result["rows"])
        assert all(1 <= len(r["token_ids"]) <= 4 for r in result["rows"])
    assert 0 <= report["identical_answers"] <= len(fixed)
    assert "facts found" in capsys.readouterr().out
