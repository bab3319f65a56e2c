"""How public datasets score an answer, by their own rules: SQuAD 2.0's normalisation, exact match and token
F1 for English, CMRC 2018's for Chinese (punctuation removed, Han characters one token each, F1 over the
longest common run of tokens). Both take the best score over the gold answers.

The model answers in sentences, not spans, so exact match and F1 stay low even when the answer is right;
``contains_gold`` (a gold answer, normalised the dataset's way, stands whole inside the normalised answer) is
the figure that says whether the fact was given. ``unsupported_figures`` lists the numbers and English names
an answer states that none of its sources holds: what a reader could not check.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Iterable, Sequence

# The decline thresholds of the answer check a run is replayed at (``bench answers``: sample set and datasets).
RELEVANCE_GRID = tuple(round(0.05 * step, 2) for step in range(20)) + (0.96, 0.97, 0.98, 0.99)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)
# CMRC 2018's evaluation script drops these characters before comparing (its "……" is two of them).
_CMRC_PUNCTUATION = set("-:_*^/\\~`+=，。：？！“”；’《》……·、「」（）－～『』")
_HAN = re.compile(r"[\u4e00-\u9fa5]")  # CMRC's script's own range, kept so scores match it
_LATIN_TOKEN = re.compile(r"\w+|[^\w\s]", re.UNICODE)


def stands_at(record: dict, threshold: float) -> bool | None:
    """Whether an answer record would stand at another decline threshold of the answer check: an answer the
    model gave and the check rated stands from its relevance up (a ``not_in_documents`` decline keeps the
    model's words as ``model_answer``). None: the check did not decide it, so no threshold changes it."""
    relevance = record.get("relevance")
    if relevance is None or record.get("decline_reason") not in (None, "not_in_documents"):
        return None
    return relevance >= threshold


def squad_normalize(text: str) -> str:
    """SQuAD's official normalisation: lower case, punctuation and articles removed, spaces folded."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def cmrc_normalize(text: str) -> str:
    """CMRC 2018's comparison form: lower case, its punctuation removed; spaces go too, since Chinese text
    sets them or not."""
    return "".join(ch for ch in text.lower().strip() if ch not in _CMRC_PUNCTUATION and not ch.isspace())


def cmrc_tokens(text: str) -> list[str]:
    """CMRC 2018's mixed segmentation: each Han character a token, other runs split into words (its script
    uses NLTK's word tokenizer there; a word/punctuation split gives the same tokens for answers' digits and
    Latin words)."""
    tokens: list[str] = []
    pending = ""
    for char in text.lower().strip():
        if char in _CMRC_PUNCTUATION:
            continue
        if _HAN.match(char):
            tokens.extend(_LATIN_TOKEN.findall(pending))
            pending = ""
            tokens.append(char)
        else:
            pending += char
    tokens.extend(_LATIN_TOKEN.findall(pending))
    return tokens


def _longest_common_run(a: Sequence[str], b: Sequence[str]) -> int:
    best = 0
    previous = [0] * (len(b) + 1)
    for token in a:
        current = [0] * (len(b) + 1)
        for j, other in enumerate(b, start=1):
            if token == other:
                current[j] = previous[j - 1] + 1
                best = max(best, current[j])
        previous = current
    return best


def _squad_f1(gold: str, prediction: str) -> float:
    gold_tokens, predicted = squad_normalize(gold).split(), squad_normalize(prediction).split()
    if not gold_tokens or not predicted:
        return float(gold_tokens == predicted)
    same = sum((Counter(gold_tokens) & Counter(predicted)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _cmrc_f1(gold: str, prediction: str) -> float:
    gold_tokens, predicted = cmrc_tokens(gold), cmrc_tokens(prediction)
    common = _longest_common_run(gold_tokens, predicted)
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _normalize(language: str):
    return cmrc_normalize if language == "zh" else squad_normalize


def exact_match(golds: Iterable[str], prediction: str, language: str) -> bool:
    normalize = _normalize(language)
    return any(normalize(gold) == normalize(prediction) for gold in golds)


def f1(golds: Iterable[str], prediction: str, language: str) -> float:
    score = _cmrc_f1 if language == "zh" else _squad_f1
    return max((score(gold, prediction) for gold in golds), default=0.0)


def contains_gold(golds: Iterable[str], prediction: str, language: str) -> bool:
    """A gold answer stands whole in the answer, both normalised the dataset's way (English on word
    boundaries: "10" is not found in "100")."""
    if language == "zh":
        answer = cmrc_normalize(prediction)
        return any(cmrc_normalize(gold) and cmrc_normalize(gold) in answer for gold in golds)
    answer = f" {squad_normalize(prediction)} "
    return any(squad_normalize(gold) and f" {squad_normalize(gold)} " in answer for gold in golds)


_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
# A capitalised English word that does not start a sentence: a name the answer states.
_NAME = re.compile(r"(?<![.!?:]\s)(?<!^)\b[A-Z][a-zA-Z\-]+")


def unsupported_figures(answer: str, question: str, sources: Iterable[str]) -> list[str]:
    """The numbers (any language) and capitalised English words inside a sentence that the answer states
    but neither the question nor any source holds (case-insensitive; thousands separators ignored)."""
    known = " ".join([question, *sources]).lower()
    known_numbers = {number.replace(",", "") for number in _NUMBER.findall(known)}
    missing = [number for number in _NUMBER.findall(answer) if number.replace(",", "") not in known_numbers]
    missing += [name for name in _NAME.findall(answer.strip()) if name.lower() not in known]
    return list(dict.fromkeys(missing))
