"""The public datasets' own scoring rules, on examples whose scores follow from the rules by hand."""

from __future__ import annotations

import pytest

from cagflow.bench import scoring


def test_squad_normalisation_drops_case_punctuation_and_articles():
    assert scoring.squad_normalize("The  Normans, in France!") == "normans in france"


@pytest.mark.parametrize(("gold", "prediction", "exact", "f1"), [
    ("Denmark, Iceland and Norway", "denmark iceland and norway", True, 1.0),
    ("10th century", "the 10th century", True, 1.0),
    ("10th century", "in the 10th and 11th centuries", False, 2 * (1 / 5) * (1 / 2) / (1 / 5 + 1 / 2)),  # 10th only
    ("Rollo", "William", False, 0.0),
])
def test_squad_exact_match_and_token_f1(gold, prediction, exact, f1):
    assert scoring.exact_match([gold], prediction, "en") is exact
    assert scoring.f1([gold], prediction, "en") == pytest.approx(f1)


def test_the_best_gold_answer_counts():
    assert scoring.f1(["Rollo", "the Viking Rollo"], "Viking Rollo", "en") == pytest.approx(1.0)
    assert scoring.exact_match(["x", "Viking Rollo"], "viking rollo.", "en")


def test_cmrc_tokens_are_han_characters_and_latin_words_without_punctuation():
    assert scoring.cmrc_tokens("《红楼梦》写于1791年，by Cao") == ["红", "楼", "梦", "写", "于", "1791", "年", "by", "cao"]


def test_cmrc_f1_is_over_the_longest_common_run():
    # gold 2 tokens (1791, 年), prediction 5 (它 写 于 1791 年), common run 2: precision 2/5, recall 1
    assert scoring.f1(["1791年"], "它写于1791年。", "zh") == pytest.approx(2 * (2 / 5) * 1 / (2 / 5 + 1))
    assert scoring.f1(["曹雪芹"], "作者是曹雪芹", "zh") == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert scoring.exact_match(["曹雪芹"], "曹雪芹。", "zh")
    assert not scoring.exact_match(["曹雪芹"], "作者是曹雪芹", "zh")


def test_contains_gold_needs_the_whole_answer_on_word_boundaries():
    assert scoring.contains_gold(["10th century"], "They arrived in the 10th century.", "en")
    assert not scoring.contains_gold(["10"], "It took 100 days.", "en")
    assert scoring.contains_gold(["1,000 years"], "about 1000 years", "en")  # punctuation goes on both sides
    assert scoring.contains_gold(["曹雪芹"], "《红楼梦》的作者是 曹雪芹。", "zh")
    assert not scoring.contains_gold(["曹雪芹"], "作者是高鹗", "zh")
    assert not scoring.contains_gold([""], "anything", "en")


def test_unsupported_figures_are_numbers_and_names_no_source_or_question_holds():
    source = "The Normans settled in Normandy in 911. Rollo led them; 1,200 ships sailed."
    assert scoring.unsupported_figures("Rollo led 1200 ships in 911.", "Who led them?", [source]) == []
    assert scoring.unsupported_figures("They came in 912 under William.", "When?", [source]) == ["912", "William"]
    # a capitalised first word is not a name; the question's own words are known
    assert scoring.unsupported_figures("They were led by Hastein.", "Was it Hastein?", [source]) == []
    assert scoring.unsupported_figures("建于1926年。", "何时建成？", ["没有年份"]) == ["1926"]
