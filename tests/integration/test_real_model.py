"""Exactness on the real default model (SmolLM2-135M): snapshot answers equal full-prompt answers."""

import pytest
import torch

from cagflow.catalog import load_snapshot, precompute_part
from cagflow.documents import parse_file
from cagflow.engine import Engine
from cagflow.stores import LocalStore

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def engine(real_model):
    # A smaller context splits each document into ~700-token parts: real text, quick to prefill twice.
    return Engine(real_model, max_context_tokens=1024, max_new_tokens=24, question_budget_tokens=128)


def test_three_documents_exact_through_the_local_store(engine, corpus, tmp_path):
    store = LocalStore(tmp_path)
    questions = {"skerry-admin-manual": "Which port does the web console listen on?",
                 "operations-incident-policy": "How fast must the on-call engineer acknowledge a SEV1 page?",
                 "security-access-policy": "What is the minimum password length?"}
    for doc_id, question in questions.items():
        entry = corpus.select([doc_id])[0]
        part = engine.split(doc_id, entry.version, parse_file(corpus.file(entry), entry.title))[0]
        snapshot = load_snapshot(store, precompute_part(engine, store, part).entry)
        cached = engine.suffix_logits(question, snapshot)
        full = engine.suffix_logits(question, snapshot, reuse_cache=False)
        assert torch.allclose(cached, full, atol=1e-4), (doc_id, (cached - full).abs().max())
        via_cache = engine.answer(question, snapshot=snapshot)
        via_full = engine.answer(question, snapshot=snapshot, reuse_cache=False)
        assert via_cache.token_ids == via_full.token_ids, doc_id
        assert via_cache.text and via_cache.reused_tokens == snapshot.n_tokens > 500
