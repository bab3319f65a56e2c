"""The dataset format of `cagflow bench answers --dataset`: loading, the split by document, clear errors, the
corpus the stack serves with it, and the verdicts on answers as the API records them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from cagflow.bench import dataset_answers
from cagflow.bench.datasets import DatasetError, load_dataset, merged_manifest
from cagflow.store.manifests import CorpusManifest

DOCS = ("alpha", "beta", "gamma")


def _write(root: Path, questions: list[dict], docs=DOCS) -> Path:
    (root / "documents").mkdir(parents=True, exist_ok=True)
    for doc_id in docs:
        (root / "documents" / f"{doc_id}.md").write_text(f"# {doc_id.title()}\n\nThe {doc_id} fact is 42.\n")
    manifest = {"documents": [{"doc_id": doc_id, "version": "1", "tier": "fixed", "title": doc_id.title(),
                               "path": f"documents/{doc_id}.md"} for doc_id in docs]}
    (root / "manifest.yaml").write_text(yaml.safe_dump(manifest))
    (root / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    return root


def _q(id: str, doc_id: str | None, kind: str = "answerable", **extra) -> dict:
    return {"id": id, "question": f"What is {id}?", "answers": ["42"] if doc_id else [], "doc_id": doc_id,
            "kind": kind, **extra}


def test_questions_are_split_by_document_never_by_question(tmp_path):
    root = _write(tmp_path / "set", [_q("1", "beta"), _q("2", "alpha"), _q("3", "gamma"), _q("4", "alpha"),
                                     _q("5", None, "near_miss", article="beta"), _q("6", None, "unrelated"),
                                     _q("7", None, "unrelated"), _q("8", "gamma", split="calibration")])
    dataset = load_dataset(str(root))
    split = {question.id: question.split for question in dataset.questions}
    # sorted documents alternate: alpha calibration, beta report, gamma calibration
    assert split == {"1": "report", "2": "calibration", "3": "calibration", "4": "calibration", "5": "report",
                     "6": "report", "7": "calibration", "8": "calibration"}
    assert dataset.doc_ids == list(DOCS) and dataset.name == "set"
    assert {q.language for q in dataset.questions} == {"en"}
    assert [q.answerable for q in dataset.questions][:5] == [True, True, True, True, False]


@pytest.mark.parametrize(("question", "message"), [
    ({"id": "1", "question": "?", "answers": []}, "missing doc_id, kind"),
    (_q("1", "alpha", kind="fact"), "kind must be one of answerable, near_miss, unrelated"),
    (_q("1", "delta"), "doc_id 'delta' is not a document of the manifest"),
    (_q("1", None, "near_miss", article="delta"), "article 'delta' is not a document"),
    (_q("1", "alpha", "near_miss"), "any other kind has doc_id null"),
    ({**_q("1", "alpha"), "answers": []}, "needs at least one gold answer"),
    ({**_q("1", "alpha"), "answers": "42"}, "answers must be a list of strings"),
    (_q("1", "alpha", split="test"), "split must be one of calibration, report"),
])
def test_a_malformed_question_is_named_with_its_line(tmp_path, question, message):
    root = _write(tmp_path / "set", [_q("0", "alpha"), question])
    with pytest.raises(DatasetError, match=message) as caught:
        load_dataset(str(root))
    assert "questions.jsonl:2" in str(caught.value)


def test_unknown_dataset_names_the_shipped_ones_and_duplicates_are_refused(tmp_path):
    _write(tmp_path / "shipped" / "mine", [_q("1", "alpha")])
    with pytest.raises(DatasetError, match="not one of mine in"):
        load_dataset("nope", datasets_dir=tmp_path / "shipped")
    assert load_dataset("mine", datasets_dir=tmp_path / "shipped").name == "mine"
    _write(tmp_path / "dup", [_q("1", "alpha"), _q("1", "beta")])
    with pytest.raises(DatasetError, match="duplicate id '1'"):
        load_dataset(str(tmp_path / "dup"))
    (tmp_path / "bad").mkdir()
    with pytest.raises(DatasetError, match="manifest not found"):
        load_dataset(str(tmp_path / "bad"))


def test_the_merged_manifest_serves_the_corpus_and_the_dataset(tmp_path, corpus_manifest_path):
    dataset = load_dataset(str(_write(tmp_path / "set", [_q("1", "alpha")])))
    merged = CorpusManifest.load(merged_manifest(corpus_manifest_path, dataset, tmp_path / "out" / "m.yaml"))
    base = CorpusManifest.load(corpus_manifest_path)
    assert [e.doc_id for e in merged.documents] == [e.doc_id for e in base.documents] + list(DOCS)
    for entry in merged.documents:
        assert merged.file(entry).is_file()
    assert merged.documents[0].published == base.documents[0].published
    clash = load_dataset(str(_write(tmp_path / "clash", [_q("1", "support-faq")], docs=("support-faq",))))
    with pytest.raises(DatasetError, match="doc_ids already in .*: support-faq"):
        merged_manifest(corpus_manifest_path, clash, tmp_path / "out" / "c.yaml")


class _Api:
    """Answers as the API records them: what each route said for each question."""

    def __init__(self, replies: dict):
        self.replies, self.asked = replies, []

    def query(self, question, max_new_tokens=None, doc_id=None, route="auto"):
        self.asked.append((question, route, doc_id))
        return self.replies[(question, route)]


def _record(answer: str, answered: bool, route: str, doc_id: str | None = None, reason=None) -> dict:
    return {"answer": answer, "answered": answered, "route": route, "decline_reason": reason,
            "snapshot": {"doc_id": doc_id} if doc_id else None, "citations": [], "suggestions": [],
            "timings_ms": {"ttft": 500.0}, "answer_source": "computed"}


def test_verdicts_come_from_the_record_not_from_the_words(tmp_path):
    root = _write(tmp_path / "set", [_q("1", "alpha"), _q("2", None, "near_miss", article="alpha"),
                                     _q("3", None, "unrelated")])
    dataset = load_dataset(str(root))
    texts = {doc_id: f"The {doc_id} fact is 42." for doc_id in DOCS}
    api = _Api({
        ("What is 1?", "cache"): _record("It is 42.", True, "cache", "alpha"),
        ("What is 1?", "retrieval"): _record("The documents do not say.", True, "retrieval"),  # words decline
        ("What is 1?", "auto"): _record("It is 42, since 1999.", True, "cache", "beta"),
        ("What is 2?", "cache"): _record("It is 43.", True, "cache", "alpha"),
        ("What is 2?", "retrieval"): _record("No.", False, "retrieval", reason="not_in_documents"),
        ("What is 2?", "auto"): _record("It is 42.", False, "cache", "alpha", reason="model"),
        ("What is 3?", "auto"): _record("Maybe 7.", True, "retrieval"),
    })
    rows = dataset_answers.ask_dataset(api, list(dataset.questions), texts, dataset_answers.ROUTES)
    assert [(q, r) for q, r, _ in api.asked][:3] == [("What is 1?", "cache"), ("What is 1?", "retrieval"),
                                                     ("What is 1?", "auto")]
    assert ("What is 1?", "cache", "alpha") in api.asked
    assert "cache" not in rows[2] and "retrieval" not in rows[2]  # an unrelated question has no document
    first, near, unrelated = rows
    assert first["cache"]["right"] and first["cache"]["exact"] is False and first["cache"]["f1"] == 0.5
    assert first["retrieval"]["right"] is False and first["retrieval"]["answered"] is True
    assert first["auto"]["right"] and first["auto"]["unsupported"] == ["1999"]
    assert near["cache"]["right"] is False and near["retrieval"]["right"] and near["auto"]["right"]
    assert near["cache"]["unsupported"] == ["43"]
    assert unrelated["auto"]["right"] is False and unrelated["auto"]["unsupported"] == ["7"]

    summary = dataset_answers.summarise(rows)
    answerable = summary["table"]["en answerable"]
    assert (answerable["cache"]["right"], answerable["retrieval"]["right"], answerable["auto"]["right"]) == (1, 0, 1)
    assert answerable["auto"]["unsupported"] == 1 and answerable["auto"]["p50_ttft_s"] == 0.5
    assert summary["table"]["en near_miss"]["auto"]["decline_reasons"] == {"model": 1}
    # question 1 is right on cache and auto, question 2 declined on retrieval and auto: each right on some route
    assert answerable["some route"] == {"asked": 1, "routes": ["auto", "cache", "retrieval"], "right": 1}
    assert summary["table"]["en near_miss"]["some route"]["right"] == 1
    assert "some route" not in summary["table"]["en unrelated"]  # asked on auto alone
    assert summary["table"]["en unrelated"]["auto"]["share"] == 0.0
    assert summary["wrong_document_cache_routes"] == ["1"]  # answered from beta's snapshot


def test_an_api_error_is_a_wrong_answer_not_a_crash(tmp_path):
    from cagflow.client.api_client import ApiError

    class Failing:
        def query(self, *args, **kwargs):
            raise ApiError(503, "triton_unavailable", "down")

    dataset = load_dataset(str(_write(tmp_path / "set", [_q("1", "alpha")])))
    rows = dataset_answers.ask_dataset(Failing(), list(dataset.questions), {}, ("auto",))
    assert rows[0]["auto"]["right"] is False and rows[0]["auto"]["error"] == "triton_unavailable: down"
    assert dataset_answers.summarise(rows)["table"]["en answerable"]["auto"]["errors"] == 1


def test_the_ablation_scores_what_each_rule_did_from_the_rules_that_fired(tmp_path):
    root = _write(tmp_path / "set", [_q("1", "alpha"), _q("2", "beta"), _q("3", None, "near_miss", article="alpha"),
                                     _q("4", "gamma"), _q("5", None, "unrelated")])
    dataset = load_dataset(str(root))
    questions = {question.id: question for question in dataset.questions}

    def asked(answered, right, reason=None, fired=(), model_answer=None):
        return {"auto": {"answered": answered, "right": right, "decline_reason": reason, "rules_fired": list(fired),
                         "model_answer": model_answer}}

    rule = "off_topic_figures"
    rows = [{"id": "1", **asked(False, False, rule, [rule], "It is 42.")},  # a right answer lost
            {"id": "2", **asked(False, False, rule, ["unsupported_figures", rule], "It is 42.")},  # not alone
            {"id": "3", **asked(False, True, rule, [rule], "It is 7.")},  # an unanswerable one caught
            {"id": "4", **asked(True, True, None, ["reask_relevant_decline"])},  # a re-ask won a right answer
            {"id": "5", **asked(False, True, "no_relevant_passage", ["no_relevant_passage"])}]
    table = dataset_answers.ablation(rows, questions)
    assert table[rule] == {"acts": "decline", "fired": 3, "decided": 2, "right_lost": 1, "unanswerable_caught": 1,
                           "net": 0}
    assert table["reask_relevant_decline"] == {"acts": "reask", "fired": 1, "right_won": 1, "net": 1}
    assert table["no_relevant_passage"]["unanswerable_caught"] == 1 and table["no_relevant_passage"]["net"] == 1
    assert table["question_name_absent"] == {"acts": "decline", "net": 0}


def test_route_timing_is_what_a_user_waits_on_computed_answers():
    def asked(seconds, generated, ttft_s=0.5, **extra):
        return {"seconds": seconds, "ttft_s": ttft_s, "tokens": {"generated": generated},
                "timings_ms": {"ttft": ttft_s * 1000, "generate": ttft_s * 1000 + 100.0 * (generated - 1)}, **extra}

    answers = [asked(2.0, 11), asked(3.0, 21, ttft_s=0.7), asked(9.0, 61), asked(0.01, 11, computed=False),
               {"error": "rate_limited: slow down", "seconds": 0.01, "answered": False}]
    timing = dataset_answers.route_timing(answers)
    assert timing["computed"] == 3 and timing["short_answers"] == 2  # the answer cache and the error left out
    assert timing["ttft_s"] == {"p50": 0.5, "p95": 0.7} and timing["total_s"] == {"p50": 3.0, "p95": 9.0}
    assert timing["short_total_p50_s"] == 2.5 and timing["decode_ms_per_token_p50"] == 100.0
    assert dataset_answers.route_timing(answers[3:]) is None


def test_the_answer_check_is_replayed_at_each_threshold_from_one_runs_records(tmp_path, capsys):
    root = _write(tmp_path / "set", [_q("1", "alpha", split="calibration"),
                                     _q("2", None, "near_miss", article="alpha", split="calibration"),
                                     _q("3", "alpha", split="calibration"), _q("4", "beta", split="report"),
                                     _q("5", None, "near_miss", article="beta", split="report")])
    questions = {question.id: question for question in load_dataset(str(root)).questions}

    def row(id, split, answered, relevance, text, reason=None):
        return {"id": id, "language": "en", "split": split,
                "cache": {"answered": answered, "relevance": relevance, "decline_reason": reason,
                          "answer": text if answered else "The documents do not contain the answer.",
                          "model_answer": None if answered else text}}

    rows = [row("1", "calibration", True, 0.8, "It is 42."),
            row("2", "calibration", True, 0.4, "It is 7."),  # a near-miss question answered
            row("3", "calibration", False, 0.3, "It is 9.", "not_in_documents"),  # a wrong answer the check stopped
            row("4", "report", True, 0.9, "It is 42."),
            row("5", "report", False, None, "", "model_declined")]  # the model's own decline stands
    sweep = dataset_answers.check_sweep(rows, questions, "cache")["en"]
    calibration, report = sweep["calibration"], sweep["report"]
    assert calibration["0.0"] == {"answerable_right": 1, "unanswerable_declined": 0, "wrong_shown": 2}
    assert calibration["0.4"] == {"answerable_right": 1, "unanswerable_declined": 0, "wrong_shown": 1}
    assert calibration["0.45"] == {"answerable_right": 1, "unanswerable_declined": 1, "wrong_shown": 0}
    assert calibration["0.85"] == {"answerable_right": 0, "unanswerable_declined": 1, "wrong_shown": 0}
    assert sweep["calibrated"] == 0.45  # the most right answers and declines there, the lowest of equals
    assert report["0.85"] == {"answerable_right": 1, "unanswerable_declined": 1, "wrong_shown": 0}
    assert report["0.95"] == {"answerable_right": 0, "unanswerable_declined": 1, "wrong_shown": 0}
    dataset_answers.print_check_sweep("cache", {"en": sweep})
    printed = capsys.readouterr().out
    assert "answer check, en, cache route" in printed and "(calibrated: 0.45)" in printed
    assert "      0.45           1 /   1 /   0           1 /   1 /   0" in printed

    rows[0]["cache"]["relevance"] = None  # the check was off: nothing to replay
    assert dataset_answers.check_sweep(rows, questions, "cache") == {}
