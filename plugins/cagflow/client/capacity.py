"""``cagflow capacity``: the store, the memory per serving replica and the replicas a corpus needs.

A snapshot's size is its token count times what it keeps per token (K and V of every layer, read from a
snapshot of the model, so it follows the recipe: bf16 under int8, fp32 under fp32), plus a file header
holding the token ids and the document's text. Token counts come from the active release, or from the
corpus manifest split and tokenised exactly as precompute does (``plan_parts``); only the second knows the
headers, which weigh a few bytes a token. Where the store holds the snapshots, their object sizes are set
against the prediction.

Every figure gets the same headroom (``HEADROOM``): sizes grow with the corpus, and load is never even.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ..config import Config
from ..errors import CagflowError
from ..store.backends import NotFound, SnapshotStore, StoreUnavailable
from ..store.manifests import CorpusManifest, Release, load_release

if TYPE_CHECKING:
    from ..engine.engine import Engine
    from ..documents.snapshot import Snapshot

HEADROOM = 1.3  # provision 30 % above every estimate


class CapacityError(CagflowError, ValueError):
    """The estimate cannot be made from what was given (arguments, release, benchmark report)."""

    code = "capacity_unavailable"


@dataclass(frozen=True)
class KVRecipe:
    """What a snapshot keeps per prefix token."""

    dtype: str
    layers: int
    kv_heads: int
    head_dim: int
    bytes_per_token: int

    @classmethod
    def of(cls, snapshot: Snapshot) -> "KVRecipe":
        keys = snapshot.keys[0]  # [kv_heads, tokens, head_dim]
        return cls(str(snapshot.dtype).removeprefix("torch."), len(snapshot.keys), keys.shape[0], keys.shape[-1],
                   snapshot.nbytes // snapshot.n_tokens)


@dataclass(frozen=True)
class SnapshotSize:
    key: str
    doc_id: str
    tokens: int
    tensor_bytes: int  # K/V: what a resident copy holds
    header_bytes: int | None  # token ids and document text; None where only the token count is known
    stored_bytes: int | None  # the object in the store; None when the store does not hold it

    @property
    def predicted_bytes(self) -> int:
        return self.tensor_bytes + (self.header_bytes or 0)


def _difference_pct(predicted: int, stored: int | None) -> float | None:
    return None if not stored else round((predicted - stored) / stored * 100, 3)


def _stored_bytes(store: SnapshotStore, object_name: str) -> int | None:
    info = store.head(object_name)
    return info.size if info is not None else None


def active_release(store: SnapshotStore) -> Release:
    """The active release; an absent or unreadable store says so rather than 'no release'."""
    store.ping()
    return load_release(store)


def release_sizes(store: SnapshotStore, release: Release) -> tuple[KVRecipe, list[SnapshotSize]]:
    """The release's snapshots at the token counts it records; the recipe is read from its smallest one."""
    from ..inference.resident import load_snapshot

    if not release.snapshots:
        raise CapacityError(f"release {release.release_id} holds no snapshots")
    recipe = KVRecipe.of(load_snapshot(store, min(release.snapshots, key=lambda entry: entry.bytes)))
    return recipe, [SnapshotSize(entry.key, entry.doc_id, entry.n_tokens, entry.n_tokens * recipe.bytes_per_token,
                                 None, _stored_bytes(store, entry.object_name)) for entry in release.snapshots]


def manifest_sizes(engine: Engine, manifest: CorpusManifest, store: SnapshotStore,
                   release: Release | None) -> tuple[KVRecipe, list[SnapshotSize]]:
    """The snapshots precompute would make of the manifest's fixed documents, each with its header; the
    release's objects of the same keys (same document version and model) are their stored sizes."""
    from ..documents.parsing import Section
    from ..engine.engine import DocumentPart
    from ..documents.keys import SnapshotKey
    from ..documents.snapshot import Snapshot
    from ..offline.precompute import plan_parts

    probe = engine.precompute(DocumentPart("capacity-probe", "1", "Probe", (Section("", "probe"),)))
    recipe = KVRecipe.of(probe)
    no_tensors = [k[:, :0] for k in probe.keys], [v[:, :0] for v in probe.values]
    entries = {entry.key: entry for entry in release.snapshots} if release is not None else {}
    sizes = []
    for part in plan_parts(engine, manifest):
        ids = engine.prompts.prefix_ids(part.system)
        key = str(SnapshotKey.for_model(part.doc_id, part.doc_version, engine.fingerprint, part.part))
        # The file without its tensors: the format's own header for these ids and this text.
        header = len(Snapshot(part.doc_id, part.doc_version, part.part, engine.fingerprint, ids, *no_tensors,
                              title=part.title, system_prompt=part.system).to_bytes())
        entry = entries.get(key)
        stored = _stored_bytes(store, entry.object_name) if entry is not None else None
        sizes.append(SnapshotSize(key, part.doc_id, len(ids), len(ids) * recipe.bytes_per_token, header, stored))
    return recipe, sizes


def resident_bytes(snapshot_bytes: Sequence[int], max_states: int, max_bytes: int) -> int:
    """The most one serving process keeps resident: the ``max_states`` largest snapshots, at most ``max_bytes``
    in all; one larger than ``max_bytes`` is served but never kept (``inference.resident``)."""
    kept = sorted((size for size in snapshot_bytes if size <= max_bytes), reverse=True)[:max_states]
    return min(sum(kept), max_bytes)


def with_headroom(value: float) -> int:
    """``value`` plus the headroom, rounded up; float noise (10 × 1.3 is 13.000000000000002) adds nothing."""
    return math.ceil(round(value * HEADROOM, 6))


def replicas_needed(target_qps: float, seconds_per_request: float) -> int:
    """Replicas answering one request at a time (each serves 1 / seconds_per_request requests a second),
    busy at most 1 / HEADROOM of the time."""
    return max(1, with_headroom(target_qps * seconds_per_request))


def bench_seconds(path: Path, tokens: int) -> tuple[float, str]:
    """Seconds per request measured by a benchmark report: ``bench answers`` (median of the answers the
    API computed; repeats it served from its answer cache left out) or ``bench engine`` (a 40-token answer
    from a resident snapshot, of the measured size closest to ``tokens``)."""
    try:
        report = json.loads(path.read_text())
    except OSError as exc:
        raise CapacityError(f"--from-bench {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise CapacityError(f"--from-bench {path}: not JSON ({exc})") from None
    try:
        seconds = [row["auto"]["seconds"] for row in report.get("rows", [])
                   if row["auto"].get("computed") and "error" not in row["auto"]]
        if seconds:
            return statistics.median(seconds), f"median of {len(seconds)} answers computed through the API, {path}"
        if report.get("documents"):
            row = min(report["documents"], key=lambda row: abs(row["document_tokens"] - tokens))
            return float(row["hit_answer_s"]), f"a {row['document_tokens']}-token snapshot's answer, {path}"
    except (AttributeError, KeyError, TypeError, ValueError):
        pass  # another report, or not one at all: said below
    raise CapacityError(f"--from-bench {path}: neither a `cagflow bench answers` nor a `cagflow bench engine` "
                        "report with timings")


@dataclass
class Estimate:
    source: dict
    model_fingerprint: str
    recipe: KVRecipe
    snapshots: list[SnapshotSize]
    copies: int
    copies_meaning: str
    max_resident_states: int
    max_resident_bytes: int
    weights_bytes: int | None
    target_qps: float | None = None
    seconds_per_request: float | None = None
    seconds_source: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def predicted_bytes(self) -> int:
        return sum(size.predicted_bytes for size in self.snapshots)

    def compared(self) -> tuple[int, int] | None:
        """(predicted, stored) over the snapshots the store holds; None when it holds none."""
        held = [size for size in self.snapshots if size.stored_bytes is not None]
        return (sum(s.predicted_bytes for s in held), sum(s.stored_bytes for s in held)) if held else None

    @property
    def resident_bytes(self) -> int:
        return resident_bytes([size.tensor_bytes for size in self.snapshots], self.max_resident_states,
                              self.max_resident_bytes)

    def documents(self) -> list[dict]:
        """Per document, its snapshots summed; stored only when the store holds every one of them."""
        rows = []
        for doc_id in dict.fromkeys(size.doc_id for size in self.snapshots):
            mine = [size for size in self.snapshots if size.doc_id == doc_id]
            predicted = sum(size.predicted_bytes for size in mine)
            stored = None if any(s.stored_bytes is None for s in mine) else sum(s.stored_bytes for s in mine)
            rows.append({"doc_id": doc_id, "snapshots": len(mine), "tokens": sum(s.tokens for s in mine),
                         "predicted_bytes": predicted, "stored_bytes": stored,
                         "difference_pct": _difference_pct(predicted, stored)})
        return rows

    def to_dict(self) -> dict:
        compared = self.compared()
        store_bytes = self.predicted_bytes * self.copies
        replica_bytes = self.resident_bytes + (self.weights_bytes or 0)  # one answering process
        replicas = None if self.target_qps is None or self.seconds_per_request is None else \
            replicas_needed(self.target_qps, self.seconds_per_request)
        return {
            "source": self.source, "model_fingerprint": self.model_fingerprint,
            "recipe": asdict(self.recipe), "headroom": HEADROOM, "documents": self.documents(),
            "total": {"snapshots": len(self.snapshots), "tokens": sum(s.tokens for s in self.snapshots),
                      "predicted_bytes": self.predicted_bytes,
                      "headers_predicted": all(s.header_bytes is not None for s in self.snapshots),
                      "stored": None if compared is None else {
                          "predicted_bytes": compared[0], "stored_bytes": compared[1],
                          "difference_pct": _difference_pct(*compared)}},
            "store": {"copies": self.copies, "copies_meaning": self.copies_meaning, "bytes": store_bytes,
                      "with_headroom_bytes": with_headroom(store_bytes)},
            "replica": {"max_resident_states": self.max_resident_states,
                        "max_resident_bytes": self.max_resident_bytes,
                        "resident_bytes": self.resident_bytes,
                        "weights_bytes": self.weights_bytes, "bytes": replica_bytes,
                        "with_headroom_bytes": with_headroom(replica_bytes)},
            "replicas": None if self.seconds_per_request is None else {
                "target_qps": self.target_qps, "seconds_per_request": self.seconds_per_request,
                "seconds_source": self.seconds_source, "qps_per_replica": round(1 / self.seconds_per_request, 3),
                "needed": replicas,
                "memory_bytes": None if replicas is None else replicas * with_headroom(replica_bytes)},
            "notes": self.notes,
        }


def estimate(config: Config, store: SnapshotStore, *, manifest: str | None = None, engine: Engine | None = None,
             copies: int | None = None, target_qps: float | None = None, seconds_per_request: float | None = None,
             bench: Path | None = None) -> Estimate:
    """The capacity estimate from the active release of ``store``, or with ``manifest`` from the corpus
    (tokenised by ``engine``, by default the configured model) and set against the release where it has
    the same snapshots."""
    from .doctor import model_folder, weights_bytes

    if copies is not None and copies < 1:
        raise CapacityError("--copies must be at least 1")
    for name, value in (("--target-qps", target_qps), ("--seconds-per-request", seconds_per_request)):
        if value is not None and not value > 0:
            raise CapacityError(f"{name} must be positive")
    if seconds_per_request is not None and bench is not None:
        raise CapacityError("give --seconds-per-request or --from-bench, not both")
    if target_qps is not None and seconds_per_request is None and bench is None:
        raise CapacityError("--target-qps needs the cost of a request: --seconds-per-request S or --from-bench FILE")
    notes = []
    if manifest is None:
        try:
            release = active_release(store)
        except NotFound as exc:
            raise CapacityError(f"{exc}; or estimate from the corpus with --manifest") from None
        recipe, sizes = release_sizes(store, release)
        source = {"kind": "release", "release_id": release.release_id, "store": store.url}
        fingerprint = release.model_fingerprint
        notes.append("headers (token ids and document text, a few bytes a token) are not predicted from a "
                     "release: --manifest predicts them")
    else:
        from ..engine.engine import Engine

        engine = engine or Engine.from_config(config.model)
        try:
            release = active_release(store)
        except (NotFound, StoreUnavailable) as exc:
            release = None
            notes.append(f"nothing stored to compare with: {exc}")
        recipe, sizes = manifest_sizes(engine, CorpusManifest.load(manifest), store, release)
        source = {"kind": "manifest", "manifest": str(manifest), "store": store.url,
                  "release_id": release.release_id if release is not None else None}
        fingerprint = engine.fingerprint
        held = sum(size.stored_bytes is not None for size in sizes)
        if release is not None and held < len(sizes):
            notes.append(f"release {release.release_id} holds {held} of the {len(sizes)} snapshots planned here "
                         "(other document versions, splits or model); only those are compared")
    seconds, seconds_source = seconds_per_request, "--seconds-per-request"
    if bench is not None:
        seconds, seconds_source = bench_seconds(bench, max(size.tokens for size in sizes))
    keep = config.maintenance.keep_releases
    meaning = (f"--copies {copies}: versions of each snapshot the store holds" if copies is not None else
               f"maintenance.keep_releases {keep}: garbage collection keeps the snapshots of the last {keep} "
               f"releases, so a document may be stored in up to {keep} versions")
    known = model_folder(config.model).exists()
    if not known:
        notes.append(f"model weights unknown: {config.model.path} is not prepared here (`cagflow model prepare`)")
    return Estimate(source, fingerprint, recipe, sizes, copies or keep, meaning, config.cache.max_resident_states,
                    config.cache.max_resident_bytes, weights_bytes(config.model) if known else None, target_qps,
                    seconds, seconds_source if seconds is not None else "", notes)


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e6:,.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.3f} %"


def render(report: dict) -> str:
    """The estimate as a table and a few lines, from ``Estimate.to_dict()``."""
    source, recipe, total = report["source"], report["recipe"], report["total"]
    origin = (f"release {source['release_id']}" if source["kind"] == "release" else
              f"corpus {source['manifest']}" + (f" against release {source['release_id']}" if source["release_id"]
                                                 else ""))
    lines = [f"capacity of {origin} in {source['store']} (model {report['model_fingerprint'][:16]})",
             f"K/V per token: 2 × {recipe['layers']} layers × {recipe['kv_heads']} KV heads × {recipe['head_dim']} "
             f"× {recipe['dtype']} = {recipe['bytes_per_token']:,} B", "",
             f"{'document':<34} {'parts':>5} {'tokens':>8} {'predicted MB':>12} {'stored MB':>10} {'diff':>9}"]
    for row in report["documents"]:
        lines.append(f"{row['doc_id']:<34} {row['snapshots']:>5} {row['tokens']:>8,} {_mb(row['predicted_bytes']):>12} "
                     f"{_mb(row['stored_bytes']):>10} {_pct(row['difference_pct']):>9}")
    stored = total["stored"] or {}
    lines.append(f"{'total':<34} {total['snapshots']:>5} {total['tokens']:>8,} {_mb(total['predicted_bytes']):>12} "
                 f"{_mb(stored.get('stored_bytes')):>10} {_pct(stored.get('difference_pct')):>9}")
    if stored:
        lines.append(f"predicted {stored['predicted_bytes']:,} B, stored {stored['stored_bytes']:,} B (the objects' "
                     f"sizes in the store): {_pct(stored['difference_pct'])}")
    store, replica = report["store"], report["replica"]
    headroom = f"with +{(report['headroom'] - 1) * 100:.0f} % headroom"
    weights = "unknown" if replica["weights_bytes"] is None else f"{_mb(replica['weights_bytes'])} MB"
    lines += ["",
              f"store: {_mb(total['predicted_bytes'])} MB × {store['copies']} copies = {_mb(store['bytes'])} MB; "
              f"{headroom} {_mb(store['with_headroom_bytes'])} MB",
              f"  copies = {store['copies_meaning']}",
              f"memory per replica (one answering process): {_mb(replica['bytes'])} MB; "
              f"{headroom} {_mb(replica['with_headroom_bytes'])} MB",
              f"  resident snapshots {_mb(replica['resident_bytes'])} MB: the largest "
              f"{min(replica['max_resident_states'], total['snapshots'])} (cache.max_resident_states "
              f"{replica['max_resident_states']}), at most cache.max_resident_bytes "
              f"{_mb(replica['max_resident_bytes'])} MB",
              f"  model weights {weights}"]
    replicas = report["replicas"]
    if replicas is not None:
        lines.append(f"one replica answers {replicas['qps_per_replica']:g} requests/s at "
                     f"{replicas['seconds_per_request']:.3g} s a request ({replicas['seconds_source']})")
        if replicas["needed"] is not None:
            lines.append(f"replicas for {replicas['target_qps']:g} requests/s: {replicas['target_qps']:g} × "
                         f"{replicas['seconds_per_request']:.3g} s × {report['headroom']} = {replicas['needed']} "
                         f"replicas, {_mb(replicas['memory_bytes'])} MB of memory in all")
    lines += [f"note: {note}" for note in report["notes"]]
    return "\n".join(lines)
