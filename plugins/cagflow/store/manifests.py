"""Corpus manifests (what documents exist) and release manifests (which snapshots serve them).

A release is immutable once written (``releases/{id}.json``); ``releases/current.json`` points at the
active one and is the only object ever overwritten, so rolling back is re-pointing.
"""

from __future__ import annotations

import datetime

import hashlib
import json
import time
from pathlib import Path
from typing import Literal, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..documents.keys import sha256_hex, validate_doc_id, validate_version
from ..errors import CagflowError
from .backends import AlreadyExists, NotFound, SnapshotStore
from .layout import CURRENT_POINTER, RELEASES_PREFIX, release_id_of, release_object, snapshot_object


class ManifestError(CagflowError, ValueError):
    """A manifest that cannot be read or does not validate; the message says where."""

    code = "invalid_manifest"


class SnapshotUnusable(CagflowError, RuntimeError):
    """A stored snapshot that is missing, corrupt or does not match what the release promised."""

    code = "snapshot_unusable"


def _describe(source: str, error: ValidationError) -> str:
    problems = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"])
        problems.append(f"{where}: {'unknown key' if item['type'] == 'extra_forbidden' else item['msg']}")
    return f"{source}: " + "; ".join(problems)


class DocumentEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    doc_id: str
    version: str
    tier: Literal["fixed", "variable"]
    title: str = Field(min_length=1)
    path: str = Field(min_length=1)
    # The day this version took effect (ISO date). A variable document published after a fixed one may
    # update it: such passages follow the fixed document's snapshot on the cache+retrieval route.
    published: str = ""

    @field_validator("doc_id")
    @classmethod
    def _doc_id(cls, value: str) -> str:
        return validate_doc_id(value)

    @field_validator("published", mode="before")
    @classmethod
    def _published(cls, value: object) -> str:
        if value is None or value == "":
            return ""
        if isinstance(value, datetime.date):
            return value.isoformat()[:10]
        try:
            return datetime.date.fromisoformat(str(value)).isoformat()
        except ValueError:
            raise ValueError(f"published must be an ISO date like 2025-03-01, got {value!r}") from None

    @field_validator("version", mode="before")
    @classmethod
    def _version(cls, value: object) -> str:
        if not isinstance(value, str):
            raise ValueError(f"version must be a quoted string, got {type(value).__name__} {value!r}")
        return validate_version(value)


class CorpusManifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    documents: list[DocumentEntry]
    base_dir: Path = Path(".")

    @classmethod
    def load(cls, path: str | Path) -> "CorpusManifest":
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ManifestError(f"manifest not found: {path}") from None
        except yaml.YAMLError as exc:
            raise ManifestError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(data, dict) or "base_dir" in data:
            raise ManifestError(f"{path}: expected a mapping with a 'documents' list")
        try:
            manifest = cls.model_validate({**data, "base_dir": path.parent.resolve()})
        except ValidationError as exc:
            raise ManifestError(_describe(str(path), exc)) from None
        seen: set[str] = set()
        for entry in manifest.documents:
            if entry.doc_id in seen:
                raise ManifestError(f"{path}: duplicate doc_id {entry.doc_id!r}")
            seen.add(entry.doc_id)
        return manifest

    def file(self, entry: DocumentEntry) -> Path:
        return (self.base_dir / entry.path).resolve()

    def tier(self, tier: str) -> list[DocumentEntry]:
        return [entry for entry in self.documents if entry.tier == tier]

    def select(self, doc_ids: list[str] | None, tier: str = "fixed") -> list[DocumentEntry]:
        entries = self.tier(tier)
        if not doc_ids:
            return entries
        known = {entry.doc_id for entry in entries}
        unknown = sorted(set(doc_ids) - known)
        if unknown:
            raise ManifestError(f"not {tier} documents of the manifest: {', '.join(unknown)}")
        return [entry for entry in entries if entry.doc_id in doc_ids]


class ReleaseEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str
    doc_id: str
    doc_version: str
    part: int | None
    title: str = ""
    n_tokens: int
    bytes: int
    sha256: str
    created_at: float

    @property
    def object_name(self) -> str:
        return snapshot_object(self.key)


class Release(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    release_id: str
    created_at: float
    model_fingerprint: str
    snapshots: list[ReleaseEntry]

    @classmethod
    def build(cls, model_fingerprint: str, snapshots: list[ReleaseEntry]) -> "Release":
        ordered = sorted(snapshots, key=lambda e: (e.doc_id, e.part or 0))
        content = json.dumps([e.model_dump() for e in ordered], sort_keys=True).encode()
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        release_id = f"{stamp}-{hashlib.sha256(content).hexdigest()[:8]}"
        return cls(release_id=release_id, created_at=time.time(), model_fingerprint=model_fingerprint,
                   snapshots=ordered)

    def for_doc(self, doc_id: str) -> list[ReleaseEntry]:
        return [entry for entry in self.snapshots if entry.doc_id == doc_id]

    @property
    def doc_ids(self) -> list[str]:
        return sorted({entry.doc_id for entry in self.snapshots})

    @property
    def object_name(self) -> str:
        return release_object(self.release_id)


def _point_current_at(store: SnapshotStore, release: Release, data: bytes) -> None:
    pointer = {"release_id": release.release_id, "object": release.object_name, "sha256": sha256_hex(data)}
    store.put(CURRENT_POINTER, json.dumps(pointer).encode(), overwrite=True)


def publish_release(store: SnapshotStore, release: Release) -> str:
    """Write the immutable release, then point ``current`` at it; returns the release id."""
    data = release.model_dump_json(indent=2).encode()
    store.put(release.object_name, data)
    _point_current_at(store, release, data)
    return release.release_id


def release_for_run(store: SnapshotStore, model_fingerprint: str, entries: list[ReleaseEntry],
                    manifest: CorpusManifest) -> Release:
    """The release a precompute run should publish: its own snapshots, plus the active release's snapshots
    of every other fixed document of the manifest whose version and model are unchanged (a partial run, or
    documents a run found unchanged and did not plan). Documents gone from the manifest drop out."""
    entries = list(entries)
    try:
        active = load_release(store)
    except NotFound:
        active = None
    if active is not None and active.model_fingerprint == model_fingerprint:
        computed = {entry.doc_id for entry in entries}
        versions = {entry.doc_id: entry.version for entry in manifest.tier("fixed")}
        entries += [entry for entry in active.snapshots
                    if entry.doc_id not in computed and versions.get(entry.doc_id) == entry.doc_version]
    return Release.build(model_fingerprint, entries)


def unchanged_documents(store: SnapshotStore, model_fingerprint: str, documents: Sequence[DocumentEntry]) -> set[str]:
    """Documents whose snapshots the active release already holds for this version and model, every object
    still in the store under its checksum (a HEAD each, no read, no model): a run need not plan them."""
    try:
        active = load_release(store)
    except NotFound:
        return set()
    if active.model_fingerprint != model_fingerprint:
        return set()
    unchanged = set()
    for document in documents:
        entries = active.for_doc(document.doc_id)
        if entries and all(entry.doc_version == document.version for entry in entries) and all(
                (info := store.head(entry.object_name)) is not None and info.sha256 == entry.sha256
                for entry in entries):
            unchanged.add(document.doc_id)
    return unchanged


def publish_if_changed(store: SnapshotStore, release: Release) -> tuple[Release, bool]:
    """Publish ``release`` unless the active release already serves exactly these snapshots.

    Returns the release now active and whether anything was published, so reruns write nothing.
    """
    try:
        active = load_release(store)
    except NotFound:
        active = None
    if active is not None and (active.model_fingerprint, active.snapshots) == (release.model_fingerprint,
                                                                                 release.snapshots):
        return active, False
    try:
        publish_release(store, release)
    except AlreadyExists:  # the same content published within the same second: its id is this one's
        activate_release(store, release.release_id)
    return release, True


def load_release(store: SnapshotStore, release_id: str | None = None) -> Release:
    """The named release, or the active one; raises ``NotFound`` when none was published."""
    if release_id is None:
        try:
            pointer = json.loads(store.get(CURRENT_POINTER))
        except NotFound:
            raise NotFound(f"no release published in {store.url} (run `cagflow precompute` first)") from None
        data = store.get(pointer["object"], sha256=pointer["sha256"])
    else:
        data = store.get(release_object(release_id))
    return _parse_release(data, release_id or "current")


def _parse_release(data: bytes, label: str) -> Release:
    try:
        return Release.model_validate_json(data)
    except ValidationError as exc:
        raise ManifestError(_describe(f"release {label}", exc)) from None


def activate_release(store: SnapshotStore, release_id: str) -> Release:
    """Point ``current`` at an existing release (rollback or roll forward)."""
    data = store.get(release_object(release_id))
    release = _parse_release(data, release_id)
    _point_current_at(store, release, data)
    return release


def list_releases(store: SnapshotStore) -> list[str]:
    ids = (release_id_of(info.name) for info in store.list(RELEASES_PREFIX))
    return sorted(release_id for release_id in ids if release_id is not None)
