"""Split parsed documents into retrieval chunks: token-bounded windows that overlap, never crossing a section.

Chunks are measured in the tokens of the embedding model, because that model truncates what it cannot
read: a chunk longer than its window would be indexed by its first part only. Windows end at sentence or
line boundaries, and each one repeats the last sentences of the previous one (up to the overlap) so a fact
spanning a boundary is still found whole. Chunk ids ``{doc_id}:{version}:{n}`` are stable: the same
document version always yields the same ids, so indexing twice replaces instead of duplicating.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

from ..documents.parsing import ParsedDocument
from ..documents.text import sentence_spans
from ..errors import CagflowError

TokenCounter = Callable[[Sequence[str]], list[int]]

# A word, or in Chinese (no spaces) a clause up to its full-width comma, enumeration comma or colon.
_WORD = re.compile(r"[^\s，、：]+[，、：]?|[，、：]")


class ChunkingError(CagflowError, ValueError):
    """Chunking settings that cannot produce chunks (e.g. an overlap as large as the window)."""

    code = "chunking_failed"


# Bump when chunk boundaries change for the same text: every document is then chunked and embedded again.
CHUNKING_VERSION = "2"


@dataclass(frozen=True)
class TextChunk:
    chunk_id: str
    doc_id: str
    version: str
    tier: str
    title: str
    section: str
    text: str
    n_tokens: int
    published: str = ""  # the document's ISO date, when the manifest gives one

    def to_record(self) -> dict:
        return asdict(self)


def chunk_id(doc_id: str, version: str, number: int) -> str:
    return f"{doc_id}:{version}:{number}"


def embedding_token_counter() -> TokenCounter:
    """Token counts under the embedding model's own tokenizer (e5's SentencePiece)."""
    from .embeddings import get_embedder

    return get_embedder().count_tokens


def _split_oversized(text: str, span: tuple[int, int], count: TokenCounter, max_tokens: int) -> list[tuple[int, int]]:
    """Break a sentence longer than the window at word (Chinese: clause) boundaries; a single giant word is cut
    by characters."""
    start, end = span
    words = [(start + m.start(), start + m.end()) for m in _WORD.finditer(text[start:end])]
    if len(words) == 1:
        n_tokens = count([text[start:end]])[0]
        if n_tokens <= max_tokens:
            return [span]
        step = max(1, (end - start) * max_tokens // (n_tokens + 1))
        pieces = [(offset, min(offset + step, end)) for offset in range(start, end, step)]
        return [piece for p in pieces for piece in _split_oversized(text, p, count, max_tokens)]
    return _pack(text, words, count(text[s:e] for s, e in words), max_tokens, overlap_tokens=0, count=count)


def _pack(text: str, spans: list[tuple[int, int]], counts: list[int], max_tokens: int, overlap_tokens: int,
          count: TokenCounter) -> list[tuple[int, int]]:
    """Greedy windows of whole spans up to ``max_tokens``; each window restarts ``overlap_tokens`` back."""
    units: list[tuple[int, int]] = []
    unit_counts: list[int] = []
    for span, n_tokens in zip(spans, counts):
        if n_tokens > max_tokens:
            pieces = _split_oversized(text, span, count, max_tokens)
            units.extend(pieces)
            unit_counts.extend(count([text[s:e] for s, e in pieces]))
        else:
            units.append(span)
            unit_counts.append(n_tokens)
    windows = []
    first = 0
    while first < len(units):
        last, used = first, 0
        while last < len(units) and (last == first or used + unit_counts[last] <= max_tokens):
            used += unit_counts[last]
            last += 1
        windows.append((units[first][0], units[last - 1][1]))
        if last == len(units):
            break
        restart, carried = last, 0
        while restart - 1 > first and carried + unit_counts[restart - 1] <= overlap_tokens:
            restart -= 1
            carried += unit_counts[restart]
        first = restart
    return windows


def chunk_document(doc_id: str, version: str, tier: str, document: ParsedDocument, count: TokenCounter,
                   max_tokens: int = 200, overlap_tokens: int = 40, published: str = "") -> list[TextChunk]:
    """The document's chunks in reading order, numbered from 0."""
    if max_tokens < 1 or not 0 <= overlap_tokens < max_tokens:
        raise ChunkingError(f"need 0 <= overlap ({overlap_tokens}) < chunk size ({max_tokens}) tokens")
    texts: list[tuple[str, str]] = []
    for section in document.sections:
        spans = sentence_spans(section.text)
        if not spans:
            continue
        counts = count([section.text[s:e] for s, e in spans])
        for start, end in _pack(section.text, spans, counts, max_tokens, overlap_tokens, count):
            texts.append((section.heading, section.text[start:end]))
    token_counts = count([text for _, text in texts]) if texts else []
    return [TextChunk(chunk_id(doc_id, version, number), doc_id, version, tier, document.title, heading, text,
                      n_tokens, published)
            for number, ((heading, text), n_tokens) in enumerate(zip(texts, token_counts))]
