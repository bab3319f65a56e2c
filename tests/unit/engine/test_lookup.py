"""Prompt lookup decoding (``cagflow.engine.lookup``): the guesses, and that decoding with them gives the same
tokens and bitwise the same logits as one-token steps, in fewer passes."""

from __future__ import annotations

import pytest
import torch

from cagflow.engine import fastlm, kernels
from cagflow.engine.lookup import PromptLookup

from .test_fastlm import _ids, _tiny


def test_a_guess_is_what_followed_the_latest_occurrence_of_the_last_tokens():
    lookup = PromptLookup([5, 6, 7, 8, 9, 5, 6, 1, 2, 5, 6])
    assert lookup.guess() == [1]  # "5 6" last occurred before "1 2 5 6"; a 2-token match guesses one token
    lookup.append(7)
    assert lookup.guess() == [8, 9, 5]  # "5 6 7": a 3-token match beats "6 7"'s and "7"'s, and guesses three
    assert lookup.guess(limit=2) == [8, 9]


def test_the_longest_match_wins_and_no_match_guesses_nothing():
    lookup = PromptLookup([1, 2, 3, 4, 9, 3, 4, 7, 2, 3, 4])
    assert lookup.guess() == [9, 3, 4]  # "2 3 4" matches once, before "9"; "3 4" alone would say 7
    assert PromptLookup([1, 2, 3]).guess() == []
    assert PromptLookup([]).guess() == []


def test_a_guess_reaching_the_end_of_the_history_repeats_what_it_copied():
    assert PromptLookup([4, 5, 4, 5, 4]).guess() == [5, 4, 5]
    assert PromptLookup([8, 8, 8, 8]).guess() == [8, 8, 8]


NATIVE = [matmul for matmul in ("native", "amx")
          if kernels.native_kernels() is not None and (matmul == "native" or kernels.amx_ready())]


@pytest.fixture(scope="module", params=[(kind, matmul) for kind in ("llama", "qwen2") for matmul in NATIVE],
                ids=lambda param: "-".join(param))
def native_lm(request):
    kind, matmul = request.param
    return fastlm.FastLM.from_hf_model(_tiny(kind), backend="native", matmul=matmul, prefill_block=128)


def _decode(lm, prefix, question, lookup, budget=24):
    """Tokens, logits and the widths of the blocks run after the question's."""
    widths, block = [], lm._block

    def counting(ids, *args):
        widths.append(ids.shape[1])
        return block(ids, *args)

    lm._block = counting
    try:
        steps = list(lm.steps(prefix, [question], budget, eos_token_ids=[], keep_logits=True, lookup=lookup))
    finally:
        del lm._block
    tokens = [step[0][0] for step in steps]
    return tokens, [step[0][1] for step in steps], widths[1:]


@pytest.mark.skipif(not NATIVE, reason="prompt lookup is exact with the native kernels only")
def test_decoding_with_right_and_wrong_guesses_is_bitwise_one_token_steps(native_lm):
    lm = native_lm
    prefix, question = lm.prefill_prefix(_ids(300, 1)), _ids(12, 2)
    tokens, logits, widths = _decode(lm, prefix, question, None)
    assert widths == [1] * 23  # one token a pass
    # a prompt that holds the answer (as a document holds what is copied from it), then one with it garbled
    right = _ids(40, 3) + question + tokens
    garbled = [token if i % 5 else 7 for i, token in enumerate(right)]
    for lookup in (right, garbled):
        looked_tokens, looked_logits, looked_widths = _decode(lm, prefix, question, lookup)
        assert looked_tokens == tokens
        assert all(torch.equal(a, b) for a, b in zip(looked_logits, logits, strict=True))
        assert max(looked_widths) == 4 and len(looked_widths) < 23
    assert _decode(lm, prefix, question, right)[2] == [4] * 5 + [3]  # 23 tokens after the first in 6 passes


@pytest.mark.skipif(not NATIVE, reason="prompt lookup is exact with the native kernels only")
def test_lookup_stops_at_the_budget_and_at_eos(native_lm):
    lm = native_lm
    prefix, question = lm.prefill_prefix(_ids(100, 4)), _ids(6, 5)
    tokens, _, _ = _decode(lm, prefix, question, None, budget=10)
    lookup = question + tokens
    assert _decode(lm, prefix, question, lookup, budget=10)[0] == tokens
    assert _decode(lm, prefix, question, lookup, budget=3)[0] == tokens[:3]
    stop = tokens[5]
    until_eos = list(lm.steps(prefix, [question], 10, eos_token_ids=[stop], lookup=lookup))
    assert [step[0][0] for step in until_eos] == tokens[:tokens.index(stop) + 1]


def test_the_torch_backend_decodes_one_token_a_pass():
    """Its attention's sums depend on the block's width, so lookup is not exact there: it is not used."""
    lm = fastlm.FastLM.from_hf_model(_tiny("llama"), backend="torch", matmul="int8pack")
    assert not lm.lookup_exact
    prefix, question = lm.prefill_prefix(_ids(50, 6)), _ids(5, 7)
    tokens, _, widths = _decode(lm, prefix, question, None, budget=6)
    assert _decode(lm, prefix, question, question + tokens, budget=6)[2] == widths == [1] * 5
