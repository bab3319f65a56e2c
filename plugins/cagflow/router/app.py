"""The REST API: ``POST /v1/query``, ``GET /v1/releases``, ``POST /admin/reload``, ``GET /healthz``,
``GET /readyz`` and ``GET /metrics``.

Every response carries ``X-Request-ID`` (the caller's, when it is a safe token, else a fresh one) and
every error is ``{"error": {"code", "message"}, "request_id"}``: never HTML, never a stack trace. Each
request writes one JSON log line (request id, key id, route, cache hit, snapshot key, fallback reason,
timings, status); the key itself is never logged. Every ``/admin/*`` request, done or refused, also writes
an audit event (``audit``).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import sys
import time
from typing import Any, Iterator

from flask import Flask, Response, g, request, stream_with_context
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from werkzeug.exceptions import HTTPException

from ..config import Config, load_config
from . import metrics
from .access import ApiError, ConcurrencyGate, parse_query, parse_reload, rate_limiter, request_id_from
from .apikeys import ApiKey, ApiKeyError, ApiKeyStore
from .audit import AuditLog
from .routing import Router, triton_failure
from .triton_client import TritonRejected, TritonUnavailable

access_log = logging.getLogger("cagflow.router.access")
log = logging.getLogger("cagflow.router")

# Werkzeug's HTTP errors under the codes clients see.
_HTTP_CODES = {400: "invalid_request", 401: "unauthenticated", 404: "not_found", 405: "method_not_allowed",
               411: "length_required", 413: "body_too_large", 415: "unsupported_media_type"}


def error_body(code: str, message: str, request_id: str | None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}, "request_id": request_id}


def _json(body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """UTF-8 JSON; a lone surrogate (a request's own text echoed in an error, such as an unknown field's
    name) is written as its JSON escape, since UTF-8 cannot encode it."""
    data = json.dumps(body, ensure_ascii=False).encode("utf-8", "backslashreplace")
    return Response(data, status=status, headers=headers, mimetype="application/json")


def _to_stderr(logger: logging.Logger, line_format: str) -> None:
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(line_format))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _configure_logging() -> None:
    """One JSON object per line on stderr for the access log; plain lines for everything else."""
    _to_stderr(access_log, "%(message)s")
    _to_stderr(log, "%(asctime)s %(name)s %(levelname)s %(message)s")


def _read_json(optional: bool = False) -> Any:
    """The request body as JSON; an empty body is None when ``optional``. Size is capped by Flask's
    ``MAX_CONTENT_LENGTH`` (413) before anything is parsed."""
    data = request.get_data(cache=False)
    if optional and not data:
        return None
    if not request.is_json:
        raise ApiError(415, "unsupported_media_type",
                       f"send the body as Content-Type: application/json, not {request.mimetype or 'nothing'}")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ApiError(400, "invalid_json", f"the body is not valid JSON: {str(exc)[:200]}") from None


def create_app(config: Config | None = None, *, router: Router | None = None,
               keys: ApiKeyStore | None = None) -> Flask:
    """The router application. ``router`` and ``keys`` default to the ones ``config`` describes."""
    config = config or load_config()
    service = config.service
    _configure_logging()
    router = router or Router.from_config(config).start()
    keys = keys or ApiKeyStore(service.api_keys_file)
    limiter = rate_limiter(service)
    gate = ConcurrencyGate(service.max_concurrent_requests)
    audit = AuditLog(service.audit_log_file)

    app = Flask("cagflow.router")
    app.config["MAX_CONTENT_LENGTH"] = service.max_body_bytes
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False  # Flask's own OPTIONS reply is an empty text/html 200: a JSON 405
    app.extensions["cagflow_router"] = router

    def authenticate(admin: bool = False) -> ApiKey:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "unauthenticated", "send an API key as 'Authorization: Bearer <key>'",
                           {"WWW-Authenticate": 'Bearer realm="cagflow"'})
        try:
            key = keys.identify(token.strip())
        except ApiKeyError as exc:  # a corrupt or unreadable keys file: nobody can be let in, say why
            log.error("API keys unavailable: %s", exc)
            raise ApiError(503, "auth_unavailable", "API keys cannot be checked right now") from None
        if key is None:
            raise ApiError(401, "invalid_api_key", "the API key is not valid",
                           {"WWW-Authenticate": 'Bearer realm="cagflow", error="invalid_token"'})
        g.key_id, g.key_name = key.key_id, key.name
        if keys.expired(key):
            raise ApiError(401, "key_expired", f"the API key expired at {key.expires}; use the key that replaced it",
                           {"WWW-Authenticate": 'Bearer realm="cagflow", error="invalid_token"'})
        if admin and not key.admin:
            raise ApiError(403, "forbidden", "this endpoint needs an admin key")
        wait_s = limiter.acquire(key.key_id)
        if wait_s > 0:
            raise ApiError(429, "rate_limited",
                           f"more than {service.rate_limit_per_s:g} requests/s (burst {service.rate_limit_burst}) "
                           "for this key", {"Retry-After": str(max(1, math.ceil(wait_s)))})
        return key

    def enter_gate() -> None:
        if not gate.try_enter():
            raise ApiError(503, "overloaded", f"{service.max_concurrent_requests} requests already in flight; "
                           "retry shortly", {"Retry-After": "1"})
        metrics.IN_FLIGHT.set(gate.in_flight)

    def leave_gate() -> None:
        gate.leave()
        metrics.IN_FLIGHT.set(gate.in_flight)

    def endpoint_label() -> str:
        return request.url_rule.rule if request.url_rule is not None else "unmatched"

    def audit_admin(status: int) -> None:
        """One audit event per /admin/* request: refusals (no key, a bad or expired key, a user key) too."""
        result = "ok" if status < 400 else "denied" if status in (401, 403) else "error"
        matched = request.url_rule is not None
        action = f"admin.{request.endpoint}" if matched else f"{request.method} {request.path[:200]}"
        audit.record(action, result, via="rest", target=g.get("audit_target"), reason=g.error_code,
                     key_id=g.get("key_id"), key_name=g.get("key_name"), remote_addr=request.remote_addr,
                     request_id=g.request_id, detail=g.get("audit_detail"))

    def finish(status: int, outcome: dict[str, Any], error_code: str | None = None) -> None:
        """Count the request and write its access-log line."""
        elapsed_s = time.perf_counter() - g.started
        endpoint = endpoint_label()
        metrics.REQUESTS.labels(endpoint, str(status)).inc()
        metrics.REQUEST_SECONDS.labels(endpoint).observe(elapsed_s)
        if error_code:
            metrics.ERRORS.labels(error_code).inc()
        snapshot = outcome.get("snapshot") or {}
        line = {"ts": round(time.time(), 3), "request_id": g.request_id, "key_id": g.get("key_id"),
                "method": request.method, "endpoint": endpoint, "status": status,
                "route": outcome.get("route"), "cache_hit": outcome.get("cache_hit"),
                "answered": outcome.get("answered"), "decline_reason": outcome.get("decline_reason"),
                "snapshot_key": snapshot.get("key"), "fallback_reason": outcome.get("fallback_reason"),
                "error_code": error_code, "latency_ms": round(elapsed_s * 1000, 2),
                "timings_ms": outcome.get("timings_ms")}
        access_log.info(json.dumps(line, ensure_ascii=False))

    @app.before_request
    def start_request() -> None:
        g.started = time.perf_counter()
        g.request_id = request_id_from(request.headers.get("X-Request-ID"))
        g.outcome = {}
        g.error_code = None
        g.streaming = False

    @app.after_request
    def end_request(response: Response) -> Response:
        response.headers["X-Request-ID"] = g.request_id
        if request.path.startswith("/admin/"):
            audit_admin(response.status_code)
        if not g.streaming:
            finish(response.status_code, g.outcome, g.error_code)
        return response

    @app.errorhandler(ApiError)
    def api_error(error: ApiError) -> Response:
        g.error_code = error.code
        return _json(error_body(error.code, error.message, g.get("request_id")), error.status, error.headers)

    @app.errorhandler(HTTPException)
    def http_error(error: HTTPException) -> Response:
        status = error.code or 500
        code = _HTTP_CODES.get(status, (error.name or "error").lower().replace(" ", "_"))
        valid_methods = getattr(error, "valid_methods", None)  # set on 405 Method Not Allowed
        headers = {"Allow": ", ".join(valid_methods)} if valid_methods else {}
        if status == 413:
            message = f"the body is larger than {service.max_body_bytes} bytes"
        elif status == 404:
            message = f"no endpoint {request.path}"
        else:
            message = error.description or error.name
        g.error_code = code
        return _json(error_body(code, message, g.get("request_id")), status, headers)

    @app.errorhandler(Exception)
    def unexpected_error(error: Exception) -> Response:
        log.exception("request %s failed", g.get("request_id"))
        g.error_code = "internal"
        return _json(error_body("internal", "internal error; the request id is in the server log",
                                g.get("request_id")), 500)

    @app.get("/healthz")
    def healthz() -> Response:
        return _json({"status": "alive"})

    @app.get("/readyz")
    def readyz() -> Response:
        limits = limiter.readiness()
        report = {**router.readiness(), "rate_limit": limits}
        if "error" in limits:  # a shared store configured but failing: limits hold per router, not in all
            report["degraded"] = True
            report["reasons"] = [*report["reasons"], f"rate limit store {limits['store']} failing: each router "
                                 "limits keys on its own (a key may get the limit once per router)"]
            metrics.DEGRADED.set(1)
        return _json(report, 200 if report["ready"] else 503)

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(generate_latest(), mimetype=CONTENT_TYPE_LATEST)

    @app.get("/v1/releases")
    def releases() -> Response:
        authenticate()
        return _json(router.releases())

    @app.post("/admin/reload")
    def reload() -> Response:
        authenticate(admin=True)
        release_id = parse_reload(_read_json(optional=True))
        g.audit_target = release_id or "current"
        enter_gate()
        try:
            result = router.reload(release_id)
        finally:
            leave_gate()
        g.audit_detail = {"release_id": result["release_id"]}
        return _json({**result, "request_id": g.request_id})

    @app.post("/v1/query")
    def query() -> Response:
        authenticate()
        parsed = parse_query(_read_json(), service)
        enter_gate()
        streaming = False
        try:
            if not parsed.stream:
                g.outcome = router.answer(parsed, g.request_id)
                return _json(g.outcome)
            events = router.stream(parsed, g.request_id)
            first = next(events)  # routing and the stream's start: errors here are plain JSON errors
            streaming = g.streaming = True
            response = Response(stream_with_context(server_sent(first, events)), mimetype="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            response.call_on_close(leave_gate)  # also when the client goes away mid-answer
            return response
        finally:
            if not streaming:
                leave_gate()

    def server_sent(first: tuple[str, dict], events: Iterator[tuple[str, dict]]) -> Iterator[str]:
        """SSE frames; the access-log line is written when the stream ends."""
        outcome: dict[str, Any] = {}
        error_code = None
        try:
            for event, data in itertools.chain([first], events):
                if event == "answer":
                    outcome = data
                yield f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
        except (ApiError, TritonUnavailable, TritonRejected) as exc:
            error = exc if isinstance(exc, ApiError) else triton_failure(exc)
            error_code = error.code
            yield f"event: error\ndata: {json.dumps(error_body(error.code, error.message, g.request_id))}\n\n"
        except Exception:
            log.exception("stream %s failed", g.request_id)
            error_code = "internal"
            body = error_body("internal", "internal error; the request id is in the server log", g.request_id)
            yield f"event: error\ndata: {json.dumps(body)}\n\n"
        finally:
            finish(200, outcome, error_code)

    return app

