"""The precompute steps of ``cag_fixed_precompute``: plan the fixed documents' parts, compute (or keep) each
part's KV-cache snapshot in this worker or on Triton, and check the stored snapshots. Steps take and return
JSON-able values (Airflow passes them between tasks as XComs); a stored snapshot that verifies is kept, so
a rerun computes only what is missing."""

from __future__ import annotations

import json
import logging
import os
import time
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ..config import Config, ModelConfig
from ..errors import CagflowError
from .connections import resolve_config, snapshot_store
from .triton_requests import triton_call

if TYPE_CHECKING:
    from ..engine.engine import Engine

log = logging.getLogger(__name__)

TRITON_PRECOMPUTE_TIMEOUT_S = 1800.0  # one document's prefill on the serving tier


class PrecomputeUnavailable(CagflowError, RuntimeError):
    """The configured precompute mode cannot run in this deployment."""

    code = "precompute_unavailable"


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

    config = resolve_config(config)
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
        outputs = triton_call(config, "cag_precompute", TRITON_PRECOMPUTE_TIMEOUT_S, DOC_ID=part["doc_id"],
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
    config = resolve_config(config)
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
