"""The sample-corpus walkthrough behind ``make run``: precompute, then answer each sample question from
its snapshot and from the full prompt, and show that both give the same tokens, faster from the cache."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from .catalog import snapshot_for_question
from .cli import precompute_and_publish
from .config import Config
from .engine import Engine
from .qa import load_qa
from .stores import open_store


def _pick_questions(qa_path: Path, release_doc_ids: list[str], count: int):
    """In-scope questions, taken round-robin over the documents so each one is shown."""
    by_doc: dict[str, list] = {}
    for item in load_qa(qa_path):
        if item.in_scope and item.doc_id in release_doc_ids:
            by_doc.setdefault(item.doc_id, []).append(item)
    picked = []
    while len(picked) < count and any(by_doc.values()):
        for items in by_doc.values():
            if items and len(picked) < count:
                picked.append(items.pop(0))
    return picked


def run_demo(config: Config, questions: int, max_new_tokens: int) -> int:
    manifest = Path(config.corpus.manifest)
    store = open_store(config.cache.state_store, config.cache.s3)
    print(f"loading model {config.model.path} ...", file=sys.stderr)
    engine = Engine.from_config(config.model)
    release, _ = precompute_and_publish(engine, store, str(manifest))
    items = _pick_questions(manifest.parent / "qa.jsonl", release.doc_ids, questions)
    engine.answer("Hello?", max_new_tokens=1)  # the first forward pass pays one-off set-up: keep it out of the timings
    identical, ttft_cache, ttft_full, ratios = 0, [], [], {}
    for number, item in enumerate(items, start=1):
        snapshot = snapshot_for_question(store, release.for_doc(item.doc_id), item.question)
        cached = engine.answer(item.question, snapshot=snapshot, max_new_tokens=max_new_tokens)
        full = engine.answer(item.question, snapshot=snapshot, max_new_tokens=max_new_tokens, reuse_cache=False)
        same = cached.token_ids == full.token_ids
        identical += same
        ttft_cache.append(cached.ttft_s)
        ttft_full.append(full.ttft_s)
        ratios.setdefault(snapshot.n_tokens, []).append(full.ttft_s / cached.ttft_s)
        print(f"\n[{number}/{len(items)}] {item.question}  ({snapshot.key}, {snapshot.n_tokens} document tokens)")
        print(f"  via cache : {cached.text}")
        print(f"              TTFT {cached.ttft_s * 1000:7.0f} ms · total {cached.total_s * 1000:6.0f} ms · "
              f"{cached.reused_tokens}/{cached.prompt_tokens} prompt tokens reused")
        print(f"  full      : {full.text}")
        print(f"              TTFT {full.ttft_s * 1000:7.0f} ms · total {full.total_s * 1000:6.0f} ms · "
              f"{'identical tokens' if same else 'DIFFERENT TOKENS'} · reference: {item.reference_answer}")
    if not items:
        print("no in-scope sample questions found next to the manifest", file=sys.stderr)
        return 1
    largest = max(ratios)
    print(f"\n{identical}/{len(items)} answers token-identical; median TTFT cache "
          f"{statistics.median(ttft_cache) * 1000:.0f} ms vs full prompt {statistics.median(ttft_full) * 1000:.0f} ms; "
          f"full/cache TTFT ratio {statistics.median(ratios[largest]):.1f}x at {largest} document tokens")
    return 0 if identical == len(items) else 1
