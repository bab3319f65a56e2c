"""The sample question set: questions with reference answers, labelled in-scope (a fixed document
answers them) or out-of-scope (a variable document, or nothing), and by kind: ``near_miss`` (the right
fact sits next to a tempting wrong one), ``near_miss_absent`` (names an identifier one detail away from a
real one, so nothing answers it), ``unanswerable``, and ``conflict`` (a newer variable document,
``updated_by``, changed the fixed document's fact: the right answer is the newer one)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..documents.text import language
from .grounding import is_declined


@dataclass(frozen=True)
class QAItem:
    id: str
    question: str
    reference_answer: str
    keywords: tuple[str, ...]
    in_scope: bool
    doc_id: str | None
    kind: str = "fact"
    updated_by: str | None = None  # conflict questions: the variable document holding the newer fact

    @property
    def answerable(self) -> bool:
        return self.doc_id is not None

    def has_keywords(self, text: str) -> bool:
        """All keywords present (case-insensitive; a keyword that is a number only as a whole number, so "5"
        is not found in "15" or "2025"; spaces ignored, as Chinese text sets them or not: "15 分钟", "15分钟"): a
        coarse, honest check for short factual answers."""
        lowered = text.lower()
        squeezed = re.sub(r"\s+", "", lowered)
        return all(re.search(rf"(?<![\d.,]){keyword}(?![\d]|[.,]\d)", lowered) if keyword.isdigit()
                   else keyword.lower() in lowered or re.sub(r"\s+", "", keyword.lower()) in squeezed
                   for keyword in self.keywords)

    @property
    def language(self) -> str:
        return language(self.question)

    def is_correct(self, answer: str, answered: bool | None = None) -> bool:
        """Answerable: answered, with every keyword. Unanswerable: declined. ``answered`` is the answer
        record's verdict when there is one; otherwise the answer's own words decide."""
        answered = not is_declined(answer) if answered is None else answered
        return answered and self.has_keywords(answer) if self.answerable else not answered


def load_qa(path: str | Path) -> list[QAItem]:
    items = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            items.append(QAItem(raw["id"], raw["question"], raw["reference_answer"], tuple(raw.get("keywords", ())),
                                bool(raw["in_scope"]), raw.get("doc_id"), raw.get("kind", "fact"),
                                raw.get("updated_by")))
        except (ValueError, KeyError) as exc:
            raise ValueError(f"{path}:{number}: malformed QA line ({exc})") from None
    return items


def halves(items: Sequence[QAItem]) -> tuple[list[QAItem], list[QAItem]]:
    """A calibration half and a held-out half: every other question of each group (fixed-document,
    variable-document, unanswerable) in id order, so both halves hold every group."""
    groups: dict[tuple[bool, bool], list[QAItem]] = {}
    for item in sorted(items, key=lambda item: item.id):
        groups.setdefault((item.in_scope, item.answerable), []).append(item)
    calibration = [item for group in groups.values() for item in group[0::2]]
    held_out = [item for group in groups.values() for item in group[1::2]]
    return calibration, held_out
