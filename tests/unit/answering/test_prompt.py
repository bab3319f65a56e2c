import pytest
from cagflow.answering.prompt import (WORDINGS, EmptyQuestionError, Passage, PromptBuilder, PromptError, declined_answer,
                                 document_system, language, passages_system)
from cagflow.answering.record import answer_record

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


@pytest.mark.parametrize("question", ["Which port?", "端口是多少？"])
def test_relevance_prompt_follows_the_same_prefix_and_asks_in_the_questions_language(builder, question):
    system = document_system("Manual", "The console listens on 8443.")
    updates = [Passage("The console now listens on 9443.")]
    plain = builder.tokenize_relevance(system, question)
    assert plain.ids[:plain.prefix_len] == builder.prefix_ids(system)
    words = WORDINGS["zh" if "端口" in question else "en"]
    text = builder.relevance_text(system, question, updates)
    assert words.relevance_question.format(question=question) in text and words.newer_label in text
    assert builder.tokenize_relevance(system, question, updates=updates).prefix_len == plain.prefix_len
    answer = "It listens on {8443}."  # braces in an answer are text, not a format field
    checked = builder.relevance_text(system, question, answer=answer)
    assert words.answer_check.format(question=question, answer=answer) in checked and answer in checked
    assert words.relevance_question.format(question=question) not in checked
    assert builder.tokenize_relevance(system, question, answer=answer).prefix_len == plain.prefix_len


# The generation prompt of Qwen3's chat template, with its switch for thinking.
THINKING_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")


def test_a_template_that_can_think_renders_with_thinking_off(tiny_model_dir):
    """The answer starts after an empty thinking block (the relevance check reads its first token), and the
    system turn is still the prefix."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tokenizer.chat_template = THINKING_TEMPLATE
    builder = PromptBuilder(tokenizer)
    system = document_system("Manual", "The console listens on 8443.")
    for text in (builder.full_text(system, "Which port?"), builder.relevance_text(system, "Which port?")):
        assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    prompt = builder.tokenize(system, "Which port?")
    assert prompt.ids[:prompt.prefix_len] == builder.prefix_ids(system)


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
    assert text.startswith(WORDINGS["en"].passages_instruction + "\n\n## ")
    assert "\n\n## Manual — Ports\nPort 8443.\n\nTen days." in text and "2024-12-16" not in text


@pytest.mark.parametrize(("text", "expected"), [
    ("Which port does the console use?", "en"), ("云帆网关的控制台用哪个端口？", "zh"),
    ("YF-G300 网关支持 TLS 1.3 吗？", "zh"),  # Chinese naming Latin identifiers
    ("What does 云帆 mean in the Yunfan product name?", "en"), ("", "en"), ("8443", "en"),
])
def test_language_is_chinese_when_han_characters_outnumber_latin_words(text, expected):
    assert language(text) == expected


def test_chinese_documents_and_questions_are_instructed_in_chinese(builder):
    system = document_system("云帆数据网关运维手册", "网页控制台监听 9443 端口。")
    assert system.startswith(WORDINGS["zh"].document_instruction + "\n\n文档: 云帆数据网关运维手册")
    assert document_system("Manual", "The console listens on port 8443.").startswith(
        WORDINGS["en"].document_instruction)
    chinese = builder.full_text(system, "控制台用哪个端口？")
    assert WORDINGS["zh"].question_reminder in chinese
    english = builder.full_text(system, "Which port does the console use?")  # an English question, same snapshot
    assert WORDINGS["en"].question_reminder in english and english.startswith(builder.prefix_text(system))
    updates = builder.full_text(system, "控制台超时多久？", updates=[Passage("超时改为 15 分钟。")])
    assert "[较新文本] 超时改为 15 分钟。" in updates and WORDINGS["zh"].updates_reminder in updates
    assert passages_system([Passage("端口 9443。")], "端口是多少？").startswith(WORDINGS["zh"].passages_instruction)


def test_a_declined_answer_reads_in_the_language_of_the_question():
    fields = dict(model_answer="YF-E105 表示磁盘空间不足。", answered=False, decline_reason="unsupported_figures",
                  route="cache", route_reason="in_scope", cache_hit=True, snapshot=None, release_id=None,
                  finish_reason="eos", timings_ms={}, prompt_tokens=10, reused_tokens=5, generated_tokens=3)
    chinese = answer_record(question="告警 YF-E105 代表什么？", **fields)
    assert chinese["answer"] == declined_answer("告警 YF-E105 代表什么？") == "文档中没有相关信息。"
    assert chinese["model_answer"] == "YF-E105 表示磁盘空间不足。"
    english = answer_record(question="What does alarm E-408 mean?", **{**fields, "model_answer": "文档中没有相关信息。"})
    assert english["answer"] == "The documents do not contain the answer." and "model_answer" not in english
