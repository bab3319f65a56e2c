"""`cagflow bench engine`: how fast the engine answers from a resident snapshot, by document length and by
number of concurrent questions, optionally side by side with llama.cpp on the same GGUF file in the same run
(``--peer llama-cpp``). Measured, printed and saved, never asserted.

Documents are synthetic: the sample corpus's fixed documents repeated until the prefix holds the wanted
number of tokens, so every length is real prose with the real prompt template around it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..config import Config
from ..documents.parsing import Section
from ..engine.engine import QUESTION_ONLY_SYSTEM, DocumentPart, Engine
from ..engine.model import ModelError, load_model
from ..answering.prompt import Passage
from ..documents.snapshot import Snapshot
from .report import save_report

DOCUMENT_TOKENS = (512, 2048, 4096, 7800)  # SmolLM2 has 8192 positions: "8k" leaves room for question + answer
ANSWER_TOKENS = 40
RETRIEVAL_TOKENS = 800  # what the retrieval route prefills: four chunks of ~200 tokens and the template
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


def _timed(engine: Engine, snapshot: Snapshot | None, reuse_cache: bool = True) -> dict:
    """One ``ANSWER_TOKENS``-token answer to the first question (EOS ignored, so every run decodes the same
    count): time to first token, decode speed after it, the whole answer, and the time to the answer's own end
    (its end-of-turn token: what a user waits for)."""
    ttft, total, tokens, end = engine.timed_answer(QUESTIONS[0], snapshot, ANSWER_TOKENS, reuse_cache)
    ended = [token in engine.eos_ids for token in tokens]
    return {"ttft_s": ttft, "decode_tok_s": (ANSWER_TOKENS - 1) / (total - ttft), "answer_s": total,
            "end_s": end, "end_tokens": ended.index(True) + 1 if True in ended else len(tokens)}


def _median_of(runs: int, measure: Callable[[], dict]) -> dict:
    return _medians([measure() for _ in range(runs)])


def _medians(results: list[dict]) -> dict:
    """Each figure's median over ``results``."""
    return {name: statistics.median(result[name] for result in results) for name in results[0]}


def _timed_both_ways(engine: Engine, snapshot: Snapshot | None, runs: int) -> dict:
    """``_timed``'s medians as configured, and the answer's time decoding one token a pass (prompt lookup off:
    what the lookup gains, in the same run)."""
    timed = _median_of(runs, lambda: _timed(engine, snapshot))
    kept, engine.prompt_lookup = engine.prompt_lookup, False
    try:
        one_a_pass = _median_of(runs, lambda: _timed(engine, snapshot))
        timed["answer_one_token_a_pass_s"] = one_a_pass["answer_s"]
        timed["end_one_token_a_pass_s"] = one_a_pass["end_s"]
    finally:
        engine.prompt_lookup = kept
    return timed


def _load_speed(snapshot: Snapshot, runs: int) -> dict:
    """Loading a stored snapshot the way serving does (read, sha256 check against the release entry, parse)
    against a raw read of the same file, both from the page cache."""
    import tempfile

    from ..inference.resident import load_snapshot
    from ..offline.precompute import store_snapshot
    from ..store.backends import LocalStore

    with tempfile.TemporaryDirectory(prefix="cagflow-bench-") as root:
        store = LocalStore(root)
        entry, _ = store_snapshot(store, snapshot)
        path = store.root / entry.object_name
        size = path.stat().st_size

        def raw() -> float:
            started = time.perf_counter()
            path.read_bytes()
            return time.perf_counter() - started

        def load() -> float:
            started = time.perf_counter()
            load_snapshot(store, entry)
            return time.perf_counter() - started

        raw_s, load_s = _median(raw, runs), _median(load, runs)
    return {"bytes": size, "raw_read_mb_s": size / raw_s / 1e6, "load_mb_s": size / load_s / 1e6}


def _peer_cases(engine: Engine, snapshots: dict[int, Snapshot], passages: list[Passage]) -> list[dict]:
    """The same token ids for llama.cpp: the document prefix it saves and restores, then the question; and
    the retrieval route's whole prompt, prefilled per request on both sides."""
    cases = [{"name": "question-only", "prefix_ids": [],
              "question_ids": engine.prompts.tokenize(QUESTION_ONLY_SYSTEM, QUESTIONS[0]).ids},
             {"name": "retrieval", "prefix_ids": [],
              "question_ids": engine.prompt_ids(QUESTIONS[0], context=passages)}]
    for tokens, snapshot in snapshots.items():
        prompt = engine.prompts.tokenize(snapshot.system_prompt, QUESTIONS[0], snapshot.prefix_token_ids)
        cases.append({"name": str(tokens), "prefix_ids": prompt.ids[:prompt.prefix_len],
                      "question_ids": prompt.ids[prompt.prefix_len:]})
    return cases


def retrieval_passages(engine: Engine, corpus_dir: Path, tokens: int = RETRIEVAL_TOKENS) -> list[Passage]:
    """Passages of about ``tokens`` tokens in all (four chunks, as the retrieval route sends)."""
    words = synthetic_part(engine, corpus_dir, tokens).sections[0].text.split(" ")
    quarter = len(words) // 4
    return [Passage(" ".join(words[i * quarter:(i + 1) * quarter]), "Bench", f"Chunk {i + 1}") for i in range(4)]


def measure(engine: Engine, corpus_dir: Path, runs: int, document_tokens: Sequence[int] = DOCUMENT_TOKENS) -> dict:
    """Question only, retrieval, a snapshot per document size, and batches over the ``BATCH_DOCUMENT_TOKENS``
    snapshot when that size is among ``document_tokens``."""
    engine.answer("Warm up?", max_new_tokens=2)
    question_only = _timed_both_ways(engine, None, runs)
    passages = retrieval_passages(engine, corpus_dir)

    def retrieval_first_token() -> dict:
        answer = engine.answer(QUESTIONS[0], context=passages, max_new_tokens=1)
        return {"ttft_s": answer.ttft_s, "prompt_tokens": answer.prompt_tokens}

    retrieval = _median_of(runs, retrieval_first_token)
    rows = []
    snapshots = {}
    for tokens in document_tokens:
        print(f"measuring a {tokens}-token document...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        snapshot = engine.precompute(synthetic_part(engine, corpus_dir, tokens))
        precompute_s = time.perf_counter() - started
        snapshots[tokens] = snapshot
        hit = _timed_both_ways(engine, snapshot, runs)
        rows.append({"requested_tokens": tokens, "document_tokens": snapshot.n_tokens, "precompute_s": precompute_s,
                     "ttft_full_s": engine.answer(QUESTIONS[0], snapshot=snapshot, max_new_tokens=1,
                                                  reuse_cache=False).ttft_s,  # one run: seconds long and stable
                     **{f"hit_{name}": value for name, value in hit.items()},
                     "snapshot_bytes_per_token": snapshot.nbytes / snapshot.n_tokens,
                     **_load_speed(snapshot, runs)})
    batch_snapshot = snapshots.get(BATCH_DOCUMENT_TOKENS)
    batches = []
    for size in BATCH_SIZES if batch_snapshot is not None else ():
        print(f"measuring {size} concurrent questions...", file=sys.stderr, flush=True)
        timings = []
        for _ in range(runs):
            started = time.perf_counter()
            answers = engine.answer_batch(QUESTIONS[:size], batch_snapshot, max_new_tokens=BATCH_NEW_TOKENS)
            timings.append((time.perf_counter() - started, sum(len(a.token_ids) for a in answers)))
        seconds, tokens = sorted(timings)[len(timings) // 2]
        batches.append({"questions": size, "answers_per_s": size / seconds, "tokens_per_s": tokens / seconds,
                        "seconds": seconds})
    return {"prompt_lookup": engine.prompt_lookup, "question_only": question_only, "retrieval": retrieval, "documents": rows,
            "batch_document_tokens": batch_snapshot.n_tokens if batch_snapshot is not None else None,
            "batch_new_tokens": BATCH_NEW_TOKENS, "batches": batches, "snapshots": snapshots, "passages": passages}


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
    q = report["question_only"]
    print(f"{report['model']} ({report['recipe']}), {report['threads']} thread(s), median of {report['runs']} runs; "
          f"answer = TTFT + {ANSWER_TOKENS - 1} decoded tokens, prompt lookup {'on' if report['prompt_lookup'] else 'off'} "
          f"(1 tok/pass: the same answer decoded one token a pass). Question only: TTFT {q['ttft_s'] * 1000:.0f} ms, "
          f"decode {q['decode_tok_s']:.1f} tok/s, answer {q['answer_s']:.2f} s (1 tok/pass "
          f"{q['answer_one_token_a_pass_s']:.2f} s)")
    r = report["retrieval"]
    print(f"Retrieval route ({r['prompt_tokens']:.0f} prompt tokens, nothing cached): TTFT {r['ttft_s'] * 1000:.0f} ms")
    print(f"{'doc tokens':>10} {'TTFT full s':>11} {'TTFT hit ms':>11} {'hit/q-only':>10} {'decode tok/s':>12} "
          f"{'vs q-only':>9} {'answer s':>8} {'1 tok/pass':>10} {'to end s':>8} {'1 tok/pass':>10} {'B/token':>8} "
          f"{'load MB/s':>9} {'raw MB/s':>9}")
    for row in report["documents"]:
        print(f"{row['document_tokens']:>10} {row['ttft_full_s']:>11.2f} {row['hit_ttft_s'] * 1000:>11.0f} "
              f"{row['hit_ttft_s'] / q['ttft_s']:>10.2f} {row['hit_decode_tok_s']:>12.1f} "
              f"{row['hit_decode_tok_s'] / q['decode_tok_s']:>9.2f} {row['hit_answer_s']:>8.2f} "
              f"{row['hit_answer_one_token_a_pass_s']:>10.2f} {row['hit_end_s']:>8.2f} "
              f"{row['hit_end_one_token_a_pass_s']:>10.2f} {row['snapshot_bytes_per_token']:>8.0f} "
              f"{row['load_mb_s']:>9.0f} {row['raw_read_mb_s']:>9.0f}")
    peer = report.get("peer")
    if peer and "cases" in peer:
        print(f"llama.cpp {peer['llama_cpp_version']} on {peer['gguf']}, same token ids and threads, state saved "
              f"after the document and restored per answer; its runs alternate with ours, whose medians over "
              f"those runs are compared here:")
        print(f"{'doc tokens':>10} {'restore ms':>10} {'TTFT ms':>8} {'decode tok/s':>12} {'answer s':>8} "
              f"{'state MB':>8} {'ours s':>6} {'faster':>7} {'1 tok/pass':>10} {'to end s':>8} {'ours s':>6} "
              f"{'faster':>7} {'1 tok/pass':>10}")
        ours = peer["ours"]
        for case in peer["cases"]:
            mine = ours[case["name"]]
            if case["name"] == "retrieval":
                print(f"{'retrieval':>10} full prefill of {r['prompt_tokens']:.0f} tokens on both: TTFT ours "
                      f"{mine['ttft_s'] * 1000:.0f} ms, llama.cpp {case['ttft_s'] * 1000:.0f} ms, ours faster "
                      f"{case['ttft_s'] / mine['ttft_s']:.2f}x")
                continue
            print(f"{case['name']:>10} {case['restore_s'] * 1000:>10.1f} {case['ttft_s'] * 1000:>8.0f} "
                  f"{case['decode_tok_s']:>12.1f} {case['answer_s']:>8.2f} {case['state_bytes'] / 1e6:>8.1f} "
                  f"{mine['answer_s']:>6.2f} {case['answer_s'] / mine['answer_s']:>6.2f}x "
                  f"{case['answer_s'] / mine['answer_one_token_a_pass_s']:>9.2f}x {case['end_s']:>8.2f} "
                  f"{mine['end_s']:>6.2f} {case['end_s'] / mine['end_s']:>6.2f}x "
                  f"{case['end_s'] / mine['end_one_token_a_pass_s']:>9.2f}x")
        lengths = ", ".join(f"{name} {timing['end_tokens']:.0f} tokens" for name, timing in ours.items()
                            if "end_tokens" in timing)
        print(f"to end: until the answer's own end-of-turn token, the answer a user reads ({lengths})")
    elif peer:
        print(f"llama.cpp: not measured ({peer['error']})")
    if report["batches"]:
        print(f"{'questions':>10} {'answers/s':>11} {'tok/s':>10}   (one {report['batch_document_tokens']}-token "
              f"snapshot, up to {report['batch_new_tokens']} new tokens each)")
    for batch in report["batches"]:
        print(f"{batch['questions']:>10} {batch['answers_per_s']:>11.2f} {batch['tokens_per_s']:>10.1f}")
    serving = report.get("serving")
    if serving is None:
        return
    print(f"serving, {serving['requests']} requests in bursts of {serving['burst']} over {serving['distinct_questions']} "
          f"questions of skewed popularity: computed {serving['computed']}, merged {serving['merged']} "
          f"({serving['merge_rate']:.0%}), answer cache {serving['answer-cache']} ({serving['answer_cache_hit_rate']:.0%}); "
          f"{serving['answers_per_s']:.2f} answers/s")


def _ours_once(engine: Engine, snapshots: dict[int, Snapshot], passages: list[Passage]) -> dict[str, dict]:
    """One run of each peer case on our engine, keyed by case name."""
    ours = {"question-only": _timed_both_ways(engine, None, 1),
            "retrieval": {"ttft_s": engine.answer(QUESTIONS[0], context=passages, max_new_tokens=1).ttft_s}}
    return ours | {str(tokens): _timed_both_ways(engine, snapshot, 1) for tokens, snapshot in snapshots.items()}


def _peer(engine: Engine, model: str, snapshots: dict[int, Snapshot], passages: list[Passage], runs: int) -> dict:
    """llama.cpp on the same cases, alternating single runs with our engine's (the machine's speed drifts over
    a run of minutes: measured one after the other, the ratio at 8k moved between 1.16x and 1.63x). A first
    llama.cpp call evaluates and saves each document's state (its prefill time is reported) and warms up."""
    import tempfile

    from ..engine.model import gguf_file
    from .llama_cpp_peer import PeerUnavailable, run_peer

    gguf = gguf_file(model)
    if gguf is None:
        return {"error": f"{model} is not a GGUF file or preset: llama.cpp needs one"}
    print("measuring llama.cpp on the same file, alternating runs with ours...", file=sys.stderr, flush=True)
    cases = _peer_cases(engine, snapshots, passages)
    with tempfile.TemporaryDirectory(prefix="cagflow-peer-") as states:
        def peer_once() -> dict:
            return run_peer(gguf, torch.get_num_threads(), engine.max_context_tokens, cases, ANSWER_TOKENS,
                            sorted(engine.eos_ids), Path(states))

        try:
            prepared = peer_once()
            ours_runs, peer_runs = [], []
            for _ in range(runs):
                ours_runs.append(_ours_once(engine, snapshots, passages))
                peer_runs.append(peer_once())
        except PeerUnavailable as exc:
            return {"error": str(exc)}
    timed = ("restore_s", "ttft_s", "decode_tok_s", "answer_s", "end_s")
    peer_cases = [{**case, **_medians([{name: run["cases"][index][name] for name in timed} for run in peer_runs])}
                  for index, case in enumerate(prepared["cases"])]
    ours = {name: _medians([run[name] for run in ours_runs]) for name in ours_runs[0]}
    return {"gguf": gguf.name, "llama_cpp_version": prepared["llama_cpp_version"], "cases": peer_cases, "ours": ours}


def main(config: Config, args: argparse.Namespace) -> int:
    """Run the benchmark on ``args.model`` (skipped with a message when that model is not installed)."""
    args.model = args.model or config.model.path
    args.document_tokens = args.document_tokens or DOCUMENT_TOKENS
    try:
        loaded = load_model(args.model, config.model.threads, config.model.precision)
    except ModelError as exc:
        print(f"skipped: {exc}")
        return 0
    engine = Engine(loaded, max_context_tokens=8192, max_new_tokens=BATCH_NEW_TOKENS, question_budget_tokens=128)
    if engine.fast is None and engine.prefix_decoder is None:
        raise ValueError(f"{args.model} runs neither on the int8 engine nor on the shared-prefix path")
    if engine.max_context_tokens < max(args.document_tokens) + 128 + ANSWER_TOKENS:
        raise ValueError(f"{args.model} has {engine.max_context_tokens} positions; the benchmark needs "
                         f"{max(args.document_tokens) + 128 + ANSWER_TOKENS}")
    corpus_dir = Path(config.corpus.manifest).parent / "fixed"
    measured = measure(engine, corpus_dir, args.runs, args.document_tokens)
    snapshots, passages = measured.pop("snapshots"), measured.pop("passages")
    report = {"model": args.model, "recipe": engine.recipe, "fingerprint": loaded.fingerprint,
              "threads": torch.get_num_threads(), "runs": args.runs, **measured}
    if args.peer == "llama-cpp":
        report["peer"] = _peer(engine, args.model, snapshots, passages, args.runs)
    if BATCH_DOCUMENT_TOKENS in snapshots:
        print("measuring the serving layer...", file=sys.stderr, flush=True)
        report["serving"] = measure_serving(engine, snapshots[BATCH_DOCUMENT_TOKENS], config)
    print_table(report)
    saved = save_report("engine", report)
    if saved:
        print(f"written {saved}")
    return 0
