"""The prompt template: a fixed header + document block whose tokens are a true prefix of every prompt.

The document (or retrieved passages) goes into the system turn; the question, followed by a short reminder
to answer only from that text, is the user turn. On the ``cache+retrieval`` route, passages of newer
documents that update the cached one go into the user turn ahead of the question: the system turn stays the
snapshot's prefix, and the passages cost only their own prefill. The prefix is the rendered system turn
alone. We tokenise the full prompt once and split it at the prefix's token count, then check the split
really is the snapshot's prefix: tokenising prefix and question separately can merge tokens differently at
the boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import CagflowError

TEMPLATE_VERSION = "cagflow-prompt-v2"

# What every route answers when the documents do not hold the answer (``cagflow.core.grounding``).
DECLINED_ANSWER = "The documents do not contain the answer."
_GROUNDING = ("Quote numbers, codes, names and durations exactly as written there. If the answer is not there, "
              f"reply only: {DECLINED_ANSWER} Answer in one or two short sentences.")
# Repeated after the question, where a small model heeds it most: Qwen2.5-1.5B declined 22 of 43 unanswerable
# sample questions with it and 9 without, and found nearly as many facts (55 and 56 of 59).
QUESTION_REMINDER = ("(Answer only from the text above. If it does not answer this exact question, "
                     f"reply: {DECLINED_ANSWER})")
# The user turn of the cache+retrieval route: newer passages first, then the question and this reminder.
# Every token of it is prefilled per request, so it is as short as a plain reminder plus the passages.
UPDATES_REMINDER = ("(Answer only from the texts above; a newer text overrides the document. If they do not answer "
                    f"this exact question, reply: {DECLINED_ANSWER})")
DOCUMENT_INSTRUCTION = ("You are a support assistant. Answer the user's question using only the document below. "
                        f"{_GROUNDING}")
PASSAGES_INSTRUCTION = ("You are a support assistant. Answer the user's question using only the documents below. "
                        f"{_GROUNDING}")


class PromptError(CagflowError, ValueError):
    """A question or document that cannot be turned into a valid prompt."""

    code = "invalid_prompt"


class EmptyQuestionError(PromptError):
    """A question with no text."""

    code = "empty_question"


@dataclass(frozen=True)
class Passage:
    text: str
    title: str = ""
    section: str = ""
    published: str = ""  # ISO date of the passage's document, when known (cited, not shown to the model)


def document_system(title: str, body: str) -> str:
    return f"{DOCUMENT_INSTRUCTION}\n\nDocument: {title}\n\n{body}"


def passages_system(passages: Sequence[Passage]) -> str:
    """Each passage under a heading of its document's title and section, as a document reads. Qwen2.5-1.5B
    answered 11 of 20 release-note questions this way against 7 with numbered, dated labels: it found the
    version in a heading ("Skerry 5.1.1 Release Notes") and no longer gave a label's date for the date a
    passage mentions."""
    blocks = []
    for passage in passages:
        label = " — ".join(part for part in (passage.title, passage.section) if part)
        blocks.append(f"## {label}\n{passage.text}" if label else passage.text)
    return f"{PASSAGES_INSTRUCTION}\n\n" + "\n\n".join(blocks)


def updates_text(passages: Sequence[Passage]) -> str:
    """The newer passages of the cache+retrieval route, as they stand ahead of the question: marked newer,
    without titles or dates (the answer record cites them; every token here is prefilled per request, and a
    date in the label was taken for the answer to "on what date...?")."""
    return "\n\n".join(f"[Newer text] {passage.text}" for passage in passages)


def clean_question(question: str) -> str:
    if not isinstance(question, str):
        raise PromptError("question must be a string")
    question = question.strip()
    if not question:
        raise EmptyQuestionError("question is empty")
    if "\x00" in question:
        raise PromptError("question contains a NUL character")
    return question


@dataclass(frozen=True)
class TokenizedPrompt:
    ids: list[int]
    prefix_len: int

    @property
    def suffix(self) -> list[int]:
        return self.ids[self.prefix_len:]


class PromptBuilder:
    """Renders prompts with the model's chat template (or a plain fallback for base models)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None))

    def prefix_text(self, system: str) -> str:
        if self.chat:
            return self.tokenizer.apply_chat_template([{"role": "system", "content": system}], tokenize=False)
        return f"{system}\n\n"

    def full_text(self, system: str, question: str, updates: Sequence[Passage] = ()) -> str:
        if updates:
            question = f"{updates_text(updates)}\n\n{clean_question(question)}\n\n{UPDATES_REMINDER}"
        else:
            question = f"{clean_question(question)}\n\n{QUESTION_REMINDER}"
        if self.chat:
            return self.tokenizer.apply_chat_template(
                [{"role": "system", "content": system}, {"role": "user", "content": question}],
                tokenize=False, add_generation_prompt=True)
        return f"{system}\n\nQuestion: {question}\nAnswer:"

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prefix_ids(self, system: str) -> list[int]:
        return self.encode(self.prefix_text(system))

    def tokenize(self, system: str, question: str, prefix_ids: Sequence[int] | None = None,
                 updates: Sequence[Passage] = ()) -> TokenizedPrompt:
        """Tokenise the full prompt once and split it where the prefix ends.

        ``prefix_ids`` (a snapshot's) must be a true prefix of the full ids, or reusing that cache would be wrong.
        """
        prefix_text = self.prefix_text(system)
        full_text = self.full_text(system, question, updates)
        if not full_text.startswith(prefix_text):
            raise PromptError("the chat template does not render the system turn as a prefix of the prompt")
        ids = self.encode(full_text)
        expected = list(prefix_ids) if prefix_ids is not None else self.encode(prefix_text)
        if ids[:len(expected)] != expected:
            raise PromptError("prefix tokens are not a prefix of the prompt tokens (template or tokenizer changed?)")
        if len(ids) == len(expected):
            raise PromptError("prompt has no tokens after the prefix")
        return TokenizedPrompt(ids, len(expected))
