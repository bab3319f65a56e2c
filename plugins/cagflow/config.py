"""One typed configuration for every CAGFlow component.

Sources, later ones winning: built-in defaults, a YAML file (``--config`` or ``CAGFLOW_CONFIG``),
then environment variables ``CAGFLOW__SECTION__KEY=value`` (e.g. ``CAGFLOW__CACHE__MAX_RESIDENT_STATES=4``).
Secrets never live here: S3 credentials come from ``CAGFLOW_S3_{READER,WRITER}_{ACCESS_KEY_ID,SECRET_ACCESS_KEY}``
(serving reads, the pipeline writes; ``store.backends.s3_credentials``), else the standard AWS environment variables
or credential files, and any other secret is read from ``<NAME>`` or the file named by ``<NAME>_FILE``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_serializer, field_validator

from .errors import CagflowError

ENV_PREFIX = "CAGFLOW__"
# The secret that, when set, gives service.rate_limit_redis_url (a URL with a password belongs in a secret).
RATE_LIMIT_REDIS_SECRET = "CAGFLOW_RATE_LIMIT_REDIS_URL"
CACHE_HOME = Path(os.environ.get("CAGFLOW_HOME", Path.home() / ".cache" / "cagflow"))
WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # binds that listen on every address of the machine


class ConfigError(CagflowError, ValueError):
    """Invalid configuration; the message names the offending key."""

    code = "invalid_config"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[^\s/:\[\]]+):(\d{1,5})$")


class TritonReplica(_Section):
    """One Triton server behind the router. ``name`` labels its metrics and places keys on it (rendezvous
    hashing): renaming a replica moves its snapshots; by default it is ``http_url``."""

    name: str | None = None
    http_url: str  # host:port of Triton's HTTP endpoint
    grpc_url: str  # host:port of Triton's gRPC endpoint: streamed answers
    metrics_url: str | None = None  # its resident snapshots for /readyz; None: not checked

    @field_validator("http_url", "grpc_url")
    @classmethod
    def _host_port(cls, value: str) -> str:
        found = _HOST_PORT.match(value)
        if not found or not 1 <= int(found.group(2)) <= 65535:
            raise ValueError("must be HOST:PORT without a scheme (e.g. 10.0.0.5:8000)")
        return value

    @field_validator("metrics_url")
    @classmethod
    def _metrics_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL (e.g. http://10.0.0.5:8002/metrics)")
        return value

    @property
    def id(self) -> str:
        return self.name or self.http_url


def redis_url(value: str) -> str:
    """``value`` when it is a Redis URL redis-py can use: ``redis://`` or ``rediss://`` (TLS), a host, a numeric
    port and database."""
    try:
        parts = urlsplit(value)
        valid = parts.scheme in ("redis", "rediss") and bool(parts.hostname) and parts.port != 0 \
            and (parts.path.strip("/") or "0").isdigit()
    except ValueError:  # a port that is not a number in range, or an unmatched bracket
        valid = False
    if not valid:
        raise ValueError("must be redis://[[USER]:PASSWORD@]HOST[:PORT][/DB] or rediss://... for TLS "
                         "(e.g. redis://10.0.0.7:6379/0), or empty for per-router limits")
    return value


def redact_url(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***``: for logs, /readyz, errors and ``cagflow config``."""
    try:
        parts = urlsplit(url)
    except ValueError:  # an unmatched bracket in the host: what follows the scheme may be a password
        return f"{url.partition('//')[0]}//(unparsable)"
    if parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{parts.netloc.rpartition('@')[2]}"))


def _replica_entries(value: Any) -> Any:
    """``service.triton_replicas`` as a list of mappings. Besides YAML or JSON lists of mappings, a text of
    comma-separated entries is read (handy in an environment variable), each entry being space-separated
    ``KEY=VALUE`` pairs with the mapping's keys: ``http_url=a:8000 grpc_url=a:8001, http_url=b:8000 ...``."""
    if isinstance(value, str):
        value = [entry for entry in value.split(",") if entry.strip()]
    if not isinstance(value, list):
        return value
    entries = []
    for entry in value:
        if isinstance(entry, str):
            pairs = [pair.partition("=") for pair in entry.split()]
            if not pairs or any(not key or not sep or not item for key, sep, item in pairs):
                raise ValueError(f"entry {entry.strip()!r}: write space-separated KEY=VALUE pairs "
                                 "(name, http_url, grpc_url, metrics_url)")
            entry = {key: item for key, _, item in pairs}
        entries.append(entry)
    return entries


class ServiceConfig(_Section):
    """The REST router: where it listens, where it finds Triton, how it routes and what it admits."""

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535)
    # HTTPS: a PEM certificate (chain) and its private key, both or neither. The key file is a secret (mode 0600).
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_file: str | None = None  # what clients of this config trust for the API; None: tls_cert_file itself
    allow_plaintext: bool = False  # plain HTTP on a non-loopback host: only behind a proxy that terminates TLS
    max_concurrent_requests: int = Field(8, ge=1)  # beyond this, requests are refused (503), never queued
    triton_url: str = "127.0.0.1:8000"  # host:port of Triton's HTTP endpoint
    triton_grpc_url: str = "127.0.0.1:8001"  # host:port of Triton's gRPC endpoint: streamed answers
    triton_metrics_url: str | None = "http://127.0.0.1:8002/metrics"  # resident snapshots for /readyz; None: skip
    # Several Triton replicas (README "Several Triton replicas"); when set, they replace the three triton_*_url
    # keys above, which describe the one replica otherwise.
    triton_replicas: list[TritonReplica] = []
    triton_reprobe_s: float = Field(2.0, gt=0)  # how often a replica marked down is probed until it is back
    triton_timeout_s: float = Field(120.0, gt=0)
    retries: int = Field(1, ge=0, le=5)  # extra attempts on connection errors to Triton and OpenSearch
    in_scope_threshold: float = Field(0.83, ge=-1.0, le=1.0)  # see cagflow.search.scope; `cagflow bench routing`
    # Below this cosine similarity to every chunk, retrieval declines without asking the model
    # (cagflow.search.scope; `cagflow bench routing` calibrates it on half of the sample questions).
    answerable_threshold: float = Field(0.832, ge=-1.0, le=1.0)
    # cache+retrieval: a newer passage joins a snapshot when it is at most this much less similar to the
    # question than the document's closest chunk (and at least answerable_threshold). Larger: more
    # questions pay the passages' prefill for little. See README "REST API".
    update_margin: float = Field(0.012, ge=0.0, le=2.0)
    api_keys_file: str = str(CACHE_HOME / "api-keys.json")  # hashed keys only, never the keys themselves
    # Admin actions (key changes, /admin/*), one JSON line each; null or "": the router's log only.
    audit_log_file: str | None = str(CACHE_HOME / "audit.jsonl")
    rate_limit_per_s: float = Field(5.0, gt=0)  # per API key, token bucket refill
    rate_limit_burst: int = Field(20, ge=1)
    # Redis holding the buckets, so that several routers share each key's limit; "": each router its own
    # (in memory). The secret CAGFLOW_RATE_LIMIT_REDIS_URL (or _FILE) overrides it (rate_limit_store).
    rate_limit_redis_url: str = ""
    max_body_bytes: int = Field(16384, ge=256)
    max_question_chars: int = Field(2000, ge=1)
    release_poll_s: float = Field(30.0, ge=0)  # how often to re-read the store's current release; 0 = only on reload

    @field_validator("rate_limit_redis_url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        return redis_url(value) if value else value

    @field_serializer("rate_limit_redis_url")
    def _hide_password(self, value: str) -> str:
        return redact_url(value)

    @field_validator("triton_replicas", mode="before")
    @classmethod
    def _read_replicas(cls, value: Any) -> Any:
        return _replica_entries(value)

    @field_validator("triton_replicas")
    @classmethod
    def _distinct_replicas(cls, value: list[TritonReplica]) -> list[TritonReplica]:
        for label, names in (("http_url", [replica.http_url for replica in value]),
                             ("name", [replica.id for replica in value])):
            repeated = sorted({name for name in names if names.count(name) > 1})
            if repeated:
                raise ValueError(f"{label} {', '.join(repeated)} given twice: list each replica once")
        return value

    def rate_limit_store(self, environ: dict[str, str] | None = None) -> str:
        """The Redis URL the routers share rate limits through ("": none): the secret RATE_LIMIT_REDIS_SECRET
        when set, else ``rate_limit_redis_url``."""
        secret = read_secret(RATE_LIMIT_REDIS_SECRET, environ)
        if not secret:
            return self.rate_limit_redis_url
        try:
            return redis_url(secret)
        except ValueError as exc:
            raise ConfigError(f"{RATE_LIMIT_REDIS_SECRET}: {exc}") from None

    def base_url(self) -> str:
        """Where a client on this machine reaches this API: the bind address, with a wildcard bind reached
        on 127.0.0.1, over HTTPS when the API serves it."""
        host = "127.0.0.1" if self.host in WILDCARD_HOSTS else self.host
        scheme = "https" if self.tls_cert_file else "http"
        return f"{scheme}://{f'[{host}]' if ':' in host else host}:{self.port}"

    def client_ca_file(self) -> str | None:
        """What a client of this API trusts: ``tls_ca_file``, else the server's certificate itself (right for
        a self-signed one); None: the system's CAs."""
        return self.tls_ca_file or self.tls_cert_file or None

    def replicas(self) -> list[TritonReplica]:
        """The Triton replicas to route to: ``triton_replicas``, else the one the triton_*_url keys name."""
        return self.triton_replicas or [TritonReplica.model_construct(  # these keys were never checked: as before
            name=None, http_url=self.triton_url, grpc_url=self.triton_grpc_url, metrics_url=self.triton_metrics_url)]


class S3Config(_Section):
    endpoint_url: str | None = None
    region: str = "us-east-1"
    multipart_threshold_bytes: int = Field(64 * 1024 * 1024, ge=5 * 1024 * 1024)
    connect_timeout_s: float = Field(3.0, gt=0)
    read_timeout_s: float = Field(30.0, gt=0)
    max_attempts: int = Field(3, ge=1, le=10)


class CacheConfig(_Section):
    state_store: str = f"file://{CACHE_HOME / 'store'}"
    max_resident_states: int = Field(8, ge=1)
    max_resident_bytes: int = Field(4 * 1024**3, ge=1)
    preload_on_startup: bool = True
    s3: S3Config = S3Config()

    @field_validator("state_store")
    @classmethod
    def _known_scheme(cls, value: str) -> str:
        if not value.startswith(("file://", "s3://")):
            raise ValueError("must start with file:// or s3:// (e.g. file:///var/lib/cagflow or s3://bucket/prefix)")
        return value


class RetrievalConfig(_Section):
    endpoint: str = "http://127.0.0.1:9200"
    index: str = "cagflow-chunks"
    top_k: int = Field(4, ge=1, le=50)
    fallback_enabled: bool = True
    timeout_s: float = Field(5.0, gt=0)
    chunk_tokens: int = Field(200, ge=16, le=512)
    chunk_overlap_tokens: int = Field(40, ge=0)
    # cache+retrieval: at most this many passages of newer variable documents follow a fixed document's
    # snapshot (0 = never; see README "Routes"), cut to their sentences closest to the question, this many
    # words in all: every word is prefilled per request.
    update_passages: int = Field(2, ge=0, le=10)
    update_words: int = Field(25, ge=5, le=2000)
    # Replicas of each shard of the indexes the pipeline creates: 0 on one node; 1 on a cluster, so that losing a
    # node loses no chunk. Applies to new indexes (each re-index or model switch creates one).
    index_replicas: int = Field(0, ge=0, le=5)

    @field_validator("chunk_overlap_tokens")
    @classmethod
    def _overlap_below_size(cls, value: int, info) -> int:
        if value >= info.data.get("chunk_tokens", value + 1):
            raise ValueError("must be smaller than retrieval.chunk_tokens")
        return value


class RelevanceConfig(_Section):
    """The relevance check (README "REST API"): after answering from a document or passages, the model is
    asked whether that text answers the question, and its probability of "yes" decides. Thresholds per
    question language, as the model's yes/no scale differs between them; `cagflow bench answers` calibrates
    them."""

    enabled: bool = True
    # An answer is declined (not_in_documents) below this P(yes, the text gives that answer) (0: never). Off: in
    # English 0.66 declines 6 more of 15 near-miss SQuAD 2.0 questions but costs 5 of 22 right answers, and 14
    # right answers for 7 declines on the sample questions (bench/README.md "The answer check").
    decline_below_en: float = Field(0.0, ge=0.0, le=1.0)
    decline_below_zh: float = Field(0.0, ge=0.0, le=1.0)
    # A decline by the model is asked again from this up (above 1: never): "excerpt" quotes the part of the
    # text closest to the question ahead of it and keeps the option to decline; "answer" leaves that option
    # out. Measured per language on the sample questions (bench/README.md): the 1.5B model's English declines
    # of a fact it had overlooked are answered with the excerpt (without it, it named a neighbouring fact); in
    # Chinese it declined again with the excerpt and answered without the option.
    reask_from_en: float = Field(0.5, ge=0.0)
    reask_from_zh: float = Field(0.96, ge=0.0)
    reask_en: Literal["excerpt", "answer"] = "excerpt"
    reask_zh: Literal["excerpt", "answer"] = "answer"

    def thresholds(self, language: str) -> tuple[float, float]:
        """(decline below, re-ask from) for questions in ``language``."""
        return getattr(self, f"decline_below_{language}"), getattr(self, f"reask_from_{language}")

    def reask(self, language: str) -> str:
        """How a decline in ``language`` is asked again: "excerpt" or "answer"."""
        return getattr(self, f"reask_{language}")


class ModelConfig(_Section):
    path: str = "qwen2.5-coder-1.5b"  # the default tier: see README "Models" and `cagflow bench answers`
    max_context_tokens: int = Field(8192, ge=256)
    max_new_tokens: int = Field(128, ge=1)
    question_budget_tokens: int = Field(256, ge=16)
    # Over a document alone (the cache route), its sentences that share the most with the question, up to this
    # many tokens, are quoted ahead of the question (0: off); prefilled per request. Off: on public data it
    # added 1 right answer in 56 for ~8 s more time to first token here (README "Answer rules").
    focus_tokens: int = Field(0, ge=0)
    # q4k: the linears the model's GGUF stores in Q4_K blocks computed from those blocks as they are, the
    # others int8 rows (a model without a GGUF: int8). int8: int8 weights; both with bf16 activations and KV
    # (Llama/Qwen2 families; others run fp32 and say so in the log). fp32: the reference, ~5x slower. A
    # snapshot belongs to one precision (it is in the fingerprint). README "Models".
    precision: Literal["q4k", "int8", "fp32"] = "q4k"
    threads: int = Field(1, ge=0)  # torch threads per process; 0 = torch default. See README "Thread policy"
    # Each block (a prefill block of the question, passages or snapshot, or one decode step) also takes the cores
    # that are idle when it starts (Linux's runnable-task count). Results do not depend on it.
    idle_cores: bool = True
    # Decode by prompt lookup (engine.lookup): guesses of the next tokens from the prompt's words, checked in the
    # same pass as the token before them. The same tokens as one-token steps, int8 engine only; measured in
    # bench/README "Prompt lookup".
    prompt_lookup: bool = True
    relevance: RelevanceConfig = RelevanceConfig()
    # The retrieval route's passages: "reuse" places each passage's K/V, computed once (by the ingest DAG or on
    # first use) and re-rotated to its position, so only the question is prefilled; "prefill" computes them
    # per request. int8 engine only. Measured in bench/README "Reused passage states".
    passage_kv: Literal["reuse", "prefill"] = "reuse"
    passage_kv_memory_mb: int = Field(512, ge=0)  # passage states kept in memory per serving process
    # With reuse, the last N passages are prefilled behind the others' states (attending to them, as in a full
    # prefill); 0: every passage reused. On public data 1 gained nothing for 1.7 s (bench/README "Reused passage
    # states").
    passage_kv_recompute: int = Field(0, ge=0)

    @field_validator("max_new_tokens")
    @classmethod
    def _fits(cls, value: int) -> int:
        if value > 4096:
            raise ValueError("must be at most 4096")
        return value


class CorpusConfig(_Section):
    manifest: str = "corpus/manifest.yaml"


class PrecomputeConfig(_Section):
    """The ``cag_fixed_precompute`` DAG: when it runs, where snapshots are computed, whom it tells."""

    via: Literal["local", "triton"] = "local"
    schedule: str = "0 2 * * *"
    parallel_parts: int = Field(1, ge=1)  # parts computed at once per run; on one machine each uses every core
    # torch threads of a local precompute (via=local); 0 = the worker's cores divided by parallel_parts.
    # Precompute runs at low-peak hours, so it takes the cores serving leaves idle (README "Thread policy").
    threads: int = Field(0, ge=0)
    # Triton's HTTP address (host:port): cag_precompute when via=triton, and the cag_llm reload after a
    # release is published (None: serving is not asked, it still follows releases/current.json).
    triton_url: str | None = "127.0.0.1:8000"


class IngestConfig(_Section):
    """The ``cag_variable_ingest`` DAG."""

    schedule: str = "@hourly"
    # Tiers whose chunks' passage states (model.passage_kv: reuse) the ingest computes; other chunks' states are
    # computed by serving on first use. Variable documents are what the retrieval route answers from.
    passage_state_tiers: list[Literal["fixed", "variable"]] = ["variable"]


class MaintenanceConfig(_Section):
    """The ``cag_snapshot_maintenance`` DAG: what garbage collection keeps."""

    schedule: str = "@weekly"
    keep_releases: int = Field(3, ge=1)
    unused_days: float = Field(14.0, ge=0)


class RulesConfig(_Section):
    """The answer rules (``cagflow.rules``; README "Answer rules"): each one can be switched off by name.
    A switched-off rule is still evaluated and listed in the answer's ``rules_fired``, so one benchmark run
    measures what each would change (``cagflow bench answers --ablate``)."""

    # The re-asks are off: on the public SQuAD 2.0 and CMRC 2018 runs they gained no right answer, answered
    # near-miss questions the first attempt had declined, and took 1.4-6x their route's median (bench/README.md
    # "Second attempts"). Off, they are still evaluated and reported in ``rules_fired``.
    disabled: list[str] = ["reask_relevant_decline", "reask_document_alone"]

    @field_validator("disabled")
    @classmethod
    def _known_rules(cls, value: list[str]) -> list[str]:
        from .rules import check_names

        return check_names(value)


class TracingConfig(_Section):
    """OpenTelemetry traces (``cagflow.tracing``; README "Tracing"). Off while ``endpoint`` is empty."""

    endpoint: str = ""  # a collector's OTLP/HTTP base URL, e.g. http://127.0.0.1:4318 (Jaeger, otel-collector)
    sample_ratio: float = Field(1.0, ge=0.0, le=1.0)  # of the traces started here; a caller's sampled flag wins
    export_timeout_s: float = Field(5.0, gt=0)
    export_delay_ms: int = Field(1000, ge=1)  # spans are sent in batches at most this long after they end
    query_url: str = "http://127.0.0.1:16686"  # the collector's query API (Jaeger's), for `cagflow trace`

    @field_validator("endpoint", "query_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if value and not value.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL (e.g. http://127.0.0.1:4318), or empty for off")
        return value


class Config(_Section):
    service: ServiceConfig = ServiceConfig()
    cache: CacheConfig = CacheConfig()
    retrieval: RetrievalConfig = RetrievalConfig()
    model: ModelConfig = ModelConfig()
    corpus: CorpusConfig = CorpusConfig()
    precompute: PrecomputeConfig = PrecomputeConfig()
    ingest: IngestConfig = IngestConfig()
    maintenance: MaintenanceConfig = MaintenanceConfig()
    rules: RulesConfig = RulesConfig()
    tracing: TracingConfig = TracingConfig()


def _set_path(tree: dict[str, Any], dotted: list[str], value: Any) -> None:
    for part in dotted[:-1]:
        node = tree.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(dotted)}: cannot override inside non-section {part!r}")
        tree = node
    tree[dotted[-1]] = value


def _env_value(raw: str) -> Any:
    """Read a value as YAML would ("4" → 4, "false" → False); text that is not valid YAML, such as a
    cron expression "*/15 * * * *", stays a string."""
    if raw == "":
        return ""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        dotted = name[len(ENV_PREFIX):].lower().split("__")
        _set_path(overrides, dotted, _env_value(raw))
    return overrides


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        key = ".".join(str(p) for p in item["loc"]) or "<root>"
        if item["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key")
        else:
            value = item.get("input")
            shown = redact_url(value) if isinstance(value, str) else value  # a URL's password stays out of it
            lines.append(f"{key}: {item['msg']} (got {shown!r})")
    return "invalid configuration: " + "; ".join(lines)


def load_config(path: str | os.PathLike[str] | None = None, environ: dict[str, str] | None = None) -> Config:
    """Build the configuration from defaults, the YAML file and ``CAGFLOW__*`` variables."""
    environ = dict(os.environ if environ is None else environ)
    path = path or environ.get("CAGFLOW_CONFIG")
    data: dict[str, Any] = {}
    if path:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config file not found: {file}")
        try:
            loaded = yaml.safe_load(file.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {file} is not valid YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {file} must hold a mapping of sections")
        data = loaded
    data = _merge(data, _env_overrides(environ))
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None


def read_secret(name: str, environ: dict[str, str] | None = None) -> str | None:
    """A secret from ``$NAME`` or from the file named by ``$NAME_FILE`` (Docker/Kubernetes secrets)."""
    environ = os.environ if environ is None else environ
    if environ.get(name):
        return environ[name]
    file = environ.get(f"{name}_FILE")
    if file:
        try:
            return Path(file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{name}_FILE: cannot read secret file {file}: {exc.strerror}") from None
    return None
