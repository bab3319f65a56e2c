"""The answer rules: every check that declines, re-asks or gates an answer, by name.

One registry, one config list (``rules.disabled``), one name everywhere: the answer record's
``decline_reason`` and ``rules_fired``, the ``cagflow_declined_total`` metric's label, and the ablation table
of ``cagflow bench answers --ablate`` (bench/README.md), which reports what each rule does on public data.
A rule that is switched off is still evaluated and reported in ``rules_fired``; it just decides nothing, so
one benchmark run measures what every rule would change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Rule:
    name: str
    acts: Literal["decline", "reask", "gate"]  # declines an answer, asks again, or declines before the model
    where: Literal["engine", "router"]
    summary: str


RULES: dict[str, Rule] = {rule.name: rule for rule in (
    Rule("unsupported_figures", "decline", "engine",
         "the answer states a number or identifier (or a unit for it) that its document and passages lack, or "
         "the question names an identifier they lack"),
    Rule("off_topic_figures", "decline", "engine",
         "an amount is asked and each figure stated stands in the source only in sentences off the question's topic"),
    Rule("question_name_absent", "decline", "engine",
         "a Chinese question names a person, place, organisation or work (jieba's tags) that its document and "
         "passages lack: it is about another document"),
    Rule("question_terms_absent", "decline", "engine",
         "a Chinese question most of whose words (jieba: nouns, verbs, numbers ...; two characters or more) its "
         "document and passages lack: it is about another document"),
    Rule("not_in_documents", "decline", "engine",
         "the answer check: P(yes, the text gives this answer to the question) below "
         "model.relevance.decline_below_<lang>"),
    Rule("reask_document_alone", "reask", "engine",
         "a decline with newer passages after the snapshot is asked again over the document alone"),
    Rule("reask_relevant_decline", "reask", "engine",
         "a decline whose relevance is at least model.relevance.reask_from_<lang> is asked again"),
    Rule("no_relevant_passage", "gate", "router",
         "retrieval: no chunk as similar to the question as service.answerable_threshold; declined unasked"),
)}

# The order a decline reason is chosen in when several rules fire.
DECLINE_ORDER = tuple(name for name, rule in RULES.items() if rule.acts == "decline")


def check_names(names: list[str]) -> list[str]:
    """``names`` when each is a rule; else ValueError naming the unknown ones and the known ones."""
    unknown = [name for name in names if name not in RULES]
    if unknown:
        raise ValueError(f"unknown rule(s) {', '.join(unknown)}; the rules are {', '.join(RULES)}")
    return names
