"""Precompute and publish: the one orchestration of turning fixed documents into stored snapshots and a
release, used by the CLI, the DAG's tasks and Triton's ``cag_precompute``.

``plan_parts`` → ``precompute_part`` (per part) → ``publish_run``. The first two are the units a scheduler
maps over (one task per part); a part whose key already exists and verifies is skipped, so reruns are
idempotent and killed runs resume. ``precompute_and_publish`` runs all three in one process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from ..documents.parsing import ParsedDocument, parse_file
from ..documents.keys import SnapshotFormatError, SnapshotKey, read_metadata
from ..store.backends import AlreadyExists, ChecksumMismatch, NotFound, SnapshotStore
from ..store.layout import snapshot_object
from ..store.manifests import (CorpusManifest, Release, ReleaseEntry, SnapshotUnusable, publish_if_changed,
                               release_for_run)

if TYPE_CHECKING:  # the engine (torch) is handed in: publishing alone never loads it
    from ..engine.engine import DocumentPart, Engine
    from ..documents.snapshot import Snapshot


@dataclass(frozen=True)
class PrecomputeResult:
    entry: ReleaseEntry
    skipped: bool
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.entry.n_tokens / self.seconds if self.seconds > 0 and not self.skipped else 0.0


def plan_parts(engine: Engine, manifest: CorpusManifest, doc_ids: list[str] | None = None) -> list[DocumentPart]:
    """The fixed documents, parsed and split into parts that fit the model's context."""
    parts: list[DocumentPart] = []
    for entry in manifest.select(doc_ids, tier="fixed"):
        document = parse_file(manifest.file(entry), entry.title)
        parts.extend(engine.split(entry.doc_id, entry.version, document))
    return parts


def _entry(key: SnapshotKey, title: str, n_tokens: int, created_at: float, data: bytes, sha256: str) -> ReleaseEntry:
    return ReleaseEntry(key=str(key), doc_id=key.doc_id, doc_version=key.doc_version, part=key.part, title=title,
                        n_tokens=n_tokens, bytes=len(data), sha256=sha256, created_at=created_at)


def _existing(store: SnapshotStore, key: SnapshotKey) -> ReleaseEntry | None:
    """The release entry of an already stored, verifying snapshot; None if absent or damaged."""
    info = store.head(snapshot_object(key))
    if info is None or info.sha256 is None:
        return None
    try:
        data = store.get(snapshot_object(key), sha256=info.sha256)
        meta = read_metadata(data)
    except (NotFound, ChecksumMismatch, SnapshotFormatError):
        return None
    return _entry(key, meta.get("title", ""), int(meta["n_tokens"]), float(meta["created_at"]), data, info.sha256)


def store_snapshot(store: SnapshotStore, snapshot: Snapshot) -> tuple[ReleaseEntry, bool]:
    """Write a snapshot under its key; returns its release entry and whether this call wrote it.

    If a concurrent writer got there first, its object is used when it verifies.
    """
    key = snapshot.key
    data = snapshot.to_bytes()
    try:
        info = store.put(snapshot_object(key), data)
    except AlreadyExists:
        existing = _existing(store, key)
        if existing is None:
            raise SnapshotUnusable(f"{key}: exists in {store.url} but does not verify; delete it and rerun",
                                   code="snapshot_corrupt") from None
        return existing, False
    return _entry(key, snapshot.title, snapshot.n_tokens, snapshot.created_at, data, info.sha256), True


def progress_line(label: str, done: int, total: int, seconds: float, width: int = 20) -> str:
    """``label [#######.............] 1024/2923 tokens · 52 tok/s · ETA 36 s``: one line of a log."""
    filled = width * done // total if total else width
    rate = done / seconds if seconds > 0 else 0.0
    eta = f"ETA {(total - done) / rate:.0f} s" if rate and done < total else f"done in {seconds:.1f} s"
    return f"{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} tokens · {rate:,.0f} tok/s · {eta}"


def precompute_part(engine: Engine, store: SnapshotStore, part: DocumentPart, force: bool = False,
                    on_progress: Callable[[int, int], None] | None = None) -> PrecomputeResult:
    """Compute and store one part's snapshot unless a verified one is already there.

    ``force`` recomputes, but never overwrites: a stored version is immutable. ``on_progress(done, total)``
    hears the prefill's progress in tokens.
    """
    started = time.perf_counter()
    key = SnapshotKey.for_model(part.doc_id, part.doc_version, engine.fingerprint, part.part)
    if not force:
        existing = _existing(store, key)
        if existing is not None:
            return PrecomputeResult(existing, True, time.perf_counter() - started)
    entry, written = store_snapshot(store, engine.precompute(part, on_progress))
    return PrecomputeResult(entry, not written, time.perf_counter() - started)


def publish_run(store: SnapshotStore, model_fingerprint: str, entries: Sequence[ReleaseEntry],
                manifest: CorpusManifest) -> tuple[Release, bool]:
    """Publish the release of a run's snapshots (with the active release's snapshots of the fixed documents
    the run did not compute); nothing is published when the active release already holds exactly these.
    Returns the release now active and whether it was published."""
    return publish_if_changed(store, release_for_run(store, model_fingerprint, list(entries), manifest))


def precompute_and_publish(engine: Engine, store: SnapshotStore, manifest: CorpusManifest,
                           doc_ids: Sequence[str] | None = None, force: bool = False,
                           on_planned: Callable[[int], None] | None = None,
                           on_done: Callable[[PrecomputeResult], None] | None = None,
                           ) -> tuple[Release, bool, list[PrecomputeResult]]:
    """Every step in this process: plan, precompute each part, publish. ``on_planned`` hears the number of
    parts, ``on_done`` each part's result (progress reporting)."""
    store.ping(create=True)
    parts = plan_parts(engine, manifest, list(doc_ids) if doc_ids else None)
    if on_planned:
        on_planned(len(parts))
    results = []
    for part in parts:
        result = precompute_part(engine, store, part, force)
        results.append(result)
        if on_done:
            on_done(result)
    release, published = publish_run(store, engine.fingerprint, [r.entry for r in results], manifest)
    return release, published, results


def precompute_document(engine: Engine, store: SnapshotStore, doc_id: str, doc_version: str,
                        document: ParsedDocument, force: bool = False) -> list[PrecomputeResult]:
    """Store every part of one document given as parsed text (``cag_precompute``: the serving tier computes,
    the scheduler publishes); idempotent like ``precompute_part``."""
    parts = engine.split(doc_id, doc_version, document)
    store.ping(create=True)
    return [precompute_part(engine, store, part, force) for part in parts]
