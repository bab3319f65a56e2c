"""The evidence of a citation: the sentence of the cited text that the answer was drawn from, so a reader can
check the answer against the words of the document without opening it (a "show quote" beside each source).

The sentence sharing the most with the answer wins, a shared word weighing more the fewer of the text's
sentences hold it (a figure or a name, not "the"); among equals, the one sharing most with the question.
Nothing is quoted when no sentence shares a word with the answer: a quote must be evidence, not decoration.
"""

from __future__ import annotations

from ..documents.text import overlap_scores, sentences

MAX_QUOTE_CHARS = 400  # a table row or a run-on line is cut here, with an ellipsis


def quote(answer: str, question: str, text: str) -> str | None:
    """The sentence of ``text`` that supports ``answer`` best, verbatim (cut at ``MAX_QUOTE_CHARS``), or None."""
    found = sentences(text)
    if not found or not answer.strip():
        return None
    by_answer = overlap_scores(answer, found)
    by_question = overlap_scores(question, found)
    best = max(range(len(found)), key=lambda i: (by_answer[i], by_question[i], -i))
    if by_answer[best] <= 0:
        return None
    sentence = found[best]
    return sentence if len(sentence) <= MAX_QUOTE_CHARS else sentence[:MAX_QUOTE_CHARS - 1].rstrip() + "…"
