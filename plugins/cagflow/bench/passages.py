"""``cagflow bench passages``: the retrieval route with reused passage states against full prefill, on a
public dataset's questions, in this process, on the same passages.

The dataset's documents are indexed into an index of their own in the running OpenSearch (chunked and
embedded as the ingest does); each question's top-k passages are searched once and then answered twice by
the same loaded model: with every passage's state precomputed and reused (``model.passage_kv: reuse``), and
with the passages prefilled. Answers are scored with the dataset's rules; time to first token per mode; the
states' precompute speed. The API route (``cagflow bench answers --route retrieval``) measures the same
through the REST API.
"""

from __future__ import annotations

import argparse
import statistics
import time

from ..config import Config
from .dataset_answers import score
from .datasets import load_dataset
from .report import save_report


def _index(config: Config, dataset, index_name: str) -> Config:
    """The dataset's documents chunked, embedded and indexed into ``index_name``; the config that searches it."""
    from ..offline.pipeline import chunk_documents, embed_chunks, index_chunks, parse_documents

    config = config.model_copy(update={"retrieval": config.retrieval.model_copy(update={"index": index_name})})
    documents = [{**entry.model_dump(), "path": str(dataset.corpus.file(entry)), "tier": "variable"}
                 for entry in dataset.corpus.documents]
    parsed = parse_documents(documents)
    chunks = chunk_documents(parsed, config)
    index_chunks(embed_chunks(chunks), "variable", remove_unlisted=False, config=config, documents=parsed)
    return config


def _mode_cell(rows: list[dict], mode: str, kind: str) -> dict:
    mine = [row[mode] for row in rows if row["kind"] == kind]
    if not mine:
        return {}
    return {"asked": len(mine), "right": sum(r["right"] for r in mine),
            "f1": round(statistics.fmean(r["f1"] for r in mine), 3),
            "declined": sum(not r["answered"] for r in mine),
            "p50_ttft_s": round(statistics.median(r["ttft_s"] for r in mine), 2),
            "p95_ttft_s": round(sorted(r["ttft_s"] for r in mine)[int(0.95 * (len(mine) - 1))], 2),
            "p50_prefix_ms": round(statistics.median(r["stages_ms"].get("prefix", 0.0) for r in mine), 1)}


def _ask(engine, question, passages, texts: dict[str, str]) -> dict:
    answer = engine.answer(question.question, context=passages)
    asked = {"answer": answer.text, "answered": answer.answered, "sources": sorted(texts),
             "ttft_s": answer.ttft_s, "total_s": answer.total_s, "stages_ms": answer.stages_ms,
             "prompt_tokens": answer.prompt_tokens, "reused_tokens": answer.reused_tokens}
    return score(question, asked, texts)


def _engine_for(mode: str, prefill, config: Config):
    """``prefill``, or ``reuse-N``: the same loaded model reusing passage states, the last N passages
    prefilled in context (``model.passage_kv_recompute``)."""
    from ..engine.engine import Engine
    from ..engine.passage_kv import PassageStates

    if mode == "prefill":
        return prefill
    states = PassageStates(prefill.fast, prefill.fingerprint, 8 * 2**30, recompute_last=int(mode.split("-")[1]))
    return Engine(prefill.loaded, prefill.max_context_tokens, prefill.max_new_tokens, prefill.question_budget_tokens,
                  config.model.relevance, config.rules.disabled, passage_states=states)


def main(config: Config, args: argparse.Namespace) -> int:
    from ..answering.prompt import Passage
    from ..engine.engine import Engine
    from .dataset_answers import document_texts
    from ..offline.connections import chunk_index
    from ..offline.passage_steps import passage_units

    dataset = load_dataset(args.dataset)
    questions = [q for q in dataset.questions if q.split == args.split and q.kind in ("answerable", "near_miss")]
    questions = questions[:args.limit] if args.limit else questions
    config = _index(config, dataset, f"bench-passages-{dataset.name}")
    texts = document_texts(dataset.manifest_path)
    with chunk_index(config) as index:
        found = {q.id: index.search(q.question) for q in questions}
    prefill = Engine.from_config(config.model.model_copy(update={"passage_kv": "prefill"}), config.rules.disabled)
    engines = {mode: _engine_for(mode, prefill, config) for mode in args.modes}
    distinct = {(h.title, h.section, h.text): Passage(h.text, h.title, h.section) for hits in found.values()
                for h in hits}
    states = next((engine.passage_states for engine in engines.values() if engine.passage_states), None)
    started, tokens = time.perf_counter(), 0
    for passage in distinct.values() if states else ():  # what the ingest DAG does, ahead of the questions
        for header, piece in passage_units(prefill.prompts, {"text": passage.text, "title": passage.title,
                                                            "section": passage.section}):
            tokens += 0 if states.state(header, piece)[1] else len(piece)
    precompute_s = time.perf_counter() - started
    rows = []
    for number, question in enumerate(questions, start=1):
        passages = [Passage(h.text, h.title, h.section) for h in found[question.id]]
        row = {"id": question.id, "kind": question.kind, "language": question.language}
        row.update({mode: _ask(engine, question, passages, texts) for mode, engine in engines.items()})
        rows.append(row)
        print(f"[{number}/{len(questions)}] {question.id} {question.kind} " + " · ".join(
            f"{mode} {'✓' if row[mode]['right'] else '✗'} {row[mode]['ttft_s']:.1f}s" for mode in engines),
            flush=True)
    report = {"dataset": dataset.name, "split": args.split, "model": config.model.path, "recipe": prefill.recipe,
              "top_k": config.retrieval.top_k, "passages": len(distinct), "modes": list(engines),
              "precompute": {"tokens": tokens, "seconds": round(precompute_s, 1),
                             "tokens_per_s": round(tokens / precompute_s, 1) if precompute_s else 0.0},
              "cells": {f"{mode} {kind}": _mode_cell(rows, mode, kind) for mode in engines
                        for kind in ("answerable", "near_miss")},
              "same_answer": sum(len({row[mode]["answer"] for mode in engines}) == 1 for row in rows),
              "rows": rows}
    print(f"\n{dataset.name} {args.split} half, top {report['top_k']} passages, {len(rows)} questions "
          f"({report['same_answer']} answered identically by every mode)")
    print(f"passage states: {len(distinct)} passages, {tokens} tokens in {precompute_s:.0f} s "
          f"({report['precompute']['tokens_per_s']} tokens/s)")
    for name, cell in report["cells"].items():
        if cell:
            print(f"  {name:<22} right {cell['right']}/{cell['asked']}  F1 {cell['f1']:.2f}  declined "
                  f"{cell['declined']}  TTFT p50 {cell['p50_ttft_s']} s p95 {cell['p95_ttft_s']} s  "
                  f"prefix p50 {cell['p50_prefix_ms']} ms")
    saved = save_report(f"passages-{dataset.name}", report)
    if saved:
        print(f"written {saved}")
    return 0
