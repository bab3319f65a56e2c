"""Every error as ``{"error": {"code", "message"}, "request_id"}`` in UTF-8 JSON: never HTML, never a stack
trace, whatever failed (the router's own ``ApiError``, Werkzeug's HTTP errors, or a bug).

The OpenAI-compatible endpoints (``openai_compat``) answer in OpenAI's shape instead,
``{"error": {"message", "type", "param", "code"}}`` with our code as ``code``, since OpenAI's clients read
that; their paths are ``OPENAI_PATHS``, so a wrong method or an unknown model there is answered that way too."""

from __future__ import annotations

import json
import logging
from typing import Any

from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException

from .access import ApiError

log = logging.getLogger("cagflow.router")

OPENAI_PATHS = ("/v1/chat/completions", "/v1/models")  # and what lies under them
# OpenAI's error types by status; any other 4xx is an invalid request, any 5xx a server error.
_OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
INTERNAL_MESSAGE = "internal error; the request id is in the server log"
# Werkzeug's HTTP errors under the codes clients see.
_HTTP_CODES = {400: "invalid_request", 401: "unauthenticated", 404: "not_found", 405: "method_not_allowed",
               411: "length_required", 413: "body_too_large", 415: "unsupported_media_type"}


def error_body(code: str, message: str, request_id: str | None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}, "request_id": request_id}


def openai_error_body(code: str, message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape; the request id travels in the ``X-Request-ID`` header (the openai package reads it)."""
    kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _is_openai_path(path: str) -> bool:
    return any(path == prefix or path.startswith(prefix + "/") for prefix in OPENAI_PATHS)


def error_payload(code: str, message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """The body of an error of this request, in the shape its endpoint speaks."""
    if _is_openai_path(request.path):
        return openai_error_body(code, message, status, param)
    return error_body(code, message, g.get("request_id"))


def json_response(body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """UTF-8 JSON; a lone surrogate (a request's own text echoed in an error, such as an unknown field's
    name) is written as its JSON escape, since UTF-8 cannot encode it."""
    data = json.dumps(body, ensure_ascii=False).encode("utf-8", "backslashreplace")
    return Response(data, status=status, headers=headers, mimetype="application/json")


def api_error(error: ApiError) -> Response:
    g.error_code = error.code
    return json_response(error_payload(error.code, error.message, error.status, error.param), error.status,
                         error.headers)


def http_error(error: HTTPException) -> Response:
    status = error.code or 500
    code = _HTTP_CODES.get(status, (error.name or "error").lower().replace(" ", "_"))
    valid_methods = getattr(error, "valid_methods", None)  # set on 405 Method Not Allowed
    headers = {"Allow": ", ".join(valid_methods)} if valid_methods else {}
    if status == 413:
        message = f"the body is larger than {request.max_content_length} bytes"
    elif status == 404:
        message = f"no endpoint {request.path}"
    else:
        message = error.description or error.name
    g.error_code = code
    return json_response(error_payload(code, message, status), status, headers)


def unexpected_error(error: Exception) -> Response:
    log.exception("request %s failed", g.get("request_id"))
    g.error_code = "internal"
    return json_response(error_payload("internal", INTERNAL_MESSAGE, 500), 500)


def register(app: Flask) -> None:
    app.register_error_handler(ApiError, api_error)
    app.register_error_handler(HTTPException, http_error)
    app.register_error_handler(Exception, unexpected_error)
