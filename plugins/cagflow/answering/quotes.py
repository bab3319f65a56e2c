"""The evidence of a citation: the sentence of the cited text that the answer was drawn from, so a reader can
check the answer against the words of the document without opening it (a "show quote" beside each source).

The sentence sharing the most with the answer wins, a shared word weighing more the fewer of the text's
sentences hold it (a figure or a name, not "the"); among equals, the one sharing most with the question.
Nothing is quoted when no sentence shares a word with the answer: a quote must be evidence, not decoration.
"""

from __future__ import annotations

from ..documents.text import overlap_scores, sentences, terms

MAX_QUOTE_CHARS = 400  # a table row or a run-on line is cut to this, around the words the answer shares


def quote(answer: str, question: str, text: str) -> str | None:
    """The sentence of ``text`` that supports ``answer`` best, verbatim (a longer one cut to ``MAX_QUOTE_CHARS``
    around the first word it shares with the answer), or None."""
    found = sentences(text)
    if not found or not answer.strip():
        return None
    by_answer = overlap_scores(answer, found)
    by_question = overlap_scores(question, found)
    best = max(range(len(found)), key=lambda i: (by_answer[i], by_question[i], -i))
    if by_answer[best] <= 0:
        return None
    return _window(found[best], terms(answer) & terms(found[best]))


def _window(sentence: str, shared: set[str]) -> str:
    if len(sentence) <= MAX_QUOTE_CHARS:
        return sentence
    lowered = sentence.lower()
    first = min((lowered.find(term) for term in shared if term in lowered), default=0)
    room = MAX_QUOTE_CHARS - 2  # an ellipsis at either end at most
    start = max(0, min(first - room // 3, len(sentence) - room))
    end = min(len(sentence), start + room)
    return ("…" if start else "") + sentence[start:end] + ("…" if end < len(sentence) else "")
