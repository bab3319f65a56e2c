"""OpenTelemetry traces: one trace per request across the router, the embedder, OpenSearch and Triton's
model, and (through Airflow's own tracing) the tasks of a DAG run. README "Tracing".

Off unless ``tracing.endpoint`` names a collector's OTLP/HTTP address: the spans below are then the
OpenTelemetry API's no-op ones and cost nothing. A process that serves (the router's worker, each Triton
model) calls :func:`setup` once; Airflow's task processes install Airflow's own provider, and the spans of
the library nest under its task spans through the global API. The trace context crosses processes as a W3C
``traceparent``: an HTTP header into the router, a request parameter into Triton.

Durations measured before their span could exist (a routing step, an engine stage) become spans after the
fact with their measured start and end (:func:`record_span`), so the trace and ``timings_ms`` agree.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from .config import TracingConfig

log = logging.getLogger("cagflow.tracing")

TRACER = trace.get_tracer("cagflow")
TRACEPARENT = "traceparent"
_PROPAGATOR = TraceContextTextMapPropagator()
_installed: dict[str, Any] = {}  # the provider this process installed, and for whom
_lock = threading.Lock()

__all__ = ["TRACER", "SpanKind", "setup", "shutdown", "context_from", "context_of", "traceparent", "trace_id",
           "attach", "detach", "record_span", "perf_to_ns", "failed"]


def setup(service_name: str, settings: "TracingConfig") -> bool:
    """Send this process's spans to ``settings.endpoint`` (OTLP over HTTP, batched off the request path) as
    ``service_name``; False, and nothing installed, when tracing is off. Idempotent: a second call in the same
    process keeps the first provider (the API allows one per process)."""
    if not settings.endpoint:
        return False
    with _lock:
        if _installed:
            return True
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                                  sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)))
        exporter = OTLPSpanExporter(endpoint=settings.endpoint.rstrip("/") + "/v1/traces",
                                    timeout=settings.export_timeout_s)
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=settings.export_delay_ms))
        trace.set_tracer_provider(provider)
        _installed.update(provider=provider, service=service_name)
    log.info("tracing: %s sends spans to %s (sampled %g)", service_name, settings.endpoint, settings.sample_ratio)
    return True


def shutdown() -> None:
    """Send the spans still batched (a model's ``finalize``, a process's end)."""
    provider = _installed.get("provider")
    if provider is not None:
        provider.force_flush()


def context_from(carrier: Mapping[str, str] | str | None) -> otel_context.Context:
    """The trace context a caller sent: headers, or a bare ``traceparent`` value. A missing or malformed one
    gives an empty context, so the request starts a trace of its own."""
    if isinstance(carrier, str):
        carrier = {TRACEPARENT: carrier}
    return _PROPAGATOR.extract(carrier or {}, context=otel_context.Context())


def traceparent(span: Span | None = None) -> str | None:
    """The W3C ``traceparent`` of ``span`` (default: the current one), to send on; None when not sampled."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span) if span is not None else None)
    return carrier.get(TRACEPARENT)


def trace_id(span: Span | None = None) -> str | None:
    """The 32-hex trace id of ``span`` (default: the current one), for records and logs; None when not traced."""
    span_context = (span or trace.get_current_span()).get_span_context()
    return format(span_context.trace_id, "032x") if span_context.is_valid and span_context.trace_flags.sampled else None


def context_of(span: Span) -> otel_context.Context:
    """A context whose current span is ``span``: the parent for spans started later, elsewhere."""
    return trace.set_span_in_context(span)


def attach(span: Span) -> object:
    """Make ``span`` the current one in this thread until :func:`detach` is given the returned token."""
    return otel_context.attach(context_of(span))


def detach(token: object) -> None:
    otel_context.detach(token)


_CLOCK_ANCHOR_S = 60.0
_clock_anchor: tuple[float, int] = (float("-inf"), 0)


def _perf_to_unix_offset_ns() -> int:
    """Unix nanoseconds minus ``perf_counter`` nanoseconds, read once a minute (so the wall clock's adjustments
    are followed) and from the tightest of three readings: a fresh reading per span would let a thread switch
    between the two clocks move adjacent spans over each other."""
    global _clock_anchor
    now = time.perf_counter()
    if now - _clock_anchor[0] > _CLOCK_ANCHOR_S:
        readings = []
        for _ in range(3):
            before, wall, after = time.perf_counter(), time.time_ns(), time.perf_counter()
            readings.append((after - before, wall - int((before + after) / 2 * 1e9)))
        _clock_anchor = (now, min(readings)[1])
    return _clock_anchor[1]


def perf_to_ns(perf_seconds: float) -> int:
    """A ``time.perf_counter()`` instant of this process as Unix nanoseconds, the span clock."""
    return int(perf_seconds * 1e9) + _perf_to_unix_offset_ns()


def record_span(name: str, started: float, ended: float | None = None, parent: otel_context.Context | None = None,
                **attributes: Any) -> Span:
    """A span for a step already timed with ``time.perf_counter()``: from ``started`` to ``ended`` (default:
    now), under ``parent`` (default: the current span)."""
    span = TRACER.start_span(name, context=parent, start_time=perf_to_ns(started),
                             attributes={key: value for key, value in attributes.items() if value is not None})
    span.end(end_time=perf_to_ns(ended if ended is not None else time.perf_counter()))
    return span


def failed(span: Span, error: BaseException | str) -> None:
    """Mark ``span`` as failed, with the error's type and message."""
    message = str(error) or type(error).__name__
    if isinstance(error, BaseException):
        span.set_attribute("error.type", type(error).__name__)
    span.set_status(Status(StatusCode.ERROR, message[:500]))
