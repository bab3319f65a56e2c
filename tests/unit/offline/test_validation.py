"""The great-expectations gates: they pass good data and name every problem in bad data readably."""

from pathlib import Path

import pytest
from cagflow.documents.parsing import ParsedDocument, Section
from cagflow.offline.precompute import precompute_part
from cagflow.offline.validation import ValidationFailed, validate_chunks, validate_documents, validate_snapshots
from cagflow.store.backends import LocalStore
from cagflow.store.manifests import ReleaseEntry


def chunk(doc_id="guide", version="1.0.0", n=0, text="Port 8443 serves the console.", n_tokens=7, **extra):
    return {"chunk_id": f"{doc_id}:{version}:{n}", "doc_id": doc_id, "version": version, "tier": "fixed",
            "title": "Guide", "section": "Ports", "text": text, "n_tokens": n_tokens, **extra}


def test_good_chunks_pass():
    """They pass all ten checks; the same rows with one more expected document fail that one check alone, so
    the other nine did run on them."""
    good = [chunk(n=0), chunk(n=1), chunk("faq", n=0)]
    validate_chunks(good, ["guide", "faq"], max_tokens=200)
    with pytest.raises(ValidationFailed) as failure:
        validate_chunks(good, ["guide", "faq", "notes"], max_tokens=200)
    assert failure.value.failures == ["every manifest document has chunks: missing: notes"]
    assert str(failure.value).startswith("chunks validation failed: 1 of 10 checks")


def test_a_document_without_chunks_is_named_with_its_reason():
    with pytest.raises(ValidationFailed) as failure:
        validate_chunks([chunk()], ["guide", "empty-notes"], 200,
                        problems={"empty-notes": "corpus/empty.md: document has no text"})
    report = str(failure.value)
    assert report.startswith("chunks validation failed: 1 of 10 checks")
    assert "every manifest document has chunks: missing: empty-notes (corpus/empty.md: document has no text)" in report


def test_every_broken_row_is_reported_by_chunk_id():
    chunks = [chunk(n=0), chunk(n=0), chunk(n=1, text="   "), chunk(n=2, n_tokens=500), chunk("stray", n=0),
              {**chunk(n=3), "chunk_id": "guide-3"}]
    with pytest.raises(ValidationFailed) as failure:
        validate_chunks(chunks, ["guide"], max_tokens=200)
    report = str(failure.value)
    assert "chunk ids are unique: 2 row(s): chunk_id='guide:1.0.0:0'" in report
    assert "chunk text is not blank: 1 row(s): chunk_id='guide:1.0.0:1'" in report
    assert "chunks are 1-200 tokens: 1 row(s): chunk_id='guide:1.0.0:2', n_tokens=500" in report
    assert "every chunk belongs to a manifest document: 1 row(s): chunk_id='stray:1.0.0:0'" in report
    assert "chunk ids read doc_id:version:n: 1 row(s): chunk_id='guide-3'" in report
    assert len(failure.value.failures) == 5


def test_no_chunks_at_all_fails():
    with pytest.raises(ValidationFailed, match="there are chunks"):
        validate_chunks([], ["guide"], 200)


def test_manifest_suite_names_missing_files_and_bad_versions(tmp_path):
    present = tmp_path / "guide.md"
    present.write_text("# Guide\ntext")
    documents = [
        {"doc_id": "guide", "version": "1.0.0", "tier": "fixed", "title": "Guide", "path": str(present)},
        {"doc_id": "gone", "version": "2.0", "tier": "fixed", "title": "Gone", "path": str(tmp_path / "gone.md")},
        {"doc_id": "odd", "version": "1..0 beta", "tier": "variable", "title": "Odd", "path": str(present)},
    ]
    with pytest.raises(ValidationFailed) as failure:
        validate_documents(documents)
    report = str(failure.value)
    assert "document files exist: 1 row(s): doc_id='gone'" in report
    assert "versions are well formed: 1 row(s): doc_id='odd', version='1..0 beta'" in report


@pytest.fixture
def stored(tiny_engine, tmp_path: Path):
    """Two snapshots in a LocalStore and their release entries."""
    store = LocalStore(tmp_path / "store")
    entries = []
    for doc_id in ("guide", "faq"):
        part = tiny_engine.split(doc_id, "1.0.0", ParsedDocument(doc_id.title(), (Section("Ports", "Port 8443."),)))[0]
        entries.append(precompute_part(tiny_engine, store, part).entry)
    return store, entries


def test_stored_snapshots_pass(stored):
    store, entries = stored
    rows = validate_snapshots(store, entries, [e.key for e in entries])
    assert [row["sha256_verified"] and row["header_consistent"] for row in rows] == [True, True]


def test_a_changed_object_fails_its_checksum(stored):
    store, entries = stored
    path = store.root / entries[0].object_name
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValidationFailed) as failure:
        validate_snapshots(store, entries, [e.key for e in entries])
    assert f"stored bytes match the recorded sha256: 1 row(s): key='{entries[0].key}'" in str(failure.value)


def test_missing_extra_and_duplicate_snapshots_are_named(stored):
    store, entries = stored
    planned = [entries[0].key, "manual/2.0.0/" + entries[0].key.split("/")[2]]
    with pytest.raises(ValidationFailed) as failure:
        validate_snapshots(store, [entries[0], entries[0], entries[1]], planned)
    report = str(failure.value)
    assert "one snapshot per planned part (2): observed 4" in report
    assert f"snapshot keys are unique: 2 row(s): key='{entries[0].key}'" in report
    assert f"every snapshot was planned: 1 row(s): key='{entries[1].key}'" in report
    assert "every planned part is stored: 1 row(s): key='manual/2.0.0/" in report
    assert "problem='not produced by this run'" in report


def test_an_entry_that_disagrees_with_the_header_is_caught(stored):
    store, entries = stored
    wrong = ReleaseEntry(**{**entries[0].model_dump(), "n_tokens": entries[0].n_tokens + 1})
    with pytest.raises(ValidationFailed, match="header disagrees on n_tokens"):
        validate_snapshots(store, [wrong], [wrong.key])
