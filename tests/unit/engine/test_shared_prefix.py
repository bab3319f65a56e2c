"""Shared-prefix decoding on the tiny model, for both recipes (the int8 engine and fp32 transformers): exact
against the full prompt, single, streamed or batched, and the snapshot is only ever read; architectures the
int8 engine does not support fall back to fp32 transformers and say so."""

import itertools
from types import SimpleNamespace

import pytest
import torch
from cagflow.engine import engine as engine_module
from cagflow.documents.parsing import parse_file
from cagflow.engine.answers import Answer
from cagflow.engine.engine import Engine, SnapshotMismatch
from cagflow.engine.shared_prefix import SharedPrefixDecoder, supports
from cagflow.documents.snapshot import Snapshot

QUESTIONS = ["Which port does the web console use?", "How long are backups kept?", "Who approves a SEV1 change?",
             "What is the exact retention period for audit logs in the archive tier, and who may shorten it?",
             "Port?"]


@pytest.fixture(scope="module", params=["int8", "fp32"])
def engine_and_snapshots(request, tiny_engine, tiny_fp32_engine, corpus):
    """Snapshots of two sizes (one part of ~600 tokens, one of ~250) of the same document."""
    loaded = (tiny_engine if request.param == "int8" else tiny_fp32_engine).loaded
    engine = Engine(loaded, max_context_tokens=900, max_new_tokens=12, question_budget_tokens=128)
    entry = corpus.tier("fixed")[0]
    document = parse_file(corpus.file(entry), entry.title)
    large = engine.precompute(engine.split(entry.doc_id, entry.version, document)[0])
    small_engine = Engine(loaded, max_context_tokens=400, max_new_tokens=12, question_budget_tokens=128)
    small = engine.precompute(small_engine.split(entry.doc_id, entry.version, document)[0])
    assert small.n_tokens < large.n_tokens
    return engine, large, small


def test_llama_family_gets_the_shared_prefix_path(tiny_engine, tiny_fp32_engine):
    assert supports(tiny_fp32_engine.model) and isinstance(tiny_fp32_engine.prefix_decoder, SharedPrefixDecoder)
    assert tiny_engine.fast is not None and tiny_engine.model is None and tiny_engine.recipe.startswith("fastlm")


def test_int8_snapshots_are_bf16_at_half_the_bytes(tiny_engine, tiny_fp32_engine, corpus):
    entry = corpus.tier("fixed")[0]
    document = parse_file(corpus.file(entry), entry.title)
    part = Engine(tiny_engine.loaded, 400, 8, 64).split(entry.doc_id, entry.version, document)[0]
    int8, fp32 = tiny_engine.precompute(part), tiny_fp32_engine.precompute(part)
    assert int8.dtype == torch.bfloat16 and fp32.dtype == torch.float32
    assert int8.n_tokens == fp32.n_tokens and 2 * int8.nbytes == fp32.nbytes
    assert Snapshot.from_bytes(int8.to_bytes()).dtype == torch.bfloat16  # the header records it


def test_the_recipe_is_part_of_the_snapshot_key(tiny_engine, tiny_fp32_engine, corpus):
    """A snapshot of one recipe is never reused by the other: another fingerprint, another key, refused."""
    assert tiny_engine.fingerprint != tiny_fp32_engine.fingerprint
    entry = corpus.tier("fixed")[0]
    part = Engine(tiny_engine.loaded, 400, 8, 64).split(entry.doc_id, entry.version,
                                                        parse_file(corpus.file(entry), entry.title))[0]
    snapshot = tiny_engine.precompute(part)
    assert snapshot.key != tiny_fp32_engine.precompute(part).key
    with pytest.raises(SnapshotMismatch):
        tiny_fp32_engine.answer("Port?", snapshot=snapshot)


def test_single_request_logits_and_tokens_match_the_full_prompt(engine_and_snapshots):
    engine, snapshot, _ = engine_and_snapshots
    for question in QUESTIONS:
        cached = engine.suffix_logits(question, snapshot)
        full = engine.suffix_logits(question, snapshot, reuse_cache=False)
        assert cached.shape == full.shape
        assert torch.allclose(cached, full, atol=1e-4), (question, (cached - full).abs().max())
        via_cache = engine.answer(question, snapshot=snapshot)
        assert via_cache.token_ids == engine.answer(question, snapshot=snapshot, reuse_cache=False).token_ids
        assert via_cache.route == "cache" and via_cache.reused_tokens == snapshot.n_tokens


def test_stream_on_the_shared_prefix_matches_the_full_prompt(engine_and_snapshots):
    engine, snapshot, _ = engine_and_snapshots
    items = list(engine.stream(QUESTIONS[3], snapshot=snapshot))
    record = items[-1]
    assert isinstance(record, Answer) and record.route == "cache"
    assert "".join(items[:-1]).strip() == record.text
    assert record.token_ids == engine.answer(QUESTIONS[3], snapshot=snapshot, reuse_cache=False).token_ids


def test_batch_is_token_identical_to_one_question_at_a_time(engine_and_snapshots):
    engine, snapshot, _ = engine_and_snapshots
    answers = engine.answer_batch(QUESTIONS, snapshot)
    assert len(answers) == len(QUESTIONS)
    for question, answer in zip(QUESTIONS, answers):
        alone = engine.answer(question, snapshot=snapshot, reuse_cache=False)
        assert answer.token_ids == alone.token_ids and answer.text == alone.text
        assert answer.route == "cache" and answer.finish_reason == alone.finish_reason
        assert answer.prompt_tokens == alone.prompt_tokens and answer.reused_tokens == snapshot.n_tokens
        assert 0 < answer.ttft_s <= answer.total_s and answer.snapshot_key == str(snapshot.key)


def test_rows_of_a_batch_finish_independently(engine_and_snapshots, monkeypatch):
    """One row's stop token ends it early while the others keep decoding, still exactly; and each row's ttft_s
    and total_s are read at its own first and last step, on a clock that ticks once a reading (answer_batch
    reads it once per step), so that they count the steps the row waited."""
    base, snapshot, _ = engine_and_snapshots
    stop_token = base.answer(QUESTIONS[0], snapshot=snapshot).token_ids[2]
    engine = Engine(base.loaded, base.max_context_tokens, base.max_new_tokens, base.question_budget_tokens)
    engine.eos_ids = base.eos_ids | {stop_token}
    steps: list[set[int]] = []
    greedy_rows = engine._greedy_rows

    def recording(*args, **kwargs):
        for step in greedy_rows(*args, **kwargs):
            steps.append(set(step))
            yield step

    with monkeypatch.context() as patched:
        patched.setattr(engine, "_greedy_rows", recording)
        patched.setattr(engine_module, "time", SimpleNamespace(perf_counter=itertools.count().__next__))
        answers = engine.answer_batch(QUESTIONS, snapshot, max_new_tokens=10)
    assert answers[0].finish_reason == "eos" and len(answers[0].token_ids) == 2
    for question, answer in zip(QUESTIONS, answers):
        alone = engine.answer(question, snapshot=snapshot, max_new_tokens=10, reuse_cache=False)
        assert (answer.token_ids, answer.finish_reason) == (alone.token_ids, alone.finish_reason)
    assert any(answer.finish_reason == "length" and len(answer.token_ids) == 10 for answer in answers)
    ran = [[number for number, rows in enumerate(steps, 1) if row in rows] for row in range(len(QUESTIONS))]
    assert [len(numbers) for numbers in ran] == [len(a.token_ids) + (a.finish_reason == "eos") for a in answers]
    assert [(answer.ttft_s, answer.total_s) for answer in answers] == [(numbers[0], numbers[-1]) for numbers in ran]
    assert answers[0].total_s < max(answer.total_s for answer in answers) == len(steps)


def test_snapshot_tensors_are_never_written_or_copied(engine_and_snapshots):
    engine, snapshot, _ = engine_and_snapshots
    tensors = snapshot.keys + snapshot.values
    before = [t.clone() for t in tensors]
    pointers = [t.data_ptr() for t in tensors]
    engine.answer_batch(QUESTIONS, snapshot)
    list(engine.stream(QUESTIONS[0], snapshot=snapshot))
    engine.suffix_logits(QUESTIONS[1], snapshot)
    assert [t.data_ptr() for t in snapshot.keys + snapshot.values] == pointers
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot.keys + snapshot.values))


def test_per_request_memory_does_not_depend_on_the_document(engine_and_snapshots, monkeypatch):
    engine, large, small = engine_and_snapshots
    allocated: list[int] = []
    if engine.fast is not None:
        new_suffix = engine.fast._new_suffix

        def recording(*args, **kwargs):
            keys, values = new_suffix(*args, **kwargs)
            allocated.append(sum(t.numel() for t in keys + values))
            return keys, values

        monkeypatch.setattr(engine.fast, "_new_suffix", recording)
    else:
        start = engine.prefix_decoder.start

        def recording(*args, **kwargs):
            cache = start(*args, **kwargs)
            allocated.append(sum(t.numel() for t in cache.keys + cache.values))
            return cache

        monkeypatch.setattr(engine.prefix_decoder, "start", recording)
    engine.answer(QUESTIONS[0], snapshot=large)
    engine.answer(QUESTIONS[0], snapshot=small)
    assert len(allocated) == 2 and allocated[0] == allocated[1]
    layers, kv_heads, head_dim = len(large.keys), large.keys[0].shape[0], large.keys[0].shape[2]
    question_tokens = len(engine.prompts.tokenize(large.system_prompt, QUESTIONS[0]).suffix)
    slots = question_tokens + engine.max_new_tokens
    if engine.fast is not None:
        slots = -(-slots // 16) * 16  # the int8 engine rounds its suffix buffer up to 16 slots
    assert allocated[0] == 2 * layers * kv_heads * head_dim * slots


def test_other_architectures_fall_back_to_the_transformers_cache(tmp_path, tiny_model, corpus, caplog):
    """A sliding-window model (Gemma 3) keeps the transformers path, says so, and stays exact."""
    from cagflow.engine.model import load_model
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(7)
    config = Gemma3TextConfig(vocab_size=len(tiny_model.tokenizer), hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              sliding_window=64, layer_types=["sliding_attention", "full_attention"],
                              max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    Gemma3ForCausalLM(config).save_pretrained(tmp_path)
    tiny_model.tokenizer.save_pretrained(tmp_path)
    with caplog.at_level("WARNING", logger="cagflow.engine"):
        engine = Engine(load_model(str(tmp_path)), max_context_tokens=400, max_new_tokens=8, question_budget_tokens=64)
    assert "not supported by the int8 engine" in caplog.text and engine.recipe == "fp32"
    assert not supports(engine.model) and engine.prefix_decoder is None and engine.fast is None
    entry = corpus.tier("fixed")[1]
    part = engine.split(entry.doc_id, entry.version, parse_file(corpus.file(entry), entry.title))[0]
    snapshot = engine.precompute(part)
    batch = engine.answer_batch(QUESTIONS[:2], snapshot)
    for question, answer in zip(QUESTIONS[:2], batch):
        assert answer.token_ids == engine.answer(question, snapshot=snapshot, reuse_cache=False).token_ids


def test_relevance_from_the_snapshot_matches_the_check_prefilled_whole(engine_and_snapshots):
    """The relevance check reads the snapshot in place, like the answer; both recipes agree with the check's
    whole prompt computed from scratch."""
    engine, snapshot, _ = engine_and_snapshots
    prefix = (snapshot.keys, snapshot.values) if engine.fast is not None else None
    for question in QUESTIONS[:2]:
        from_snapshot = engine.relevance(question, snapshot, reused=snapshot.n_tokens, prefix=prefix)
        assert engine.relevance(question, snapshot) == pytest.approx(from_snapshot, abs=1e-4)
