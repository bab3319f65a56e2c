"""Data-quality gates of the pipeline, as great-expectations suites over small tables.

Three suites: the manifest's documents, the chunks made from them, and the stored snapshots of a run
(every planned part present once, its bytes re-read and matching the recorded sha256, its header agreeing
with its release entry). A failed suite raises ``ValidationFailed`` whose message lists every failed
check with the offending rows, so one task log says everything that is wrong, and nothing downstream
(indexing, publishing) runs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import pandas as pd

from ..documents.keys import DOC_ID_PATTERN, VERSION_PATTERN
from ..errors import CagflowError
from ..search.index_schema import TIERS

CHUNK_ID_PATTERN = rf"^{DOC_ID_PATTERN.pattern[1:-1]}:{VERSION_PATTERN.pattern[1:-1]}:[0-9]+$"
_SHOWN_ROWS = 5


class ValidationFailed(CagflowError, ValueError):
    """One or more checks failed; ``str()`` is the readable report."""

    code = "validation_failed"

    def __init__(self, suite: str, failures: list[str], checks: int):
        self.suite = suite
        self.failures = failures
        lines = [f"{suite} validation failed: {len(failures)} of {checks} checks"]
        lines += [f"  - {failure}" for failure in failures]
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class Check:
    """One expectation with the sentence a reader sees when it fails."""

    label: str
    expectation: Any


def _gx():
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")  # no usage reports leave the machine
    import great_expectations as gx

    logging.getLogger("great_expectations").setLevel(logging.WARNING)  # its INFO chatter buries task logs

    return gx


def _describe_row(row: Mapping[str, Any], id_columns: Sequence[str]) -> str:
    """The row's ids first, then the value that failed."""
    ordered = [*(c for c in id_columns if c in row), *(c for c in row if c not in id_columns)]
    return ", ".join(f"{column}={row[column]!r}" for column in ordered)


def _describe_failure(result: Mapping[str, Any], id_columns: Sequence[str], explain: Mapping[str, str]) -> str:
    if result.get("unexpected_index_list"):
        rows = result["unexpected_index_list"]
        shown = "; ".join(_describe_row(row, id_columns) for row in rows[:_SHOWN_ROWS])
        more = f" (and {len(rows) - _SHOWN_ROWS} more)" if len(rows) > _SHOWN_ROWS else ""
        return f"{len(rows)} row(s): {shown}{more}"
    if result.get("partial_missing_list"):
        missing = [f"{item} ({explain[item]})" if item in explain else str(item)
                   for item in sorted(result["partial_missing_list"])]
        return "missing: " + ", ".join(missing)
    if result.get("partial_unexpected_list"):
        return "unexpected: " + ", ".join(repr(v) for v in result["partial_unexpected_list"][:_SHOWN_ROWS])
    return f"observed {result.get('observed_value')!r}"


def run_suite(suite: str, frame: pd.DataFrame, checks: Sequence[Check], id_columns: Sequence[str],
              explain: Mapping[str, str] | None = None) -> None:
    """Validate ``frame``; raise ``ValidationFailed`` naming each failed check and its rows (by ``id_columns``).

    ``explain`` maps a value reported missing (e.g. a doc id) to why it is missing.
    """
    gx = _gx()
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    batch = (context.data_sources.add_pandas(suite).add_dataframe_asset(suite)
             .add_batch_definition_whole_dataframe(suite).get_batch(batch_parameters={"dataframe": frame}))
    expectations = []
    for check in checks:
        check.expectation.meta = {"label": check.label}
        expectations.append(check.expectation)
    results = batch.validate(gx.ExpectationSuite(name=suite, expectations=expectations),
                             result_format={"result_format": "COMPLETE",
                                            "unexpected_index_column_names": list(id_columns)})
    failures = []
    for result in results.results:
        if result.success:
            continue
        label = result.expectation_config.meta["label"]
        if result.exception_info and result.exception_info.get("raised_exception"):
            failures.append(f"{label}: check could not run: {result.exception_info.get('exception_message')}")
        else:
            failures.append(f"{label}: {_describe_failure(result.result, id_columns, explain or {})}")
    if failures:
        raise ValidationFailed(suite, failures, len(checks))


def _expectations():
    _gx()
    import great_expectations.expectations as gxe

    return gxe


def _frame(records: Iterable[Mapping[str, Any]], columns: Sequence[str]) -> pd.DataFrame:
    frame = pd.DataFrame(list(records), columns=list(columns))
    return frame.astype(object)  # keep None as None and ints as ints in reports


# ---- documents and chunks --------------------------------------------------------------------------

DOCUMENT_COLUMNS = ("doc_id", "version", "tier", "title", "path", "file_exists")


def validate_documents(documents: Sequence[Mapping[str, Any]]) -> None:
    """The manifest's entries as loaded: ids unique and well formed, versions well formed, files present."""
    gxe = _expectations()
    checks = [
        Check("the manifest lists documents", gxe.ExpectTableRowCountToBeBetween(min_value=1)),
        Check("doc ids are unique", gxe.ExpectColumnValuesToBeUnique(column="doc_id")),
        Check("doc ids are well formed", gxe.ExpectColumnValuesToMatchRegex(column="doc_id", regex=DOC_ID_PATTERN.pattern)),
        Check("versions are well formed", gxe.ExpectColumnValuesToMatchRegex(column="version", regex=VERSION_PATTERN.pattern)),
        Check("versions are present", gxe.ExpectColumnValuesToNotBeNull(column="version")),
        Check("tiers are fixed or variable", gxe.ExpectColumnValuesToBeInSet(column="tier", value_set=list(TIERS))),
        Check("titles are present", gxe.ExpectColumnValueLengthsToBeBetween(column="title", min_value=1)),
        Check("document files exist", gxe.ExpectColumnValuesToBeInSet(column="file_exists", value_set=[True])),
    ]
    rows = [{**{c: doc.get(c) for c in DOCUMENT_COLUMNS[:-1]}, "file_exists": os.path.isfile(doc["path"])}
            for doc in documents]
    run_suite("manifest", _frame(rows, DOCUMENT_COLUMNS), checks, ["doc_id"])


CHUNK_COLUMNS = ("chunk_id", "doc_id", "version", "tier", "title", "section", "text", "n_tokens")


def validate_chunks(chunks: Sequence[Mapping[str, Any]], expected_doc_ids: Sequence[str], max_tokens: int,
                    problems: Mapping[str, str] | None = None) -> None:
    """Chunks ready to embed: text present and within the token window, ids unique and stable, every
    expected document represented. ``problems`` says why a document produced no chunks (parse errors)."""
    gxe = _expectations()
    checks = [
        Check("there are chunks", gxe.ExpectTableRowCountToBeBetween(min_value=1 if expected_doc_ids else 0)),
        Check("chunk text is present", gxe.ExpectColumnValuesToNotBeNull(column="text")),
        Check("chunk text is not blank", gxe.ExpectColumnValuesToMatchRegex(column="text", regex=r"\S")),
        Check(f"chunks are 1-{max_tokens} tokens",
              gxe.ExpectColumnValuesToBeBetween(column="n_tokens", min_value=1, max_value=max_tokens)),
        Check("chunk ids are unique", gxe.ExpectColumnValuesToBeUnique(column="chunk_id")),
        Check("chunk ids read doc_id:version:n",
              gxe.ExpectColumnValuesToMatchRegex(column="chunk_id", regex=CHUNK_ID_PATTERN)),
        Check("versions are well formed", gxe.ExpectColumnValuesToMatchRegex(column="version", regex=VERSION_PATTERN.pattern)),
        Check("tiers are fixed or variable", gxe.ExpectColumnValuesToBeInSet(column="tier", value_set=list(TIERS))),
        Check("every manifest document has chunks",
              gxe.ExpectColumnDistinctValuesToContainSet(column="doc_id", value_set=sorted(expected_doc_ids))),
        Check("every chunk belongs to a manifest document",
              gxe.ExpectColumnValuesToBeInSet(column="doc_id", value_set=sorted(expected_doc_ids))),
    ]
    run_suite("chunks", _frame(chunks, CHUNK_COLUMNS), checks, ["chunk_id"], explain=problems)


# ---- snapshots -------------------------------------------------------------------------------------

SNAPSHOT_COLUMNS = ("key", "planned", "stored", "sha256_verified", "header_consistent", "model_fingerprint",
                    "n_tokens", "bytes", "problem")


def snapshot_row(store, entry, planned: bool) -> dict[str, Any]:
    """Re-read one stored snapshot and compare it with its release entry."""
    from ..documents.keys import SnapshotFormatError
    from ..documents.snapshot import Snapshot
    from ..store.backends import ChecksumMismatch, NotFound

    row = {"key": entry.key, "planned": planned, "stored": False, "sha256_verified": False,
           "header_consistent": False, "model_fingerprint": None, "n_tokens": entry.n_tokens,
           "bytes": entry.bytes, "problem": ""}
    try:
        data = store.get(entry.object_name, sha256=entry.sha256)
        row.update(stored=True, sha256_verified=True)
        snapshot = Snapshot.from_bytes(data)
    except NotFound:
        return {**row, "problem": "object missing"}
    except ChecksumMismatch as exc:
        return {**row, "stored": True, "problem": str(exc)}
    except SnapshotFormatError as exc:
        return {**row, "problem": str(exc)}
    mismatches = [name for name, stored, recorded in (
        ("key", str(snapshot.key), entry.key),
        ("doc_version", snapshot.doc_version, entry.doc_version),
        ("part", snapshot.part, entry.part),
        ("n_tokens", snapshot.n_tokens, entry.n_tokens),
        ("bytes", len(data), entry.bytes),
    ) if stored != recorded]
    row.update(header_consistent=not mismatches, model_fingerprint=snapshot.model_fingerprint,
               problem=f"header disagrees on {', '.join(mismatches)}" if mismatches else "")
    return row


def validate_snapshots(store, entries: Sequence, planned_keys: Sequence[str]) -> list[dict[str, Any]]:
    """Every planned part has exactly one stored, verifying, self-consistent snapshot, all from one model.

    Returns the rows (one per snapshot) for reporting.
    """
    gxe = _expectations()
    planned = set(planned_keys)
    rows = [snapshot_row(store, entry, entry.key in planned) for entry in entries]
    produced = {row["key"] for row in rows}
    rows += [{**dict.fromkeys(SNAPSHOT_COLUMNS), "key": key, "planned": True, "stored": False,
              "sha256_verified": False, "header_consistent": False, "problem": "not produced by this run"}
             for key in sorted(planned - produced)]
    checks = [
        Check(f"one snapshot per planned part ({len(planned)})", gxe.ExpectTableRowCountToEqual(value=len(planned))),
        Check("snapshot keys are unique", gxe.ExpectColumnValuesToBeUnique(column="key")),
        Check("every snapshot was planned", gxe.ExpectColumnValuesToBeInSet(column="planned", value_set=[True])),
        Check("every planned part is stored", gxe.ExpectColumnValuesToBeInSet(column="stored", value_set=[True])),
        Check("stored bytes match the recorded sha256",
              gxe.ExpectColumnValuesToBeInSet(column="sha256_verified", value_set=[True])),
        Check("snapshot headers match their release entries",
              gxe.ExpectColumnValuesToBeInSet(column="header_consistent", value_set=[True])),
        Check("all snapshots come from one model",
              gxe.ExpectColumnUniqueValueCountToBeBetween(column="model_fingerprint", min_value=1, max_value=1)),
        Check("snapshots hold tokens", gxe.ExpectColumnValuesToBeBetween(column="n_tokens", min_value=1)),
    ]
    run_suite("snapshots", _frame(rows, SNAPSHOT_COLUMNS), checks, ["key", "problem"])
    return rows
