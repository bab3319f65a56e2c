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

from ..documents.text import language
from ..errors import CagflowError

TEMPLATE_VERSION = "cagflow-prompt-v3"
# Options every chat template is rendered with; a template that does not read one ignores it. Thinking is off:
# an answer is a few sentences from the given text, and the relevance check reads the first token as yes or no.
CHAT_TEMPLATE_OPTIONS = {"enable_thinking": False}

@dataclass(frozen=True)
class Wording:
    """Everything the prompt says in one language. A Chinese question gets the Chinese reminder (and so a
    Chinese answer); a Chinese document gets the Chinese instruction in its system turn (its snapshot's prefix)."""

    declined: str  # what every route answers when the documents do not hold the answer (answering.grounding)
    document_instruction: str
    passages_instruction: str
    question_reminder: str
    updates_reminder: str
    # The same without the option to decline: a question the model declined although it judged its text to
    # answer it is asked again with these (engine.engine, the relevance check).
    answer_reminder: str
    answer_updates_reminder: str
    # Or with the part of the text closest to the question quoted ahead of it, the option to decline kept: a
    # fact in a table row the model overlooked in the whole document (engine.engine, the relevance check).
    excerpt_label: str
    excerpt_reminder: str
    newer_label: str
    relevance_question: str  # asks whether the text answers ``{question}``, to be answered yes or no
    # asks whether the text gives ``{answer}`` as the answer to ``{question}``: the check of an answer given
    answer_check: str
    yes: str
    no: str


# The reminder is repeated after the question, where a small model heeds it most: Qwen2.5-1.5B declined 22 of
# 43 unanswerable sample questions with it and 9 without, and found nearly as many facts (55 and 56 of 59).
# The cache+retrieval route's user turn (newer passages, question, reminder) is prefilled per request, so
# its reminder is as short as the plain one.
_EN_DECLINED = "The documents do not contain the answer."
_EN_GROUNDING = ("Quote numbers, codes, names and durations exactly as written there. If the answer is not there, "
                 f"reply only: {_EN_DECLINED} Answer in one or two short sentences.")
_ZH_DECLINED = "文档中没有相关信息。"
_ZH_GROUNDING = f"数字、代码、名称和时长须按原文准确引用。如果答案不在其中，只回复：{_ZH_DECLINED}请用中文回答，一两句话即可。"
WORDINGS = {
    "en": Wording(
        declined=_EN_DECLINED,
        document_instruction=("You are a support assistant. Answer the user's question using only the document "
                              f"below. {_EN_GROUNDING}"),
        passages_instruction=("You are a support assistant. Answer the user's question using only the documents "
                              f"below. {_EN_GROUNDING}"),
        question_reminder=("(Answer only from the text above. If it does not answer this exact question, "
                           f"reply: {_EN_DECLINED})"),
        updates_reminder=("(Answer only from the texts above; a newer text overrides the document. If they do not "
                          f"answer this exact question, reply: {_EN_DECLINED})"),
        answer_reminder="(Answer from the text above, in one or two short sentences.)",
        answer_updates_reminder=("(Answer from the texts above, in one or two short sentences; a newer text overrides "
                                 "the document.)"),
        excerpt_label="[Excerpt]",
        excerpt_reminder=("(The excerpt is part of the text above. Answer only from that text. If it does not answer "
                          f"this exact question, reply: {_EN_DECLINED})"),
        newer_label="[Newer text]",
        relevance_question='Does the text above answer this question: "{question}"? Reply Yes or No.',
        answer_check=('Question: "{question}"\nProposed answer: "{answer}"\nDoes the text above say that this is '
                      'the answer to this question? Reply Yes or No.'),
        yes="Yes", no="No"),
    "zh": Wording(
        declined=_ZH_DECLINED,
        document_instruction=f"你是技术支持助手。只根据下面的文档回答用户的问题。{_ZH_GROUNDING}",
        passages_instruction=f"你是技术支持助手。只根据下面的文档回答用户的问题。{_ZH_GROUNDING}",
        question_reminder=f"（只根据上面的文本回答。如果它没有回答这个问题，请回复：{_ZH_DECLINED}）",
        updates_reminder=f"（只根据上面的文本回答；较新的文本优先于文档。如果它们没有回答这个问题，请回复：{_ZH_DECLINED}）",
        answer_reminder="（请根据上面的文本用中文回答，一两句话即可。）",
        answer_updates_reminder="（请根据上面的文本用中文回答，一两句话即可；较新的文本优先于文档。）",
        excerpt_label="[摘录]",
        excerpt_reminder=f"（摘录是上面文本的一部分。只根据该文本回答。如果它没有回答这个问题，请回复：{_ZH_DECLINED}）",
        newer_label="[较新文本]",
        relevance_question="上面的文本能回答这个问题吗：“{question}”？只回答“是”或“否”。",
        answer_check="问题：“{question}”\n候选答案：“{answer}”\n上面的文本是否说明这就是这个问题的答案？只回答“是”或“否”。",
        yes="是", no="否"),
}
DECLINED_ANSWER = _EN_DECLINED


def wording(text: str) -> Wording:
    """The wording in the language of ``text`` (a question, or a document's body)."""
    return WORDINGS[language(text)]


def declined_answer(question: str) -> str:
    """The decline sentence in the question's language."""
    return wording(question).declined


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
    """The system turn of a document (a snapshot's prefix), instructed in the document's language."""
    instruction = wording(body).document_instruction
    label = "文档" if language(body) == "zh" else "Document"
    return f"{instruction}\n\n{label}: {title}\n\n{body}"


def passages_system(passages: Sequence[Passage], question: str = "") -> str:
    """Each passage under a heading of its document's title and section, as a document reads. Qwen2.5-1.5B
    answered 11 of 20 release-note questions this way against 7 with numbered, dated labels: it found the
    version in a heading ("Skerry 5.1.1 Release Notes") and no longer gave a label's date for the date a
    passage mentions."""
    return f"{wording(question).passages_instruction}\n\n" + "".join(passage_piece(passage) for passage in passages)


def passage_piece(passage: Passage) -> str:
    """One passage as it follows the instruction (or the passage before it) in the retrieval route's system
    turn; the unit whose keys and values are computed once and reused (``engine.passage_kv``). It ends with
    its blank line: byte-level tokenizers join punctuation to the newlines after it (".\n\n" is one token),
    so a piece that began with them would not tokenize alone as it does in the prompt."""
    label = " — ".join(part for part in (passage.title, passage.section) if part)
    return f"## {label}\n{passage.text}\n\n" if label else f"{passage.text}\n\n"


def updates_text(passages: Sequence[Passage], question: str = "") -> str:
    """The newer passages of the cache+retrieval route, as they stand ahead of the question: marked newer,
    without titles or dates (the answer record cites them; every token here is prefilled per request, and a
    date in the label was taken for the answer to "on what date...?")."""
    label = wording(question).newer_label
    return "\n\n".join(f"{label} {passage.text}" for passage in passages)


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


@dataclass(frozen=True)
class PassageLayout:
    """A retrieval prompt's system turn: the instruction's ids, each passage's (``passage_piece``), the end's."""

    header: list[int]
    pieces: list[list[int]]
    closing: list[int]

    @property
    def n_tokens(self) -> int:
        """The ids a reused prefix covers: the instruction and the passages."""
        return len(self.header) + sum(map(len, self.pieces))

    @property
    def ids(self) -> list[int]:
        return [*self.header, *(token for piece in self.pieces for token in piece), *self.closing]


class PromptBuilder:
    """Renders prompts with the model's chat template (or a plain fallback for base models)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None))

    def prefix_text(self, system: str) -> str:
        if self.chat:
            return self.tokenizer.apply_chat_template([{"role": "system", "content": system}], tokenize=False,
                                                      **CHAT_TEMPLATE_OPTIONS)
        return f"{system}\n\n"

    def full_text(self, system: str, question: str, updates: Sequence[Passage] = (), may_decline: bool = True,
                  excerpt: str = "") -> str:
        """The whole prompt; ``may_decline=False`` leaves the option to decline out of the reminder; ``excerpt``
        (a part of the system turn's text) is quoted ahead of the question."""
        question = clean_question(question)
        words = wording(question)
        if excerpt:
            if updates:
                raise PromptError("an excerpt is quoted only from a document or passages without newer passages")
            return self._render(system, f"{words.excerpt_label} {excerpt}\n\n{question}\n\n{words.excerpt_reminder}")
        if updates:
            reminder = words.updates_reminder if may_decline else words.answer_updates_reminder
            return self._render(system, f"{updates_text(updates, question)}\n\n{question}\n\n{reminder}")
        reminder = words.question_reminder if may_decline else words.answer_reminder
        return self._render(system, f"{question}\n\n{reminder}")

    def relevance_text(self, system: str, question: str, updates: Sequence[Passage] = (), answer: str = "") -> str:
        """The prompt that asks, after the same system turn (and newer passages), whether the text answers the
        question, or with ``answer``, whether it gives that answer to it: answered by one yes or no token
        (``Engine.relevance``)."""
        question = clean_question(question)
        words = wording(question)
        check = (words.answer_check.format(question=question, answer=answer) if answer
                 else words.relevance_question.format(question=question))
        return self._render(system, f"{updates_text(updates, question)}\n\n{check}" if updates else check)

    def _render(self, system: str, user: str) -> str:
        if self.chat:
            return self.tokenizer.apply_chat_template(
                [{"role": "system", "content": system}, {"role": "user", "content": user}],
                tokenize=False, add_generation_prompt=True, **CHAT_TEMPLATE_OPTIONS)
        return f"{system}\n\nQuestion: {user}\nAnswer:"

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prefix_ids(self, system: str) -> list[int]:
        return self.encode(self.prefix_text(system))

    def passage_layout(self, passages: Sequence[Passage], question: str) -> "PassageLayout":
        """The retrieval route's system turn in tokens: the instruction's (``header``), each passage's on its
        own (``pieces``), then the turn's end. The route's prompt is these ids joined (``tokenize(...,
        joined=True)``), so a passage has the same ids wherever it stands and its reused state fits exactly."""
        system = passages_system(passages, question)
        rendered = self.prefix_text(system)
        header_end = rendered.index(system) + len(wording(question).passages_instruction) + 2  # its blank line
        texts = [passage_piece(passage) for passage in passages]
        closing = rendered[header_end + sum(map(len, texts)):]
        return PassageLayout(self.encode(rendered[:header_end]), [self.encode(text) for text in texts],
                             self.encode(closing))

    def tokenize(self, system: str, question: str, prefix_ids: Sequence[int] | None = None,
                 updates: Sequence[Passage] = (), may_decline: bool = True, excerpt: str = "",
                 joined: bool = False) -> TokenizedPrompt:
        """Tokenise the full prompt once and split it where the prefix ends.

        ``prefix_ids`` (a snapshot's) must be a true prefix of the full ids, or reusing that cache would be wrong;
        ``joined``: they are the system turn's ids as given (``passage_layout``), the rest is tokenised after them.
        """
        return self._split(system, self.full_text(system, question, updates, may_decline, excerpt), prefix_ids,
                           joined)

    def tokenize_relevance(self, system: str, question: str, prefix_ids: Sequence[int] | None = None,
                           updates: Sequence[Passage] = (), joined: bool = False, answer: str = "") -> TokenizedPrompt:
        """The relevance check's prompt, split where the (shared) prefix ends, like ``tokenize``."""
        return self._split(system, self.relevance_text(system, question, updates, answer), prefix_ids, joined)

    def _split(self, system: str, full_text: str, prefix_ids: Sequence[int] | None,
               joined: bool = False) -> TokenizedPrompt:
        prefix_text = self.prefix_text(system)
        if not full_text.startswith(prefix_text):
            raise PromptError("the chat template does not render the system turn as a prefix of the prompt")
        if joined and prefix_ids is not None:
            return TokenizedPrompt([*prefix_ids, *self.encode(full_text[len(prefix_text):])], len(prefix_ids))
        ids = self.encode(full_text)
        expected = list(prefix_ids) if prefix_ids is not None else self.encode(prefix_text)
        if ids[:len(expected)] != expected:
            raise PromptError("prefix tokens are not a prefix of the prompt tokens (template or tokenizer changed?)")
        if len(ids) == len(expected):
            raise PromptError("prompt has no tokens after the prefix")
        return TokenizedPrompt(ids, len(expected))
