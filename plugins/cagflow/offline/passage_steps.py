"""The ingest DAGs' last step: each indexed chunk's K/V as the retrieval route places it (``engine.passage_kv``),
computed once per content and model at ingest time and written to the store, so a question that falls back to
retrieval prefills only itself. A state already stored is kept; a chunk without one is computed by the serving
process on first use, so this step only moves work off the request path."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Iterable, Sequence

from ..config import Config
from .connections import chunk_index, resolve_config, snapshot_store
from .snapshot_steps import engine_for

if TYPE_CHECKING:
    from ..answering.prompt import PromptBuilder
    from ..store.backends import SnapshotStore

log = logging.getLogger(__name__)

SECONDS_PER_DAY = 86400


def passage_units(prompts: PromptBuilder, chunk: dict) -> list[tuple[list[int], list[int]]]:
    """The (context, ids) pairs a chunk's states are keyed by: its language's instruction alone, and the chunk
    after it (the instruction follows the question's language; a chunk is kept for its own language's
    questions)."""
    from ..answering.prompt import Passage

    layout = prompts.passage_layout([Passage(chunk["text"], chunk["title"], chunk["section"])], chunk["text"])
    return [([], layout.header), (layout.header, layout.pieces[0])]


def precompute_passages(chunks: Sequence[dict], config: Config | None = None) -> dict:
    """Write the state of every chunk (records with ``text``, ``title``, ``section``, ``tier``) of the tiers
    ``ingest.passage_state_tiers`` names that the store lacks; returns counts and prompt tokens per second."""
    from ..documents.snapshot import passage_state_bytes
    from ..store.layout import passage_object

    config = resolve_config(config)
    counts = {"computed": 0, "present": 0, "tokens": 0}
    chunks = [chunk for chunk in chunks if chunk.get("tier") in config.ingest.passage_state_tiers]
    if config.model.passage_kv != "reuse" or not chunks:
        return {**counts, "tokens_per_s": 0.0}
    engine = engine_for(config)
    states = engine.passage_states
    if states is None:
        log.info("the %s engine keeps no passage states: the retrieval route prefills", engine.recipe)
        return {**counts, "tokens_per_s": 0.0}
    store = snapshot_store(config)
    started = time.perf_counter()
    for chunk in chunks:
        for header, piece in passage_units(engine.prompts, chunk):
            key = states.key(header, piece)
            name = passage_object(engine.fingerprint, key)
            if store.head(name) is not None:
                counts["present"] += bool(header)
                continue
            keys, values = states.compute(header, piece)
            store.put(name, passage_state_bytes(keys, values, engine.fingerprint, key), overwrite=True)
            counts["computed"] += bool(header)
            counts["tokens"] += len(piece)  # a passage is computed behind the instruction's kept state
    seconds = time.perf_counter() - started
    rate = counts["tokens"] / seconds if seconds > 0 else 0.0
    log.info("passage states: %d computed (%d prompt tokens, %.0f tokens/s), %d already stored",
             counts["computed"], counts["tokens"], rate, counts["present"])
    return {**counts, "tokens_per_s": round(rate, 1)}


def precompute_indexed_passages(tier: str, config: Config | None = None) -> dict:
    """``precompute_passages`` over every chunk of ``tier`` the index holds, not only the run's changed ones:
    an incremental run skips unchanged documents, yet their states may be missing (states switched on later, a
    new model, a state deleted)."""
    config = resolve_config(config)
    if tier not in config.ingest.passage_state_tiers or config.model.passage_kv != "reuse":
        return {"computed": 0, "present": 0, "tokens": 0, "tokens_per_s": 0.0}
    with chunk_index(config) as index:
        chunks = [{"text": c.text, "title": c.title, "section": c.section, "tier": tier} for c in index.scan(tier)]
    return precompute_passages(chunks, config)


def live_passage_objects(chunks: Iterable[dict], config: Config) -> set[str]:
    """The store objects of the states of ``chunks`` for the configured model (its tokenizer only is loaded)."""
    from transformers import AutoTokenizer

    from ..answering.prompt import PromptBuilder
    from ..engine.model import identify_model
    from ..engine.passage_kv import passage_key
    from ..store.layout import passage_object

    folder, _, fingerprint = identify_model(config.model.path, config.model.precision)
    prompts = PromptBuilder(AutoTokenizer.from_pretrained(str(folder)))
    return {passage_object(fingerprint, passage_key(fingerprint, header, piece))
            for chunk in chunks for header, piece in passage_units(prompts, chunk)}


def plan_passage_garbage(store: SnapshotStore, live: set[str], unused_days: float,
                         now: float | None = None) -> dict[str, int]:
    """Passage states no indexed chunk of the configured model has (another model's, a replaced document
    version's), written more than ``unused_days`` ago: object name -> bytes."""
    from ..store.layout import PASSAGES_PREFIX

    cutoff = (time.time() if now is None else now) - unused_days * SECONDS_PER_DAY
    return {info.name: info.size for info in store.list(PASSAGES_PREFIX)
            if info.name not in live and info.modified <= cutoff}


def passage_garbage(store: SnapshotStore, unused_days: float, config: Config,
                    now: float | None = None) -> dict[str, int]:
    """``plan_passage_garbage`` over the chunks the index holds now; nothing when the index cannot be read
    (a state is never deleted on a guess)."""
    from ..errors import CagflowError

    try:
        with chunk_index(config) as index:
            chunks = [{"text": c.text, "title": c.title, "section": c.section} for c in index.scan()]
    except (CagflowError, OSError) as exc:
        log.warning("passage states kept: the index could not be read (%s)", exc)
        return {}
    return plan_passage_garbage(store, live_passage_objects(chunks, config), unused_days, now)
