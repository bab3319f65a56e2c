"""`cagflow bench answers`: what a numeric recipe costs in answers. Every sample question that a fixed
document answers is answered from that document's snapshot under each precision (int8 and fp32) of one
model, in the same run; a fact counts as found when the answer holds all of the question's keywords.
Measured and reported, never asserted.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..config import Config
from ..core.documents import parse_file
from ..core.engine import Engine, best_part
from ..core.model import ModelError, load_model
from ..core.qa import load_qa
from ..store.manifests import CorpusManifest
from .report import save_report

PRECISIONS = ("int8", "fp32")
MAX_NEW_TOKENS = 64


def answer_all(engine: Engine, manifest: Path, qa_path: Path) -> list[dict]:
    """Each in-scope question about a fixed document, answered from the best-matching part's snapshot."""
    corpus = CorpusManifest.load(manifest)
    items = [item for item in load_qa(qa_path) if item.in_scope and item.doc_id]
    snapshots = {}
    for document in corpus.tier("fixed"):
        parts = engine.split(document.doc_id, document.version, parse_file(corpus.file(document), document.title))
        snapshots[document.doc_id] = [engine.precompute(part) for part in parts]
    rows = []
    for item in items:
        if item.doc_id not in snapshots:
            continue
        parts = snapshots[item.doc_id]
        snapshot = parts[best_part(item.question, [s.system_prompt for s in parts])]
        answer = engine.answer(item.question, snapshot=snapshot, max_new_tokens=MAX_NEW_TOKENS)
        rows.append({"id": item.id, "answer": answer.text, "found": item.is_correct(answer.text),
                     "token_ids": answer.token_ids, "seconds": answer.total_s})
    return rows


def main(config: Config, args: argparse.Namespace) -> int:
    args.model = args.model or config.model.path
    manifest = Path(config.corpus.manifest)
    report: dict = {"model": args.model, "threads": config.model.threads, "precisions": {}}
    for precision in PRECISIONS:
        print(f"answering under {precision}...", file=sys.stderr, flush=True)
        try:
            loaded = load_model(args.model, config.model.threads, precision)
        except ModelError as exc:
            print(f"skipped: {exc}")
            return 0
        engine = Engine(loaded, config.model.max_context_tokens, MAX_NEW_TOKENS, config.model.question_budget_tokens)
        started = time.perf_counter()
        rows = answer_all(engine, manifest, manifest.parent / "qa.jsonl")
        report["precisions"][precision] = {"recipe": engine.recipe, "rows": rows,
                                           "found": sum(row["found"] for row in rows), "questions": len(rows),
                                           "seconds": time.perf_counter() - started}
        del engine, loaded
    results = report["precisions"]
    same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(results["int8"]["rows"], results["fp32"]["rows"]))
    report["identical_answers"] = same
    print(f"{args.model}: facts found in answers from snapshots ({MAX_NEW_TOKENS} new tokens at most)")
    for precision, result in results.items():
        print(f"  {precision:>5} ({result['recipe']}): {result['found']}/{result['questions']} "
              f"({result['found'] / result['questions']:.0%}) in {result['seconds']:.0f} s")
    print(f"  token-identical answers int8 vs fp32: {same}/{len(results['int8']['rows'])}")
    differ = [(a, b) for a, b in zip(results["int8"]["rows"], results["fp32"]["rows"]) if a["found"] != b["found"]]
    for a, b in differ:
        print(f"  {a['id']}: int8 {'found' if a['found'] else 'missed'} ({a['answer'][:70]!r}) / fp32 "
              f"{'found' if b['found'] else 'missed'} ({b['answer'][:70]!r})")
    saved = save_report("answers", report)
    if saved:
        print(f"written {saved}")
    return 0
