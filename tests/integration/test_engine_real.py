"""Shared-prefix decoding on the real models (SmolLM2 on both recipes, Qwen2.5-0.5B on int8 with the Chinese
manual): single, streamed, batched and cache+retrieval answers from a snapshot are token-identical to the full
prompt, the logits agree, and the snapshot is never written."""

import pytest
import torch
from cagflow.documents.parsing import parse_file
from cagflow.engine.answers import Answer
from cagflow.engine.engine import Engine
from cagflow.answering.prompt import Passage

QUESTIONS = ["Which port does the web console use?", "How long are backups kept?",
             "Who can approve an emergency change?"]


@pytest.mark.real_model
@pytest.mark.parametrize("model", ["real_model", "real_fp32_model"])
def test_real_model_shared_prefix_is_exact(model, request, corpus):
    engine = Engine(request.getfixturevalue(model), max_context_tokens=600, max_new_tokens=10,
                    question_budget_tokens=128)
    assert (engine.prefix_decoder if model == "real_fp32_model" else engine.fast) is not None
    entry = corpus.tier("fixed")[0]
    snapshot = engine.precompute(engine.split(entry.doc_id, entry.version, parse_file(corpus.file(entry),
                                                                                      entry.title))[0])
    tensors = snapshot.keys + snapshot.values
    before = [t.clone() for t in tensors]
    pointers = [t.data_ptr() for t in tensors]

    full = [engine.answer(q, snapshot=snapshot, reuse_cache=False) for q in QUESTIONS]
    for question, reference in zip(QUESTIONS, full):
        assert engine.answer(question, snapshot=snapshot).token_ids == reference.token_ids
    for question in QUESTIONS[:2]:
        cached = engine.suffix_logits(question, snapshot)
        uncached = engine.suffix_logits(question, snapshot, reuse_cache=False)
        assert torch.allclose(cached, uncached, atol=1e-4), (question, (cached - uncached).abs().max())
        assert engine.fast is None or torch.equal(cached, uncached)  # the int8 engine: bitwise
    streamed = list(engine.stream(QUESTIONS[0], snapshot=snapshot))
    assert isinstance(streamed[-1], Answer) and streamed[-1].token_ids == full[0].token_ids
    assert "".join(streamed[:-1]).strip() == full[0].text
    updates = [Passage("Since Skerry 5.4.0 the web console listens on port 9443.", "Skerry 5.4.0 Release Notes",
                       "Changes", "2025-03-10")]
    combined = engine.answer(QUESTIONS[0], snapshot=snapshot, context=updates)
    assert combined.token_ids == engine.answer(QUESTIONS[0], snapshot=snapshot, context=updates,
                                               reuse_cache=False).token_ids
    _declined_then_alone_or_combined(combined, full[0])
    cached = engine.suffix_logits(QUESTIONS[0], snapshot, updates=updates)
    uncached = engine.suffix_logits(QUESTIONS[0], snapshot, reuse_cache=False, updates=updates)
    assert torch.allclose(cached, uncached, atol=1e-4) and (engine.fast is None or torch.equal(cached, uncached))
    batch = engine.answer_batch(QUESTIONS, snapshot)
    assert [a.token_ids for a in batch] == [a.token_ids for a in full]
    assert [a.finish_reason for a in batch] == [a.finish_reason for a in full]

    assert [t.data_ptr() for t in snapshot.keys + snapshot.values] == pointers
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot.keys + snapshot.values))


def _declined_then_alone_or_combined(combined: Answer, alone: Answer) -> None:
    """An answer with a newer passage after the snapshot is that route's, or - when the model declined next to
    the passage - the snapshot's alone (``Engine.stream``), token for token."""
    if combined.route == "cache":
        assert combined.token_ids == alone.token_ids
    else:
        assert combined.route == "cache+retrieval"


ZH_QUESTIONS = ["网页控制台使用哪个端口？", "告警 YF-E104 表示什么？", "控制台空闲多久会自动退出？"]


@pytest.mark.real_model
def test_a_chinese_document_and_questions_are_exact_on_qwen(real_qwen_model, corpus):
    """The Chinese sample manual under its Chinese instruction, asked in Chinese: cached, streamed, batched
    and cache+retrieval answers are the full prompt's tokens, and they are Chinese; the logits are bitwise the
    full prompt's (Qwen2's q/k/v biases and 14:2 grouped heads), and the snapshot is left as it was."""
    engine = Engine(real_qwen_model, max_context_tokens=700, max_new_tokens=16, question_budget_tokens=128)
    entry = next(entry for entry in corpus.tier("fixed") if entry.doc_id == "yunfan-ops-manual")
    parts = engine.split(entry.doc_id, entry.version, parse_file(corpus.file(entry), entry.title))
    snapshot = engine.precompute(parts[0])
    assert snapshot.system_prompt.startswith("你是技术支持助手")
    before = [t.clone() for t in snapshot.keys + snapshot.values]
    full = [engine.answer(q, snapshot=snapshot, reuse_cache=False) for q in ZH_QUESTIONS]
    assert [engine.answer(q, snapshot=snapshot).token_ids for q in ZH_QUESTIONS] == [a.token_ids for a in full]
    assert [a.token_ids for a in engine.answer_batch(ZH_QUESTIONS, snapshot)] == [a.token_ids for a in full]
    streamed = list(engine.stream(ZH_QUESTIONS[0], snapshot=snapshot))
    assert streamed[-1].token_ids == full[0].token_ids
    assert any("\u4e00" <= char <= "\u9fff" for char in full[0].text), full[0].text  # answered in Chinese
    updates = [Passage("自 3.2.0 版本起，控制台空闲超时由 20 分钟改为 15 分钟。", "云帆数据网关 3.2.0 版本发布说明", "变更")]
    combined = engine.answer(ZH_QUESTIONS[2], snapshot=snapshot, context=updates)
    assert combined.token_ids == engine.answer(ZH_QUESTIONS[2], snapshot=snapshot, context=updates,
                                               reuse_cache=False).token_ids
    _declined_then_alone_or_combined(combined, full[2])
    assert torch.equal(engine.suffix_logits(ZH_QUESTIONS[1], snapshot),
                       engine.suffix_logits(ZH_QUESTIONS[1], snapshot, reuse_cache=False))
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot.keys + snapshot.values))
