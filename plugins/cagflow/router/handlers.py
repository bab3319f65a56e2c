"""The endpoints, as a Blueprint; what they use (``Dependencies``) is in ``app.extensions[EXTENSION]``, put
there by ``create_app``, so a test can hand them a stand-in router and close the real one. ``answer`` is the
one way a question is answered, shared with the OpenAI-compatible endpoints (``openai_compat``), which only
read their request and write their response differently."""

from __future__ import annotations

import functools
import itertools
import json
import logging
from dataclasses import dataclass
from importlib import resources
from typing import Any, Callable, Iterable, Iterator, Protocol

import yaml
from flask import Blueprint, Response, current_app, g, request, stream_with_context
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..config import ModelConfig, ServiceConfig
from . import metrics
from .access import ApiError, Query, parse_query, parse_reload
from .admission import Admission, finish
from .errors import INTERNAL_MESSAGE, error_payload, json_response
from .failures import triton_failure
from .routing import Router
from .triton_client import TritonRejected, TritonUnavailable

log = logging.getLogger("cagflow.router")
api = Blueprint("api", __name__)
EXTENSION = "cagflow_router"


@dataclass(frozen=True)
class Dependencies:
    router: Router  # or a stand-in with its answer, stream, readiness, releases and reload
    admission: Admission
    service: ServiceConfig
    model: ModelConfig  # what the OpenAI-compatible endpoints name as their model


def dependencies() -> Dependencies:
    return current_app.extensions[EXTENSION]


def read_json(optional: bool = False) -> Any:
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


@api.get("/healthz")
def healthz() -> Response:
    return json_response({"status": "alive"})


@api.get("/readyz")
def readyz() -> Response:
    deps = dependencies()
    limits = deps.admission.limiter.readiness()
    report = {**deps.router.readiness(), "rate_limit": limits}
    if "error" in limits:  # a shared store configured but failing: limits hold per router, not in all
        report["degraded"] = True
        report["reasons"] = [*report["reasons"], f"rate limit store {limits['store']} failing: each router "
                             "limits keys on its own (a key may get the limit once per router)"]
        metrics.DEGRADED.set(1)
    return json_response(report, 200 if report["ready"] else 503)


@functools.cache
def openapi_document() -> dict[str, Any]:
    """The API's description, kept next to the code as ``openapi.yaml``."""
    return yaml.safe_load((resources.files(__package__) / "openapi.yaml").read_text(encoding="utf-8"))


# The page's script and style are files of their own (static/, Flask's static route), so nothing inline runs.
PAGE_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; base-uri 'none'; "
               "form-action 'none'; frame-ancestors 'none'")


@functools.cache
def page_html() -> str:
    return (resources.files(__package__) / "static" / "index.html").read_text(encoding="utf-8")


@api.get("/")
def page() -> Response:
    """The web page that asks questions (README "Web page"); public, as it holds no data until a key is typed."""
    return Response(page_html(), mimetype="text/html", headers={
        "Content-Security-Policy": PAGE_POLICY, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"})


@api.get("/openapi.json")
def openapi() -> Response:
    return json_response(openapi_document())


@api.get("/metrics")
def prometheus() -> Response:
    return Response(generate_latest(), mimetype=CONTENT_TYPE_LATEST)


@api.get("/v1/releases")
def releases() -> Response:
    deps = dependencies()
    deps.admission.authenticate()
    return json_response(deps.router.releases())


@api.post("/admin/reload")
def reload() -> Response:
    deps = dependencies()
    deps.admission.authenticate(admin=True)
    release_id = parse_reload(read_json(optional=True))
    g.audit_target = release_id or "current"
    deps.admission.enter_gate()
    try:
        result = deps.router.reload(release_id)
    finally:
        deps.admission.leave_gate()
    g.audit_detail = {"release_id": result["release_id"]}
    return json_response({**result, "request_id": g.request_id})


@api.post("/v1/query")
def query() -> Response:
    deps = dependencies()
    deps.admission.authenticate()
    return answer(parse_query(read_json(), deps.service), json_response, QueryEvents())


class EventFormat(Protocol):
    """How the router's ``(event, data)`` stream is written as server-sent events."""

    def frames(self, event: str, data: dict[str, Any]) -> Iterable[str]: ...

    def error(self, body: dict[str, Any]) -> str: ...

    def end(self) -> Iterable[str]: ...


class QueryEvents:
    """``/v1/query``'s own events: ``token`` events, then ``answer`` with the answer body, or ``error``."""

    def frames(self, event: str, data: dict[str, Any]) -> Iterable[str]:
        return [f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"]

    def error(self, body: dict[str, Any]) -> str:
        return f"event: error\ndata: {json.dumps(body)}\n\n"

    def end(self) -> Iterable[str]:
        return []


def answer(parsed: Query, reply: Callable[[dict[str, Any]], Response], events: EventFormat) -> Response:
    """Answer an admitted question under the concurrency cap: ``reply`` renders the answer body, ``events``
    writes the stream when ``parsed.stream``."""
    deps = dependencies()
    deps.admission.enter_gate()
    streaming = False
    try:
        if not parsed.stream:
            g.outcome = deps.router.answer(parsed, g.request_id)
            return reply(g.outcome)
        stream = deps.router.stream(parsed, g.request_id)
        first = next(stream)  # routing and the stream's start: errors here are plain JSON errors
        streaming = g.streaming = True
        response = Response(stream_with_context(_server_sent(first, stream, events)), mimetype="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        response.call_on_close(deps.admission.leave_gate)  # also when the client goes away mid-answer
        return response
    finally:
        if not streaming:
            deps.admission.leave_gate()


def _server_sent(first: tuple[str, dict], stream: Iterator[tuple[str, dict]], events: EventFormat) -> Iterator[str]:
    """SSE frames; the access-log line is written when the stream ends."""
    outcome: dict[str, Any] = {}
    error_code = None
    try:
        for event, data in itertools.chain([first], stream):
            if event == "answer":
                outcome = data
            yield from events.frames(event, data)
        yield from events.end()
    except (ApiError, TritonUnavailable, TritonRejected) as exc:
        error = exc if isinstance(exc, ApiError) else triton_failure(exc)
        error_code = error.code
        yield events.error(error_payload(error.code, error.message, error.status, error.param))
    except Exception:
        log.exception("stream %s failed", g.request_id)
        error_code = "internal"
        yield events.error(error_payload("internal", INTERNAL_MESSAGE, 500))
    finally:
        finish(200, outcome, error_code)
