"""The pieces of the cache+retrieval route that need no server: newer passages cut to the sentences
closest to the question, manifest dates, and conflict questions scored on the newer fact."""

from __future__ import annotations

import numpy as np
import pytest
from cagflow.answering.qa import QAItem
from cagflow.router.excerpts import excerpts
from cagflow.documents.text import word_count
from cagflow.search.retrieval import SearchHit
from cagflow.store.manifests import CorpusManifest, ManifestError

WORDS = ("enrollment", "rollback", "mqtt", "folders")


def bag_of_words(texts):
    """A stand-in embedder: one axis per topic word, unit rows."""
    rows = np.array([[text.lower().count(word) for word in WORDS] for text in texts], dtype=np.float32) + 1e-3
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def hit(chunk_id: str, text: str) -> SearchHit:
    return SearchHit(chunk_id, "skerry-5-4-0-release-notes", text, "variable", "1.0.0", "Skerry 5.4.0 Release Notes",
                     "Changed behaviour", 0.9, "2025-03-10")


NOTES = hit("n:0", "Enrollment codes now expire after 24 hours instead of 60 minutes. Codes remain single-use "
                   "for enrollment. Sources can now be grouped into folders. After an upgrade a gateway has 15 "
                   "minutes for its rollback checks.")
MQTT = hit("n:1", "The default MQTT rate limit is now 100 messages per second. Messages above the mqtt limit are "
                  "dropped.")


def test_each_passage_keeps_its_sentences_closest_to_the_question_in_reading_order():
    question = bag_of_words(["enrollment enrollment"])[0]
    cut = excerpts([NOTES, MQTT], question, bag_of_words, max_words=30)
    assert [h.chunk_id for h in cut] == ["n:0", "n:1"]  # every passage keeps at least its best sentence
    assert cut[0].text == "Enrollment codes now expire after 24 hours instead of 60 minutes."
    # "Codes remain single-use for enrollment." is short: joined to the next sentence, it scores lower
    assert cut[1].text == ("The default MQTT rate limit is now 100 messages per second. Messages above the mqtt "
                           "limit are dropped.")
    assert sum(len(h.text.split()) for h in cut) == 29  # any further sentence would pass the 30 words
    assert cut[0].published == "2025-03-10" and cut[0].title == NOTES.title  # only the text is cut


def test_chinese_passages_are_cut_by_sentences_and_counted_in_words_of_two_characters():
    notes = hit("n:3", "控制台空闲超时由 20 分钟改为 15 分钟。本地缓冲时长由 72 小时改为 96 小时。修复了若干已知问题，提升了稳定性。")
    question = np.array([1.0, 0.0])

    def by_topic(texts):  # a stand-in embedder: the first axis is "timeout"
        rows = np.array([[("超时" in text) * 1.0, 0.5] for text in texts], dtype=np.float32)
        return rows / np.linalg.norm(rows, axis=1, keepdims=True)

    cut = excerpts([notes], question, by_topic, max_words=12)
    assert cut[0].text == "控制台空闲超时由 20 分钟改为 15 分钟。"  # 9 words; the next sentence would pass 12
    assert word_count("控制台空闲超时由 20 分钟改为 15 分钟。") == 9 and word_count("Ports 8443 and 8883.") == 4


def test_markup_a_bold_lead_in_and_explaining_clauses_go():
    notes = hit("n:2", "- **Longer-lived enrollment codes.** Enrollment codes now expire after 24 hours instead of 60 "
                       "minutes, so a code can be handed over the day before.\n- **Folders.** Sources can be grouped.")
    cut = excerpts([notes], bag_of_words(["enrollment"])[0], bag_of_words, max_words=5)
    assert cut[0].text == "Enrollment codes now expire after 24 hours instead of 60 minutes."


def test_a_sentence_far_from_the_question_does_not_fill_the_budget():
    question = bag_of_words(["enrollment"])[0]
    assert excerpts([NOTES], question, bag_of_words, max_words=40)[0].text == NOTES.text  # room for everything
    assert excerpts([NOTES], question, bag_of_words, max_words=40, min_similarity=0.9)[0].text == \
        "Enrollment codes now expire after 24 hours instead of 60 minutes."


def test_a_generous_budget_keeps_whole_passages():
    question = bag_of_words(["rollback"])[0]
    assert excerpts([NOTES], question, bag_of_words, max_words=500)[0].text == NOTES.text


def test_manifest_dates_are_iso_dates(tmp_path):
    (tmp_path / "a.md").write_text("# A\n\nText.\n")
    good = tmp_path / "good.yaml"
    good.write_text("documents:\n  - {doc_id: a, version: '1', tier: fixed, title: A, path: a.md, published: 2025-03-01}\n"
                    "  - {doc_id: b, version: '1', tier: fixed, title: B, path: a.md}\n")
    assert [entry.published for entry in CorpusManifest.load(good).documents] == ["2025-03-01", ""]
    bad = tmp_path / "bad.yaml"
    bad.write_text("documents:\n  - {doc_id: a, version: '1', tier: fixed, title: A, path: a.md, published: March}\n")
    with pytest.raises(ManifestError, match="published must be an ISO date"):
        CorpusManifest.load(bad)


def test_a_number_keyword_counts_only_as_a_whole_number():
    item = QAItem("q", "After how many failed attempts is an account locked?", "After 5.", ("5",), True, "policy",
                  "conflict", "amendment")
    assert item.is_correct("An account is locked after 5 consecutive failed sign-in attempts.")
    assert not item.is_correct("It is locked for 15 minutes since January 2025.")
    assert not item.is_correct("Version 5.1 locks it after six attempts.")
