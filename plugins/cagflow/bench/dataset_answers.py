"""`cagflow bench answers --dataset NAME|PATH`: a question set nobody here wrote, asked through the running
REST API and scored by the dataset's own rules (``bench.scoring``).

The dataset's documents join the stack as fixed documents next to the configured corpus: when the active
release lacks them, they are ingested and precomputed in this process (``pipeline.run_fixed_pipeline``; a
3k-token document takes about 100 s on the default model). Every question is asked as routed by the API
(``auto``); questions written against a document are also asked on each route by itself, the cache route
over that document's snapshot (``doc_id``, ``"route": "cache"``) and retrieval (``"route": "retrieval"``),
unless ``--route`` picks fewer.

Whether an answer was declined is the answer record's ``answered`` field, never a reading of its text, so
the score does not depend on the decline rules it measures. Figures are reported per split (calibration,
report: by document, see ``bench.datasets``), language, kind and route. Measured, never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from ..config import CACHE_HOME, Config
from ..client.demo import format_breakdown, percentile, stage_breakdown
from . import scoring
from .scoring import RELEVANCE_GRID
from ..rules import RULES
from .datasets import SPLITS, Dataset, DatasetError, DatasetQuestion, load_dataset, merged_manifest
from .report import save_report

ROUTES = ("auto", "cache", "retrieval")
MAX_NEW_TOKENS = 64


def _reply_fields(reply: dict, seconds: float) -> dict:
    snapshot = reply.get("snapshot") or {}
    cited = {item["doc_id"] for item in reply.get("citations", []) + reply.get("suggestions", [])}
    return {"answer": reply.get("answer", ""), "answered": bool(reply.get("answered", False)),
            "model_answer": reply.get("model_answer"), "route": reply.get("route"),
            "cache_doc_id": snapshot.get("doc_id"),
            "sources": sorted(cited | ({snapshot["doc_id"]} if snapshot.get("doc_id") else set())),
            "decline_reason": reply.get("decline_reason"), "rules_fired": reply.get("rules_fired", []),
            "relevance": reply.get("relevance"), "seconds": seconds,
            "ttft_s": (reply.get("timings_ms") or {}).get("ttft", 0.0) / 1000,
            "timings_ms": reply.get("timings_ms") or {}, "tokens": reply.get("tokens") or {},
            "computed": reply.get("answer_source") in (None, "computed"),
            "quotes": [item.get("quote") for item in reply.get("citations", [])]}


def score(question: DatasetQuestion, asked: dict, texts: dict[str, str]) -> dict:
    """The dataset's verdicts on one answer: right (answerable: answered and a gold answer in it; any other
    kind: declined), exact match, F1, and the figures it states that its sources lack."""
    if "error" in asked:
        return {**asked, "right": False, "exact": False, "f1": 0.0, "contains": False, "unsupported": []}
    answer = asked["answer"] if asked["answered"] else ""
    contains = scoring.contains_gold(question.answers, answer, question.language) if answer else False
    sources = [texts.get(doc_id, "") for doc_id in asked["sources"]]
    unsupported = scoring.unsupported_figures(answer, question.question, sources) if answer else []
    # the evidence shown with a right answer: does a citation's quote hold a gold answer too?
    quoted = contains and any(scoring.contains_gold(question.answers, text, question.language)
                              for text in asked.get("quotes") or [] if text)
    return {**asked, "contains": contains, "quoted_gold": quoted,
            "exact": scoring.exact_match(question.answers, answer, question.language) if answer else False,
            "f1": scoring.f1(question.answers, answer, question.language) if answer else 0.0,
            "right": contains if question.answerable else not asked["answered"], "unsupported": unsupported}


def _routes_for(question: DatasetQuestion, routes: tuple[str, ...]) -> list[tuple[str, dict]]:
    """Each route with its request options; the forced ones first, so that the API's own routing is not
    answered from the answer cache those fill."""
    forced = [] if question.article is None else \
        [("cache", {"doc_id": question.article, "route": "cache"}), ("retrieval", {"route": "retrieval"})]
    return [(route, options) for route, options in forced + [("auto", {})] if route in routes]


def ask_dataset(client, questions: list[DatasetQuestion], texts: dict[str, str], routes: tuple[str, ...],
                max_new_tokens: int = MAX_NEW_TOKENS, progress=None) -> list[dict]:
    from ..client.api_client import ApiError

    rows = []
    for number, question in enumerate(questions, start=1):
        row = {"id": question.id, "kind": question.kind, "split": question.split, "language": question.language,
               "doc_id": question.doc_id, "article": question.article, "question": question.question,
               "answers": list(question.answers)}
        for route, options in _routes_for(question, routes):
            started = time.perf_counter()
            try:
                reply = client.query(question.question, max_new_tokens=max_new_tokens, **options)
                asked = _reply_fields(reply, time.perf_counter() - started)
            except ApiError as exc:
                asked = {"error": f"{exc.code}: {exc.message}", "answered": False,
                         "seconds": time.perf_counter() - started}
            row[route] = score(question, asked, texts)
        rows.append(row)
        if progress:
            progress(number, len(questions), row)
    return rows


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _cell(answers: list[dict]) -> dict | None:
    if not answers:
        return None
    computed = [answer for answer in answers if answer.get("computed", True) and "error" not in answer]
    answered = [answer for answer in answers if answer.get("answered")]
    return {"asked": len(answers), "right": sum(answer["right"] for answer in answers),
            "share": sum(answer["right"] for answer in answers) / len(answers),
            "declined": len(answers) - len(answered), "errors": sum("error" in answer for answer in answers),
            "exact": sum(answer["exact"] for answer in answers),
            "f1": statistics.fmean(answer["f1"] for answer in answers),
            "unsupported": sum(bool(answer["unsupported"]) for answer in answered),
            "quoted_gold": sum(bool(answer.get("quoted_gold")) for answer in answers),
            "p50_ttft_s": _median([answer["ttft_s"] for answer in computed if answer.get("ttft_s")]),
            "p50_s": _median([answer["seconds"] for answer in computed]),
            "p50_stages_ms": stage_breakdown([answer.get("timings_ms") or {} for answer in computed]),
            "routes": dict(Counter(answer.get("route") or "error" for answer in answers)),
            "decline_reasons": dict(Counter(answer.get("decline_reason") or "model" for answer in answers
                                            if not answer.get("answered") and "error" not in answer))}


def summarise(rows: list[dict]) -> dict:
    """Cells per language, kind and route; the auto route also by the route it took; where several routes
    were asked, how many questions some route got right (no choice of route per question can do better: the
    ceiling of routing over these answers); and the answerable questions a cache route answered from another
    document than theirs."""
    table: dict = {}
    for language in sorted({row["language"] for row in rows}):
        for kind in ("answerable", "near_miss", "unrelated"):
            mine = [row for row in rows if row["language"] == language and row["kind"] == kind]
            if not mine:
                continue
            cells = {route: _cell([row[route] for row in mine if route in row]) for route in ROUTES}
            taken = Counter(row["auto"].get("route") or "error" for row in mine if "auto" in row)
            cells["auto by route taken"] = {route: _cell([row["auto"] for row in mine if "auto" in row
                                                          and (row["auto"].get("route") or "error") == route])
                                            for route in taken}
            asked = [route for route in ROUTES if cells[route] is not None]
            if len(asked) > 1:
                cells["some route"] = {"asked": len(mine), "routes": asked, "right": sum(
                    any(row[route]["right"] for route in asked if route in row) for row in mine)}
            table[f"{language} {kind}"] = cells
    timing = {route: route_timing([row[route] for row in rows if route in row]) for route in ROUTES}
    wrong_document = [row["id"] for row in rows if row["doc_id"] and "auto" in row
                      and row["auto"].get("route") in ("cache", "cache+retrieval")
                      and row["auto"].get("cache_doc_id") != row["doc_id"]]
    return {"questions": len(rows), "table": table, "timing": {route: cell for route, cell in timing.items() if cell},
            "wrong_document_cache_routes": wrong_document}


SHORT_ANSWER_TOKENS = 30  # "a short answer": the total time goal is for answers of fewer generated tokens


def route_timing(answers: list[dict]) -> dict | None:
    """What a user waits on one route, over its computed answers of every kind (the answer cache and errors
    left out): time to first token and total (p50, p95), the total of answers under ``SHORT_ANSWER_TOKENS``
    tokens, and the decode time per token after the first."""
    computed = [answer for answer in answers if answer.get("computed", True) and "error" not in answer
                and answer.get("tokens")]
    if not computed:
        return None
    generated = [answer["tokens"]["generated"] for answer in computed]
    decode = [(answer["timings_ms"]["generate"] - answer["timings_ms"]["ttft"]) / (count - 1)
              for answer, count in zip(computed, generated) if count > 1 and answer.get("timings_ms")]
    return {"computed": len(computed),
            "ttft_s": _percentiles([answer["ttft_s"] for answer in computed]),
            "total_s": _percentiles([answer["seconds"] for answer in computed]),
            "short_total_p50_s": _median([answer["seconds"] for answer, count in zip(computed, generated)
                                          if count < SHORT_ANSWER_TOKENS]),
            "short_answers": sum(count < SHORT_ANSWER_TOKENS for count in generated),
            "decode_ms_per_token_p50": _median(decode), "generated_tokens_p50": _median(generated)}


def _percentiles(values: list[float]) -> dict:
    return {"p50": statistics.median(values), "p95": percentile(values, 0.95)}


def ablation(rows: list[dict], questions: dict[str, DatasetQuestion], route: str = "auto") -> dict:
    """What each answer rule (``cagflow.rules``) did to the answers of ``route``, from the rules each record says
    fired. A decline rule that decided an answer alone (no other decline rule held) gave away the model's
    text (``model_answer``): scored as if shown, it is a right answer lost, a wrong answer stopped, or an
    unanswerable question caught; the router's gate stops the model before it answers, so its answerable
    declines are counted, not scored. A re-ask replaced a decline: a right answer won, a wrong one made, or an
    unanswerable question answered. ``net``: the change in right answers the rule brings."""
    table = {}
    for name, rule in RULES.items():
        effect = Counter()
        for row in rows:
            asked = row.get(route)
            if not asked or name not in asked.get("rules_fired", []):
                continue
            question = questions[row["id"]]
            effect["fired"] += 1
            if rule.acts == "reask":
                if not question.answerable:
                    effect["unanswerable_answered" if asked["answered"] else "declined_again"] += 1
                else:
                    effect["right_won" if asked["right"] else "wrong_made" if asked["answered"]
                           else "declined_again"] += 1
                continue
            others = [other for other in asked["rules_fired"] if other != name and RULES[other].acts != "reask"]
            if asked["answered"] or asked.get("decline_reason") != name or others:
                continue  # switched off, or another rule declines it too
            effect["decided"] += 1
            if not question.answerable:
                effect["unanswerable_caught"] += 1
            elif rule.acts == "gate":
                effect["answerable_declined_unasked"] += 1
            elif scoring.contains_gold(question.answers, asked.get("model_answer") or "", question.language):
                effect["right_lost"] += 1
            else:
                effect["wrong_stopped"] += 1
        net = (effect["right_won"] - effect["unanswerable_answered"] if rule.acts == "reask"
               else effect["unanswerable_caught"] - effect["right_lost"])
        table[name] = {"acts": rule.acts, **effect, "net": net}
    return table


def check_sweep(rows: list[dict], questions: dict[str, DatasetQuestion], route: str) -> dict:
    """What the answer check (``not_in_documents``) would do at each threshold, replayed from one run's records
    on ``route``, per language and half: answerable questions right, unanswerable ones declined, wrong answers
    shown. A language whose answers lack their relevance (the check was off: run with
    ``model.relevance.decline_below_<language>`` above 0, e.g. 0.01, to record it) is left out. ``calibrated``:
    the threshold with the most right answers and declines on the calibration half (the lowest of equals)."""
    sweeps = {}
    for language in sorted({row["language"] for row in rows}):
        mine = [row for row in rows if row["language"] == language and row.get(route) and "error" not in row[route]]
        if not mine or any(row[route].get("relevance") is None for row in mine
                           if row[route]["answered"] or row[route].get("decline_reason") == "not_in_documents"):
            continue
        # each record scored once: (its half, answerable, holds a gold answer); only whether it stands varies
        scored = []
        for row in mine:
            asked, question = row[route], questions[row["id"]]
            text = asked.get("model_answer") or asked["answer"]
            scored.append((row["split"], asked, question.answerable,
                           question.answerable and scoring.contains_gold(question.answers, text, question.language)))
        halves = {split: {} for split in SPLITS}
        for threshold in RELEVANCE_GRID:
            for split in SPLITS:
                halves[split][str(threshold)] = dict.fromkeys(("answerable_right", "unanswerable_declined",
                                                               "wrong_shown"), 0)
            for split, asked, answerable, fact in scored:
                stands = scoring.stands_at(asked, threshold)
                shown = asked["answered"] if stands is None else stands
                cell = halves[split][str(threshold)]
                cell["answerable_right"] += shown and fact
                cell["unanswerable_declined"] += not answerable and not shown
                cell["wrong_shown"] += shown and not fact

        def score(threshold: str) -> tuple[int, float]:
            cell = halves["calibration"][threshold]
            return cell["answerable_right"] + cell["unanswerable_declined"], -float(threshold)

        chosen = max(halves["calibration"], key=score)
        sweeps[language] = {"calibrated": float(chosen), **halves}
    return sweeps


def print_check_sweep(route: str, sweeps: dict) -> None:
    for language, sweep in sweeps.items():
        print(f"\nanswer check, {language}, {route} route, at each decline threshold: answerable right / "
              f"unanswerable declined / wrong answers shown (calibrated: {sweep['calibrated']})")
        print(f"{'threshold':>10}" + "".join(f"{split + ' half':>24}" for split in SPLITS))
        for threshold in sweep["calibration"]:
            cells = "".join("{answerable_right:>12} / {unanswerable_declined:>3} / {wrong_shown:>3}".format_map(
                sweep[split][threshold]) for split in SPLITS)
            print(f"{threshold:>10}{cells}")


def print_ablation(title: str, table: dict) -> None:
    print(f"\n{title}: what each rule did (net: right answers it adds; decline rules: when it decided alone)")
    for name, effect in table.items():
        details = ", ".join(f"{key} {value}" for key, value in effect.items() if key not in ("acts", "net"))
        print(f"  {name:<24} {effect['acts']:<7} net {effect['net']:+d}  {details or 'never fired'}")


def _shown(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def print_summary(title: str, summary: dict) -> None:
    print(f"\n{title}: {summary['questions']} questions; cells: right / asked (share), declined, answers with "
          "unsupported figures, mean F1, p50 TTFT")
    print(f"{'':<22}" + "".join(f"{route:>40}" for route in ROUTES))
    for group, cells in summary["table"].items():
        line = f"{group:<22}"
        for route in ROUTES:
            cell = cells[route]
            ttft = "-" if cell is None or cell["p50_ttft_s"] is None else f"{cell['p50_ttft_s']:.1f}s"
            line += f"{'-':>40}" if cell is None else (
                f"{cell['right']:>4}/{cell['asked']:<3} ({cell['share']:>4.0%}) dec {cell['declined']:>3} "
                f"uns {cell['unsupported']:>2} F1 {cell['f1']:.2f} {ttft:>6}")
        print(line)
        taken = ", ".join(f"{route} {cell['right']}/{cell['asked']}"
                          for route, cell in sorted(cells["auto by route taken"].items()))
        print(f"{'':<22}auto by route taken: {taken}")
        if "some route" in cells:
            best = cells["some route"]
            print(f"{'':<22}right on some route ({', '.join(best['routes'])}): {best['right']}/{best['asked']}")
        for route in ROUTES:
            if cells[route] is not None and cells[route]["p50_stages_ms"]:
                print(f"{'':<22}{route} p50 ms by stage: {format_breakdown(cells[route]['p50_stages_ms'])}")
            if cells[route] is not None and cells[route]["right"] and group.endswith("answerable"):
                print(f"{'':<22}{route}: a quote holds the gold answer for {cells[route]['quoted_gold']} of "
                      f"{cells[route]['right']} right answers")
    for route, timing in summary.get("timing", {}).items():
        print(f"{route} timing ({timing['computed']} computed answers): TTFT p50 {timing['ttft_s']['p50']:.2f} s "
              f"p95 {timing['ttft_s']['p95']:.2f} s; total p50 {timing['total_s']['p50']:.2f} s p95 "
              f"{timing['total_s']['p95']:.2f} s; under {SHORT_ANSWER_TOKENS} tokens ({timing['short_answers']}) "
              f"p50 {_shown(timing['short_total_p50_s'], '{:.2f} s')}; decode p50 "
              f"{_shown(timing['decode_ms_per_token_p50'], '{:.0f} ms')}/token")
    print(f"wrong-document cache routes: {len(summary['wrong_document_cache_routes'])} "
          f"{summary['wrong_document_cache_routes']}")


def document_texts(manifest_path: Path) -> dict[str, str]:
    """Every document's text as stored, for checking what an answer states against its sources."""
    from ..store.manifests import CorpusManifest

    manifest = CorpusManifest.load(manifest_path)
    return {entry.doc_id: manifest.file(entry).read_text(encoding="utf-8", errors="replace")
            for entry in manifest.documents}


def ensure_served(config: Config, client, dataset: Dataset, ingest: bool) -> Path:
    """The merged corpus manifest, after making sure the API serves every document of the dataset:
    ingested and precomputed here when the active release lacks some (unless ``ingest`` is off)."""
    from ..offline.pipeline import run_fixed_pipeline

    manifest = merged_manifest(Path(config.corpus.manifest), dataset, CACHE_HOME / "bench" / f"{dataset.name}.yaml")
    missing = sorted(set(dataset.doc_ids) - set(client.releases()["documents"]))
    if not missing:
        return manifest
    if not ingest:
        raise DatasetError(f"{len(missing)} of {dataset.name}'s {len(dataset.doc_ids)} documents are not in the "
                           f"active release ({', '.join(missing[:3])}...); run without --no-ingest to add them")
    print(f"adding {len(missing)} document(s) of {dataset.name} to the stack (index, snapshots, release), with the "
          f"corpus of {config.corpus.manifest}: {manifest}", file=sys.stderr, flush=True)
    # the dataset's passages get their states at ingest, as a deployment that reuses them computes them
    settings = config.model_copy(update={
        "corpus": config.corpus.model_copy(update={"manifest": str(manifest)}),
        "ingest": config.ingest.model_copy(update={"passage_state_tiers": ["fixed", "variable"]})})
    release = run_fixed_pipeline(settings)
    print(f"release {release['release_id']}: {release['documents']} documents; serving reload: "
          f"{release['reload']}", file=sys.stderr, flush=True)
    still = sorted(set(dataset.doc_ids) - set(client.releases()["documents"]))  # the router re-reads the release
    if still:
        raise DatasetError(f"the API does not serve {', '.join(still)} after the ingest; see `cagflow doctor`")
    return manifest


def run(config: Config, args: argparse.Namespace) -> int:
    from ..client.demo import open_local_client

    try:
        dataset = load_dataset(args.dataset)
    except DatasetError as exc:
        print(f"cagflow bench answers: error: {exc}", file=sys.stderr)
        return 2
    client = open_local_client(config, "bench answers")
    if client is None:
        return 2
    questions = [question for question in dataset.questions
                 if (not args.split or question.split == args.split)
                 and (not args.language or question.language == args.language)
                 and (not args.only or question.id in args.only.split(","))]
    questions = questions[:args.limit] if args.limit else questions
    routes = tuple(args.route or ROUTES)
    try:
        manifest = ensure_served(config, client, dataset, ingest=not args.no_ingest)
    except DatasetError as exc:
        print(f"cagflow bench answers: error: {exc}", file=sys.stderr)
        return 2

    def progress(number: int, total: int, row: dict) -> None:
        marks = " ".join(f"{route} {'✓' if row[route]['right'] else '✗'}" for route in ROUTES if route in row)
        print(f"[{number}/{total}] {row['id']} {row['kind']} {marks}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    rows = ask_dataset(client, questions, document_texts(manifest), routes, MAX_NEW_TOKENS, progress)
    report = {"dataset": dataset.name, "model": config.model.path, "api": client.base_url, "routes": list(routes),
              "max_new_tokens": MAX_NEW_TOKENS, "seconds": time.perf_counter() - started,
              "thresholds": {"in_scope": config.service.in_scope_threshold,
                             "answerable": config.service.answerable_threshold,
                             "relevance": config.model.relevance.model_dump()},
              "disabled_rules": config.rules.disabled,
              "splits": {split: summarise([row for row in rows if row["split"] == split]) for split in SPLITS},
              "ablation": {split: ablation([row for row in rows if row["split"] == split],
                                           {question.id: question for question in questions}) for split in SPLITS},
              "answer_check": {route: check_sweep(rows, {question.id: question for question in questions}, route)
                               for route in routes},
              "rows": rows}
    print(f"{dataset.name}: {config.model.path} through {client.base_url} ({MAX_NEW_TOKENS} new tokens at most)")
    for split in SPLITS:
        if report["splits"][split]["questions"]:
            print_summary(f"{split} half", report["splits"][split])
            if getattr(args, "ablate", False):
                print_ablation(f"{split} half, auto route", report["ablation"][split])
    for route, sweeps in report["answer_check"].items():
        print_check_sweep(route, sweeps)
    saved = save_report(f"answers-{dataset.name}", report)
    if saved:
        print(f"written {saved}")
    return 0
