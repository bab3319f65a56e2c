"""An answer as the engine gives it: its text, route and timings, with the grounding verdict against the text
it was answered from; and the part of that text closest to a question (what a declined answer is re-asked with)."""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator, Sequence

from ..answering import grounding
from ..answering.prompt import Passage, passages_system
from ..documents.snapshot import Snapshot
from ..documents.text import overlap_scores


class Stages:
    """Where an answer's time went, stage by stage: the laps, back to back, add up to its total."""

    def __init__(self, started: float):
        self.last = started
        self.laps: list[tuple[str, float, float]] = []  # (stage, start, end): the answer's trace spans

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.laps.append((stage, self.last, now))
        self.last = now

    @property
    def ms(self) -> dict[str, float]:
        """Milliseconds per stage, a stage run twice (the answer's rest after the relevance check) summed."""
        totals: dict[str, float] = {}
        for stage, start, end in self.laps:
            totals[stage] = totals.get(stage, 0.0) + (end - start) * 1000
        return {stage: round(ms, 2) for stage, ms in totals.items()}


@dataclass
class Answer:
    text: str
    route: str  # "cache" | "cache+retrieval" | "retrieval" | "full" | "question-only"
    prompt_tokens: int
    reused_tokens: int
    ttft_s: float
    total_s: float
    finish_reason: str  # "eos" | "length"
    token_ids: list[int] = field(default_factory=list)
    snapshot_key: str | None = None
    answered: bool = True  # False: declined, or states figures its document or passages lack (answering.grounding)
    unsupported: tuple[str, ...] = ()
    misses: str | None = None  # declined: the answer is next to the question (answering.grounding: off_topic_figures)
    relevance: float | None = None  # the model's P("yes") that its text answers the question (None: not asked)
    not_relevant: bool = False  # declined because that probability was below the engine's threshold
    reasked: bool = False  # the model declined, judged its text to answer after all, and was asked again
    rules_fired: tuple[str, ...] = ()  # the rules (cagflow.rules) that held for this answer, switched off or not
    # milliseconds per stage (Stages): prefix (the system turn: a snapshot, reused passage states or a
    # prefill), answer (question prefill and decoding), relevance (the check), reask (second attempts)
    stages_ms: dict[str, float] = field(default_factory=dict)
    # the same stages as (stage, start, end) ``time.perf_counter()`` instants of the computing process, in order:
    # its trace spans (inference.triton); meaningless elsewhere, so not in ``to_dict``
    stage_laps: list[tuple[str, float, float]] = field(default_factory=list, repr=False)

    @property
    def decline_reason(self) -> str | None:
        if self.not_relevant:
            return "not_in_documents"
        return grounding.Grounding(self.answered, self.unsupported, self.misses).reason

    @property
    def decode_tokens_per_s(self) -> float:
        decode_time = self.total_s - self.ttft_s
        return (len(self.token_ids) - 1) / decode_time if len(self.token_ids) > 1 and decode_time > 0 else 0.0

    def to_dict(self) -> dict:
        record = asdict(self)
        del record["stage_laps"]
        return record


def _answer_source(snapshot: Snapshot | None, context: Sequence[Passage] | None) -> str | None:
    """The text an answer must be grounded in: the snapshot's document, the passages, or both."""
    texts = [snapshot.system_prompt] if snapshot is not None else []
    if context is not None:
        texts.append(passages_system(context))
    return "\n\n".join(texts) if texts else None


def grounded_answer(text: str, source: str | None, question: str, disabled: frozenset[str], **fields) -> Answer:
    """The answer with its grounding verdict against the text it was answered from (none: a question alone)."""
    verdict = grounding.check(text, source, question, disabled)
    return Answer(text, **fields, answered=verdict.answered, unsupported=verdict.unsupported,
                  misses=verdict.misses, rules_fired=verdict.fired)


@dataclass
class Decoded:
    """What one greedy decoding produced so far, and how much of its text has been shown."""

    started: float  # perf_counter of the request, for ttft_s
    tokens: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    finish: str = "length"
    emitted: str = ""

    def rest(self, tokenizer) -> Iterator[str]:
        """The text not shown yet (what was held back)."""
        text = tokenizer.decode(self.tokens, skip_special_tokens=True)
        if len(text) > len(self.emitted):
            yield text[len(self.emitted):]

    def answer(self, tokenizer, snapshot: Snapshot | None, context: Sequence[Passage] | None, question: str,
               route: str, prompt_tokens: int, reused: int, disabled: frozenset[str]) -> Answer:
        text = tokenizer.decode(self.tokens, skip_special_tokens=True).strip()
        return grounded_answer(text, _answer_source(snapshot, context), question, disabled, route=route,
                               prompt_tokens=prompt_tokens, reused_tokens=reused, ttft_s=self.ttft_s, total_s=0.0,
                               finish_reason=self.finish, token_ids=self.tokens,
                               snapshot_key=str(snapshot.key) if snapshot is not None else None)




def document_body(snapshot: Snapshot) -> str:
    """The snapshot's document as it stands in its system turn, less the instruction and title."""
    return snapshot.system_prompt.split("\n\n", 2)[-1]


def closest_part(question: str, snapshot: Snapshot | None, context: Sequence[Passage] | None) -> str:
    """The section of the snapshot's document, or the passage, that shares the most with the question
    (``text.overlap_scores``)."""
    texts = (re.split(r"\n\n(?=## )", document_body(snapshot)) if snapshot is not None
             else [passage.text for passage in context or ()])
    if not texts:
        return ""
    scores = overlap_scores(question, texts)
    return texts[max(range(len(texts)), key=lambda i: (scores[i], -i))]
