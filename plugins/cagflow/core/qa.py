"""The sample question set: questions with reference answers, labelled in-scope (a fixed document
answers them) or out-of-scope (a variable document, or nothing)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class QAItem:
    id: str
    question: str
    reference_answer: str
    keywords: tuple[str, ...]
    in_scope: bool
    doc_id: str | None

    def is_correct(self, answer: str) -> bool:
        """All keywords present (case-insensitive): a coarse, honest check for short factual answers."""
        text = answer.lower()
        return all(keyword.lower() in text for keyword in self.keywords)


def load_qa(path: str | Path) -> list[QAItem]:
    items = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            items.append(QAItem(raw["id"], raw["question"], raw["reference_answer"], tuple(raw.get("keywords", ())),
                                bool(raw["in_scope"]), raw.get("doc_id")))
        except (ValueError, KeyError) as exc:
            raise ValueError(f"{path}:{number}: malformed QA line ({exc})") from None
    return items
