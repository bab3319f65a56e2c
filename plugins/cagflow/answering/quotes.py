"""The evidence of a citation: the sentence of the cited text that the answer was drawn from, so a reader can
check the answer against the words of the document without opening it (a "show quote" beside each source).

The sentence holding most of the answer's figures (numbers, versions, codes: what a reader checks first) wins;
then the one sharing most with the answer, a shared word weighing more the fewer of the text's sentences hold
it (a name, not "the"); among equals, the one sharing most with the question. A table row counts as a sentence
("| SEV1 | 5 minutes | Every 30 minutes |" is the evidence for "within 5 minutes", not the sentence on another
deadline that shares "must", "within" and "SEV1" with the answer).
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
    figures = _figures(answer)
    held = [len(figures & terms(sentence)) for sentence in found]
    by_answer = overlap_scores(answer, found)
    by_question = overlap_scores(question, found)
    best = max(range(len(found)), key=lambda i: (held[i], by_answer[i], by_question[i], -i))
    if by_answer[best] <= 0:
        return None
    return _window(found[best], terms(answer) & terms(found[best]))


def best_supported(answer: str, texts: list[str]) -> int:
    """Which of ``texts`` (candidates to cite, closest by meaning first) holds the sentence that supports
    ``answer`` most: the most of its figures, then the most of its words; the first on a tie or when none shares
    a word. The closest chunk by meaning can be the sentence next to the fact (a deadline of the same section)."""
    figures, words = _figures(answer), terms(answer)

    def support(text: str) -> tuple[int, int]:
        return max(((len(figures & held), len(words & held)) for held in map(terms, sentences(text))),
                   default=(0, 0))

    supports = [support(text) for text in texts]
    return max(range(len(texts)), key=lambda i: (supports[i], -i)) if texts else 0


def _figures(text: str) -> set[str]:
    """The terms of ``text`` holding a digit: numbers, versions, codes (SEV1, E-407's 407)."""
    return {term for term in terms(text) if any(char.isdigit() for char in term)}


def _window(sentence: str, shared: set[str]) -> str:
    if len(sentence) <= MAX_QUOTE_CHARS:
        return sentence
    lowered = sentence.lower()
    first = min((lowered.find(term) for term in shared if term in lowered), default=0)
    room = MAX_QUOTE_CHARS - 2  # an ellipsis at either end at most
    start = max(0, min(first - room // 3, len(sentence) - room))
    end = min(len(sentence), start + room)
    return ("…" if start else "") + sentence[start:end] + ("…" if end < len(sentence) else "")
