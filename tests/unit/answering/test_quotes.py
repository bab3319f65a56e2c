"""A citation's quote: the sentence the answer was drawn from, or none."""

from __future__ import annotations

from cagflow.answering.quotes import MAX_QUOTE_CHARS, best_supported, quote

MANUAL = ("The gateway exposes three ports. The web console listens on port 8443 (HTTPS). "
          "The API listens on port 9441. Ports can be changed in gateway.yaml.")


def test_the_sentence_holding_the_answers_rare_words_is_quoted():
    assert quote("Port 8443.", "Which port does the web console use?", MANUAL) == \
        "The web console listens on port 8443 (HTTPS)."
    assert quote("9441", "Which port does the API use?", MANUAL) == "The API listens on port 9441."


def test_the_row_holding_the_answers_figures_beats_a_sentence_sharing_more_words():
    section = ("Acknowledgement targets are measured from the moment the first page is sent.\n\n"
               "| Severity | Acknowledge within | Status page update interval |\n|---|---|---|\n"
               "| SEV1 | 5 minutes | Every 30 minutes |\n| SEV2 | 15 minutes | Every 60 minutes |\n\n"
               "An incident commander must be assigned within 10 minutes of a SEV1 being declared.")
    assert quote("The on-call engineer must acknowledge a SEV1 page within 5 minutes.",
                 "How fast must the on-call engineer acknowledge a SEV1 page?", section) == \
        "| SEV1 | 5 minutes | Every 30 minutes |"


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


def test_the_citation_is_the_candidate_holding_the_answers_evidence():
    closest = "An incident commander must be assigned within 10 minutes of a SEV1 being declared."
    table = "| Severity | Acknowledge within |\n|---|---|\n| SEV1 | 5 minutes |\n| SEV2 | 15 minutes |"
    answer = "The on-call engineer must acknowledge a SEV1 page within 5 minutes."
    assert best_supported(answer, [closest, table, "Postmortems are blameless."]) == 1
    assert best_supported("Forty-two.", [closest, table]) == 0  # nothing shared: the closest by meaning
    assert best_supported(answer, []) == 0
