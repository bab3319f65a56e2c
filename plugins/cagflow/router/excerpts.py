"""Newer passages cut to their sentences closest to the question: a passage's prefill is paid on every
request, so it brings only what bears on the question."""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from ..documents.text import sentences, word_count
from ..search.retrieval import SearchHit

# Markup, and a list item's bold title sentence ("- **Longer-lived codes.** Codes now expire…": the sentence
# says it; a bold identifier such as "**E-407** —" stays).
_MARKUP = re.compile(r"^\s*[-*]\s+(?:\*\*[^*\n]{1,80}\.\*\*\s*)?|\*\*|__|`", re.MULTILINE)
# Where a sentence may be cut: before a clause that explains or adds to the fact.
_CLAUSE = re.compile(r"(?<=[,;])\s+(?=(?:so|which|because|while|but|and then)\b)|(?<=;)\s+")


def _units(text: str) -> list[str]:
    """Sentences without markup or title lead-ins (another short one joined to the next), cut before their
    explaining clauses ("…, so a code can be handed over the day before"): the fact stays, the reason may go."""
    units = []
    for sentence in sentences(_MARKUP.sub("", text), min_words=8):
        clauses = _CLAUSE.split(sentence)
        units += [clause.rstrip(",;") + ("." if clause is not clauses[-1] else "") for clause in clauses]
    return units


def excerpts(hits: list[SearchHit], question: np.ndarray, sentence_vectors, max_words: int,
             min_similarity: float = -1.0) -> list[SearchHit]:
    """Each passage cut to its sentences (or clauses) closest to the question (unit vectors;
    ``sentence_vectors`` embeds a list of texts), kept in reading order: every passage's best one first, then
    the next best of any that is at least ``min_similarity`` close, while ``max_words`` allow."""
    pieces = [(number, text) for number, hit in enumerate(hits) for text in _units(hit.text)]
    if not pieces:
        return hits
    scores = sentence_vectors([text for _, text in pieces]) @ question
    ranked = sorted(range(len(pieces)), key=lambda piece: -scores[piece])
    best_of_each = sorted({pieces[piece][0]: piece for piece in reversed(ranked)}.values(), key=lambda p: -scores[p])
    chosen: set[int] = set()
    words = 0
    further = [piece for piece in ranked if scores[piece] >= min_similarity]
    for piece in [*best_of_each, *further]:
        size = word_count(pieces[piece][1])
        if piece in chosen or (chosen and words + size > max_words):
            continue
        chosen.add(piece)
        words += size
    return [dataclasses.replace(hit, text=" ".join(pieces[piece][1] for piece in sorted(chosen)
                                                   if pieces[piece][0] == number))
            for number, hit in enumerate(hits) if any(pieces[piece][0] == number for piece in chosen)]
