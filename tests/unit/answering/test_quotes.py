"""A citation's quote: the sentence the answer was drawn from, or none."""

from __future__ import annotations

from cagflow.answering.quotes import MAX_QUOTE_CHARS, quote

MANUAL = ("The gateway exposes three ports. The web console listens on port 8443 (HTTPS). "
          "The API listens on port 9441. Ports can be changed in gateway.yaml.")


def test_the_sentence_holding_the_answers_rare_words_is_quoted():
    assert quote("Port 8443.", "Which port does the web console use?", MANUAL) == \
        "The web console listens on port 8443 (HTTPS)."
    assert quote("9441", "Which port does the API use?", MANUAL) == "The API listens on port 9441."


def test_among_equal_sentences_the_one_closer_to_the_question_wins():
    text = "Backups run at 02:00. Reports run at 02:00."
    assert quote("At 02:00.", "When do reports run?", text) == "Reports run at 02:00."


def test_chinese_text_is_quoted_by_its_characters():
    text = "网关有三个端口。网页控制台监听 8443 端口。接口服务监听 9441 端口。"
    assert quote("网页控制台使用端口 8443。", "网页控制台使用哪个端口？", text) == "网页控制台监听 8443 端口。"


def test_nothing_is_quoted_without_a_shared_word():
    assert quote("Forty-two.", "What is the answer?", MANUAL) is None
    assert quote("", "Which port?", MANUAL) is None and quote("8443", "Which port?", "") is None


def test_a_run_on_line_is_cut_around_the_answers_words():
    cells = [f"value {n}" for n in range(200)]
    for row, keeps in (("| 8443 | " + " | ".join(cells) + " |", "| 8443 |"),
                       ("| " + " | ".join(cells[:100]) + " | 8443 | " + " | ".join(cells[100:]) + " |", "| 8443 |"),
                       ("| " + " | ".join(cells) + " | 8443 |", "| 8443 |")):
        quoted = quote("8443", "Which port?", row)
        assert len(quoted) <= MAX_QUOTE_CHARS and keeps in quoted and "…" in quoted
