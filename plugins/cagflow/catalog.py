"""Turn a corpus manifest into stored snapshots and a release, and read snapshots back.

``plan_parts`` and ``precompute_part`` are the units a scheduler maps over (one task per part); a part
whose key already exists and verifies is skipped, so reruns are idempotent and killed runs resume.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

from .documents import parse_file
from .engine import DocumentPart, Engine, best_part
from .manifest import CorpusManifest, ReleaseEntry
from .snapshot import Snapshot, SnapshotFormatError, SnapshotKey, read_metadata
from .stores import AlreadyExists, ChecksumMismatch, NotFound, SnapshotStore


class SnapshotUnusable(RuntimeError):
    """A stored snapshot that is missing, corrupt or does not match what the release promised."""


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
    info = store.head(key.object_name)
    if info is None or info.sha256 is None:
        return None
    try:
        data = store.get(key.object_name, sha256=info.sha256)
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
        info = store.put(key.object_name, data)
    except AlreadyExists:
        existing = _existing(store, key)
        if existing is None:
            raise SnapshotUnusable(f"{key}: exists in {store.url} but does not verify; delete it and rerun") from None
        return existing, False
    return _entry(key, snapshot.title, snapshot.n_tokens, snapshot.created_at, data, info.sha256), True


def precompute_part(engine: Engine, store: SnapshotStore, part: DocumentPart, force: bool = False) -> PrecomputeResult:
    """Compute and store one part's snapshot unless a verified one is already there.

    ``force`` recomputes, but never overwrites: a stored version is immutable.
    """
    started = time.perf_counter()
    key = SnapshotKey.for_model(part.doc_id, part.doc_version, engine.fingerprint, part.part)
    if not force:
        existing = _existing(store, key)
        if existing is not None:
            return PrecomputeResult(existing, True, time.perf_counter() - started)
    entry, written = store_snapshot(store, engine.precompute(part))
    return PrecomputeResult(entry, not written, time.perf_counter() - started)


def precompute_all(engine: Engine, store: SnapshotStore, parts: Iterable[DocumentPart], force: bool = False,
                   on_done: Callable[[PrecomputeResult], None] | None = None) -> list[PrecomputeResult]:
    results = []
    for part in parts:
        result = precompute_part(engine, store, part, force)
        results.append(result)
        if on_done:
            on_done(result)
    return results


def load_snapshot(store: SnapshotStore, entry: ReleaseEntry) -> Snapshot:
    """Read, verify against the release's sha256, and check the header names the same key."""
    try:
        snapshot = Snapshot.from_bytes(store.get(entry.object_name, sha256=entry.sha256))
    except NotFound:
        raise SnapshotUnusable(f"snapshot {entry.key} is missing from {store.url}") from None
    except (ChecksumMismatch, SnapshotFormatError) as exc:
        raise SnapshotUnusable(f"snapshot {entry.key} is corrupt: {exc}") from None
    if str(snapshot.key) != entry.key:
        raise SnapshotUnusable(f"object for {entry.key} holds snapshot {snapshot.key}")
    return snapshot


def snapshot_for_question(store: SnapshotStore, entries: list[ReleaseEntry], question: str) -> Snapshot:
    """The snapshot of a document to answer ``question`` from; for a split document, the part that
    shares the most words with the question."""
    if not entries:
        raise SnapshotUnusable("the release has no snapshot for that document")
    snapshots = [load_snapshot(store, entry) for entry in entries]
    return snapshots[best_part(question, [s.system_prompt for s in snapshots])]
