"""The ingest step that stores passage states, and a serving engine that reads them back."""

import time

from cagflow.answering.prompt import Passage
from cagflow.config import Config
from cagflow.engine.engine import Engine
from cagflow.inference.service import _passage_reader
from cagflow.offline.passage_steps import live_passage_objects, plan_passage_garbage, precompute_passages
from cagflow.store.backends import open_store

CHUNKS = [{"text": "The console listens on port 8443.", "title": "Admin guide", "section": "Ports", "tier": "variable"},
          {"text": "Backups run nightly at 02:00.", "title": "Admin guide", "section": "Backups", "tier": "variable"},
          {"text": "控制台默认监听 8443 端口。", "title": "管理指南", "section": "端口", "tier": "variable"}]


def _config(model_dir, store_dir, mode="reuse") -> Config:
    config = Config()
    return config.model_copy(update={
        "model": config.model.model_copy(update={"path": str(model_dir), "passage_kv": mode, "max_new_tokens": 4}),
        "cache": config.cache.model_copy(update={"state_store": f"file://{store_dir}"})})


def test_ingest_stores_each_passage_once_and_serving_reuses_it(tiny_model_dir, tmp_path):
    config = _config(tiny_model_dir, tmp_path / "store")
    first = precompute_passages(CHUNKS, config)
    assert first["computed"] == 3 and first["present"] == 0 and first["tokens"] > 0
    again = precompute_passages(CHUNKS, config)
    assert again["computed"] == 0 and again["present"] == 3
    store = open_store(config.cache.state_store)
    assert len(list(store.list("passages/"))) == 5  # three passages, the English and the Chinese instruction

    engine = Engine.from_config(config.model, stored_passage=_passage_reader(store))
    passages = [Passage(c["text"], c["title"], c["section"]) for c in CHUNKS[:2]]
    answer = engine.answer("Which port does the console use?", context=passages)
    layout = engine.prompts.passage_layout(passages, "Which port does the console use?")
    assert answer.route == "retrieval" and answer.reused_tokens == layout.n_tokens


def test_a_damaged_stored_state_is_computed_instead(tiny_model_dir, tmp_path):
    config = _config(tiny_model_dir, tmp_path / "store")
    precompute_passages(CHUNKS[:1], config)
    for path in (tmp_path / "store" / "passages").rglob("*.safetensors"):
        path.write_bytes(b"not a state")
    store = open_store(config.cache.state_store)
    engine = Engine.from_config(config.model, stored_passage=_passage_reader(store))
    passages = [Passage(CHUNKS[0]["text"], CHUNKS[0]["title"], CHUNKS[0]["section"])]
    answer = engine.answer("Which port does the console use?", context=passages)
    assert answer.route == "retrieval" and answer.reused_tokens == 0 and answer.token_ids


def test_only_the_configured_tiers_are_computed_at_ingest(tiny_model_dir, tmp_path):
    config = _config(tiny_model_dir, tmp_path / "store")
    fixed = [{**chunk, "tier": "fixed"} for chunk in CHUNKS]
    assert precompute_passages(fixed, config)["computed"] == 0
    both = config.model_copy(update={"ingest": config.ingest.model_copy(update={"passage_state_tiers": ["fixed"]})})
    assert precompute_passages(fixed, both)["computed"] == 3


def test_prefill_mode_stores_nothing(tiny_model_dir, tmp_path):
    config = _config(tiny_model_dir, tmp_path / "store", mode="prefill")
    assert precompute_passages(CHUNKS, config)["computed"] == 0
    assert Engine.from_config(config.model).passage_states is None


def test_garbage_is_the_states_no_indexed_chunk_has(tiny_model_dir, tmp_path):
    config = _config(tiny_model_dir, tmp_path / "store")
    precompute_passages(CHUNKS, config)
    store = open_store(config.cache.state_store)
    written = {info.name for info in store.list("passages/")}
    live = live_passage_objects(CHUNKS[:2], config)  # the Chinese chunk left the index
    assert live < written and len(written - live) == 2  # the Chinese chunk and its instruction
    later = time.time() + 15 * 86400
    assert plan_passage_garbage(store, live, unused_days=14, now=time.time()) == {}  # too recent to go
    doomed = plan_passage_garbage(store, live, unused_days=14, now=later)
    assert set(doomed) == written - live and all(size > 0 for size in doomed.values())
    assert plan_passage_garbage(store, live_passage_objects(CHUNKS, config), unused_days=14, now=later) == {}
