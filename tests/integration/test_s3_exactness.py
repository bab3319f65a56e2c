"""Snapshots saved to and loaded from a real S3 server (SeaweedFS) answer exactly like the full prompt."""

import pytest
import torch
from cagflow.config import S3Config
from cagflow.documents.parsing import parse_file
from cagflow.engine.engine import Engine
from cagflow.inference.resident import load_snapshot
from cagflow.offline.precompute import store_snapshot
from cagflow.store.backends import LocalStore, open_store

pytestmark = pytest.mark.integration

QUESTIONS = {"skerry-admin-manual": "Which port does the web console listen on?",
             "operations-incident-policy": "How fast must the on-call engineer acknowledge a SEV1 page?",
             "security-access-policy": "What is the minimum password length?"}


@pytest.fixture(scope="module")
def stores(s3_server, tmp_path_factory):
    s3_server.create_bucket("exactness")
    return {"local": LocalStore(tmp_path_factory.mktemp("local-store")),
            "s3": open_store("s3://exactness/snapshots", S3Config(endpoint_url=s3_server.endpoint_url))}


def first_parts(engine, corpus, doc_ids):
    for doc_id in doc_ids:
        question = QUESTIONS[doc_id]
        entry = corpus.select([doc_id])[0]
        yield engine.split(doc_id, entry.version, parse_file(corpus.file(entry), entry.title))[0], question


def assert_exact_through_every_store(engine, corpus, stores, doc_ids=tuple(QUESTIONS)):
    """One precompute per part, its bytes saved to each store and loaded back; each loaded snapshot must
    give the full prompt's logits and greedy tokens."""
    for part, question in first_parts(engine, corpus, doc_ids):
        computed = engine.precompute(part)
        full_logits = engine.suffix_logits(question, computed, reuse_cache=False)
        full_tokens = engine.answer(question, snapshot=computed, reuse_cache=False).token_ids
        for name, store in stores.items():
            entry, written = store_snapshot(store, computed)
            assert written
            snapshot = load_snapshot(store, entry)
            cached = engine.suffix_logits(question, snapshot)
            assert torch.allclose(cached, full_logits, atol=1e-4), (name, part.doc_id, (cached - full_logits).abs().max())
            via_cache = engine.answer(question, snapshot=snapshot)
            assert via_cache.token_ids == full_tokens, (name, part.doc_id)
            assert via_cache.reused_tokens == snapshot.n_tokens == computed.n_tokens


def test_tiny_model_exact_through_local_and_s3(tiny_model, corpus, stores):
    engine = Engine(tiny_model, max_context_tokens=1024, max_new_tokens=24, question_budget_tokens=128)
    assert_exact_through_every_store(engine, corpus, stores)


@pytest.mark.real_model
def test_real_model_exact_through_local_and_s3(real_model, corpus, stores):
    """A real model's snapshot (~20 MB here, twenty times the tiny model's) through both stores; one document
    is enough, the others would only repeat the tiny model's checks."""
    engine = Engine(real_model, max_context_tokens=1024, max_new_tokens=24, question_budget_tokens=128)
    assert_exact_through_every_store(engine, corpus, stores, ["skerry-admin-manual"])
