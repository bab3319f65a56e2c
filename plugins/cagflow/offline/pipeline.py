"""The steps of the CAGFlow DAGs as plain functions; the files in ``dags/`` only wire them together.

Steps take and return JSON-able values (Airflow passes them between tasks as XComs) and read their
settings from the project configuration. The snapshot store and OpenSearch are reached through the
Airflow connections ``cagflow_s3`` and ``cagflow_opensearch`` when those are defined, so credentials stay
in Airflow's secret storage; otherwise the configuration (and boto3's usual credential chain) applies.

Every step is idempotent: a stored snapshot that verifies is kept, chunks are upserted under stable ids,
and a release identical to the active one is not published again. Rerunning a failed or killed run
therefore finishes the missing work only.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..config import Config, ConfigError, ModelConfig, load_config
from ..errors import CagflowError

if TYPE_CHECKING:
    from ..engine.engine import Engine
    from ..search.retrieval import Chunk, ChunkIndex
    from ..store.backends import SnapshotStore

log = logging.getLogger(__name__)

S3_CONNECTION_ID = "cagflow_s3"
OPENSEARCH_CONNECTION_ID = "cagflow_opensearch"
INDEXING_TIMEOUT_S = 60.0  # bulk writes and deletes are not latency-bound like searches
RELOAD_TIMEOUT_S = 10.0
TRITON_PRECOMPUTE_TIMEOUT_S = 1800.0  # one document's prefill on the serving tier
SECONDS_PER_DAY = 86400


class PrecomputeUnavailable(CagflowError, RuntimeError):
    """The configured precompute mode cannot run in this deployment."""

    code = "precompute_unavailable"


# ---- settings and connections ----------------------------------------------------------------------


def _config(config: Config | None) -> Config:
    return config if config is not None else load_config()


def airflow_connection(conn_id: str):
    """The Airflow connection ``conn_id``, or None when it is not defined or Airflow is not installed."""
    try:
        from airflow.sdk import Connection
        from airflow.sdk.exceptions import AirflowNotFoundException
    except ImportError:
        return None
    try:
        return Connection.get(conn_id)
    except AirflowNotFoundException:
        return None


def snapshot_store(config: Config | None = None) -> SnapshotStore:
    """The configured store; connection ``cagflow_s3`` (type aws) may supply the endpoint, region,
    credentials and, in its extra ``state_store``, the ``s3://bucket/prefix`` itself."""
    from ..store.backends import open_store, s3_client

    config = _config(config)
    connection = airflow_connection(S3_CONNECTION_ID)
    if connection is None:
        return open_store(config.cache.state_store, config.cache.s3, role="writer")
    extra = connection.extra_dejson
    url = extra.get("state_store", config.cache.state_store)
    settings = config.cache.s3.model_copy(update={
        "endpoint_url": extra.get("endpoint_url", config.cache.s3.endpoint_url),
        "region": extra.get("region_name", config.cache.s3.region),
    })
    if not url.startswith("s3://"):
        raise ConfigError(f"connection {S3_CONNECTION_ID}: state store {url!r} is not an s3:// URL")
    # The connection's keys, when it has them, else the writer role's (then boto3's chain).
    client = s3_client(settings, connection.login, connection.password or None) if connection.login else None
    return open_store(url, settings, client=client, role="writer")


def chunk_index(config: Config | None = None) -> ChunkIndex:
    """The chunk index; connection ``cagflow_opensearch`` may supply host, port, ``use_ssl`` and ``index``."""
    from ..search.retrieval import ChunkIndex

    config = _config(config)
    endpoint, index = config.retrieval.endpoint, config.retrieval.index
    connection = airflow_connection(OPENSEARCH_CONNECTION_ID)
    if connection is not None:
        if connection.login or connection.password:
            raise ConfigError(f"connection {OPENSEARCH_CONNECTION_ID}: OpenSearch authentication is not supported; "
                              "use a network-restricted endpoint without credentials")
        extra = connection.extra_dejson
        scheme = "https" if str(extra.get("use_ssl", "false")).lower() == "true" else "http"
        endpoint = f"{scheme}://{connection.host}:{connection.port or 9200}"
        index = extra.get("index", index)
    return ChunkIndex(endpoint, index, top_k=config.retrieval.top_k, timeout_s=INDEXING_TIMEOUT_S,
                      replicas=config.retrieval.index_replicas)


@lru_cache(maxsize=1)
def _engine(model_settings: str) -> Engine:
    from ..engine.engine import Engine

    return Engine.from_config(ModelConfig.model_validate_json(model_settings))


def precompute_threads(config: Config) -> int:
    """Threads of a local precompute: ``precompute.threads``, or this worker's cores shared by the parts
    that run at once. Results do not depend on it, so snapshot keys do not either."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return config.precompute.threads or max(1, cores // config.precompute.parallel_parts)


def engine_for(config: Config) -> Engine:
    """One loaded model per worker process and model configuration, on the precompute's threads."""
    return _engine(config.model.model_copy(update={"threads": precompute_threads(config)}).model_dump_json())


def _triton_call(config: Config, model: str, timeout_s: float, **values: str | bool) -> dict[str, str]:
    """One request to a CAGFlow model on Triton (every input a ``[1, 1]`` tensor); its text outputs.

    Raises ``OSError`` when Triton cannot be reached and ``InferenceServerException`` when it refuses.
    """
    import tritonclient.http as httpclient

    inputs = []
    for name, value in values.items():
        datatype, array = (("BOOL", np.array([[value]], dtype=bool)) if isinstance(value, bool) else
                           ("BYTES", np.array([[value.encode()]], dtype=np.object_)))
        tensor = httpclient.InferInput(name, [1, 1], datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    client = httpclient.InferenceServerClient(config.precompute.triton_url, connection_timeout=timeout_s,
                                              network_timeout=timeout_s)
    try:
        result = client.infer(model, inputs)
        names = [output["name"] for output in result.get_response()["outputs"]]
        return {name: result.as_numpy(name).reshape(-1)[0].decode() for name in names
                if result.as_numpy(name).dtype == np.object_}
    finally:
        client.close()


# ---- documents, chunks, embeddings, index ----------------------------------------------------------


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

    config = _config(config)
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

    config = _config(config)
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

    config = _config(config)
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
    from ..search.retrieval import embedding_text

    if not chunks:  # nothing changed: the model is not even loaded
        return []

    started = time.perf_counter()
    vectors = get_embedder().encode([embedding_text(c["title"], c["section"], c["text"]) for c in chunks])
    seconds = time.perf_counter() - started
    log.info("embedded %d chunk(s) in %.1f s (%.0f chunks/s)", len(chunks), seconds, len(chunks) / max(seconds, 1e-9))
    return [{**chunk, "embedding": encode_vector(vector)} for chunk, vector in zip(chunks, vectors)]


def index_records(embedded: Sequence[dict]) -> list[Chunk]:
    """Embedded chunk records (as tasks pass them) → the index's chunk type."""
    from ..search.retrieval import Chunk

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


# ---- snapshots and releases ------------------------------------------------------------------------


def _require_precompute_mode(config: Config) -> None:
    if config.precompute.via == "triton" and not config.precompute.triton_url:
        raise PrecomputeUnavailable("precompute.via='triton' needs precompute.triton_url (Triton's HTTP host:port)")


def model_fingerprint(config: Config) -> str:
    """The configured model's fingerprint, without loading it."""
    from ..engine.model import identify_model

    return identify_model(config.model.path, config.model.precision)[2]


def plan_snapshot_parts(doc_ids: Sequence[str] | None = None, force: bool = False,
                        config: Config | None = None) -> list[dict]:
    """The fixed documents split into parts that fit the model's context: one precompute task each.

    Documents the active release already holds for their version and this model (objects present under
    their checksums) are left out unless ``force``: the release step keeps their snapshots, and the model
    is loaded only when something is left to split."""
    from ..documents.keys import SnapshotKey
    from ..store.manifests import CorpusManifest, unchanged_documents
    from .precompute import plan_parts

    config = _config(config)
    _require_precompute_mode(config)
    manifest = CorpusManifest.load(config.corpus.manifest)
    selected = [entry.doc_id for entry in manifest.select(list(doc_ids) if doc_ids else None, tier="fixed")]
    unchanged = set() if force else unchanged_documents(snapshot_store(config), model_fingerprint(config),
                                                          manifest.select(selected, tier="fixed"))
    todo = [doc_id for doc_id in selected if doc_id not in unchanged]
    if unchanged:
        log.info("%d fixed document(s) unchanged since the active release, kept without planning: %s",
                 len(unchanged), ", ".join(sorted(unchanged)))
    if not todo:
        log.info("nothing to precompute")
        return []
    engine = engine_for(config)
    parts = plan_parts(engine, manifest, todo)
    paths = {entry.doc_id: str(manifest.file(entry)) for entry in manifest.documents}
    doc_order = list(dict.fromkeys(part.doc_id for part in parts))
    planned = []
    for position, part in enumerate(parts, start=1):
        key = SnapshotKey.for_model(part.doc_id, part.doc_version, engine.fingerprint, part.part)
        planned.append({
            "key": str(key), "label": f"{part.doc_id}#{part.part}" if part.part else part.doc_id,
            "doc_id": part.doc_id, "doc_version": part.doc_version, "title": part.title, "part": part.part,
            "path": paths[part.doc_id], "sections": [[s.heading, s.text] for s in part.sections],
            "model_fingerprint": engine.fingerprint,
            "position": position, "total": len(parts),
            "doc_position": doc_order.index(part.doc_id) + 1, "doc_total": len(doc_order),
        })
    log.info("planned %d part(s) of %d fixed document(s) for model %s", len(parts), len(doc_order),
             engine.fingerprint[:16])
    return planned


def _precompute_locally(part: dict, force: bool, config: Config) -> tuple[dict, bool, float]:
    from ..documents.parsing import Section
    from ..engine.engine import DocumentPart
    from .precompute import precompute_part, progress_line

    engine = engine_for(config)
    if engine.fingerprint != part["model_fingerprint"]:
        raise PrecomputeUnavailable(f"{part['key']}: planned for model {part['model_fingerprint'][:16]}, but this "
                                    f"worker runs {engine.fingerprint[:16]}; rerun the whole DAG")
    document_part = DocumentPart(part["doc_id"], part["doc_version"], part["title"],
                                 tuple(Section(heading, text) for heading, text in part["sections"]), part["part"])
    started = time.perf_counter()

    def progress(done: int, total: int) -> None:
        log.info("%s", progress_line(part["label"], done, total, time.perf_counter() - started))

    result = precompute_part(engine, snapshot_store(config), document_part, force, progress)
    return result.entry.model_dump(), result.skipped, result.seconds


def _precompute_on_triton(part: dict, force: bool, config: Config) -> tuple[dict, bool, float]:
    """Send the part's document to Triton's ``cag_precompute``, which stores every part of it (verified
    parts are kept) in the store it is configured with, and take this part's entry from its answer."""
    from tritonclient.utils import InferenceServerException

    path = Path(part["path"])
    try:
        outputs = _triton_call(config, "cag_precompute", TRITON_PRECOMPUTE_TIMEOUT_S, DOC_ID=part["doc_id"],
                               DOC_VERSION=part["doc_version"], DOCUMENT=path.read_text(encoding="utf-8"),
                               FORMAT=path.suffix.lstrip(".").lower(), TITLE=part["title"], FORCE=force)
    except InferenceServerException as exc:
        raise PrecomputeUnavailable(f"{part['key']}: Triton at {config.precompute.triton_url} refused: "
                                    f"{exc.message()}") from None
    except OSError as exc:
        raise PrecomputeUnavailable(f"{part['key']}: Triton at {config.precompute.triton_url} unreachable: "
                                    f"{exc}") from None
    entries = {entry["key"]: entry for entry in json.loads(outputs["ENTRIES"])}
    if part["key"] not in entries:
        raise PrecomputeUnavailable(f"{part['key']}: Triton stored {', '.join(entries)} instead; its model or "
                                    "model.* settings differ from this worker's")
    entry = entries[part["key"]]
    return {k: v for k, v in entry.items() if k not in ("skipped", "seconds")}, entry["skipped"], entry["seconds"]


def precompute_snapshot(part: dict, force: bool = False, config: Config | None = None) -> dict:
    """Compute and store one part's snapshot in this worker or on Triton (``precompute.via``), or keep
    the stored one when it verifies; ``force`` recomputes, but a stored version is never overwritten."""
    config = _config(config)
    _require_precompute_mode(config)
    compute = _precompute_on_triton if config.precompute.via == "triton" else _precompute_locally
    entry, skipped, seconds = compute(part, force, config)
    rate = entry["n_tokens"] / seconds if seconds > 0 else 0.0
    state = "kept (stored copy verified)" if skipped else f"computed in {seconds:.1f} s, {rate:,.0f} tokens/s"
    log.info("part %d/%d (document %d/%d) %s: %d tokens, %.1f MB, %s (%s)", part["position"], part["total"],
             part["doc_position"], part["doc_total"], part["label"], entry["n_tokens"], entry["bytes"] / 1e6, state,
             config.precompute.via)
    return {"entry": entry, "model_fingerprint": part["model_fingerprint"], "skipped": skipped, "seconds": seconds,
            "via": config.precompute.via}


def check_snapshots(results: Sequence[dict], parts: Sequence[dict], config: Config | None = None) -> dict:
    """Run the snapshot suite over this run's snapshots: count, checksums re-read, headers."""
    from ..store.manifests import ReleaseEntry
    from .validation import validate_snapshots

    entries = [ReleaseEntry(**result["entry"]) for result in results or ()]
    if entries or parts:
        validate_snapshots(snapshot_store(config), entries, [part["key"] for part in parts])
    computed = [result for result in results or () if not result["skipped"]]
    tokens = sum(result["entry"]["n_tokens"] for result in computed)
    seconds = sum(result["seconds"] for result in computed)
    summary = {"snapshots": len(entries), "documents": len({e.doc_id for e in entries}),
               "computed": len(computed), "kept": len(entries) - len(computed),
               "bytes": sum(e.bytes for e in entries), "tokens": sum(e.n_tokens for e in entries),
               "tokens_per_s": round(tokens / seconds) if seconds > 0 else 0}
    log.info("snapshot suite passed: %(snapshots)d snapshot(s) of %(documents)d document(s), %(computed)d computed, "
             "%(kept)d kept, %(bytes)d bytes, %(tokens_per_s)d tokens/s while computing", summary)
    return summary


def _active_release(store: SnapshotStore):
    from ..store.backends import NotFound
    from ..store.manifests import load_release

    try:
        return load_release(store)
    except NotFound:
        return None


def publish_fixed_release(results: Sequence[dict] | None, config: Config | None = None) -> dict:
    """Publish a release of this run's snapshots and point ``current`` at it.

    The fixed documents the run did not compute (not selected, or unchanged) keep their snapshots from the
    active release; a release identical to the active one is not published again, so a rerun writes nothing.
    """
    from ..store.manifests import CorpusManifest, ReleaseEntry
    from .precompute import publish_run

    config = _config(config)
    store = snapshot_store(config)
    results = list(results or ())
    fingerprints = {result["model_fingerprint"] for result in results} or {model_fingerprint(config)}
    if len(fingerprints) != 1:
        raise PrecomputeUnavailable(f"snapshots of {len(fingerprints)} models cannot form one release")
    fingerprint = fingerprints.pop()
    entries = [ReleaseEntry(**result["entry"]) for result in results]
    release, published = publish_run(store, fingerprint, entries, CorpusManifest.load(config.corpus.manifest))
    summary = {"store": store.url, "snapshots": len(release.snapshots), "documents": len(release.doc_ids),
               "bytes": sum(entry.bytes for entry in release.snapshots)}
    if not published:
        log.info("release %s already holds these %d snapshot(s); nothing published", release.release_id,
                 len(release.snapshots))
        return {**summary, "release_id": release.release_id, "published": False}
    log.info("published release %s: %d snapshot(s) of %d document(s), %d bytes, in %s", release.release_id,
             summary["snapshots"], summary["documents"], summary["bytes"], store.url)
    return {**summary, "release_id": release.release_id, "published": True}


def request_serving_reload(release: dict, config: Config | None = None) -> dict:
    """Ask serving (``cag_llm`` on Triton) to switch to the new release. Serving being down is not a
    failure: it follows ``releases/current.json`` and loads the active release when it starts."""
    from tritonclient.utils import InferenceServerException

    config = _config(config)
    url = config.precompute.triton_url
    if not release["published"]:
        return {"requested": False, "reason": "release unchanged"}
    if not url:
        return {"requested": False, "reason": "precompute.triton_url is not set"}
    try:
        outputs = _triton_call(config, "cag_llm", RELOAD_TIMEOUT_S, ACTION="reload", RELEASE_ID=release["release_id"])
    except InferenceServerException as exc:
        reason = f"refused: {exc.message()}"
    except OSError as exc:
        reason = f"unreachable: {exc}"
    else:
        log.info("serving at %s switched to release %s: %s", url, outputs["RELEASE_ID"], outputs["STATUS"])
        return {"requested": True, "release_id": outputs["RELEASE_ID"], "status": json.loads(outputs["STATUS"])}
    log.warning("serving at %s did not take release %s (%s); it picks up the active release by itself", url,
                release["release_id"], reason)
    return {"requested": False, "reason": reason}


def run_fixed_pipeline(config: Config) -> dict:
    """What ``cag_fixed_precompute`` runs, task after task in this process, over ``config.corpus.manifest``:
    ingest the changed fixed documents, precompute what the active release lacks, publish, ask serving to
    reload. For one-off loads outside Airflow (`cagflow bench answers --dataset`); documents of the index
    that the manifest does not list are kept."""
    documents = load_documents("fixed", config=config, incremental=True)
    parsed = parse_documents(documents)
    chunks = chunk_documents(parsed, config)
    check_chunks(parsed, chunks, config)
    index_chunks(embed_chunks(chunks), "fixed", remove_unlisted=False, config=config, documents=parsed)
    parts = plan_snapshot_parts(config=config)
    results = [precompute_snapshot(part, config=config) for part in parts]
    if parts:
        check_snapshots(results, parts, config)
    release = publish_fixed_release(results, config)
    return {**release, "reload": request_serving_reload(release, config)}


# ---- maintenance -----------------------------------------------------------------------------------


def verify_active_release(config: Config | None = None) -> dict:
    """Re-read every snapshot of the active release and check it against its recorded sha256 and header."""
    from .validation import validate_snapshots

    store = snapshot_store(config)
    release = _active_release(store)
    if release is None:
        log.info("no release published in %s yet; nothing to verify", store.url)
        return {"release_id": None, "snapshots": 0, "bytes": 0}
    validate_snapshots(store, release.snapshots, [entry.key for entry in release.snapshots])
    size = sum(entry.bytes for entry in release.snapshots)
    log.info("active release %s verified: %d snapshot(s), %d bytes", release.release_id, len(release.snapshots), size)
    return {"release_id": release.release_id, "snapshots": len(release.snapshots), "bytes": size}


@dataclass(frozen=True)
class GarbagePlan:
    kept_releases: list[str]
    snapshots: dict[str, int]  # object name -> bytes
    releases: dict[str, int]  # release object name -> bytes

    @property
    def bytes(self) -> int:
        return sum(self.snapshots.values()) + sum(self.releases.values())


def plan_garbage(store: SnapshotStore, keep_releases: int, unused_days: float, now: float | None = None) -> GarbagePlan:
    """Snapshot objects that no kept release references and that have not been servable for ``unused_days``.

    Kept: the newest ``keep_releases`` releases and the active one. Stores record no read times, and serving
    reads snapshots only through releases, so a snapshot counts as read until the newest release holding it
    was superseded by the next one (the active release counts as read now); a snapshot no release ever held
    counts from when it was written. Older releases that hold a deleted snapshot are deleted with it, since
    they could no longer be activated.
    """
    from ..store.layout import SNAPSHOTS_PREFIX
    from ..store.manifests import list_releases, load_release

    now = time.time() if now is None else now
    releases = sorted((load_release(store, release_id) for release_id in list_releases(store)),
                      key=lambda release: release.created_at)
    active = _active_release(store)
    active_id = active.release_id if active else None
    kept = {release.release_id for release in releases[-keep_releases:]} | ({active_id} - {None})
    referenced = {entry.object_name for release in releases if release.release_id in kept
                  for entry in release.snapshots}
    last_read: dict[str, float] = {}
    for position, release in enumerate(releases):
        superseded = now if release.release_id == active_id or position + 1 == len(releases) else \
            releases[position + 1].created_at
        for entry in release.snapshots:
            last_read[entry.object_name] = max(last_read.get(entry.object_name, 0.0), superseded)
    cutoff = now - unused_days * SECONDS_PER_DAY
    doomed = {info.name: info.size for info in store.list(SNAPSHOTS_PREFIX)
              if info.name not in referenced and max(info.modified, last_read.get(info.name, 0.0)) <= cutoff}
    doomed_releases = {}
    for release in releases:
        if release.release_id not in kept and any(entry.object_name in doomed for entry in release.snapshots):
            info = store.head(release.object_name)
            doomed_releases[release.object_name] = info.size if info else 0
    return GarbagePlan(sorted(kept), doomed, doomed_releases)


def collect_garbage(keep_releases: int | None = None, unused_days: float | None = None, dry_run: bool = True,
                    config: Config | None = None, now: float | None = None) -> dict:
    """Delete (or, in a dry run, list) what ``plan_garbage`` finds; report the bytes freed."""
    config = _config(config)
    keep_releases = config.maintenance.keep_releases if keep_releases is None else keep_releases
    unused_days = config.maintenance.unused_days if unused_days is None else unused_days
    if keep_releases < 1 or unused_days < 0:
        raise ConfigError(f"keep_releases must be >= 1 and unused_days >= 0 (got {keep_releases}, {unused_days})")
    store = snapshot_store(config)
    plan = plan_garbage(store, keep_releases, unused_days, now)
    verb = "would delete" if dry_run else "deleted"
    for name, size in [*plan.snapshots.items(), *plan.releases.items()]:
        if not dry_run:
            store.delete(name)
        log.info("%s %s (%d bytes)", verb, name, size)
    from ..store.heat import prune_heat

    heat_objects = prune_heat(store, unused_days, now, dry_run=dry_run)
    log.info("%s %d snapshot(s) and %d release(s): %d bytes %s; kept releases %s (last %d and the active one, "
             "snapshots read within %g days)", verb, len(plan.snapshots), len(plan.releases), plan.bytes,
             "would be freed" if dry_run else "freed", ", ".join(plan.kept_releases) or "none", keep_releases,
             unused_days)
    return {"dry_run": dry_run, "store": store.url, "kept_releases": plan.kept_releases,
            "snapshots": sorted(plan.snapshots), "releases": sorted(plan.releases), "bytes_freed": plan.bytes,
            "heat_objects": heat_objects}
