"""The int8 engine (``cagflow.engine.fastlm``): exactness of cache vs full prompt, batched vs single, snapshot
immutability, kernel determinism, and agreement with transformers' fp32 model; on both backends."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from cagflow.engine import fastlm, kernels, lm_config, weights_file
from cagflow.engine import model as engine_model

# (backend, matmul): the torch backend's two kernels, the native one where the CPU has it, and AMX tiles where
# the CPU has them too
KERNELS = [("torch", "int8pack"), ("torch", "f32")] + (
    [("native", "native")] if kernels.native_kernels() is not None else []) + (
    [("native", "amx")] if kernels.amx_ready() else [])
BACKENDS = [backend for backend, _ in KERNELS]


def _tiny(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    vocab = 49152  # the SmolLM2 tokenizer's vocabulary
    if kind == "llama":
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=64, vocab_size=vocab, max_position_embeddings=2048,
                             tie_word_embeddings=True, rope_theta=100000.0)
        model = LlamaForCausalLM(config)
    else:
        config = Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=64, vocab_size=vocab, max_position_embeddings=2048,
                             tie_word_embeddings=False, rope_theta=1000000.0)
        model = Qwen2ForCausalLM(config)
        for layer in model.model.layers:  # make the q/k/v biases matter
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    return model.eval()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_model(request):
    return _tiny(request.param)


@pytest.fixture(scope="module", params=KERNELS, ids=["-".join(k) for k in KERNELS])
def tiny(request, tiny_model):
    # a small prefill block so the prefix spans several blocks (f32: prefix blocks >= WIDE_BLOCK use fp32 GEMMs)
    backend, matmul = request.param
    return fastlm.FastLM.from_hf_model(tiny_model, backend=backend, matmul=matmul, prefill_block=128), tiny_model


def _ids(n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (n,), generator=generator).tolist()


def _reload(prefix):
    """A snapshot as another process would see it: serialised and loaded back (new memory)."""
    keys, values = prefix
    blob = st_save({**{f"k.{i}": k for i, k in enumerate(keys)}, **{f"v.{i}": v for i, v in enumerate(values)}})
    loaded = st_load(blob)
    return [loaded[f"k.{i}"] for i in range(len(keys))], [loaded[f"v.{i}"] for i in range(len(values))]


def _same(a: fastlm.Generation, b: fastlm.Generation) -> bool:
    return a.tokens == b.tokens and len(a.logits) == len(b.logits) and all(
        torch.equal(x, y) for x, y in zip(a.logits, b.logits))


# ---- exactness -------------------------------------------------------------------------------------------

def test_cache_equals_full_prompt(tiny):
    lm, _ = tiny
    prompt = _ids(333, 1)
    split = 300  # the prefix spans 3 blocks of 128, the last one partial
    snapshot = _reload(lm.prefill_prefix(prompt[:split]))
    cached = lm.answer(snapshot, prompt[split:], 24, eos_token_ids=[])
    full = lm.answer_full(prompt, split, 24, eos_token_ids=[])
    assert _same(cached, full)
    assert torch.equal(lm.logits(snapshot, prompt[split:]), lm.logits(lm.prefill_prefix(prompt[:split]), prompt[split:]))


def test_prefill_reports_each_block_and_computes_the_same(tiny):
    lm, _ = tiny
    prompt = _ids(300, 3)
    heard = []
    keys, values = lm.prefill_prefix(prompt, on_block=lambda done, total: heard.append((done, total)))
    assert heard == [(128, 300), (256, 300), (300, 300)]
    plain_keys, plain_values = lm.prefill_prefix(prompt)
    assert all(torch.equal(a, b) for a, b in zip(keys + values, plain_keys + plain_values))


def test_block_boundaries_only_change_rounding(tiny):
    """One big block vs several blocks: not bitwise (different attention chunks), but close."""
    lm, _ = tiny
    prompt = _ids(300, 2)
    blocks = lm.logits(lm.prefill_prefix(prompt[:260]), prompt[260:])
    whole = lm.logits(None, prompt)[260:]
    torch.testing.assert_close(blocks, whole, atol=0.05, rtol=0)


def test_batched_equals_single(tiny):
    lm, _ = tiny
    prefix = lm.prefill_prefix(_ids(200, 3))
    questions = [_ids(n, 10 + n) for n in (5, 17, 1, 30)]
    budgets_eos = _ids(1, 99)  # an arbitrary "EOS" id: rows may stop at different steps
    batched = lm.answer_batch(prefix, questions, 20, eos_token_ids=budgets_eos)
    for question, together in zip(questions, batched):
        alone = lm.answer(prefix, question, 20, eos_token_ids=budgets_eos)
        assert _same(alone, together)


def test_rows_stop_on_their_own(tiny):
    lm, _ = tiny
    prefix = lm.prefill_prefix(_ids(64, 4))
    questions = [_ids(8, 5), _ids(9, 6)]
    first = lm.answer(prefix, questions[0], 12, eos_token_ids=[])
    stop = first.tokens[3]  # make row 0 stop at step 4 (or earlier if the token repeats)
    batched = lm.answer_batch(prefix, questions, 12, eos_token_ids=[stop])
    assert batched[0].finish_reason == "eos" and batched[0].tokens[-1] == stop
    assert len(batched[0].tokens) <= 4
    assert _same(batched[1], lm.answer(prefix, questions[1], 12, eos_token_ids=[stop]))


def test_steps_stream_what_answer_batch_returns(tiny):
    lm, _ = tiny
    prefix = lm.prefill_prefix(_ids(90, 16))
    questions = [_ids(6, 17), _ids(11, 18)]
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for step in lm.steps(prefix, questions, 9, eos_token_ids=[]):
        for row, (token, logits) in step.items():
            assert logits is None
            streamed[row].append(token)
    assert [streamed[0], streamed[1]] == [g.tokens for g in lm.answer_batch(prefix, questions, 9, eos_token_ids=[])]
    assert len(streamed[0]) == len(streamed[1]) == 9


def test_recipe_is_known_before_loading_weights(tiny):
    lm, model = tiny
    if lm.backend == "native" and lm.matmul == lm_config.native_matmul(lm.config):  # the one "auto" picks here
        assert lm_config.recipe_for(model.config, lm.prefill_block) == lm.recipe
    assert lm_config.supports(model.config)


def test_no_prefix_route(tiny):
    lm, _ = tiny
    question = _ids(40, 7)
    a = lm.answer(None, question, 10, eos_token_ids=[])
    b = lm.answer_batch(None, [question, _ids(3, 8)], 10, eos_token_ids=[])[0]
    assert _same(a, b)


def test_snapshot_never_written_or_copied(tiny):
    lm, _ = tiny
    keys, values = lm.prefill_prefix(_ids(150, 9))
    before = [t.clone() for t in keys + values]
    pointers = [t.data_ptr() for t in keys + values]
    prefix = (keys, values)
    lm.answer(prefix, _ids(12, 10), 16, eos_token_ids=[])
    lm.answer_batch(prefix, [_ids(5, 11), _ids(9, 12)], 16, eos_token_ids=[])
    lm.logits(prefix, _ids(7, 13))
    assert [t.data_ptr() for t in keys + values] == pointers
    assert all(torch.equal(a, b) for a, b in zip(before, keys + values))
    c = lm.config
    assert keys[0].shape == (c.kv_heads, 150, c.head_dim) and keys[0].dtype == torch.bfloat16
    assert keys[0].is_contiguous()


def test_thread_count_does_not_change_results(tiny):
    lm, _ = tiny
    threads = torch.get_num_threads()
    prompt = _ids(260, 14)
    try:
        torch.set_num_threads(1)
        one = lm.answer_full(prompt, 230, 10, eos_token_ids=[])
        snap_one = lm.prefill_prefix(prompt[:230])
        torch.set_num_threads(2)
        two = lm.answer_full(prompt, 230, 10, eos_token_ids=[])
        snap_two = lm.prefill_prefix(prompt[:230])
    finally:
        torch.set_num_threads(threads)
    assert _same(one, two)
    assert all(torch.equal(a, b) for a, b in zip(snap_one[0] + snap_one[1], snap_two[0] + snap_two[1]))


def test_close_to_transformers_fp32(tiny):
    assert_close_to_fp32(*tiny)


def assert_close_to_fp32(lm: fastlm.FastLM, model) -> None:
    """Logits of a snapshot's continuation within 0.1 of transformers' fp32 model, the same argmax at > 90 %."""
    prompt = _ids(200, 15)
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits[0, 150:]
    ours = lm.logits(lm.prefill_prefix(prompt[:150]), prompt[150:])
    assert (ours - reference).abs().max() < 0.1
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9


# ---- kernels ----------------------------------------------------------------------------------------------

@pytest.mark.skipif("native" not in BACKENDS, reason="native kernels unavailable")
def test_native_attention_matches_torch_reference():
    k = kernels.native_kernels()
    torch.manual_seed(0)
    rows, width, kv, groups, dim, plen, cap = 3, 5, 2, 3, 64, 700, 64
    q = (torch.randn(rows, width, kv, groups, dim) * 0.3).bfloat16()
    pk, pv = torch.randn(kv, plen, dim).bfloat16(), torch.randn(kv, plen, dim).bfloat16()
    sk, sv = torch.randn(rows, kv, cap, dim).bfloat16(), torch.randn(rows, kv, cap, dim).bfloat16()
    start = torch.tensor([0, 7, 40])
    out = torch.empty_like(q)
    k.attend(q, pk, pv, sk, sv, start, out)
    for r in range(rows):
        for w in range(width):
            visible = int(start[r]) + w + 1
            keys = torch.cat([pk, sk[r, :, :visible]], 1).float()
            values = torch.cat([pv, sv[r, :, :visible]], 1).float()
            ref = torch.softmax(q[r, w].float() @ keys.transpose(1, 2), -1) @ values
            torch.testing.assert_close(out[r, w].float(), ref, atol=2e-2, rtol=2e-2)
    # one row alone gives the same bits as inside the batch
    alone = torch.empty_like(q[1:2])
    k.attend(q[1:2].contiguous(), pk, pv, sk[1:2], sv[1:2], start[1:2], alone)
    assert torch.equal(alone, out[1:2])


@pytest.mark.parametrize("kernel", [
    pytest.param("mm_int8", marks=pytest.mark.skipif("native" not in BACKENDS, reason="native kernels unavailable")),
    pytest.param("mm_int8_amx", marks=pytest.mark.skipif(not kernels.amx_ready(), reason="no AMX-BF16 here"))])
def test_native_matmuls_rows_independent_and_close_to_int8pack(kernel):
    k = kernels.native_kernels()
    torch.manual_seed(0)
    w, s = weights_file.quantize_rows(torch.randn(300, 320))  # 300: an odd number of 16-channel blocks
    packed = k.pack_int8(w)
    x = torch.randn(70, 320).bfloat16()  # AMX: more than two tiles of 32 rows, the last one partial
    y = getattr(k, kernel)(x, packed, s)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for a, b in [(0, 1), (2, 3), (1, 6), (1, 17), (0, 32), (5, 40), (31, 70)]:
                assert torch.equal(getattr(k, kernel)(x[a:b].contiguous(), packed, s), y[a:b])
    finally:
        torch.set_num_threads(threads)
    ref = torch.ops.aten._weight_int8pack_mm(x, w, s)
    torch.testing.assert_close(y.float(), ref.float(), atol=0.02, rtol=0.01)


def test_kernels_build_with_the_requirements_ninja_whatever_ninja_path_finds_first(tmp_path, monkeypatch):
    """Triton's stub and a shell find different ninjas on PATH; ninja versions hash build commands differently,
    so each would rebuild what the other built. Both build with the requirements' ninja."""
    import shutil

    import ninja

    other = tmp_path / "bin"
    other.mkdir()
    (other / "ninja").write_text("#!/bin/sh\necho 1.11.1\n")
    (other / "ninja").chmod(0o755)
    monkeypatch.setenv("PATH", f"{other}{os.pathsep}/usr/bin")
    with kernels._pinned_ninja():
        assert Path(shutil.which("ninja")).parent == Path(ninja.BIN_DIR)
    assert os.environ["PATH"] == f"{other}{os.pathsep}/usr/bin"  # as it was


def test_int8pack_rows_independent_of_batch_and_threads():
    """The property the recipe relies on (ENVIRONMENT.md): each output row of _weight_int8pack_mm is bitwise
    independent of the number of rows and of the thread count."""
    torch.manual_seed(0)
    w, s = weights_file.quantize_rows(torch.randn(512, 192))
    x = torch.randn(40, 192).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = torch.ops.aten._weight_int8pack_mm(x, w, s)
        for n in (1, 2):
            torch.set_num_threads(n)
            for a, b in [(0, 1), (5, 6), (3, 11), (0, 33), (7, 40)]:
                assert torch.equal(torch.ops.aten._weight_int8pack_mm(x[a:b].contiguous(), w, s), full[a:b])
    finally:
        torch.set_num_threads(threads)


def test_f32_gemms_do_not_depend_on_the_thread_count():
    """The f32 matmul relies on MKL's strict reproducible mode: without it these shapes (a decode-like attention over
    4k keys, a projection with few output channels) give other bits on 2 threads than on 1."""
    assert kernels.MKL_STRICT_ERROR is None, kernels.MKL_STRICT_ERROR
    generator = torch.Generator().manual_seed(3)
    queries, keys = torch.randn(1, 6, 4096, generator=generator), torch.randn(1, 4096, 128, generator=generator)
    w, s = weights_file.quantize_rows(torch.randn(37, 128, generator=generator))
    x = torch.randn(3072, 128, generator=generator).bfloat16()
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append((torch.bmm(queries, keys), fastlm._widened_mm(x, w, s)))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) and torch.equal(c, d) for (a, c), (b, d) in zip(results, results[1:]))
    torch.testing.assert_close(results[0][1].float(), torch.ops.aten._weight_int8pack_mm(x, w, s).float(),
                               atol=0.02, rtol=0.01)


# ---- the real SmolLM2 ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_dir():
    from cagflow.engine.model import resolve_model_dir

    return resolve_model_dir("smollm2-135m")


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from transformers import AutoTokenizer

    return fastlm.FastLM.from_pretrained(smollm2_dir), AutoTokenizer.from_pretrained(str(smollm2_dir))


def _chat(tokenizer, system: str, question: str) -> tuple[list[int], int]:
    prefix = tokenizer.apply_chat_template([{"role": "system", "content": system}], tokenize=False)
    full = tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": question}],
                                         tokenize=False, add_generation_prompt=True)
    assert full.startswith(prefix)
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    prefix_len = len(tokenizer(prefix, add_special_tokens=False)["input_ids"])
    assert ids[:prefix_len] == tokenizer(prefix, add_special_tokens=False)["input_ids"]
    return ids, prefix_len


DOCUMENT = ("Skerry is a backup appliance. Nightly backups are kept for 35 days; monthly backups are kept for one "
            "year. Only members of the storage-admins group may restore a backup. The appliance listens on port "
            "8443 for its web console. Support is reached at support@skerry.example between 08:00 and 18:00 CET.")


@pytest.mark.real_model
def test_smollm2_cache_full_batched_identical(smollm2):
    lm, tokenizer = smollm2
    system = "Answer from the document in one short sentence.\n\n" + DOCUMENT * 6
    questions = ["How long are nightly backups kept?", "Who may restore a backup?", "Which port does the console use?"]
    plans = [_chat(tokenizer, system, q) for q in questions]
    prefix_len = plans[0][1]
    snapshot = _reload(lm.prefill_prefix(plans[0][0][:prefix_len]))
    pointers = [t.data_ptr() for t in snapshot[0] + snapshot[1]]
    batched = lm.answer_batch(snapshot, [ids[prefix_len:] for ids, _ in plans], 32)
    for (ids, split), together in zip(plans, batched):
        assert split == prefix_len
        cached = lm.answer(snapshot, ids[prefix_len:], 32)
        full = lm.answer_full(ids, prefix_len, 32)
        assert _same(cached, full) and _same(cached, together)
    assert [t.data_ptr() for t in snapshot[0] + snapshot[1]] == pointers
    answers = [tokenizer.decode(g.tokens, skip_special_tokens=True) for g in batched]
    assert "35" in answers[0]


@pytest.mark.real_model
def test_smollm2_agrees_with_transformers(smollm2, smollm2_dir):
    from transformers import AutoModelForCausalLM

    lm, tokenizer = smollm2
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    ids = tokenizer(DOCUMENT * 4)["input_ids"][:300]
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0, 200:]
    ours = lm.logits(lm.prefill_prefix(ids[:200]), ids[200:])
    agreement = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    assert agreement >= 0.9, agreement


def test_a_kernel_build_killed_midway_does_not_hang_the_next_process(tmp_path):
    """torch's extension builder waits forever on the lock file a killed build leaves behind; under our own
    file lock no builder is alive, so the next process removes it and goes on."""
    import os
    import shutil
    import subprocess
    import sys

    if kernels.native_kernels() is None:
        pytest.skip(f"no native kernels here: {kernels.native_error()}")
    home = tmp_path / "home"
    build = home / "kernels" / kernels.kernel_build_dir().name
    shutil.copytree(kernels.kernel_build_dir(), build)  # built already: the check must not recompile
    (build / "lock").touch()  # what a killed build leaves
    probe = "from cagflow.engine import kernels; print(kernels.native_kernels() is not None, kernels.native_error())"
    result = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "CAGFLOW_HOME": str(home)},
                            capture_output=True, text=True, timeout=240)
    assert result.stdout.split()[:1] == ["True"], result.stderr[-2000:]
    assert not (build / "lock").exists()


def test_prepared_weights_are_mapped_from_the_file_and_answer_bitwise_the_same(tiny, tmp_path):
    lm, model = tiny
    model.save_pretrained(tmp_path / "model")
    options = {"backend": lm.backend, "prefill_block": lm.prefill_block}
    quantised = fastlm.FastLM.from_pretrained(tmp_path / "model", **options)
    quantised.save_weights(tmp_path / "w.fastlm")
    mapped = fastlm.FastLM.load(tmp_path / "model", tmp_path / "w.fastlm", **options)
    prefix, question = _ids(150, 21), _ids(12, 22)
    expected = quantised.answer(quantised.prefill_prefix(prefix), question, 12, eos_token_ids=[])
    assert _same(mapped.answer(mapped.prefill_prefix(prefix), question, 12, eos_token_ids=[]), expected)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the mapping is read-only
        start = torch.frombuffer(mapped._mapped, dtype=torch.uint8).data_ptr()
    end = start + len(mapped._mapped)
    weights = [t for t in mapped._named_weights().values() if t.numel()]
    assert all(start <= t.data_ptr() < end for t in weights)  # views of the file's pages, no private copies
    with pytest.raises(ValueError, match="holds weights for"):
        fastlm.FastLM.load(tmp_path / "model", tmp_path / "w.fastlm", backend=lm.backend, matmul=lm.matmul,
                            prefill_block=256)


def test_prepared_weights_are_written_once_per_model_and_recipe(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(engine_model, "CACHE_HOME", tmp_path)
    folder = tmp_path / "tiny-model"
    tiny_model.save_pretrained(folder)
    first = engine_model.prepared_weights(folder, "a" * 64)
    written = first.stat().st_mtime_ns
    assert engine_model.prepared_weights(folder, "a" * 64) == first and first.stat().st_mtime_ns == written
    second = engine_model.prepared_weights(folder, "b" * 64)  # new weights or recipe: the old file goes
    assert second != first and second.exists() and not first.exists()
    assert sorted(p.name for p in second.parent.iterdir() if not p.name.startswith(".")) == [second.name]


def test_block_threads_change_time_only(tiny):
    """Every block, prefill or decode step, may take idle cores (``block_threads``): same bits, asked once
    per block and never from inside one, and the caller's thread count is back afterwards."""
    lm, _ = tiny
    prefix_ids, question = _ids(300, 7), _ids(12, 8)
    expected = lm.answer(lm.prefill_prefix(prefix_ids), question, 6, eos_token_ids=[]).tokens
    threads = torch.get_num_threads()
    seen = []
    lm.block_threads = lambda: seen.append(torch.get_num_threads()) or threads + 1
    try:
        prefix = lm.prefill_prefix(prefix_ids)
        prefill_blocks = len(seen)
        assert lm.answer(prefix, question, 6, eos_token_ids=[]).tokens == expected
    finally:
        lm.block_threads = None
    assert torch.get_num_threads() == threads
    assert prefill_blocks >= 1 and len(seen) == prefill_blocks + 6  # the question's block, then 5 decode steps
    assert set(seen) == {threads}


def test_idle_cores_reads_the_runnable_count(monkeypatch, tmp_path):
    from cagflow.engine import threads

    loadavg = tmp_path / "loadavg"
    monkeypatch.setattr(threads, "_LOADAVG", loadavg)
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    for line, idle in [("0.5 0.4 0.3 1/300 999", 4), ("2.0 1.0 1.0 3/300 999", 2), ("9 9 9 12/300 1", 1)]:
        loadavg.write_text(line)
        assert threads.idle_cores() == idle
    loadavg.unlink()
    assert threads.idle_cores() == 1  # unreadable: no extra threads
