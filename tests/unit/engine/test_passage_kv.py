"""Reused passage states (the retrieval route without prefilling its passages), on the tiny model."""

import pytest
import torch

from cagflow.answering.prompt import Passage, passage_piece, passages_system
from cagflow.documents.keys import SnapshotFormatError
from cagflow.documents.snapshot import passage_state_bytes, passage_state_from_bytes
from cagflow.engine.engine import Engine
from cagflow.engine.passage_kv import PassageStates, passage_key, rerotate, state_bytes

PASSAGES = [Passage("The console listens on port 8443 and redirects plain HTTP to it.", "Admin guide", "Ports"),
            Passage("Backups run nightly at 02:00 and are kept for 14 days.", "Admin guide", "Backups"),
            Passage("控制台默认监听 8443 端口。", "管理指南", "")]


@pytest.fixture()
def reusing_engine(tiny_model):
    engine = Engine(tiny_model, max_context_tokens=4096, max_new_tokens=12)
    engine.passage_states = PassageStates(engine.fast, engine.fingerprint, 64 * 2**20)
    return engine


def test_system_turn_text_is_the_instruction_then_each_piece():
    system = passages_system(PASSAGES[:2], "Which port?")
    assert system.endswith(".\n\n## Admin guide — Ports\nThe console listens on port 8443 and redirects plain "
                           "HTTP to it.\n\n## Admin guide — Backups\nBackups run nightly at 02:00 and are kept "
                           "for 14 days.\n\n")
    assert passage_piece(Passage("plain")) == "plain\n\n"


def test_layout_tokens_are_the_retrieval_prompts_leading_tokens(reusing_engine):
    prompts = reusing_engine.prompts
    layout = prompts.passage_layout(PASSAGES, "Which port?")
    ids = prompts.tokenize(passages_system(PASSAGES, "Which port?"), "Which port?").ids
    assert len(layout.pieces) == 3 and len(ids) > len(layout.ids)
    joined = prompts.tokenize(passages_system(PASSAGES, "Which port?"), "Which port?", layout.ids, joined=True)
    assert joined.ids[:len(layout.ids)] == layout.ids and joined.prefix_len == len(layout.ids)
    assert prompts.tokenizer.decode(joined.ids) == prompts.tokenizer.decode(ids)  # the same text


def test_rerotation_moves_keys_to_a_later_position(reusing_engine):
    """Layer 0's keys depend only on the token and its position: a piece computed at position h and re-rotated
    by d must match the same piece computed at position h + d (to bf16 rounding)."""
    fast, states = reusing_engine.fast, reusing_engine.passage_states
    header = reusing_engine.prompts.encode("Read this.")
    piece = reusing_engine.prompts.encode(passage_piece(PASSAGES[0]))
    filler = reusing_engine.prompts.encode(" one two three four five six seven")
    keys, values = states.compute(header, piece)
    shifted_keys, shifted_values = fast.prefill_prefix([*header, *filler, *piece])
    start = len(header) + len(filler)
    moved = rerotate(keys[0], fast.cos[len(filler)], fast.sin[len(filler)])
    assert moved.dtype == torch.bfloat16
    torch.testing.assert_close(moved.float(), shifted_keys[0][:, start:].float(), atol=0.05, rtol=0.02)
    assert torch.equal(values[0], shifted_values[0][:, start:])
    assert not torch.allclose(keys[0].float(), shifted_keys[0][:, start:].float(), atol=0.05, rtol=0.02)


def test_retrieval_answer_reuses_passage_states(reusing_engine):
    first = reusing_engine.answer("Which port does the console use?", context=PASSAGES[:2])
    layout = reusing_engine.prompts.passage_layout(PASSAGES[:2], "Which port does the console use?")
    assert first.route == "retrieval" and first.reused_tokens == 0 and first.token_ids
    again = reusing_engine.answer("When do backups run?", context=PASSAGES[:2])
    assert again.reused_tokens == layout.n_tokens  # instruction and both passages kept from the first request
    # the same passages in another order: states are reused at their new positions
    swapped = reusing_engine.answer("When do backups run?", context=[PASSAGES[1], PASSAGES[0]])
    assert swapped.reused_tokens == layout.n_tokens and swapped.token_ids


def test_one_passage_composed_is_the_prefilled_prefix(reusing_engine):
    """With one passage nothing is moved: the composed prefix is the prefill's, up to block rounding (the
    instruction is computed in a block of its own)."""
    layout = reusing_engine.prompts.passage_layout(PASSAGES[:1], "Which port?")
    (keys, values), reused = reusing_engine.passage_states.compose(layout)
    full_keys, full_values = reusing_engine.fast.prefill_prefix(layout.header + layout.pieces[0])
    assert reused == 0 and keys[1].shape == full_keys[1].shape
    for ours, theirs in zip(keys + values, full_keys + full_values):
        torch.testing.assert_close(ours.float(), theirs.float(), atol=0.1, rtol=0.05)
    assert reusing_engine.passage_states.compose(layout)[1] == layout.n_tokens


def test_trailing_passages_are_prefilled_in_context(reusing_engine):
    """``recompute_last``: the last passages are prefilled behind the others' placed states, so they attend to
    them as in a full prefill; the passages before them are placed as before."""
    fast, states = reusing_engine.fast, reusing_engine.passage_states
    layout = reusing_engine.prompts.passage_layout(PASSAGES[:2], "Which port?")
    (placed_keys, placed_values), _ = states.compose(layout)
    states.recompute_last = 1
    (keys, values), reused = states.compose(layout)
    placed = len(layout.header) + len(layout.pieces[0])
    assert reused == placed and keys[0].shape == placed_keys[0].shape
    assert all(torch.equal(ours[:, :placed], theirs[:, :placed])
               for ours, theirs in zip(keys + values, placed_keys + placed_values))
    expected_keys, _ = fast.prefill_prefix(layout.pieces[1], after=([k[:, :placed] for k in placed_keys],
                                                                    [v[:, :placed] for v in placed_values]))
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(keys, expected_keys))
    assert not torch.equal(keys[-1][:, placed:], placed_keys[-1][:, placed:])  # not its state computed alone


def test_kept_states_stay_within_their_memory_bound(tiny_model):
    engine = Engine(tiny_model, max_context_tokens=4096, max_new_tokens=4)
    header = engine.prompts.encode("Read this.")
    pieces = [engine.prompts.encode(passage_piece(p)) for p in PASSAGES]
    one = state_bytes(PassageStates(engine.fast, engine.fingerprint, 1 << 30).compute(header, pieces[0]))
    states = PassageStates(engine.fast, engine.fingerprint, int(one * 1.5))
    for piece in pieces:
        states.state(header, piece)
    assert states._kept_bytes <= int(one * 1.5) and len(states._kept) == 1
    assert states.state(header, pieces[-1])[1] is True  # the last one is still kept
    assert states.state(header, pieces[0])[1] is False  # the first was let go: computed again


def test_stored_states_are_loaded_and_checked(tiny_model):
    engine = Engine(tiny_model, max_context_tokens=4096, max_new_tokens=4)
    header = engine.prompts.encode("Read this.")
    piece = engine.prompts.encode(passage_piece(PASSAGES[0]))
    key = passage_key(engine.fingerprint, header, piece)
    keys, values = PassageStates(engine.fast, engine.fingerprint, 1 << 30).compute(header, piece)
    data = passage_state_bytes(keys, values, engine.fingerprint, key)
    loaded_keys, loaded_values = passage_state_from_bytes(data, engine.fingerprint, key)
    assert all(torch.equal(a, b) for a, b in zip(loaded_keys + loaded_values, keys + values))
    with pytest.raises(SnapshotFormatError):
        passage_state_from_bytes(data, "another-model", key)
    with pytest.raises(SnapshotFormatError):
        passage_state_from_bytes(data, engine.fingerprint, passage_key(engine.fingerprint, header, piece[:-1]))
    asked = []
    states = PassageStates(engine.fast, engine.fingerprint, 1 << 30,
                           load=lambda k: asked.append(k) or passage_state_from_bytes(data, engine.fingerprint, k))
    state, reused = states.state(header, piece)
    assert reused and asked == [key] and torch.equal(state[0][0], keys[0])


def test_stages_add_up_to_the_answer_time(reusing_engine):
    answer = reusing_engine.answer("When do backups run?", context=PASSAGES[:2])
    assert {"prefix", "answer", "relevance"} <= set(answer.stages_ms)
    assert abs(sum(answer.stages_ms.values()) - answer.total_s * 1000) < 5
