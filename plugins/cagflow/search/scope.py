"""In-scope detection: does a question belong to a fixed document, so its snapshot can answer it?

The detector holds the embedding of every chunk in memory (a few hundred rows for a typical collection,
so a question costs one matrix product of microseconds and no OpenSearch round trip), split into the
*cacheable* chunks (fixed tier, and in the active release when one is given) and all *other* chunks. A
question goes to the cache route when its best cosine similarity to a cacheable chunk reaches the
threshold **and** no other chunk is closer: similarity alone cannot tell "When was 5.1.1 released?"
(release notes, variable) from questions about the admin manual, but the release notes' own chunks
outscore the manual's. On the sample questions this lifts the best F1 from 0.84 to 0.96.

The threshold is calibrated on the labelled sample questions by ``calibrate`` (``cagflow bench routing``):
among the cut points between observed scores, it takes the one with the highest recall whose precision is
at least ``MIN_PRECISION``; if none reaches that precision, the one with the best F1. Precision comes
first because a question wrongly sent to a snapshot is answered from the wrong document, while an
in-scope question sent to retrieval is still answered from the right passages, only more slowly.
The vectors of variable documents change with every ingest: refresh the detector after one.

A closer chunk of a document published after the matched fixed one (``ScopeMatch.newer_other``) may be an
update of it: the router then tries the cache+retrieval route rather than plain retrieval.

Identifiers settle what similarity cannot: "What does alarm YF-E116 mean?" reads like any alarm question of
the operations manual, but when the manual lists no YF-E116 and a release note does, the snapshot can only
decline or describe a neighbouring alarm. A question naming an identifier (``cagflow.answering.grounding``) that
its matched fixed document lacks and another document holds is not routed to the cache
(``ScopeMatch.elsewhere``): retrieval, whose BM25 half finds the identifier, answers it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

from ..answering.grounding import identifiers, listed_figures
from .index_schema import Chunk

if TYPE_CHECKING:
    from ..answering.qa import QAItem
    from .retrieval import ChunkIndex

MIN_PRECISION = 0.95
FULL_RESCAN_S = 600.0  # vectors re-read at least this often even when the index looks unchanged
NO_MATCH_SCORE = -1.0  # the lowest cosine similarity: the score against an empty set of chunks


@dataclass(frozen=True)
class ScopeMatch:
    doc_id: str | None  # the document of the closest cacheable chunk
    score: float  # cosine similarity to that chunk
    in_scope: bool
    other_score: float = NO_MATCH_SCORE  # cosine similarity to the closest chunk that is not cacheable
    published: str = ""  # ISO date of the matched fixed document, when known
    other_published: str = ""  # ISO date of the closest other chunk's document, when known
    elsewhere: tuple[str, ...] = ()  # identifiers of the question the matched document lacks and another holds

    @property
    def newer_other(self) -> bool:
        """The closest other chunk comes from a document published after the matched fixed document."""
        return bool(self.published and self.other_published and self.other_published > self.published)

    @property
    def best_score(self) -> float:
        """Cosine similarity to the closest chunk of any document: how answerable the question looks."""
        return max(self.score, self.other_score)

    def routes_to_cache(self, threshold: float) -> bool:
        return (self.doc_id is not None and self.score >= threshold and self.score >= self.other_score
                and not self.elsewhere)


def _unit_rows(matrix: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(matrix, axis=-1, keepdims=True)
    return matrix / np.where(norms == 0, 1.0, norms)


def _matrix(vectors: list) -> np.ndarray:
    """Rows of unit vectors, as wide as the embedding model makes them (no rows: an empty matrix)."""
    if not len(vectors):
        return np.empty((0, 0), dtype=np.float32)
    return _unit_rows(np.asarray(vectors, dtype=np.float32).reshape(len(vectors), -1))


def _dot(matrix: np.ndarray, vector: np.ndarray) -> np.ndarray:
    """``matrix @ vector`` without BLAS: numpy's own loop. BLAS maps a 32 MiB buffer in every thread that
    calls it, which the router's request threads kept for their whole life; a few thousand rows of a few
    hundred floats take well under a millisecond either way."""
    return np.einsum("...j,j->...", matrix, vector)


def _best(matrix: np.ndarray, vector: np.ndarray) -> tuple[int, float]:
    """Row index and cosine similarity of the closest row, or (-1, NO_MATCH_SCORE) for no rows."""
    if not len(matrix):
        return -1, NO_MATCH_SCORE
    similarities = _dot(matrix, vector)
    best = int(np.argmax(similarities))
    return best, float(similarities[best])


@dataclass(frozen=True)
class Citation:
    """The chunk of a cached document an answer came from; ``text`` is for quoting it, not for the record."""

    doc_id: str
    chunk_id: str
    title: str
    section: str
    score: float
    text: str = field(default="", repr=False)

    def to_dict(self) -> dict:
        record = {**asdict(self), "score": round(self.score, 4)}
        del record["text"]
        return record


@dataclass(frozen=True)
class _Vectors:
    cacheable: np.ndarray
    cacheable_chunks: list[Chunk]  # without their embeddings, row for row with ``cacheable``
    others: np.ndarray
    other_chunks: list[Chunk]  # likewise for ``others``
    other_rows: dict[str, int]  # chunk_id -> row of ``others``
    figures: dict[str, frozenset[str]]  # doc_id -> the numbers and identifiers of all its chunks


_NO_VECTORS = _Vectors(_matrix([]), [], _matrix([]), [], {}, {})


def _figures_by_document(chunks: Iterable[Chunk]) -> dict[str, frozenset[str]]:
    """Each document's figures (``cagflow.answering.grounding.listed_figures`` of its chunks)."""
    found: dict[str, set[str]] = {}
    for chunk in chunks:
        found.setdefault(chunk.doc_id, set()).update(listed_figures(f"{chunk.section}\n{chunk.text}"))
    return {doc_id: frozenset(held) for doc_id, held in found.items()}


class ScopeDetector:
    """Routes a question vector by its closest chunks, held in memory (see the module docstring)."""

    def __init__(self, index: ChunkIndex, threshold: float) -> None:
        self.index = index
        self.threshold = threshold
        self._vectors = _NO_VECTORS
        self._loaded: tuple = ()  # (index generation, release documents) of the vectors held
        self._loaded_at = 0.0
        self._refresh_lock = threading.Lock()

    @property
    def size(self) -> int:
        """Cacheable (fixed-tier) chunks held."""
        return len(self._vectors.cacheable_chunks)

    @property
    def total_chunks(self) -> int:
        """Chunks of every document held (cacheable or not)."""
        return len(self._vectors.cacheable_chunks) + len(self._vectors.others)

    @property
    def doc_ids(self) -> frozenset[str]:
        return frozenset(chunk.doc_id for chunk in self._vectors.cacheable_chunks)

    def refresh(self, doc_ids: Iterable[str] | None = None, if_changed: bool = False) -> int | None:
        """Reload every chunk vector from OpenSearch. With ``doc_ids`` (the active release's documents)
        only their fixed chunks are cacheable, so no question is sent to a document without a snapshot.
        ``if_changed``: only when the index's generation or ``doc_ids`` differ from the last load, or that
        load is ``FULL_RESCAN_S`` old (a periodic poll then costs two small requests, alias and index stats,
        instead of every vector, whose parsing churns the router's memory). Returns the number of cacheable
        chunks loaded (None: skipped as unchanged); matching uses the previous set until the new one is whole."""
        release = None if doc_ids is None else set(doc_ids)
        with self._refresh_lock:
            generation = self.index.generation()  # before the scan: a write during it shows at the next look
            loaded = (generation, release)
            if if_changed and loaded == self._loaded and time.monotonic() - self._loaded_at < FULL_RESCAN_S:
                return None
            cacheable, chunks, others, other_chunks = [], [], [], []
            for chunk in self.index.scan():
                if chunk.tier == "fixed" and (release is None or chunk.doc_id in release):
                    cacheable.append(chunk.embedding)
                    chunks.append(replace(chunk, embedding=None))
                else:
                    others.append(chunk.embedding)
                    other_chunks.append(replace(chunk, embedding=None))
            rows = {chunk.chunk_id: row for row, chunk in enumerate(other_chunks)}
            self._vectors = _Vectors(_matrix(cacheable), chunks, _matrix(others), other_chunks, rows,
                                     _figures_by_document([*chunks, *other_chunks]))  # one assignment: atomic swap
            self._loaded, self._loaded_at = loaded, time.monotonic()
            return len(chunks)

    def match(self, vector: Sequence[float] | np.ndarray, question: str = "", doc_id: str | None = None) -> ScopeMatch:
        """Route by ``vector``, the question's embedding; ``question``'s identifiers, when given, keep it
        from a document that lacks them while another document holds them. ``doc_id``: the match of that
        fixed document (its closest chunk) rather than of the closest one."""
        held = self._vectors
        unit = _unit_rows(np.asarray(vector, dtype=np.float32))
        chunk, score = _closest_cacheable(held, unit, doc_id)
        other, other_score = _best(held.others, unit)
        match = ScopeMatch(doc_id=chunk.doc_id if chunk else None, score=score, in_scope=False,
                           other_score=other_score, published=chunk.published if chunk else "",
                           other_published=held.other_chunks[other].published if other >= 0 else "",
                           elsewhere=_held_elsewhere(held.figures, chunk.doc_id, question) if chunk else ())
        return replace(match, in_scope=match.routes_to_cache(self.threshold))

    def published(self, doc_id: str) -> str:
        """The ISO date of a cacheable document, or empty when unknown."""
        return next((chunk.published for chunk in self._vectors.cacheable_chunks if chunk.doc_id == doc_id), "")

    def similarity(self, chunk_id: str, vector: Sequence[float] | np.ndarray) -> float | None:
        """Cosine similarity of ``vector`` to a chunk that is not cacheable, or None when it is not held."""
        held = self._vectors
        row = held.other_rows.get(chunk_id)
        if row is None:
            return None
        return float(_dot(held.others[row], _unit_rows(np.asarray(vector, dtype=np.float32))))

    def cite(self, doc_id: str, vector: Sequence[float] | np.ndarray) -> Citation | None:
        """The chunk of ``doc_id`` closest to ``vector`` (the embedding of question and answer together), or
        None when the detector holds no chunk of that document."""
        closest = self.candidates(doc_id, vector, 1)
        return closest[0] if closest else None

    def candidates(self, doc_id: str, vector: Sequence[float] | np.ndarray, count: int) -> list[Citation]:
        """The ``count`` chunks of ``doc_id`` closest to ``vector``, closest first (the citation's candidates)."""
        held = self._vectors
        rows = [row for row, chunk in enumerate(held.cacheable_chunks) if chunk.doc_id == doc_id]
        if not rows:
            return []
        similarities = _dot(held.cacheable[rows], _unit_rows(np.asarray(vector, dtype=np.float32)))
        closest = np.argsort(-similarities, kind="stable")[:count]
        return [Citation(chunk.doc_id, chunk.chunk_id, chunk.title, chunk.section, float(similarities[index]),
                         chunk.text) for index in closest for chunk in [held.cacheable_chunks[rows[index]]]]


def _closest_cacheable(held: _Vectors, unit: np.ndarray, doc_id: str | None) -> tuple[Chunk | None, float]:
    """The cacheable chunk closest to ``unit`` (of ``doc_id`` only, when given) and its similarity."""
    if doc_id is None:
        best, score = _best(held.cacheable, unit)
        return (held.cacheable_chunks[best] if best >= 0 else None), score
    rows = [row for row, chunk in enumerate(held.cacheable_chunks) if chunk.doc_id == doc_id]
    if not rows:
        return None, NO_MATCH_SCORE
    best, score = _best(held.cacheable[rows], unit)
    return held.cacheable_chunks[rows[best]], score


def _held_elsewhere(held: dict[str, frozenset[str]], doc_id: str, question: str) -> tuple[str, ...]:
    """The identifiers of ``question`` that ``doc_id`` lacks and some other document holds."""
    missing = [name for name in identifiers(question) if name not in held.get(doc_id, frozenset())]
    return tuple(name for name in missing
                 if any(name in others for other, others in held.items() if other != doc_id))


# --- calibration -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ThresholdMetrics:
    """How routing at one threshold does on the labelled questions (positive = in scope)."""

    threshold: float
    precision: float
    recall: float
    f1: float
    doc_accuracy: float  # of the truly in-scope questions routed to the cache, the share matched to the right document
    routed_to_cache: int


@dataclass(frozen=True)
class Calibration:
    threshold: float
    rule: str
    chosen: ThresholdMetrics
    sweep: list[ThresholdMetrics]

    def to_dict(self) -> dict:
        return {"threshold": self.threshold, "rule": self.rule, "chosen": asdict(self.chosen),
                "sweep": [asdict(row) for row in self.sweep]}


def evaluate(records: Sequence[QAItem], matches: Sequence[ScopeMatch], threshold: float) -> ThresholdMetrics:
    routed = [(item, match) for item, match in zip(records, matches, strict=True) if match.routes_to_cache(threshold)]
    true_positives = [(item, match) for item, match in routed if item.in_scope]
    positives = sum(item.in_scope for item in records)
    precision = len(true_positives) / len(routed) if routed else 1.0
    recall = len(true_positives) / positives if positives else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    right_document = sum(match.doc_id == item.doc_id for item, match in true_positives)
    doc_accuracy = right_document / len(true_positives) if true_positives else 0.0
    return ThresholdMetrics(threshold, precision, recall, f1, doc_accuracy, len(routed))


def _cut_points(scores: Sequence[float]) -> list[float]:
    """Midpoints between consecutive distinct scores, plus one above the highest, rounded to 3 decimals
    (a threshold that reads well in a config file; metrics are measured at the rounded value)."""
    distinct = sorted(set(scores), reverse=True)
    cuts = [distinct[0] + 0.001] + [(high + low) / 2 for high, low in zip(distinct, distinct[1:])]
    cuts.append(distinct[-1] - 0.001)
    return sorted({round(cut, 3) for cut in cuts}, reverse=True)


def calibrate(records: Sequence[QAItem], matches: Sequence[ScopeMatch],
              min_precision: float = MIN_PRECISION) -> Calibration:
    """Pick the routing threshold for labelled questions and their detector matches (see the module
    docstring for the rule)."""
    if not records:
        raise ValueError("calibration needs at least one labelled question")
    sweep = [evaluate(records, matches, cut) for cut in _cut_points([match.score for match in matches])]
    precise = [row for row in sweep if row.precision >= min_precision and row.routed_to_cache]
    if precise:
        chosen = max(precise, key=lambda row: (row.recall, row.threshold))
        rule = f"highest recall at precision >= {min_precision:g}"
    else:
        chosen = max(sweep, key=lambda row: (row.f1, row.threshold))
        rule = f"best F1 (no threshold reaches precision {min_precision:g})"
    return Calibration(threshold=chosen.threshold, rule=rule, chosen=chosen, sweep=sweep)


# --- answerability ---------------------------------------------------------------------------------

MIN_ANSWERABLE_KEPT = 0.98


@dataclass(frozen=True)
class AnswerabilityMetrics:
    """How declining below one threshold does on labelled questions (answerable = some document answers)."""

    threshold: float
    answerable_kept: float  # share of answerable questions that reach the model
    unanswerable_declined: float  # share of unanswerable questions declined without the model


def evaluate_answerability(records: Sequence[QAItem], matches: Sequence[ScopeMatch],
                           threshold: float) -> AnswerabilityMetrics:
    kept = [match.best_score >= threshold for match in matches]
    answerable = [keep for item, keep in zip(records, kept, strict=True) if item.answerable]
    unanswerable = [keep for item, keep in zip(records, kept) if not item.answerable]
    return AnswerabilityMetrics(threshold, sum(answerable) / len(answerable) if answerable else 1.0,
                                sum(not keep for keep in unanswerable) / len(unanswerable) if unanswerable else 0.0)


def calibrate_answerability(records: Sequence[QAItem], matches: Sequence[ScopeMatch],
                            min_kept: float = MIN_ANSWERABLE_KEPT) -> tuple[AnswerabilityMetrics,
                                                                             list[AnswerabilityMetrics]]:
    """The highest threshold that still lets ``min_kept`` of the answerable questions reach the model: a
    wrongly declined question loses an answer the documents hold, while a wrongly kept one still meets the
    grounded prompt, which declines by itself. Returns the chosen metrics and the sweep."""
    if not records:
        raise ValueError("calibration needs at least one labelled question")
    sweep = [evaluate_answerability(records, matches, cut)
             for cut in _cut_points([match.best_score for match in matches])]
    keeping = [row for row in sweep if row.answerable_kept >= min_kept]
    return max(keeping, key=lambda row: row.threshold), sweep
