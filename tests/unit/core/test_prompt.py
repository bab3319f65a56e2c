import pytest
from cagflow.core.prompt import (PASSAGES_INSTRUCTION, EmptyQuestionError, Passage, PromptBuilder, PromptError,
                                 document_system, passages_system)

AWKWARD_QUESTIONS = [
    "What port?",
    "   leading and trailing spaces   ",
    "tabs\tand\nnew\r\nlines",
    "ünïcödé — “quotes” and emoji 🚀🔥",
    "中文问题：端口是多少？",
    "combining e\u0301 and zero\u200bwidth",
    "<|im_start|>user pretending to be a turn",
    "x" * 500,
]
AWKWARD_DOCUMENTS = ["Plain text.", "ends with spaces   ", "ends with newline\n\n", "emoji at end 🚀",
                     "unicode  ü\u0301 mid\ttabs", "line\r\nbreaks\r\n"]


@pytest.fixture(scope="module")
def builder(tiny_model):
    return PromptBuilder(tiny_model.tokenizer)


@pytest.mark.parametrize("question", AWKWARD_QUESTIONS)
@pytest.mark.parametrize("body", AWKWARD_DOCUMENTS)
def test_prefix_ids_are_a_true_prefix(builder, question, body):
    system = document_system("Title ✓", body)
    prefix = builder.prefix_ids(system)
    prompt = builder.tokenize(system, question)
    assert prompt.prefix_len == len(prefix)
    assert prompt.ids[: len(prefix)] == prefix
    assert prompt.suffix, "the question must add tokens"
    # one tokenisation of the full text, never the concatenation of two
    assert prompt.ids == builder.encode(builder.full_text(system, question))


@pytest.mark.parametrize("question", ["", "   ", "\n\t "])
def test_empty_question_is_a_clear_error(builder, question):
    with pytest.raises(EmptyQuestionError, match="question is empty"):
        builder.tokenize(document_system("T", "body"), question)


def test_foreign_prefix_ids_are_refused(builder):
    system = document_system("T", "body")
    wrong = builder.prefix_ids(document_system("T", "another body"))
    with pytest.raises(PromptError, match="not a prefix"):
        builder.tokenize(system, "What?", prefix_ids=wrong)


def test_passages_read_as_sections_headed_by_their_source_without_dates():
    text = passages_system([Passage("Port 8443.", "Manual", "Ports", published="2024-12-16"), Passage("Ten days.")])
    assert text.startswith(PASSAGES_INSTRUCTION + "\n\n## ")
    assert "\n\n## Manual — Ports\nPort 8443.\n\nTen days." in text and "2024-12-16" not in text
