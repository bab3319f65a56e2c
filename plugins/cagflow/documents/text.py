"""Sentences and words of parsed text, in English and Chinese: what chunking cuts at, what the router cuts
newer passages to, where the grounding check looks a figure up, and which sentences a question is about."""

from __future__ import annotations

import functools
import logging
import math
import re
from typing import Callable, Sequence

_LINE = re.compile(r"[^\n]+")
# A sentence ends at ". ! ?" and a space, or at Chinese full-width "。！？；" (and a closing quote or bracket
# after it), where no space follows.
_SENTENCE_GAP = re.compile(r"(?:(?<=[.!?])\s+|(?<=[。！？；])(?![”’」』）])\s*|(?<=[。！？；][”’」』）])\s*)(?=\S)")
# Han characters: the CJK unified ideographs, extension A and the compatibility ideographs; the one definition
# every package uses.
HAN_RANGES = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
HAN = re.compile(f"[{HAN_RANGES}]")
HAN_RUN = re.compile(f"[{HAN_RANGES}]+")
_LATIN_WORD = re.compile(f"[^\\s\u3000-\u303f{HAN_RANGES}\uff00-\uffef]+")  # not Han, not CJK punctuation


_LATIN_LETTERS = re.compile(r"[A-Za-z]+")


def language(text: str) -> str:
    """``"zh"`` when Han characters outnumber Latin words (a Chinese sentence naming "YF-G300" or "TLS" is
    still Chinese), else ``"en"``. It picks the prompt's wording and which questions are read for Chinese
    words."""
    han = len(HAN.findall(text))
    return "zh" if han >= 2 and han >= len(_LATIN_LETTERS.findall(text)) else "en"


def word_count(text: str) -> int:
    """Words in ``text``: Latin words, and for Chinese (written without spaces) one per two Han characters,
    the length of a typical Chinese word."""
    return len(_LATIN_WORD.findall(text)) + (len(HAN.findall(text)) + 1) // 2


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


_TERM_WORD = re.compile(r"[a-z0-9]+")
# Words that say what kind of answer is asked, not what it is about: a sentence holding "what" or "什么" is no
# closer to the question for it. Lucene's English stop set, the question words, and the Han characters that
# only ask (a bigram holding one is dropped).
_FUNCTION_WORDS = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the their then there these they "
    "this to was will with what which who whom whose when where why how do does did has have had were".split())
_ASKING_HAN = frozenset("什么哪谁吗呢怎几")


def terms(text: str) -> set[str]:
    """The words a question and a text can share: Latin words (but function words), and for Chinese (no
    spaces between words) every pair of adjacent Han characters that does not only ask."""
    text = text.lower()
    bigrams = {run[i:i + 2] for run in HAN_RUN.findall(text) for i in range(max(1, len(run) - 1))}
    return ({word for word in _TERM_WORD.findall(text) if word not in _FUNCTION_WORDS}
            | {pair for pair in bigrams if not _ASKING_HAN.intersection(pair)})


def best_part(question: str, texts: Sequence[str]) -> int:
    """Index of the text sharing the most terms with the question (ties: the first): picks the part of a
    split document to answer from when no embedding router is in front."""
    words = terms(question)
    scores = [len(words & terms(text)) for text in texts]
    return max(range(len(texts)), key=lambda i: (scores[i], -i))


def overlap_scores(question: str, texts: Sequence[str]) -> list[float]:
    """How much each text shares with the question, a shared term weighing less the more of the texts hold
    it (inverse document frequency over ``texts``): "the" and "does" pick nothing."""
    words = terms(question)
    held = [words & terms(text) for text in texts]
    weight = {term: math.log(1 + len(texts) / sum(term in found for found in held)) for term in set().union(*held)}
    return [sum(weight[term] for term in found) for found in held]


_TABLE_SEPARATOR = re.compile(r"^\|[\s:|-]+\|$")


def _focus_units(text: str) -> list[str]:
    """The sentences of ``text``, a table row with its table's header row ahead of it: a row ("| SEV1 |
    5 minutes |") holds the values, its header ("| Severity | Acknowledge within |") the words a question
    asks with."""
    units: list[str] = []
    header = ""
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            header = ""
            units.extend(sentences(line))
        elif not header:
            header = line
        elif not _TABLE_SEPARATOR.match(line):
            units.append(f"{header}\n{line}")
    return units


def focus(question: str, text: str, budget_tokens: int, count_tokens: Callable[[str], int]) -> str:
    """The sentences of ``text`` that share the most with the question, as many as fit ``budget_tokens``, in
    the text's order ("…" where sentences were skipped): quoted ahead of a question about a long document, so
    that a small model reads the few lines that matter right before it answers."""
    found = _focus_units(text)
    scores = overlap_scores(question, found)
    chosen: list[int] = []
    used = 0
    for index in sorted(range(len(found)), key=lambda i: (-scores[i], i)):
        if scores[index] <= 0:
            break
        cost = count_tokens(found[index])
        if used + cost > budget_tokens:
            continue
        chosen.append(index)
        used += cost
    chosen.sort()
    return " ".join(found[index] if position == 0 or chosen[position - 1] == index - 1 else f"… {found[index]}"
                    for position, index in enumerate(chosen))


# jieba's part-of-speech tags of proper names: person, place, organisation, other proper noun, Latin word.
_NAME_TAGS = frozenset({"nr", "nrfg", "nrt", "ns", "nt", "nz", "eng"})


@functools.cache
def _chinese_tagger():
    import jieba
    import jieba.posseg

    jieba.setLogLevel(logging.WARNING)
    return jieba.posseg.POSTokenizer(jieba.Tokenizer())


# jieba's tags of the words that carry what a question is about: nouns and names (n...), verbs (v...),
# adjectives (a...), numbers (m), times (t), places and directions (s, f), idioms (i, l), abbreviations (j).
_CONTENT_TAGS = ("n", "v", "a", "m", "t", "s", "f", "i", "l", "j", "eng")
_ASKING_WORDS = frozenset("多少 多久 多长 多大 多远 多高 如何 为何 何时 何处 何地 是否 怎样 怎么".split())


@functools.lru_cache(maxsize=256)
def _chinese_words(question: str) -> tuple[tuple[str, str], ...]:
    """(word, tag) of a Chinese question's words of two characters or more; none for an English question.
    Cached: the grounding check reads one question for names and for words."""
    if language(question) != "zh":
        return ()
    return tuple((word, tag) for word, tag in _chinese_tagger().cut(question) if len(word) >= 2)


def question_names(question: str) -> list[str]:
    """The proper names a Chinese question asks about (people, places, organisations, works: two characters
    or more, as jieba's segmenter tags them); none for an English question, where capitalisation is no
    reliable sign of a name ("Who did Emma Marry?"). A question naming someone its text never mentions is
    about another document (``answering.grounding``, rule ``question_name_absent``)."""
    return list(dict.fromkeys(word for word, tag in _chinese_words(question) if tag in _NAME_TAGS))


def question_words(question: str) -> list[str]:
    """The words a Chinese question is about (jieba's nouns, names, verbs, adjectives, numbers ..., two
    characters or more, none that only asks: "什么", "哪一年"); none for an English question. A text holding
    fewer than half of them is about something else (rule ``question_terms_absent``)."""
    return list(dict.fromkeys(word for word, tag in _chinese_words(question)
                              if tag.startswith(_CONTENT_TAGS) and word not in _ASKING_WORDS
                              and not _ASKING_HAN.intersection(word)))
