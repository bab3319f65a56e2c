"""The ingest steps of the CAGFlow DAGs as plain functions (manifest → parse → chunk → check → embed →
index), and the whole fixed pipeline for one-off runs outside Airflow; the files in ``dags/`` only wire the
steps together. The snapshot, release and maintenance steps are in ``snapshot_steps``, ``release_steps`` and
``maintenance_steps``; where settings, the store and the index come from is in ``connections``.

Steps take and return JSON-able values (Airflow passes them between tasks as XComs) and read their
settings from the project configuration. Every step is idempotent: a stored snapshot that verifies is
kept, chunks are upserted under stable ids, and a release identical to the active one is not published
again. Rerunning a failed or killed run therefore finishes the missing work only.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..config import Config
from .connections import chunk_index, resolve_config
from .passage_steps import precompute_indexed_passages
from .release_steps import publish_fixed_release, request_serving_reload
from .snapshot_steps import check_snapshots, plan_snapshot_parts, precompute_snapshot

if TYPE_CHECKING:
    from ..search.index_schema import Chunk

log = logging.getLogger(__name__)


def source_digest(document: dict, config: Config) -> str:
    """What a document's chunks are made from: its file, its manifest fields, the parser and chunker
    versions, the chunk sizes and the embedding model. Chunks carrying the same digest need not be made
    again. An unreadable file gets no digest (parsing reports it)."""
    from ..documents.parsing import PARSER_VERSION
    from ..search.chunking import CHUNKING_VERSION
    from ..search.embeddings import MODEL_ID

    try:
        digest = hashlib.sha256(Path(document["path"]).read_bytes())
    except OSError:
        return ""
    fields = {key: document.get(key) or "" for key in ("doc_id", "version", "tier", "title", "published")}
    made_by = {"parser": PARSER_VERSION, "chunker": CHUNKING_VERSION, "chunk_tokens": config.retrieval.chunk_tokens,
               "overlap_tokens": config.retrieval.chunk_overlap_tokens, "embedder": MODEL_ID}
    digest.update(json.dumps([fields, made_by], sort_keys=True).encode())
    return digest.hexdigest()


def load_documents(tier: str, doc_ids: Sequence[str] | None = None, config: Config | None = None,
                   incremental: bool = False) -> list[dict]:
    """The manifest's documents of ``tier`` (all, or the chosen ids), checked by the manifest suite, each
    with its ``source_sha256``. ``incremental`` marks ``unchanged`` the documents whose indexed chunks
    were all made from the same source: the later steps skip them."""
    from ..store.manifests import CorpusManifest
    from .validation import validate_documents

    config = resolve_config(config)
    manifest = CorpusManifest.load(config.corpus.manifest)
    entries = manifest.select(list(doc_ids) if doc_ids else None, tier=tier)
    documents = [{**entry.model_dump(), "path": str(manifest.file(entry))} for entry in entries]
    if documents:
        validate_documents(documents)
    for document in documents:
        document["source_sha256"] = source_digest(document, config)
    indexed = _indexed_sources(tier, config) if incremental and documents else {}
    for document in documents:
        document["unchanged"] = bool(document["source_sha256"]) and indexed.get(document["doc_id"]) == {
            document["source_sha256"]}
    unchanged = sum(document["unchanged"] for document in documents)
    log.info("%d %s document(s) from %s%s", len(documents), tier, config.corpus.manifest,
             f"; {unchanged} unchanged since they were indexed, skipped" if unchanged else "")
    return documents


def _indexed_sources(tier: str, config: Config) -> dict[str, set[str]]:
    """The index's documents of ``tier`` and their source digests; none when the index cannot say (not
    created yet, or unreachable: then every document is ingested, and the index step reports the error)."""
    from ..search.retrieval import RetrievalError

    with chunk_index(config) as index:
        try:
            return index.sources(tier)
        except RetrievalError as exc:
            log.warning("cannot tell which documents are indexed already, ingesting all: %s", exc)
            return {}


def parse_documents(documents: Sequence[dict]) -> list[dict]:
    """Titled sections per document. A document that cannot be parsed (empty, unreadable) is kept with
    its problem, so the validation step reports every broken document at once. Unchanged documents
    (``load_documents(incremental=True)``) are passed on without their text."""
    from ..documents.parsing import DocumentError, parse_file

    parsed = []
    for document in documents:
        record = {key: document[key] for key in ("doc_id", "version", "tier", "title")}
        record.update(published=document.get("published", ""), source_sha256=document.get("source_sha256", ""),
                      unchanged=bool(document.get("unchanged")))
        if record["unchanged"]:
            parsed.append({**record, "sections": [], "problem": None})
            continue
        try:
            sections = parse_file(document["path"], document["title"]).sections
            parsed.append({**record, "sections": [[s.heading, s.text] for s in sections], "problem": None})
        except DocumentError as exc:
            log.warning("%s: %s", document["doc_id"], exc)
            parsed.append({**record, "sections": [], "problem": str(exc)})
    return parsed


def chunk_documents(parsed: Sequence[dict], config: Config | None = None) -> list[dict]:
    """Token-bounded, overlapping chunks of every parsed document."""
    from ..documents.parsing import ParsedDocument, Section
    from ..search.chunking import chunk_document, embedding_token_counter

    config = resolve_config(config)
    count = embedding_token_counter()
    chunks = []
    changed = [doc for doc in parsed if not doc.get("unchanged")]
    for doc in changed:
        document = ParsedDocument(doc["title"], tuple(Section(heading, text) for heading, text in doc["sections"]))
        chunks += [{**chunk.to_record(), "source_sha256": doc.get("source_sha256", "")} for chunk in chunk_document(
            doc["doc_id"], doc["version"], doc["tier"], document, count,
            config.retrieval.chunk_tokens, config.retrieval.chunk_overlap_tokens, doc.get("published", ""))]
    log.info("%d chunk(s) from %d document(s), at most %d tokens, %d overlapping", len(chunks), len(changed),
             config.retrieval.chunk_tokens, config.retrieval.chunk_overlap_tokens)
    return chunks


def check_chunks(parsed: Sequence[dict], chunks: Sequence[dict], config: Config | None = None) -> dict:
    """Run the chunk suite; raises ``ValidationFailed`` (nothing downstream runs) with a readable report."""
    from .validation import validate_chunks

    config = resolve_config(config)
    changed = [doc for doc in parsed if not doc.get("unchanged")]
    problems = {doc["doc_id"]: doc["problem"] for doc in changed if doc["problem"]}
    validate_chunks(chunks, [doc["doc_id"] for doc in changed], config.retrieval.chunk_tokens, problems)
    log.info("chunk suite passed: %d chunk(s) of %d document(s)", len(chunks), len(changed))
    return {"documents": len(changed), "chunks": len(chunks)}


def encode_vector(vector: np.ndarray) -> str:
    """float32 vector as base64: exact, and a quarter of the size of a JSON list in an XCom."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def decode_vector(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype="<f4")


def embed_chunks(chunks: Sequence[dict]) -> list[dict]:
    from ..search.embeddings import get_embedder
    from ..search.index_schema import embedding_text

    if not chunks:  # nothing changed: the model is not even loaded
        return []

    started = time.perf_counter()
    vectors = get_embedder().encode([embedding_text(c["title"], c["section"], c["text"]) for c in chunks])
    seconds = time.perf_counter() - started
    log.info("embedded %d chunk(s) in %.1f s (%.0f chunks/s)", len(chunks), seconds, len(chunks) / max(seconds, 1e-9))
    return [{**chunk, "embedding": encode_vector(vector)} for chunk, vector in zip(chunks, vectors)]


def index_records(embedded: Sequence[dict]) -> list[Chunk]:
    """Embedded chunk records (as tasks pass them) → the index's chunk type."""
    from ..search.index_schema import Chunk

    return [Chunk(chunk_id=c["chunk_id"], doc_id=c["doc_id"], text=c["text"], tier=c["tier"], version=c["version"],
                  title=c["title"], section=c["section"], published=c.get("published", ""),
                  embedding=decode_vector(c["embedding"]).tolist(), source_sha256=c.get("source_sha256", ""))
            for c in embedded]


def index_chunks(embedded: Sequence[dict], tier: str, remove_unlisted: bool, config: Config | None = None,
                 documents: Sequence[dict] | None = None) -> dict:
    """Upsert chunks by chunk id, then make each document's chunks exactly this set.

    A document whose index holds more chunks than were just written had an older version (or chunking)
    indexed: its chunks are replaced. With ``remove_unlisted``, documents of ``tier`` that are no longer
    in the manifest (``documents``, unchanged ones included; by default those of the chunks) lose their
    chunks.
    """
    chunks = index_records(embedded)
    per_doc = Counter(chunk.doc_id for chunk in chunks)
    listed = {document["doc_id"] for document in documents} if documents is not None else set(per_doc)
    with chunk_index(config) as index:
        index.ensure_index()
        index.upsert(chunks)
        replaced = sorted(doc_id for doc_id, n in per_doc.items() if index.count(doc_id=doc_id) != n)
        for doc_id in replaced:
            index.delete_document(doc_id)
            index.upsert([chunk for chunk in chunks if chunk.doc_id == doc_id])
        removed = sorted(set(index.sources(tier)) - listed) if remove_unlisted else []
        for doc_id in removed:
            index.delete_document(doc_id)
        total = index.count(tier=tier)
        alias = index.alias
    log.info("indexed %d %s chunk(s) of %d document(s) into %s; replaced older chunks of %s; removed %s; "
             "%d %s chunk(s) in the index", len(chunks), tier, len(per_doc), alias, replaced or "none",
             removed or "none", total, tier)
    return {"index": alias, "upserted": len(chunks), "replaced": replaced, "removed": removed, "tier_total": total}


def run_fixed_pipeline(config: Config) -> dict:
    """What ``cag_fixed_precompute`` runs, task after task in this process, over ``config.corpus.manifest``:
    ingest the changed fixed documents (their passage states too), precompute what the active release lacks,
    publish, ask serving to reload. For one-off loads outside Airflow (`cagflow bench answers --dataset`);
    documents of the index that the manifest does not list are kept."""
    documents = load_documents("fixed", config=config, incremental=True)
    parsed = parse_documents(documents)
    chunks = chunk_documents(parsed, config)
    check_chunks(parsed, chunks, config)
    index_chunks(embed_chunks(chunks), "fixed", remove_unlisted=False, config=config, documents=parsed)
    precompute_indexed_passages("fixed", config)
    parts = plan_snapshot_parts(config=config)
    results = [precompute_snapshot(part, config=config) for part in parts]
    if parts:
        check_snapshots(results, parts, config)
    release = publish_fixed_release(results, config)
    return {**release, "reload": request_serving_reload(release, config)}
