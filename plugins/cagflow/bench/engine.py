"""`cagflow bench engine`: how fast the engine answers from a resident snapshot, by document length and by
number of concurrent questions. Measured, printed and saved, never asserted.

Documents are synthetic: the sample corpus's fixed documents repeated until the prefix holds the wanted
number of tokens, so every length is real prose with the real prompt template around it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from ..config import Config
from ..core.documents import Section
from ..core.engine import QUESTION_ONLY_SYSTEM, DocumentPart, Engine
from ..core.model import ModelError, load_model
from ..core.snapshot import Snapshot
from .report import save_report

DOCUMENT_TOKENS = (512, 2048, 4096, 7800)  # SmolLM2 has 8192 positions: "8k" leaves room for question + answer
DECODE_TOKENS = 16
BATCH_SIZES = (1, 2, 4, 8)
BATCH_DOCUMENT_TOKENS = 2048
BATCH_NEW_TOKENS = 24
SERVING_ROUNDS = 4
QUESTIONS = ("Which port does the web console use?", "How long are backups kept?",
             "Who approves a SEV1 change?", "How do I reset a locked account?",
             "Where are audit logs stored?", "What happens when a disk is full?",
             "Who can grant administrator access?", "How often are restore tests run?")


def _median(measure: Callable[[], float], runs: int) -> float:
    return statistics.median(measure() for _ in range(runs))


def synthetic_part(engine: Engine, corpus_dir: Path, tokens: int) -> DocumentPart:
    """A document of the corpus's fixed texts repeated, cut at a word so its prefix is ~``tokens`` long."""
    text = "\n\n".join(path.read_text(encoding="utf-8") for path in sorted(corpus_dir.glob("*.md")))
    words = text.split(" ") * (tokens // len(engine.prompts.encode(text)) + 1)

    def part(count: int) -> DocumentPart:
        return DocumentPart("bench", "1", "Bench", (Section("Text", " ".join(words[:count])),))

    low, high = 1, len(words)
    while low < high:  # the most words whose prefix fits
        middle = (low + high + 1) // 2
        if len(engine.prompts.prefix_ids(part(middle).system)) <= tokens:
            low = middle
        else:
            high = middle - 1
    return part(low)


def _decode_rate(engine: Engine, snapshot: Snapshot | None) -> float:
    """Decoded tokens per second after the question, ignoring EOS so every run decodes the same count; with
    no snapshot, the question-only prompt on the same decoder."""
    decoder = engine.prefix_decoder
    if snapshot is None:
        empty = torch.empty(engine.model.config.num_key_value_heads, 0, decoder.head_dim)
        keys = values = [empty] * len(engine.model.model.layers)
        question = engine.prompts.tokenize(QUESTION_ONLY_SYSTEM, QUESTIONS[0]).ids
    else:
        keys, values = snapshot.keys, snapshot.values
        question = engine.prompts.tokenize(snapshot.system_prompt, QUESTIONS[0], snapshot.prefix_token_ids).suffix
    cache = decoder.start(keys, values, 1, len(question) + DECODE_TOKENS + 1)
    token = int(decoder.step(cache, [question]).argmax())
    started = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        token = int(decoder.step(cache, [[token]]).argmax())
    return DECODE_TOKENS / (time.perf_counter() - started)


def _old_decode_rate(engine: Engine, snapshot: Snapshot) -> float:
    return engine.answer(QUESTIONS[0], snapshot=snapshot, max_new_tokens=DECODE_TOKENS).decode_tokens_per_s


def _old_copy_ms(engine: Engine, snapshot: Snapshot) -> float:
    """What the transformers path paid per request and again per decoded token: the snapshot concatenated
    with one new token in every layer."""
    cache = engine._cache_from(snapshot)
    kv_heads, _, head_dim = snapshot.keys[0].shape
    token = torch.zeros(1, kv_heads, 1, head_dim)
    started = time.perf_counter()
    for layer in range(len(snapshot.keys)):
        cache.update(token, token, layer)
    return (time.perf_counter() - started) * 1000


def measure(engine: Engine, corpus_dir: Path, runs: int, baseline: bool) -> dict:
    def ttft(**route) -> float:
        return engine.answer(QUESTIONS[0], max_new_tokens=1, **route).ttft_s

    engine.answer("Warm up?", max_new_tokens=2)
    question_only = _median(ttft, runs)
    rows = []
    snapshots = {}
    for tokens in DOCUMENT_TOKENS:
        print(f"measuring a {tokens}-token document...", file=sys.stderr, flush=True)
        snapshot = engine.precompute(synthetic_part(engine, corpus_dir, tokens))
        snapshots[tokens] = snapshot
        row = {"document_tokens": snapshot.n_tokens,
               "ttft_full_s": ttft(snapshot=snapshot, reuse_cache=False),  # one run: seconds long and stable
               "ttft_hit_s": _median(lambda: ttft(snapshot=snapshot), runs),
               "ttft_question_only_s": question_only,
               "old_cache_copy_ms": _median(lambda: _old_copy_ms(engine, snapshot), runs),
               "decode_tok_s": _median(lambda: _decode_rate(engine, snapshot), runs)}
        if baseline:
            decoder, engine.prefix_decoder = engine.prefix_decoder, None
            try:
                row["old_ttft_hit_s"] = _median(lambda: ttft(snapshot=snapshot), runs)
                row["old_decode_tok_s"] = _median(lambda: _old_decode_rate(engine, snapshot), runs)
            finally:
                engine.prefix_decoder = decoder
        rows.append(row)
    batch_snapshot = snapshots[BATCH_DOCUMENT_TOKENS]
    batches = []
    for size in BATCH_SIZES:
        print(f"measuring {size} concurrent questions...", file=sys.stderr, flush=True)
        timings = []
        for _ in range(runs):
            started = time.perf_counter()
            answers = engine.answer_batch(QUESTIONS[:size], batch_snapshot, max_new_tokens=BATCH_NEW_TOKENS)
            timings.append((time.perf_counter() - started, sum(len(a.token_ids) for a in answers)))
        seconds, tokens = sorted(timings)[len(timings) // 2]
        batches.append({"questions": size, "answers_per_s": size / seconds, "tokens_per_s": tokens / seconds,
                        "seconds": seconds})
    return {"question_only_decode_tok_s": _median(lambda: _decode_rate(engine, None), runs),
            "documents": rows, "batch_document_tokens": batch_snapshot.n_tokens, "batch_new_tokens": BATCH_NEW_TOKENS,
            "batches": batches}


def measure_serving(engine: Engine, snapshot: Snapshot, config: Config, rounds: int = SERVING_ROUNDS) -> dict:
    """The serving layer (``cag_llm``'s logic, without Triton) under a frequent-questions workload: bursts of
    ``BATCH_SIZES[-1]`` concurrent requests whose questions follow a Zipf-like popularity. Reports how many
    answers were computed, merged with an identical request in flight, or served from the answer cache."""
    import asyncio
    import random
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from ..inference.concurrency import answer_requests
    from ..inference.resident import ResidentSet
    from ..inference.service import AnswerRequest, CagService, Runtime
    from ..offline.precompute import store_snapshot
    from ..store.backends import LocalStore
    from ..store.manifests import Release, publish_release

    burst = BATCH_SIZES[-1]
    popularity = random.Random(7)
    weights = [1 / (rank + 1) for rank in range(len(QUESTIONS))]
    with tempfile.TemporaryDirectory(prefix="cagflow-bench-") as root, ThreadPoolExecutor(burst) as pool:
        store = LocalStore(root)
        entry, _ = store_snapshot(store, snapshot)
        publish_release(store, Release.build(engine.fingerprint, [entry]))
        resident = ResidentSet(store, engine.fingerprint, max_states=1, max_bytes=2**40)
        service = CagService(Runtime(config, engine, store), resident, answer_cache_entries=1024)
        service.reload(None, preload=True)
        sources: list[str] = []
        started = time.perf_counter()
        for _ in range(rounds):
            questions = popularity.choices(QUESTIONS, weights, k=burst)
            requests = [AnswerRequest(q, entry.key, max_new_tokens=BATCH_NEW_TOKENS) for q in questions]
            sources += [served.source for served in asyncio.run(answer_requests(service, pool, requests))]
        seconds = time.perf_counter() - started
        service.close()
    count = {source: sources.count(source) for source in ("computed", "merged", "answer-cache")}
    return {"requests": len(sources), "burst": burst, "distinct_questions": len(QUESTIONS), **count,
            "merge_rate": count["merged"] / len(sources), "answer_cache_hit_rate": count["answer-cache"] / len(sources),
            "seconds": seconds, "answers_per_s": len(sources) / seconds}


def print_table(report: dict) -> None:
    print(f"{report['model']}, {report['threads']} threads, median of {report['runs']} runs; decode: "
          f"{DECODE_TOKENS} tokens after the question; at 0 document tokens {report['question_only_decode_tok_s']:.1f} tok/s")
    old = "old_decode_tok_s" in report["documents"][0]
    header = (f"{'doc tokens':>10} {'TTFT full s':>11} {'TTFT hit s':>10} {'TTFT q-only s':>13} {'old copy ms':>11} "
              f"{'decode tok/s':>12}" + (f" {'old TTFT hit s':>14} {'old decode tok/s':>16}" if old else ""))
    print(header)
    for row in report["documents"]:
        line = (f"{row['document_tokens']:>10} {row['ttft_full_s']:>11.2f} {row['ttft_hit_s']:>10.3f} "
                f"{row['ttft_question_only_s']:>13.3f} {row['old_cache_copy_ms']:>11.1f} {row['decode_tok_s']:>12.1f}")
        if old:
            line += f" {row['old_ttft_hit_s']:>14.3f} {row['old_decode_tok_s']:>16.1f}"
        print(line)
    print(f"{'questions':>10} {'answers/s':>11} {'tok/s':>10}   (one {report['batch_document_tokens']}-token snapshot, "
          f"up to {report['batch_new_tokens']} new tokens each)")
    for batch in report["batches"]:
        print(f"{batch['questions']:>10} {batch['answers_per_s']:>11.2f} {batch['tokens_per_s']:>10.1f}")
    serving = report["serving"]
    print(f"serving, {serving['requests']} requests in bursts of {serving['burst']} over {serving['distinct_questions']} "
          f"questions of skewed popularity: computed {serving['computed']}, merged {serving['merged']} "
          f"({serving['merge_rate']:.0%}), answer cache {serving['answer-cache']} ({serving['answer_cache_hit_rate']:.0%}); "
          f"{serving['answers_per_s']:.2f} answers/s")


def main(config: Config, args: argparse.Namespace) -> int:
    """Run the benchmark on ``args.model`` (skipped with a message when that model is not installed)."""
    try:
        loaded = load_model(args.model, config.model.threads)
    except ModelError as exc:
        print(f"skipped: {exc}")
        return 0
    engine = Engine(loaded, max_context_tokens=8192, max_new_tokens=BATCH_NEW_TOKENS, question_budget_tokens=128)
    if engine.prefix_decoder is None:
        raise ValueError(f"{args.model} is not a Llama-family model: the shared-prefix path does not apply")
    if engine.max_context_tokens < max(DOCUMENT_TOKENS) + 128 + BATCH_NEW_TOKENS:
        raise ValueError(f"{args.model} has {engine.max_context_tokens} positions; the benchmark needs "
                         f"{max(DOCUMENT_TOKENS) + 128 + BATCH_NEW_TOKENS}")
    report = {"model": args.model, "fingerprint": loaded.fingerprint, "threads": torch.get_num_threads(),
              "runs": args.runs, **measure(engine, Path(config.corpus.manifest).parent / "fixed", args.runs,
                                            args.baseline)}
    print("measuring the serving layer...", file=sys.stderr, flush=True)
    batch_part = synthetic_part(engine, Path(config.corpus.manifest).parent / "fixed", BATCH_DOCUMENT_TOKENS)
    report["serving"] = measure_serving(engine, engine.precompute(batch_part), config)
    print_table(report)
    saved = save_report("engine", report)
    if saved:
        print(f"written {saved}")
    return 0
