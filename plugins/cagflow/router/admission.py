"""Admitting requests under Flask: the API key (``Authorization: Bearer``), its rate limit, the concurrency
cap (``access`` holds the rules), and the per-request bookkeeping: ``X-Request-ID`` on every response, one
JSON access-log line and the request metrics per request, one audit event per ``/admin/*`` request."""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Any

from flask import Flask, Response, g, request

from .. import tracing
from ..config import ServiceConfig
from . import metrics
from .access import ApiError, ConcurrencyGate, RateLimiter, RedisRateLimiter, request_id_from
from .apikeys import ApiKey, ApiKeyError, ApiKeyStore
from .audit import AuditLog

access_log = logging.getLogger("cagflow.router.access")
log = logging.getLogger("cagflow.router")

_INVALID_TOKEN = {"WWW-Authenticate": 'Bearer realm="cagflow", error="invalid_token"'}


def _endpoint_label() -> str:
    return request.url_rule.rule if request.url_rule is not None else "unmatched"


def finish(status: int, outcome: dict[str, Any], error_code: str | None = None) -> None:
    """Count the request, end its span and write its access-log line (for a stream: when the stream ends).
    README "Logs" lists the line's fields."""
    elapsed_s = time.perf_counter() - g.started
    endpoint = _endpoint_label()
    metrics.REQUESTS.labels(endpoint, str(status)).inc()
    metrics.REQUEST_SECONDS.labels(endpoint).observe(elapsed_s)
    if error_code:
        metrics.ERRORS.labels(error_code).inc()
    snapshot = outcome.get("snapshot") or {}
    line = {"ts": round(time.time(), 3), "request_id": g.request_id, "trace_id": g.trace_id,
            "key_id": g.get("key_id"), "key_name": g.get("key_name"),
            "method": request.method, "endpoint": endpoint, "status": status,
            "route": outcome.get("route"), "cache_hit": outcome.get("cache_hit"),
            "answered": outcome.get("answered"), "decline_reason": outcome.get("decline_reason"),
            "snapshot_key": snapshot.get("key"), "fallback_reason": outcome.get("fallback_reason"),
            "error_code": error_code, "latency_ms": round(elapsed_s * 1000, 2),
            "timings_ms": outcome.get("timings_ms")}
    _end_span(status, line)
    access_log.info(json.dumps(line, ensure_ascii=False))


def _start_span() -> None:
    """The request's server span, child of the caller's ``traceparent`` when it sent one, current for
    everything the request does in this thread (a stream's events included) until ``finish``."""
    endpoint = _endpoint_label()
    g.span = tracing.TRACER.start_span(f"{request.method} {endpoint}", kind=tracing.SpanKind.SERVER,
                                       context=tracing.context_from(request.headers),
                                       attributes={"http.request.method": request.method, "http.route": endpoint,
                                                   "cagflow.request_id": g.request_id})
    g.span_token = tracing.attach(g.span)
    g.trace_id = tracing.trace_id(g.span)


def _end_span(status: int, line: dict[str, Any]) -> None:
    span = g.pop("span", None)
    if span is None:
        return
    span.set_attribute("http.response.status_code", status)
    for field in ("key_name", "route", "cache_hit", "answered", "decline_reason", "fallback_reason", "error_code"):
        if line[field] is not None:
            span.set_attribute(f"cagflow.{field}", line[field])
    if status >= 500:
        tracing.failed(span, line["error_code"] or f"HTTP {status}")
    span.end()
    tracing.detach(g.pop("span_token"))


class Admission:
    """Who may ask, how often and how many at once; one per application."""

    def __init__(self, service: ServiceConfig, keys: ApiKeyStore, limiter: RateLimiter | RedisRateLimiter,
                 audit: AuditLog):
        self.service = service
        self.keys = keys
        self.limiter = limiter
        self.audit = audit
        self.gate = ConcurrencyGate(service.max_concurrent_requests)

    def install(self, app: Flask) -> None:
        app.before_request(self.start_request)
        app.after_request(self.end_request)

    def start_request(self) -> None:
        g.started = time.perf_counter()
        g.request_id = request_id_from(request.headers.get("X-Request-ID"))
        g.outcome = {}
        g.error_code = None
        g.streaming = False
        _start_span()

    def end_request(self, response: Response) -> Response:
        response.headers["X-Request-ID"] = g.request_id
        if request.path.startswith("/admin/"):
            self._audit_admin(response.status_code)
        if not g.streaming:
            finish(response.status_code, g.outcome, g.error_code)
        return response

    def _audit_admin(self, status: int) -> None:
        """One audit event per /admin/* request: refusals (no key, a bad or expired key, a user key) too."""
        result = "ok" if status < 400 else "denied" if status in (401, 403) else "error"
        if request.url_rule is not None:
            action = f"admin.{request.endpoint.rpartition('.')[2]}"  # the view's name, without its blueprint's
        else:
            action = f"{request.method} {request.path[:200]}"
        self.audit.record(action, result, via="rest", target=g.get("audit_target"), reason=g.error_code,
                          key_id=g.get("key_id"), key_name=g.get("key_name"), remote_addr=request.remote_addr,
                          request_id=g.request_id, trace_id=g.trace_id, detail=g.get("audit_detail"))

    def authenticate(self, admin: bool = False) -> ApiKey:
        """The request's key, once it is valid, unexpired, allowed here and within its rate limit."""
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "unauthenticated", "send an API key as 'Authorization: Bearer <key>'",
                           {"WWW-Authenticate": 'Bearer realm="cagflow"'})
        try:
            key = self.keys.identify(token.strip())
        except ApiKeyError as exc:  # a corrupt or unreadable keys file: nobody can be let in, say why
            log.error("API keys unavailable: %s", exc)
            raise ApiError(503, "auth_unavailable", "API keys cannot be checked right now") from None
        if key is None:
            raise ApiError(401, "invalid_api_key", "the API key is not valid", _INVALID_TOKEN)
        g.key_id, g.key_name = key.key_id, key.name
        if self.keys.expired(key):
            raise ApiError(401, "key_expired", f"the API key expired at {key.expires}; use the key that replaced it",
                           _INVALID_TOKEN)
        if admin and not key.admin:
            raise ApiError(403, "forbidden", "this endpoint needs an admin key")
        wait_s = self.limiter.acquire(key.key_id)
        if wait_s > 0:
            raise ApiError(429, "rate_limited",
                           f"more than {self.service.rate_limit_per_s:g} requests/s "
                           f"(burst {self.service.rate_limit_burst}) for this key",
                           {"Retry-After": str(max(1, math.ceil(wait_s)))})
        return key

    def enter_gate(self) -> None:
        if not self.gate.try_enter():
            raise ApiError(503, "overloaded", f"{self.service.max_concurrent_requests} requests already in flight; "
                           "retry shortly", {"Retry-After": "1"})
        metrics.IN_FLIGHT.set(self.gate.in_flight)

    def leave_gate(self) -> None:
        self.gate.leave()
        metrics.IN_FLIGHT.set(self.gate.in_flight)
