"""`cagflow bench answers --precisions` on the tiny model: both precisions answer the same questions from
snapshots, and the report counts what it says it counts. (Through the API: tests/integration/test_router.py.)"""

from __future__ import annotations

import argparse
import json
import shutil

from cagflow.bench import answers
from cagflow.config import load_config
from cagflow.answering.qa import load_qa


def test_answers_bench_compares_both_precisions(tiny_model_dir, corpus_manifest_path, monkeypatch, tmp_path, capsys,
                                                sample_subset):
    monkeypatch.setattr(answers, "MAX_NEW_TOKENS", 4)
    monkeypatch.setattr(answers, "save_report", lambda name, report: (tmp_path / "r.json").write_text(json.dumps(report)))
    documents = ["support-faq", "yunfan-ops-manual"]  # one English, one Chinese: each precision precomputes both
    manifest = sample_subset(tmp_path / "corpus", documents)
    shutil.copyfile(corpus_manifest_path.parent / "qa.jsonl", manifest.parent / "qa.jsonl")
    config = load_config(environ={"CAGFLOW__CORPUS__MANIFEST": str(manifest)})
    assert answers.main(config, argparse.Namespace(model=str(tiny_model_dir), precisions=True)) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    int8, fp32 = report["precisions"]["int8"], report["precisions"]["fp32"]
    assert int8["recipe"].startswith("fastlm") and fp32["recipe"] == "fp32"
    fixed = [item for item in load_qa(manifest.parent / "qa.jsonl")
             if item.in_scope and item.kind != "conflict" and item.doc_id in documents]
    assert int8["questions"] == fp32["questions"] == len(fixed) > 0  # the questions these documents answer
    assert [r["id"] for r in int8["rows"]] == [r["id"] for r in fp32["rows"]]
    for result in (int8, fp32):
        assert result["found"] == sum(r["found"] for r in result["rows"])
        assert all(1 <= len(r["token_ids"]) <= 4 for r in result["rows"])
    assert 0 <= report["identical_answers"] <= len(fixed)
    assert "facts found" in capsys.readouterr().out


def _auto(answer: str, answered: bool, relevance: float | None, reason: str | None = None, model_answer=None) -> dict:
    return {"answer": answer, "answered": answered, "relevance": relevance, "decline_reason": reason,
            "model_answer": model_answer}


def test_relevance_sweep_replays_each_threshold_and_calibrates_on_one_half_only():
    from cagflow.answering.qa import QAItem

    declined = "The documents do not contain the answer."
    items = [QAItem(f"a{n}", "Which port?", "Port 8443.", ("8443",), True, "manual") for n in range(4)]
    items += [QAItem(f"u{n}", "How many on the board?", declined, (), False, None, "unanswerable") for n in range(4)]
    autos = {
        "a0": _auto("Port 8443.", True, 0.9), "a1": _auto(declined, False, 0.35, "not_in_documents", "Port 8443."),
        "a2": _auto("Port 8443.", True, 0.8), "a3": _auto(declined, False, None, "model_declined"),
        "u0": _auto("Five people.", True, 0.6), "u1": _auto(declined, False, 0.2, "not_in_documents", "Seven."),
        "u2": _auto(declined, False, 0.45, "not_in_documents", "Three."), "u3": _auto("Nine.", True, 0.7),
    }
    rows = []
    for item in items:
        auto = autos[item.id]
        auto["correct"] = item.is_correct(auto["answer"], auto["answered"])
        rows.append({"id": item.id, "kind": item.kind, "doc_id": item.doc_id, "in_scope": item.in_scope, "auto": auto})
    sweep = answers.relevance_sweep(rows, {item.id: item for item in items})["en"]
    # halves: a0 a2 u0 u2 calibrate, a1 a3 u1 u3 are held out
    assert sweep["questions"]["calibration"] == {"answerable": 2, "unanswerable": 2}
    assert sweep["calibration"]["0.0"] == {"answerable": 2, "unanswerable": 0}  # never asked: u0, u2 answered
    assert sweep["calibration"]["0.5"] == {"answerable": 2, "unanswerable": 1}  # u2 (0.45) declined
    assert sweep["calibration"]["0.65"] == {"answerable": 2, "unanswerable": 2}
    assert sweep["calibration"]["0.85"] == {"answerable": 1, "unanswerable": 2}  # a2 (0.8) lost
    assert sweep["calibrated"] == 0.65  # keeps both right answers and declines both unanswerable ones, lowest such
    assert sweep["held_out"]["0.3"] == {"answerable": 1, "unanswerable": 1}  # a1 (0.35) stands, u1 (0.2) declined
    assert sweep["held_out"]["0.8"] == {"answerable": 0, "unanswerable": 2}
