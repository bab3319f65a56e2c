"""Weights kept in the GGUF's Q4_K blocks (``model.precision: q4k``): the kernel computes with exactly the
file's values, its rows are independent of the batch and the threads, a fused linear mixes Q4_K and int8
parts, and every exactness property of the engine holds with them (cache = full prompt, batched = single,
lookup = one-token steps, the prepared file = the weights it was made from)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cagflow.engine import fastlm, kernels, q4k

from .test_fastlm import _ids, _reload, _same, assert_close_to_fp32
from .test_lookup import _decode

pytestmark = pytest.mark.skipif(kernels.native_kernels() is None, reason="native kernels unavailable")


def _raw_blocks(rows: int, inputs: int, seed: int) -> np.ndarray:
    """Random Q4_K rows (any bytes are a valid block once d and dmin are finite): small d and dmin keep the
    weights the size of a trained model's."""
    from gguf import GGMLQuantizationType, quant_shape_to_byte_shape

    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=quant_shape_to_byte_shape((rows, inputs), GGMLQuantizationType.Q4_K),
                       dtype=np.uint8)
    scales = rng.uniform(2e-5, 2e-4, size=(rows, inputs // 256, 2)).astype(np.float16)
    raw.reshape(rows, inputs // 256, 144)[:, :, :4] = scales.view(np.uint8).reshape(rows, inputs // 256, 4)
    return raw


def _dequantized(raw: np.ndarray) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_K).copy())


def test_the_product_is_the_file_s_weights_times_x_and_rows_stand_alone():
    k = kernels.native_kernels()
    raw = _raw_blocks(112, 512, 1)  # 7 blocks of 16 channels: groups of 4 (one row) and 2 (many), and tails
    packed = k.pack_q4k(torch.from_numpy(raw))
    x = torch.randn(21, 512, generator=torch.Generator().manual_seed(0)).bfloat16()
    y = k.mm_q4k(x, packed)
    weights = _dequantized(raw)
    reference = x.float() @ weights.T
    # the bf16 rounding of the output, and fp32 sums of (128 + q) x that cancel: an error small against
    # sum |w x|, not always against a sum near zero
    bound = reference.abs() * 2 ** -7 + (x.float().abs() @ weights.abs().T) * 2 ** -12
    assert ((y.float() - reference).abs() <= bound).all()
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for a, b in [(0, 1), (2, 4), (1, 4), (3, 7), (0, 8), (5, 21), (20, 21)]:
                assert torch.equal(k.mm_q4k(x[a:b].contiguous(), packed), y[a:b])
    finally:
        torch.set_num_threads(threads)


def _q4k_model(kind: str):
    """A tiny model whose linears are Q4_K blocks (their dequantised values in the checkpoint), except one
    layer's v and another's down projection, kept as int8 rows: a fused linear then mixes both."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shapes = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=49152, max_position_embeddings=2048)
    model = (LlamaForCausalLM(LlamaConfig(**shapes, tie_word_embeddings=True)) if kind == "llama"
             else Qwen2ForCausalLM(Qwen2Config(**shapes, tie_word_embeddings=False)))
    blocks = {}
    for seed, (name, weight) in enumerate(model.named_parameters()):
        if weight.dim() == 2 and "layers" in name:
            raw = _raw_blocks(*weight.shape, seed)
            with torch.no_grad():
                weight.copy_(_dequantized(raw))
            if name not in ("model.layers.0.self_attn.v_proj.weight", "model.layers.1.mlp.down_proj.weight"):
                blocks[name] = torch.from_numpy(raw)
    return model.eval(), blocks


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_q4k(request):
    model, blocks = _q4k_model(request.param)
    return fastlm.FastLM.from_hf_model(model, backend="native", prefill_block=128, q4k_blocks=blocks), model, blocks


def test_the_recipe_names_q4k_and_each_linear_keeps_its_parts(tiny_q4k):
    lm, _, _ = tiny_q4k
    assert lm.recipe.endswith("/q4k")
    first, second = lm.layers
    assert first.q_qkv.shape[0] * 16 == 256 + 128 and first.s_qkv.numel() == 128  # q, k Q4_K; v int8 rows
    assert second.q_qkv.shape[0] * 16 == 512 and second.w_qkv.numel() == 0
    assert second.q_down.numel() == 0 and second.s_down.numel() == 256


def test_cache_equals_full_prompt_and_batched_equals_single(tiny_q4k):
    lm, _, _ = tiny_q4k
    prompt = _ids(333, 1)
    snapshot = _reload(lm.prefill_prefix(prompt[:300]))
    cached = lm.answer(snapshot, prompt[300:], 16, eos_token_ids=[])
    assert _same(cached, lm.answer_full(prompt, 300, 16, eos_token_ids=[]))
    questions = [_ids(n, 10 + n) for n in (5, 17, 1)]
    for question, together in zip(questions, lm.answer_batch(snapshot, questions, 12, eos_token_ids=[])):
        assert _same(lm.answer(snapshot, question, 12, eos_token_ids=[]), together)


def test_lookup_gives_the_one_token_steps(tiny_q4k):
    lm, _, _ = tiny_q4k
    prefix, question = lm.prefill_prefix(_ids(200, 4)), _ids(9, 5)
    tokens, logits, _ = _decode(lm, prefix, question, None)
    looked_tokens, looked_logits, widths = _decode(lm, prefix, question, _ids(40, 3) + question + tokens)
    assert looked_tokens == tokens and max(widths) == 4  # rows of up to 4 tokens: the kernels' decode paths
    assert all(torch.equal(a, b) for a, b in zip(looked_logits, logits, strict=True))


def test_close_to_transformers_fp32_with_the_same_weights(tiny_q4k):
    lm, model, _ = tiny_q4k
    assert_close_to_fp32(lm, model)


def test_a_prepared_file_answers_bitwise_like_the_weights_it_was_made_from(tiny_q4k, tmp_path):
    lm, model, _ = tiny_q4k
    model.save_pretrained(tmp_path / "model")
    lm.save_weights(tmp_path / "w.fastlm")
    mapped = fastlm.FastLM.load(tmp_path / "model", tmp_path / "w.fastlm", backend="native", prefill_block=128)
    assert mapped.recipe == lm.recipe
    prefix, question = _ids(150, 21), _ids(12, 22)
    assert _same(mapped.answer(mapped.prefill_prefix(prefix), question, 12, eos_token_ids=[]),
                 lm.answer(lm.prefill_prefix(prefix), question, 12, eos_token_ids=[]))


def test_blocks_are_read_from_a_gguf_only_where_they_are_the_checkpoint_s_weights(tmp_path):
    from gguf import GGMLQuantizationType, GGUFWriter

    kept, permuted = _raw_blocks(32, 256, 7), _raw_blocks(32, 256, 8)
    writer = GGUFWriter(str(tmp_path / "m.gguf"), "qwen2")
    writer.add_tensor("blk.0.attn_q.weight", kept, raw_dtype=GGMLQuantizationType.Q4_K)
    writer.add_tensor("blk.0.attn_k.weight", permuted, raw_dtype=GGMLQuantizationType.Q4_K)
    writer.add_tensor("blk.0.attn_v.weight", np.zeros((32, 256), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    checkpoint = {"model.layers.0.self_attn.q_proj.weight": _dequantized(kept),
                  "model.layers.0.self_attn.k_proj.weight": _dequantized(permuted).flip(0),  # rows reordered
                  "model.layers.0.self_attn.v_proj.weight": torch.zeros(32, 256)}
    blocks = q4k.read_blocks(tmp_path / "m.gguf", checkpoint)
    assert list(blocks) == ["model.layers.0.self_attn.q_proj.weight"]  # k differs as stored, v is not Q4_K
    assert np.array_equal(blocks["model.layers.0.self_attn.q_proj.weight"].numpy(), kept)
    assert q4k.leading_blocks(["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"],
                              blocks) == 1
