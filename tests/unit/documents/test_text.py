"""Which sentences a question is about: the terms they share, weighed by rarity, in English and Chinese."""

from cagflow.documents.text import focus, overlap_scores, terms

DOCUMENT = ("# Backups\n\nThe team meets every Monday. Backups run every night at 02:00. "
            "What the team does is described below. Each backup is kept for 35 days, then deleted. "
            "The console listens on port 8443.")


def _words(text: str) -> int:
    return len(text.split())


def test_terms_leave_out_words_that_only_ask():
    assert terms("What does the console do, and when?") == {"console"}
    assert terms("备份保留多少天？") == {"备份", "份保", "保留", "留多", "多少", "少天"}
    assert "什么" not in terms("密码是什么？") and "密码" in terms("密码是什么？")


def test_a_term_most_sentences_hold_weighs_less_than_a_rare_one():
    texts = ["the team backup", "the team console", "the team meets"]
    scores = overlap_scores("How long is a backup kept by the team?", texts)
    assert scores[0] > scores[1] == scores[2] > 0


def test_focus_quotes_the_closest_sentences_in_document_order_within_the_budget():
    quote = focus("How long is each backup kept?", DOCUMENT, budget_tokens=20, count_tokens=_words)
    assert quote == "Backups run every night at 02:00. … Each backup is kept for 35 days, then deleted." or \
        quote == "Each backup is kept for 35 days, then deleted."
    assert "35 days" in quote and _words(quote.replace("… ", "")) <= 20
    assert "console" not in quote and "What the team" not in quote


def test_focus_in_chinese_and_with_nothing_in_common():
    document = "第一章 总则。本制度适用于全体员工。密码长度不得少于14位。密码每120天更换一次。访客须登记。"
    quote = focus("密码多久更换一次？", document, budget_tokens=12, count_tokens=len)
    assert quote == "密码每120天更换一次。"
    assert focus("Which colour is the logo?", DOCUMENT, budget_tokens=50, count_tokens=_words) == ""
    assert focus("backup", DOCUMENT, budget_tokens=2, count_tokens=_words) == ""


def test_a_table_row_is_quoted_under_its_header():
    document = ("## Acknowledgement\n\nTargets start at the first page.\n\n| Severity | Acknowledge within | Update |\n"
                "|---|---|---|\n| SEV1 | 5 minutes | 30 minutes |\n| SEV2 | 15 minutes | 2 hours |\n\nSEV1 is the "
                "highest severity.")
    quote = focus("How fast must a SEV1 page be acknowledged?", document, budget_tokens=30, count_tokens=_words)
    assert "| Severity | Acknowledge within | Update |\n| SEV1 | 5 minutes | 30 minutes |" in quote
    assert "SEV2" not in quote
