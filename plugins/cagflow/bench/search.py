"""`cagflow bench retrieval` and `cagflow bench routing`: recall of the search modes, and in-scope detection
per threshold with its calibration. Measured and reported, never asserted."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from ..config import Config
from ..answering.qa import QAItem, load_qa

RECALL_KS = (1, 3, 5, 8)
ROUTING_THRESHOLDS = (0.8, 0.82, 0.84, 0.86, 0.88, 0.9, 0.92)  # e5 cosines: related text scores 0.85 and up
RETRIEVAL_SETUPS = (("bm25", "bm25", None), ("vector", "vector", None), ("hybrid min-max", "hybrid", "min_max"),
                    ("hybrid rrf", "hybrid", "rrf"))


def _index_corpus(config: Config, index_name: str):
    """Both tiers parsed, chunked and embedded as the pipeline does it, into a fresh index of their own
    (OpenSearch is asked first, so a missing node fails before the slow embedding)."""
    from ..offline import pipeline
    from ..search.retrieval import ChunkIndex

    index = ChunkIndex(config.retrieval.endpoint, index_name, top_k=max(RECALL_KS),
                       timeout_s=config.retrieval.timeout_s)
    index.describe()
    embedded = []
    for tier in ("fixed", "variable"):
        parsed = pipeline.parse_documents(pipeline.load_documents(tier, config=config))
        embedded += pipeline.embed_chunks(pipeline.chunk_documents(parsed, config))
    index.rebuild(pipeline.index_records(embedded))
    return index, len(embedded)


def _first_relevant_rank(hits, item: QAItem, answer_bearing: bool) -> int | None:
    """1-based rank of the first hit from the answering document (that also holds every keyword, when
    ``answer_bearing``), or None."""
    for rank, hit in enumerate(hits, start=1):
        if hit.doc_id == item.doc_id and (not answer_bearing or item.has_keywords(hit.text)):
            return rank
    return None


def _recall(document_ranks, answer_ranks) -> dict:
    """recall@k of the answering document and of a chunk holding the answer, from first-relevant ranks."""
    return {"document_recall": {k: sum(r is not None and r <= k for r in document_ranks) / len(document_ranks)
                                for k in RECALL_KS},
            "answer_chunk_recall": {k: sum(r is not None and r <= k for r in answer_ranks) / len(answer_ranks)
                                    for k in RECALL_KS}}


def retrieval_recall(config: Config, qa_path: Path) -> dict:
    """recall@k of BM25, vector and hybrid search on the sample questions that a document answers."""
    items = [item for item in load_qa(qa_path) if item.doc_id]
    languages = sorted({item.language for item in items})
    index, n_chunks = _index_corpus(config, f"{config.retrieval.index}-bench")
    backend = index.describe()
    results = {}
    try:
        index.search("warm up", mode="hybrid")  # creates the search pipeline outside the timings
        for label, mode, fusion in RETRIEVAL_SETUPS:
            document_ranks, answer_ranks, latencies = [], [], []
            for item in items:
                started = time.perf_counter()
                hits = index.search(item.question, mode=mode, fusion=fusion, top_k=max(RECALL_KS))
                latencies.append(time.perf_counter() - started)
                document_ranks.append(_first_relevant_rank(hits, item, answer_bearing=False))
                answer_ranks.append(_first_relevant_rank(hits, item, answer_bearing=True))
            results[label] = {**_recall(document_ranks, answer_ranks), "p50_ms": statistics.median(latencies) * 1000,
                              "by_language": {language: _recall(*zip(*[(d, a) for item, d, a in
                                                                       zip(items, document_ranks, answer_ranks)
                                                                       if item.language == language]))
                                              for language in languages}}
    finally:
        index.close()
    return {"questions": len(items), "chunks": n_chunks, "opensearch": backend.version,
            "questions_by_language": {language: sum(item.language == language for item in items)
                                      for language in languages},
            "hybrid_runs_on": {fusion: index.hybrid_runs_on(fusion) for fusion in ("min_max", "rrf")},
            "results": results}


def print_retrieval_table(report: dict) -> None:
    print(f"{report['questions']} questions answered by a document, {report['chunks']} chunks, "
          f"OpenSearch {report['opensearch']}, hybrid runs {report['hybrid_runs_on']}")
    header = "".join(f"  R@{k:<4}" for k in RECALL_KS)
    print(f"{'mode':<16}{'document recall':<{len(header)}}  |{'answer-chunk recall':<{len(header)}}  | p50 ms")
    print(f"{'':<16}{header}  |{header}  |")
    for label, row in report["results"].items():
        for language, recall in [("", row), *row.get("by_language", {}).items()]:
            docs = "".join(f"  {recall['document_recall'][k]:<6.2f}" for k in RECALL_KS)
            answers = "".join(f"  {recall['answer_chunk_recall'][k]:<6.2f}" for k in RECALL_KS)
            name = f"  {language} ({report['questions_by_language'][language]})" if language else label
            print(f"{name:<16}{docs}  |{answers}  |" + ("" if language else f" {row['p50_ms']:.1f}"))


def routing_calibration(config: Config, qa_path: Path) -> dict:
    """In-scope detection and answerability on every sample question: both thresholds calibrated on one half
    of the questions (``cagflow.answering.qa.halves``) and measured on the other."""
    from dataclasses import asdict

    from ..answering.qa import halves
    from ..search.scope import ScopeDetector, calibrate, calibrate_answerability, evaluate, evaluate_answerability

    items = load_qa(qa_path)
    index, n_chunks = _index_corpus(config, f"{config.retrieval.index}-bench")
    try:
        detector = ScopeDetector(index, config.service.in_scope_threshold)
        cacheable = detector.refresh()
        vectors = index.embedder.encode_queries([item.question for item in items])
        latencies, matches = [], []
        for item, vector in zip(items, vectors):
            started = time.perf_counter()
            matches.append(detector.match(vector, item.question))
            latencies.append(time.perf_counter() - started)
    finally:
        index.close()
    match_of = {item.id: match for item, match in zip(items, matches)}
    calibration_half, held_out = halves(items)
    # In-scope routing is judged on the questions some document answers: an unanswerable question is
    # declined on either route, and the cache route declines it sooner. A conflict question belongs to the
    # fixed document and to its newer update at once (the cache+retrieval route): left out too.
    routed_calibration = [item for item in calibration_half if item.answerable and item.kind != "conflict"]
    routed_held_out = [item for item in held_out if item.answerable and item.kind != "conflict"]

    def matched(part):
        return [match_of[item.id] for item in part]

    calibration = calibrate(routed_calibration, matched(routed_calibration))
    answerable, answerable_sweep = calibrate_answerability(calibration_half, matched(calibration_half))
    thresholds = sorted({*ROUTING_THRESHOLDS, config.service.in_scope_threshold, calibration.threshold})
    misrouted = [{"id": item.id, "in_scope": item.in_scope, "doc_id": item.doc_id, "matched_doc_id": match.doc_id,
                  "score": round(match.score, 4), "other_score": round(match.other_score, 4)}
                 for item, match in zip(items, matches)
                 if item.answerable and item.kind != "conflict"
                 and match.routes_to_cache(calibration.threshold) != item.in_scope]
    return {"questions": len(items), "in_scope_questions": sum(item.in_scope for item in items),
            "calibration_questions": len(calibration_half), "held_out_questions": len(held_out),
            "chunks": n_chunks, "cacheable_chunks": cacheable,
            "configured_threshold": config.service.in_scope_threshold,
            "configured_answerable_threshold": config.service.answerable_threshold,
            "match_p50_us": statistics.median(latencies) * 1e6,
            "thresholds": [asdict(evaluate(routed_held_out, matched(routed_held_out), threshold))
                           for threshold in thresholds],
            "calibration": calibration.to_dict(),
            "held_out_at_calibrated": asdict(evaluate(routed_held_out, matched(routed_held_out),
                                                      calibration.threshold)),
            "answerable_calibration": asdict(answerable),
            "answerable_sweep": [asdict(row) for row in answerable_sweep],
            "answerable_held_out": asdict(evaluate_answerability(held_out, matched(held_out), answerable.threshold)),
            "answerable_held_out_at_configured": asdict(evaluate_answerability(
                held_out, matched(held_out), config.service.answerable_threshold)),
            "held_out_by_language": {
                language: {
                    "routing": asdict(evaluate([i for i in routed_held_out if i.language == language],
                                               matched([i for i in routed_held_out if i.language == language]),
                                               calibration.threshold)),
                    "answerability": asdict(evaluate_answerability(
                        [i for i in held_out if i.language == language],
                        matched([i for i in held_out if i.language == language]), answerable.threshold))}
                for language in sorted({item.language for item in items})},
            "misrouted_at_calibrated": misrouted}


def print_routing_table(report: dict) -> None:
    calibration = report["calibration"]
    print(f"{report['questions']} questions ({report['in_scope_questions']} in scope), {report['chunks']} chunks "
          f"({report['cacheable_chunks']} cacheable), match p50 {report['match_p50_us']:.0f} µs")
    print(f"thresholds calibrated on {report['calibration_questions']} questions; the table is measured on the "
          f"other {report['held_out_questions']} (held out; routing on those a document answers)")
    print(f"{'threshold':<12}{'precision':>10}{'recall':>8}{'F1':>8}{'doc acc':>9}{'to cache':>10}")
    for row in report["thresholds"]:
        marks = "".join(mark for value, mark in ((calibration["threshold"], "  ← calibrated"),
                                                 (report["configured_threshold"], "  ← configured"))
                        if row["threshold"] == value)
        print(f"{row['threshold']:<12.3f}{row['precision']:>10.3f}{row['recall']:>8.3f}{row['f1']:>8.3f}"
              f"{row['doc_accuracy']:>9.3f}{row['routed_to_cache']:>10}{marks}")
    print(f"calibrated in-scope threshold {calibration['threshold']:.3f} ({calibration['rule']}); on the "
          f"calibration half precision {calibration['chosen']['precision']:.3f} recall "
          f"{calibration['chosen']['recall']:.3f}; {len(report['misrouted_at_calibrated'])} answerable questions "
          "misrouted there")
    for language, row in report.get("held_out_by_language", {}).items():
        routing, answerability = row["routing"], row["answerability"]
        print(f"  held out, {language}: routing precision {routing['precision']:.3f} recall {routing['recall']:.3f} "
              f"F1 {routing['f1']:.3f} doc acc {routing['doc_accuracy']:.3f}; answerability keeps "
              f"{answerability['answerable_kept']:.0%} of answerable, declines "
              f"{answerability['unanswerable_declined']:.0%} of unanswerable")
    chosen, held = report["answerable_calibration"], report["answerable_held_out"]
    configured = report["answerable_held_out_at_configured"]
    print(f"answerability: calibrated threshold {chosen['threshold']:.3f} (the highest keeping >= 98% of answerable "
          f"questions): calibration half keeps {chosen['answerable_kept']:.0%} of answerable, declines "
          f"{chosen['unanswerable_declined']:.0%} of unanswerable; held-out half keeps {held['answerable_kept']:.0%}, "
          f"declines {held['unanswerable_declined']:.0%}; configured {configured['threshold']:.3f} on the held-out "
          f"half keeps {configured['answerable_kept']:.0%}, declines {configured['unanswerable_declined']:.0%}")
