"""Sentences and words of parsed text, in English and Chinese: what chunking cuts at, what the router cuts
newer passages to, and where the grounding check looks a figure up."""

from __future__ import annotations

import re

_LINE = re.compile(r"[^\n]+")
# A sentence ends at ". ! ?" and a space, or at Chinese full-width "。！？；" (and a closing quote or bracket
# after it), where no space follows.
_SENTENCE_GAP = re.compile(r"(?:(?<=[.!?])\s+|(?<=[。！？；])(?![”’」』）])\s*|(?<=[。！？；][”’」』）])\s*)(?=\S)")
_HAN = re.compile(r"[\u4e00-\u9fff]")
_LATIN_WORD = re.compile(r"[^\s\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]+")  # not Han, not CJK punctuation


def word_count(text: str) -> int:
    """Words in ``text``: Latin words, and for Chinese (written without spaces) one per two Han characters,
    the length of a typical Chinese word."""
    return len(_LATIN_WORD.findall(text)) + (len(_HAN.findall(text)) + 1) // 2


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of every sentence, or line where lines carry no sentence punctuation (lists, tables)."""
    spans = []
    for line in _LINE.finditer(text):
        start = line.start()
        for gap in _SENTENCE_GAP.finditer(text, line.start(), line.end()):
            spans.append((start, gap.start()))
            start = gap.end()
        spans.append((start, line.end()))
    return [(start, end) for start, end in spans if text[start:end].strip()]


def sentences(text: str, min_words: int = 1) -> list[str]:
    """The sentences of ``text`` (lines, where lines carry no sentence punctuation), stripped; a sentence of
    fewer than ``min_words`` words (a bold lead-in such as "**Longer-lived codes.**") is joined to the next
    one on its line."""
    found: list[str] = []
    short_end = -1  # end offset of a pending short sentence, or -1
    for start, end in sentence_spans(text):
        if short_end >= 0 and "\n" not in text[short_end:start]:
            found[-1] = f"{found[-1]} {text[start:end].strip()}"
        else:
            found.append(text[start:end].strip())
        short_end = end if word_count(found[-1]) < min_words else -1
    return found
