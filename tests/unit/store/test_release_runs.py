"""Which snapshots a precompute run keeps from the active release, decided from the release and the store
alone (no model): the basis of runs that cost only what changed."""

from __future__ import annotations

import hashlib

from cagflow.documents.keys import SnapshotKey
from cagflow.store.backends import LocalStore
from cagflow.store.layout import snapshot_object
from cagflow.store.manifests import (CorpusManifest, DocumentEntry, Release, ReleaseEntry, publish_release,
                                     release_for_run, unchanged_documents)

MODEL = "a" * 64
OTHER_MODEL = "b" * 64


def manifest(tmp_path, versions: dict[str, str]) -> CorpusManifest:
    return CorpusManifest(documents=[DocumentEntry(doc_id=doc_id, version=version, tier="fixed", title=doc_id,
                                                   path=f"{doc_id}.md") for doc_id, version in versions.items()],
                          base_dir=tmp_path)


def stored_entry(store: LocalStore, doc_id: str, version: str, model: str = MODEL) -> ReleaseEntry:
    key = SnapshotKey.for_model(doc_id, version, model)
    data = f"snapshot of {key}".encode()
    store.put(snapshot_object(key), data)
    return ReleaseEntry(key=str(key), doc_id=doc_id, doc_version=version, part=None, n_tokens=10, bytes=len(data),
                        sha256=hashlib.sha256(data).hexdigest(), created_at=1.0)


def test_documents_the_active_release_holds_for_their_version_and_model_are_unchanged(tmp_path):
    store = LocalStore(tmp_path / "store")
    faq, guide, policy = (stored_entry(store, "faq", "1.0.0"), stored_entry(store, "guide", "2.0.0"),
                          stored_entry(store, "policy", "1.0.0"))
    publish_release(store, Release.build(MODEL, [faq, guide, policy]))
    store.delete(policy.object_name)  # a snapshot gone from the store is planned again
    corpus = manifest(tmp_path, {"faq": "1.0.0", "guide": "2.1.0", "policy": "1.0.0", "new": "1.0.0"})

    assert unchanged_documents(store, MODEL, corpus.tier("fixed")) == {"faq"}
    assert unchanged_documents(store, OTHER_MODEL, corpus.tier("fixed")) == set()
    assert unchanged_documents(LocalStore(tmp_path / "empty"), MODEL, corpus.tier("fixed")) == set()


def test_a_run_keeps_what_it_did_not_compute_and_drops_what_left_the_manifest(tmp_path):
    store = LocalStore(tmp_path / "store")
    faq, guide, policy = (stored_entry(store, "faq", "1.0.0"), stored_entry(store, "guide", "2.0.0"),
                          stored_entry(store, "policy", "1.0.0"))
    publish_release(store, Release.build(MODEL, [faq, guide, policy]))
    new_guide = stored_entry(store, "guide", "2.1.0")
    corpus = manifest(tmp_path, {"faq": "1.0.0", "guide": "2.1.0"})  # policy removed, guide edited

    release = release_for_run(store, MODEL, [new_guide], corpus)

    assert sorted(release.snapshots, key=lambda e: e.doc_id) == [faq, new_guide]
    assert list(release_for_run(store, MODEL, [], corpus).snapshots) == [faq]  # nothing computed: faq stays
    assert not release_for_run(store, OTHER_MODEL, [], corpus).snapshots  # another model reuses nothing
