"""Benchmarks behind `cagflow bench ...`: measured, reported and saved, never asserted."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from .config import Config
from .qa import QAItem, load_qa

RECALL_KS = (1, 3, 5, 8)
RETRIEVAL_SETUPS = (("bm25", "bm25", None), ("vector", "vector", None), ("hybrid min-max", "hybrid", "min_max"),
                    ("hybrid rrf", "hybrid", "rrf"))


def _index_corpus(config: Config, index_name: str):
    """Both tiers parsed, chunked and embedded as the pipeline does it, into a fresh index of their own."""
    from . import pipeline
    from .retrieval import ChunkIndex

    embedded = []
    for tier in ("fixed", "variable"):
        parsed = pipeline.parse_documents(pipeline.load_documents(tier, config=config))
        embedded += pipeline.embed_chunks(pipeline.chunk_documents(parsed, config))
    index = ChunkIndex(config.retrieval.endpoint, index_name, top_k=max(RECALL_KS), timeout_s=config.retrieval.timeout_s)
    index.rebuild(pipeline.index_records(embedded))
    return index, len(embedded)


def _first_relevant_rank(hits, item: QAItem, answer_bearing: bool) -> int | None:
    """1-based rank of the first hit from the answering document (that also holds every keyword, when
    ``answer_bearing``), or None."""
    for rank, hit in enumerate(hits, start=1):
        if hit.doc_id == item.doc_id and (not answer_bearing or item.is_correct(hit.text)):
            return rank
    return None


def retrieval_recall(config: Config, qa_path: Path) -> dict:
    """recall@k of BM25, vector and hybrid search on the sample questions that a document answers."""
    items = [item for item in load_qa(qa_path) if item.doc_id]
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
            results[label] = {
                "document_recall": {k: sum(r is not None and r <= k for r in document_ranks) / len(items)
                                    for k in RECALL_KS},
                "answer_chunk_recall": {k: sum(r is not None and r <= k for r in answer_ranks) / len(items)
                                        for k in RECALL_KS},
                "p50_ms": statistics.median(latencies) * 1000,
            }
    finally:
        index.close()
    return {"questions": len(items), "chunks": n_chunks, "opensearch": backend.version,
            "hybrid_runs_on": {fusion: index.hybrid_runs_on(fusion) for fusion in ("min_max", "rrf")},
            "results": results}


def print_retrieval_table(report: dict) -> None:
    print(f"{report['questions']} questions answered by a document, {report['chunks']} chunks, "
          f"OpenSearch {report['opensearch']}, hybrid runs {report['hybrid_runs_on']}")
    header = "".join(f"  R@{k:<4}" for k in RECALL_KS)
    print(f"{'mode':<16}{'document recall':<{len(header)}}  |{'answer-chunk recall':<{len(header)}}  | p50 ms")
    print(f"{'':<16}{header}  |{header}  |")
    for label, row in report["results"].items():
        docs = "".join(f"  {row['document_recall'][k]:<6.2f}" for k in RECALL_KS)
        answers = "".join(f"  {row['answer_chunk_recall'][k]:<6.2f}" for k in RECALL_KS)
        print(f"{label:<16}{docs}  |{answers}  | {row['p50_ms']:.1f}")


def save_report(name: str, report: dict, directory: Path = Path("bench/results")) -> Path | None:
    """Write the report next to earlier ones when run from the repository; None elsewhere."""
    if not directory.is_dir():
        return None
    path = directory / f"{name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    return path
