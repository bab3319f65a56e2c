"""``cagflow doctor``: the rows of the README's troubleshooting table, checked against the running setup.

Each check looks at the real parts (the store, OpenSearch, Triton's and the router's metrics, the keys
file, the model cache) and says ``ok``, ``warn``, ``fail`` or ``skip`` (could not tell), with what it saw
and the fix. Nothing here loads the model or writes anything.
"""

from __future__ import annotations

import re
import ssl
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from ..config import CACHE_HOME, Config, ModelConfig
from ..errors import CagflowError

SLOW_STORE_MB_S = 100.0  # below this a snapshot of ~80 MB takes about a second to load on a first request
LOW_HIT_RATE = 0.5  # of the answers that tried the cache route, after at least MIN_ATTEMPTS
MIN_ATTEMPTS = 20
METRICS_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Verdict:
    symptom: str  # the row of the troubleshooting table
    status: str  # ok | warn | fail | skip
    detail: str
    fix: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _metrics(url: str | None, ca_file: str | None = None) -> str | None:
    """Prometheus text from ``url`` (an ``https://`` one verified against ``ca_file``, else the system's CAs);
    None when nothing answers there."""
    if not url:
        return None
    context = ssl.create_default_context(cafile=ca_file) if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=METRICS_TIMEOUT_S, context=context) as response:
            return response.read().decode("utf-8", "replace")
    except (OSError, urllib.error.URLError):
        return None


def _sample(text: str, name: str) -> float | None:
    """The sum of a metric's samples (every label set) in Prometheus text; None when absent."""
    values = [float(value) for value in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)]
    return sum(values) if values else None


def _active_release(config: Config):
    from ..store.backends import NotFound, open_store
    from ..store.manifests import load_release

    store = open_store(config.cache.state_store, config.cache.s3, role="reader")  # what serving sees
    try:
        return store, load_release(store)
    except NotFound:
        return store, None


def model_folder(model: ModelConfig) -> Path:
    """Where the configured model lives, without preparing it: a preset's folder may not exist yet."""
    from ..engine.model import find_preset, preset_folder

    preset = find_preset(model.path)
    return preset_folder(preset) if preset is not None else Path(model.path).expanduser()


def weights_bytes(model: ModelConfig) -> int:
    """The weights one serving process holds: the engine's prepared file (mapped, so shared by the processes
    of a machine), else the folder's safetensors."""
    folder = model_folder(model)
    prepared = sorted((CACHE_HOME / "weights").glob(f"{folder.name}-*.fastlm"))  # what the engine maps
    return prepared[0].stat().st_size if prepared and model.precision != "fp32" else sum(
        path.stat().st_size for path in folder.glob("*.safetensors"))


# ---- the rows ----------------------------------------------------------------------------------------


def service_does_not_start(config: Config) -> Verdict:
    """The model is prepared, memory holds it and the resident budget, and the keys file has a key."""
    from ..engine.model import find_preset
    from ..router.apikeys import ApiKeyStore

    symptom = "service does not start"
    spec = config.model.path
    folder = model_folder(config.model)
    if find_preset(spec) is not None and not (folder / "config.json").exists():
        return Verdict(symptom, "fail", f"model {spec} is not prepared ({folder} missing)",
                       "run `cagflow model prepare` before starting Triton (make run does)")
    if not folder.exists():
        return Verdict(symptom, "fail", f"model.path {spec!r} does not exist", "point model.path at a preset, "
                       "a Hugging Face folder or a .gguf file")
    weights = weights_bytes(config.model)
    available = _available_memory()
    needed = weights + config.cache.max_resident_bytes
    keys = ApiKeyStore(config.service.api_keys_file).list() if Path(config.service.api_keys_file).exists() else []
    if not keys:
        return Verdict(symptom, "fail", f"no API key in {config.service.api_keys_file}: every request gets 401",
                       "`cagflow keys init-local` (local) or `cagflow keys create NAME`")
    if available is not None and needed > available:
        return Verdict(symptom, "warn", f"model weights {weights / 1e9:.1f} GB + resident budget "
                       f"{config.cache.max_resident_bytes / 1e9:.1f} GB exceed the {available / 1e9:.1f} GB "
                       "available", "lower cache.max_resident_bytes, pick a smaller model tier or add memory")
    return Verdict(symptom, "ok", f"model {folder.name} prepared ({weights / 1e9:.1f} GB), {len(keys)} API key(s)"
                   + (f", {available / 1e9:.1f} GB memory available" if available is not None else ""))


def _available_memory() -> int | None:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    found = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.MULTILINE)
    return int(found.group(1)) * 1024 if found else None


def slow_first_requests(config: Config) -> Verdict:
    """Preload on, and the store reads a whole snapshot fast."""
    symptom = "slow first requests"
    store, release = _active_release(config)
    if release is None or not release.snapshots:
        return Verdict(symptom, "skip", f"no release in {store.url} to read", "run cag_fixed_precompute")
    entry = max(release.snapshots, key=lambda e: e.bytes)
    started = time.perf_counter()
    store.get(entry.object_name, sha256=entry.sha256)
    seconds = time.perf_counter() - started
    speed = entry.bytes / 1e6 / max(seconds, 1e-9)
    read = f"read {entry.bytes / 1e6:.0f} MB ({entry.key}) in {seconds:.2f} s, {speed:,.0f} MB/s, checksum verified"
    if not config.cache.preload_on_startup:
        return Verdict(symptom, "warn", f"cache.preload_on_startup is off: each snapshot loads on its first request; "
                       f"{read}", "set cache.preload_on_startup: true")
    if speed < SLOW_STORE_MB_S:
        return Verdict(symptom, "warn", read, "a store closer to Triton (same zone), or keep more snapshots "
                       "resident (cache.max_resident_states/bytes)")
    return Verdict(symptom, "ok", f"preload on; {read}")


def hit_rate_far_below_expectation(config: Config) -> Verdict:
    """The release was built for the configured model, its keys are the ones asked for, and the router's hit
    rate (when it has served enough) is not low."""
    from ..engine.model import ModelError, identify_model
    from ..devstack.router import local_api
    from ..store.layout import HEAT_PREFIX

    symptom = "hit rate far below expectation"
    store, release = _active_release(config)
    if release is None:
        return Verdict(symptom, "fail", f"no release published in {store.url}: every question goes to retrieval",
                       "run cag_fixed_precompute (make run does)")
    try:
        fingerprint = identify_model(config.model.path, config.model.precision)[2]
    except (ModelError, OSError, ValueError) as exc:
        return Verdict(symptom, "skip", f"cannot identify the configured model: {exc}", "see 'service does not start'")
    if fingerprint != release.model_fingerprint:
        return Verdict(symptom, "fail", f"release {release.release_id} was built for model "
                       f"{release.model_fingerprint[:16]}, the configured model is {fingerprint[:16]}: no snapshot "
                       "can be used", "rerun cag_fixed_precompute with this model (or roll back model.path)")
    keys = {entry.key for entry in release.snapshots}
    asked = set()
    for info in store.list(HEAT_PREFIX):
        asked |= set(_heat_keys(store, info.name))
    # Keys of this model that the release lacks: requests for document versions it no longer serves.
    strangers = sorted(key for key in asked - keys if key.split("/")[2:3] == [fingerprint[:16]])
    api, ca_file = local_api(config)
    text = _metrics(f"{api}/metrics", ca_file)
    attempts = _sample(text, "cagflow_router_cache_attempts_total") if text else None
    hits = _sample(text, "cagflow_router_cache_hits_total") if text else None
    rate = hits / attempts if attempts and hits is not None else None
    if rate is not None:
        served = f"router hit rate {rate:.0%} of {attempts:.0f} cache attempts"
    else:
        served = "router idle: no hit rate yet" if text else f"no router at port {config.service.port}: no hit rate"
    if rate is not None and attempts >= MIN_ATTEMPTS and rate < LOW_HIT_RATE:
        detail = f"{served}; snapshot keys asked but not in the release: {', '.join(strangers[:5]) or 'none'}"
        return Verdict(symptom, "fail", detail, "clients asking for a doc_id not in the release go to retrieval: "
                       "check doc_ids against GET /v1/releases; versions that moved on: rerun cag_fixed_precompute")
    if strangers:
        return Verdict(symptom, "warn", f"{served}; keys asked for that the release lacks (older versions?): "
                       f"{', '.join(strangers[:5])}", "replicas still serving an older release: POST "
                       "/v1/admin/reload, or wait for service.release_poll_s")
    return Verdict(symptom, "ok", f"release {release.release_id} matches the model ({len(keys)} snapshots); {served}")


def _heat_keys(store, name: str) -> list[str]:
    import json

    try:
        return list(json.loads(store.get(name)).get("counts", {}))
    except (CagflowError, ValueError, AttributeError):
        return []


def memory_grows(config: Config) -> Verdict:
    """Triton's resident snapshot bytes stay within ``cache.max_resident_bytes``."""
    symptom = "memory grows"
    text = _metrics(config.service.triton_metrics_url)
    if text is None:
        return Verdict(symptom, "skip", f"Triton metrics not reachable at {config.service.triton_metrics_url}",
                       "start Triton (`cagflow triton up`) to check its resident set")
    resident = _sample(text, "cagflow_resident_bytes")
    if resident is None:
        return Verdict(symptom, "skip", "Triton answers but reports no cagflow_resident_bytes (model not loaded?)",
                       "check `cagflow triton status` and Triton's log")
    budget = config.cache.max_resident_bytes
    detail = f"resident snapshots {resident / 1e6:,.0f} MB of a {budget / 1e6:,.0f} MB budget"
    if resident > budget:
        return Verdict(symptom, "fail", detail + " (over: snapshots in use past eviction, or a leak)",
                       "lower service.max_concurrent_requests or raise cache.max_resident_bytes; restart Triton "
                       "if it keeps growing while idle")
    return Verdict(symptom, "ok", detail)


def stale_answers(config: Config) -> Verdict:
    """Every fixed document of the manifest is in the active release at its manifest version."""
    from ..store.manifests import CorpusManifest, ManifestError

    symptom = "stale answers"
    try:
        fixed = CorpusManifest.load(config.corpus.manifest).tier("fixed")
    except ManifestError as exc:
        return Verdict(symptom, "skip", str(exc), "set corpus.manifest")
    store, release = _active_release(config)
    if release is None:
        return Verdict(symptom, "fail", f"no release in {store.url}", "run cag_fixed_precompute")
    served = {entry.doc_id: entry.doc_version for entry in release.snapshots}
    behind = [f"{doc.doc_id} (release {served[doc.doc_id]}, manifest {doc.version})" for doc in fixed
              if doc.doc_id in served and served[doc.doc_id] != doc.version]
    missing = [doc.doc_id for doc in fixed if doc.doc_id not in served]
    if behind or missing:
        detail = "; ".join(part for part in (f"older versions served: {', '.join(behind)}" if behind else "",
                                             f"not in the release: {', '.join(missing)}" if missing else "") if part)
        return Verdict(symptom, "fail", detail, "trigger cag_fixed_precompute (`cagflow airflow trigger "
                       "cag_fixed_precompute`); it computes only what changed")
    return Verdict(symptom, "ok", f"release {release.release_id} serves all {len(fixed)} fixed documents at their "
                   "manifest versions")


def retrieval_fallback_fails(config: Config) -> Verdict:
    """OpenSearch answers, the index alias exists and both tiers have chunks."""
    from ..search.retrieval import ChunkIndex, RetrievalError

    symptom = "retrieval fallback fails"
    settings = config.retrieval
    with ChunkIndex(settings.endpoint, settings.index, timeout_s=settings.timeout_s, max_retries=0) as index:
        try:
            health = index.health()
            if not health["alias_exists"]:
                return Verdict(symptom, "fail", f"index alias {settings.index!r} missing at {settings.endpoint}",
                               "run cag_variable_ingest and cag_fixed_precompute (they create and fill it)")
            counts = {tier: index.count(tier=tier) for tier in ("fixed", "variable")}
        except RetrievalError as exc:
            return Verdict(symptom, "fail", f"OpenSearch at {settings.endpoint}: {exc}",
                           "start it (`cagflow opensearch up`) or fix retrieval.endpoint")
    empty = [tier for tier, count in counts.items() if count == 0]
    detail = f"{settings.endpoint} {health['status']}, alias {settings.index}: " + ", ".join(
        f"{count} {tier} chunks" for tier, count in counts.items())
    if empty:
        return Verdict(symptom, "warn", detail, f"no {' or '.join(empty)} chunks: run the ingest DAG(s)")
    return Verdict(symptom, "ok", detail)


CHECKS: tuple[Callable[[Config], Verdict], ...] = (
    service_does_not_start, slow_first_requests, hit_rate_far_below_expectation, memory_grows, stale_answers,
    retrieval_fallback_fails)


def diagnose(config: Config) -> list[Verdict]:
    """Every row; a check that breaks on something unexpected reports it instead of stopping the others."""
    verdicts = []
    for check in CHECKS:
        symptom = check.__name__.replace("_", " ")
        try:
            verdicts.append(check(config))
        except (CagflowError, OSError) as exc:
            verdicts.append(Verdict(symptom, "fail", f"{type(exc).__name__}: {exc}", "see the message"))
    return verdicts
