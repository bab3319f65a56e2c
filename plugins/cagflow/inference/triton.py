"""The Triton adapter: the only code that touches ``pb_utils``. It turns Triton's requests into the answer
service's requests and its answers and errors into Triton's responses, publishes metrics, and holds what
a model keeps from ``initialize`` to ``finalize``. The model files in ``triton_models/`` only wire these
into ``initialize / execute / finalize``.

Threading: the Python backend's calls (tensors, responses, metrics) are made only on the thread that runs
``execute`` (the stub's event loop); model work runs in a thread pool and talks back through asyncio.
Metrics are therefore collected from any thread and published from ``execute``.

Errors: every error response's message starts with the error's reason code (``[code] message``, see
``cagflow.errors``), which the router maps to a fallback reason; the Triton status says what kind of
failure it is (bad input, not found, unavailable, internal).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .. import tracing
from ..config import ConfigError
from ..documents.parsing import ParsedDocument, parse_document_text
from ..engine.engine import SnapshotMismatch
from ..errors import INTERNAL, error_code, with_code
from ..store.backends import NotFound, StoreError
from ..store.manifests import ManifestError, SnapshotUnusable
from .answer_cache import ANSWER_CACHE, MERGED
from .concurrency import answer_requests, in_thread
from .resident import NoActiveRelease, UnknownSnapshot
from .service import (AnswerRequest, CagService, InvalidRequest, ReloadResult, ServedAnswer, ServingListener,
                      ServingSettings, parse_context)

log = logging.getLogger("cagflow.serving")

ACTIONS = ("answer", "reload")
LOAD_SECONDS_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


# ---- settings and start-up --------------------------------------------------------------------------

def settings_from_args(args: dict[str, str]) -> ServingSettings:
    """The serving settings from the ``args`` Triton passes to ``initialize``: config.pbtxt's parameters."""
    config = json.loads(args["model_config"])
    raw = {key: value.get("string_value", "") for key, value in (config.get("parameters") or {}).items()}
    known = {"config_file", "replica_id", "worker_threads", "release_poll_s", "heat_flush_s",
             "answer_cache_entries"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{args['model_name']}/config.pbtxt: unknown parameters {', '.join(unknown)} "
                          f"(known: {', '.join(sorted(known))})")

    def number(name: str, kind: type, default: float, minimum: float) -> Any:
        text = raw.get(name, "").strip()
        where = f"{args['model_name']}/config.pbtxt: parameter {name}"
        try:
            value = kind(text) if text else default
        except ValueError:
            raise ConfigError(f"{where} must be a number, got {text!r}") from None
        if value < minimum:
            raise ConfigError(f"{where} must be >= {minimum}, got {value}")
        return value

    instance = args.get("model_instance_name", args["model_name"])
    return ServingSettings(
        model_name=args["model_name"],
        instance_name=instance,
        config_file=raw.get("config_file") or None,
        replica_id=raw.get("replica_id") or f"{socket.gethostname()}-{instance}",
        worker_threads=number("worker_threads", int, 4, 1),
        release_poll_s=number("release_poll_s", float, 30.0, 0.0),
        heat_flush_s=number("heat_flush_s", float, 60.0, 0.0),
        answer_cache_entries=number("answer_cache_entries", int, 1024, 0),
    )


def configure_logging(instance_name: str) -> None:
    """CAGFlow's log lines go to the stub's stderr, which Triton writes to its own log; writing there
    directly is safe from any thread."""
    logger = logging.getLogger("cagflow")
    if not any(getattr(handler, "cagflow_triton", False) for handler in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[cagflow {instance_name}] %(levelname)s %(message)s"))
        handler.cagflow_triton = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


@dataclass
class Serving:
    """What an answering model holds from ``initialize`` to ``finalize``."""

    settings: ServingSettings
    metrics: "TritonMetrics"
    service: CagService
    pool: ThreadPoolExecutor

    @classmethod
    def start(cls, pb_utils, args: dict[str, str]) -> "Serving":
        settings = settings_from_args(args)
        configure_logging(settings.instance_name)
        metrics = TritonMetrics(pb_utils, settings.model_name, settings.instance_name)
        service = CagService.start(settings, listener=metrics)
        tracing.setup("cagflow-triton", service.runtime.config.tracing)
        pool = ThreadPoolExecutor(settings.worker_threads, thread_name_prefix=settings.model_name)
        metrics.publish()
        return cls(settings, metrics, service, pool)

    async def reload_response(self, pb_utils, request):
        """``ACTION=reload``: switch to ``RELEASE_ID`` (default: the store's current release)."""
        try:
            release_id = input_text(pb_utils, request, "RELEASE_ID") or None
            result = await in_thread(self.pool, self.service.reload, release_id)
            return pb_utils.InferenceResponse(output_tensors=reload_outputs(pb_utils, result))
        except Exception as exc:
            return error_response(pb_utils, exc, request.request_id())

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.service.close()
        self.metrics.close()
        tracing.shutdown()


# ---- precompute -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DocumentRequest:
    """``cag_precompute``'s inputs: one document as text."""

    doc_id: str
    doc_version: str
    text: str
    format: str = "md"
    title: str = ""
    force: bool = False

    def parse(self) -> ParsedDocument:
        return parse_document_text(self.text, self.format, self.title or None, self.doc_id)


def entries_json(results: list) -> str:
    return json.dumps([{**r.entry.model_dump(), "skipped": r.skipped, "seconds": round(r.seconds, 4)} for r in results])


# ---- errors -----------------------------------------------------------------------------------------

def triton_status(exc: BaseException) -> str:
    """The Triton error status for an exception: what kind of failure it is for a client."""
    if isinstance(exc, (UnknownSnapshot, NotFound)):
        return "NOT_FOUND"
    if isinstance(exc, (SnapshotUnusable, StoreError, NoActiveRelease, ManifestError)):
        return "UNAVAILABLE"
    if isinstance(exc, ValueError) and not isinstance(exc, SnapshotMismatch):
        return "INVALID_ARG"  # bad inputs: InvalidRequest, PromptError, DocumentError, ReleaseMismatch...
    return "INTERNAL"


def describe(exc: BaseException, request_id: str = "") -> str:
    """The error message a client sees, led by the reason code."""
    message = str(exc) or type(exc).__name__
    if error_code(exc) == INTERNAL:
        message = f"internal error ({type(exc).__name__}): {message}"
    return with_code(error_code(exc), f"request {request_id}: {message}" if request_id else message)


# ---- Triton tensors ---------------------------------------------------------------------------------

def _single(pb_utils, request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise InvalidRequest(f"{name} must hold exactly one value, got {values.size}")
    return values[0]


def input_text(pb_utils, request, name: str) -> str | None:
    value = _single(pb_utils, request, name)
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest(f"{name} is not UTF-8 text") from None
    return str(value)


def input_int(pb_utils, request, name: str) -> int | None:
    value = _single(pb_utils, request, name)
    return None if value is None else int(value)


def input_bool(pb_utils, request, name: str) -> bool:
    value = _single(pb_utils, request, name)
    return bool(value) if value is not None else False


def read_action(pb_utils, request) -> str:
    action = (input_text(pb_utils, request, "ACTION") or "answer").strip().lower()
    if action not in ACTIONS:
        raise InvalidRequest(f"ACTION must be one of {', '.join(ACTIONS)}, got {action!r}")
    return action


def read_answer_request(pb_utils, request) -> AnswerRequest:
    question = input_text(pb_utils, request, "QUESTION")
    if question is None:
        raise InvalidRequest("QUESTION is required")
    context = input_text(pb_utils, request, "CONTEXT")
    return AnswerRequest(
        question=question,
        snapshot_key=(input_text(pb_utils, request, "SNAPSHOT_KEY") or "").strip(),
        context=parse_context(context) if context and context.strip() else None,
        max_new_tokens=input_int(pb_utils, request, "MAX_NEW_TOKENS"),
        request_id=input_text(pb_utils, request, "REQUEST_ID") or request.request_id() or "",
    )


def trace_parent(request):
    """The caller's trace context: the ``traceparent`` request parameter the router sends (none: a new trace)."""
    try:
        parameters = json.loads(request.parameters() or "{}")
    except (ValueError, TypeError):
        parameters = {}
    value = parameters.get(tracing.TRACEPARENT) if isinstance(parameters, dict) else None
    return tracing.context_from(value if isinstance(value, str) else None)


def trace_answer(model_name: str, parent, received: float, result: ServedAnswer | BaseException) -> None:
    """The model's span of one answer request, from its arrival in ``execute`` to now (so the wait for a thread,
    a batch or an identical request in flight is inside it), and the engine's stages of a computed answer as
    its children."""
    span = tracing.TRACER.start_span(f"{model_name} answer", context=parent, kind=tracing.SpanKind.SERVER,
                                     start_time=tracing.perf_to_ns(received))
    if isinstance(result, BaseException):
        tracing.failed(span, result)
    else:
        answer = result.answer
        span.set_attributes({
            "cagflow.route": answer.route, "cagflow.answer_source": result.source,
            "cagflow.resident_hit": result.resident_hit, "cagflow.snapshot_key": answer.snapshot_key or "",
            "cagflow.snapshot_load_ms": round(result.load_ms, 2), "cagflow.prompt_tokens": answer.prompt_tokens,
            "cagflow.reused_tokens": answer.reused_tokens, "cagflow.generated_tokens": len(answer.token_ids),
            "cagflow.ttft_ms": round(answer.ttft_s * 1000, 2), "cagflow.answered": answer.answered})
        if result.source != ANSWER_CACHE:
            context = tracing.context_of(span)
            for stage, start, end in answer.stage_laps:
                tracing.record_span(f"engine {stage}", start, end, parent=context)
    span.end()


def read_document_request(pb_utils, request) -> DocumentRequest:
    fields = {}
    for name in ("DOC_ID", "DOC_VERSION", "DOCUMENT"):
        value = input_text(pb_utils, request, name)
        if not value:
            raise InvalidRequest(f"{name} is required")
        fields[name] = value
    return DocumentRequest(fields["DOC_ID"], fields["DOC_VERSION"], fields["DOCUMENT"],
                           input_text(pb_utils, request, "FORMAT") or "md",
                           input_text(pb_utils, request, "TITLE") or "", input_bool(pb_utils, request, "FORCE"))


def _text(pb_utils, name: str, value: str):
    import numpy as np

    return pb_utils.Tensor(name, np.array([[value.encode("utf-8")]], dtype=np.object_))


def _number(pb_utils, name: str, value, dtype):
    import numpy as np

    return pb_utils.Tensor(name, np.array([[value]], dtype=dtype))


def answer_outputs(pb_utils, served: ServedAnswer) -> list:
    import numpy as np

    answer = served.answer
    return [
        _text(pb_utils, "ANSWER", answer.text),
        _number(pb_utils, "CACHE_HIT", served.cache_hit, np.bool_),
        _number(pb_utils, "RESIDENT_HIT", served.resident_hit, np.bool_),
        _number(pb_utils, "PROMPT_TOKENS", answer.prompt_tokens, np.int32),
        _number(pb_utils, "REUSED_TOKENS", answer.reused_tokens, np.int32),
        _number(pb_utils, "TTFT_MS", answer.ttft_s * 1000, np.float32),
        _number(pb_utils, "GEN_MS", answer.total_s * 1000, np.float32),
        _number(pb_utils, "SNAPSHOT_LOAD_MS", served.load_ms, np.float32),
        _text(pb_utils, "SNAPSHOT_KEY", answer.snapshot_key or ""),
        _text(pb_utils, "RELEASE_ID", served.release_id),
        _text(pb_utils, "ROUTE", answer.route),
        _text(pb_utils, "FINISH_REASON", answer.finish_reason),
        _text(pb_utils, "REQUEST_ID", served.request_id),
        pb_utils.Tensor("TOKEN_IDS", np.array([answer.token_ids], dtype=np.int32).reshape(1, -1)),
        _text(pb_utils, "ANSWER_SOURCE", served.source),
        _number(pb_utils, "ANSWERED", answer.answered, np.bool_),
        _text(pb_utils, "UNSUPPORTED", json.dumps(list(answer.unsupported))),
        _text(pb_utils, "DECLINE_REASON", answer.decline_reason or ""),
        _number(pb_utils, "RELEVANCE", -1.0 if answer.relevance is None else answer.relevance, np.float32),
        _text(pb_utils, "RULES_FIRED", json.dumps(list(answer.rules_fired))),
        _text(pb_utils, "STAGES_MS", json.dumps(answer.stages_ms)),
    ]


def reload_outputs(pb_utils, result: ReloadResult) -> list:
    return [_text(pb_utils, "RELEASE_ID", result.current), _text(pb_utils, "STATUS", result.to_json())]


def text_piece_outputs(pb_utils, piece: str) -> list:
    return [_text(pb_utils, "TEXT", piece)]


def precompute_outputs(pb_utils, results: list, seconds: float) -> list:
    import numpy as np

    keys = np.array([[r.entry.key.encode() for r in results]], dtype=np.object_)
    return [_text(pb_utils, "ENTRIES", entries_json(results)), pb_utils.Tensor("SNAPSHOT_KEYS", keys),
            _number(pb_utils, "PRECOMPUTE_MS", seconds * 1000, np.float32)]


def error_response(pb_utils, exc: BaseException, request_id: str = ""):
    status = triton_status(exc)
    if status == "INTERNAL":
        log.exception("request %s failed", request_id or "?", exc_info=exc)
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(describe(exc, request_id),
                                                                 getattr(pb_utils.TritonError, status)))


async def respond(pb_utils, serving: "Serving", requests) -> list:
    """``cag_llm``'s responses, one per request: reloads on their own, answers through ``answer_requests``."""
    received = time.perf_counter()
    responses: list = [None] * len(requests)
    questions: dict[int, AnswerRequest] = {}
    reloads = []
    for position, request in enumerate(requests):
        try:
            if read_action(pb_utils, request) == "reload":
                reloads.append(position)
            else:
                questions[position] = read_answer_request(pb_utils, request)
        except Exception as exc:
            responses[position] = error_response(pb_utils, exc, request.request_id())
    reloaded = await asyncio.gather(*(serving.reload_response(pb_utils, requests[position]) for position in reloads))
    for position, response in zip(reloads, reloaded):
        responses[position] = response
    answers = await answer_requests(serving.service, serving.pool, list(questions.values()))
    for (position, question), result in zip(questions.items(), answers):
        trace_answer(serving.settings.model_name, trace_parent(requests[position]), received, result)
        responses[position] = (error_response(pb_utils, result, question.request_id) if isinstance(result, Exception)
                               else pb_utils.InferenceResponse(output_tensors=answer_outputs(pb_utils, result)))
    return responses


# ---- metrics ----------------------------------------------------------------------------------------

class TritonMetrics(ServingListener):
    """Custom metrics on Triton's metrics port (``pb_utils.MetricFamily``).

    The service reports from request threads; the counts are buffered here and published by
    ``publish()``, which the model calls from ``execute``, the only thread allowed to talk to Triton.
    """

    def __init__(self, pb_utils, model: str, instance: str):
        labels = {"model": model, "instance": instance}
        family = pb_utils.MetricFamily
        specs = {
            "hits": ("cagflow_snapshot_hits_total", "Requests whose snapshot was already resident", family.COUNTER),
            "misses": ("cagflow_snapshot_misses_total", "Requests that had to load (or wait for) their snapshot",
                       family.COUNTER),
            "evictions": ("cagflow_snapshot_evictions_total", "Snapshots evicted from the resident set",
                          family.COUNTER),
            "store_errors": ("cagflow_store_errors_total",
                             "Snapshot loads that failed because the store did not answer", family.COUNTER),
            "states": ("cagflow_resident_states", "Snapshots resident in memory", family.GAUGE),
            "bytes": ("cagflow_resident_bytes", "Bytes of KV tensors resident in memory", family.GAUGE),
            "quarantined": ("cagflow_quarantined_snapshots", "Snapshots of the active release that failed verification",
                            family.GAUGE),
            "evicted_in_use": ("cagflow_evicted_in_use_bytes",
                               "Bytes of evicted snapshots still held by running requests (count toward the budget)",
                               family.GAUGE),
            "answer_requests": ("cagflow_answer_requests_total", "Answer requests (not reloads)", family.COUNTER),
            "answer_cache_lookups": ("cagflow_answer_cache_lookups_total",
                                     "Answer requests that looked in the answer cache", family.COUNTER),
            "answer_cache_hits": ("cagflow_answer_cache_hits_total", "Answers served from the answer cache",
                                  family.COUNTER),
            "merged": ("cagflow_merged_requests_total",
                       "Answer requests that waited for an identical request already being computed", family.COUNTER),
            "batched": ("cagflow_batched_requests_total",
                        "Requests computed in a batched pass with others on the same snapshot", family.COUNTER),
            "batches": ("cagflow_batches_total", "Batched passes (two or more requests on one snapshot)",
                        family.COUNTER),
        }
        self._families = {}
        self._metrics = {}
        for name, (metric_name, description, kind) in specs.items():
            self._families[name] = family(name=metric_name, description=description, kind=kind)
            self._metrics[name] = self._families[name].Metric(labels=labels)
        self._families["load"] = family(name="cagflow_snapshot_load_seconds",
                                        description="Time to read, verify and deserialize a snapshot",
                                        kind=family.HISTOGRAM)
        self._metrics["load"] = self._families["load"].Metric(labels=labels, buckets=LOAD_SECONDS_BUCKETS)
        self._lock = threading.Lock()
        self._increments = dict.fromkeys((name for name, spec in specs.items() if spec[2] == family.COUNTER), 0)
        self._gauges: dict[str, float] = {}
        self._load_seconds: list[float] = []

    def _add(self, name: str) -> None:
        with self._lock:
            self._increments[name] += 1

    def on_hit(self) -> None:
        self._add("hits")

    def on_miss(self) -> None:
        self._add("misses")

    def on_evict(self) -> None:
        self._add("evictions")

    def on_store_error(self) -> None:
        self._add("store_errors")

    def on_load(self, seconds: float, nbytes: int) -> None:
        with self._lock:
            self._load_seconds.append(seconds)

    def on_quarantine(self, quarantined: int) -> None:
        with self._lock:
            self._gauges["quarantined"] = quarantined

    def on_resident(self, states: int, nbytes: int) -> None:
        with self._lock:
            self._gauges["states"] = states
            self._gauges["bytes"] = nbytes

    def on_evicted_in_use(self, nbytes: int) -> None:
        with self._lock:
            self._gauges["evicted_in_use"] = nbytes

    def on_answer(self, source: str, looked_up: bool) -> None:
        with self._lock:
            self._increments["answer_requests"] += 1
            self._increments["answer_cache_lookups"] += looked_up
            self._increments["answer_cache_hits"] += source == ANSWER_CACHE
            self._increments["merged"] += source == MERGED

    def on_batch(self, size: int) -> None:
        with self._lock:
            self._increments["batched"] += size
            self._increments["batches"] += 1

    def publish(self) -> None:
        with self._lock:
            increments = {name: count for name, count in self._increments.items() if count}
            self._increments = dict.fromkeys(self._increments, 0)
            gauges, self._gauges = self._gauges, {}
            loads, self._load_seconds = self._load_seconds, []
        for name, count in increments.items():
            self._metrics[name].increment(count)
        for name, value in gauges.items():
            self._metrics[name].set(value)
        for seconds in loads:
            self._metrics["load"].observe(seconds)

    def close(self) -> None:
        """Metrics must go before their families (the Python backend's rule)."""
        self._metrics.clear()
        self._families.clear()
