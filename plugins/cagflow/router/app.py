"""The REST API: ``POST /v1/query``, ``GET /v1/releases``, ``POST /admin/reload``, ``GET /healthz``,
``GET /readyz``, ``GET /metrics`` and ``GET /openapi.json``; and for OpenAI's clients
``POST /v1/chat/completions`` and ``GET /v1/models`` (``openai_compat``); ``GET /``, a web page that asks
``POST /v1/query`` (its script and style are served from ``static/`` by Flask's static route).

Every response carries ``X-Request-ID`` (the caller's, when it is a safe token, else a fresh one) and
every error is ``{"error": {"code", "message"}, "request_id"}`` (OpenAI's shape on its endpoints): never
HTML, never a stack trace. Each request writes one JSON log line (request id, key id, route, cache hit,
snapshot key, fallback reason, timings, status); the key itself is never logged. Every ``/admin/*``
request, done or refused, also writes an audit event (``audit``). Admission (``admission``), the endpoints
(``handlers``, ``openai_compat``) and the error bodies (``errors``) each have their module; this one puts
them together.
"""

from __future__ import annotations

import logging
import sys

from flask import Flask

from .. import tracing
from ..config import Config, load_config
from . import errors
from .access import rate_limiter
from .admission import Admission, access_log
from .apikeys import ApiKeyStore
from .audit import AuditLog
from .handlers import EXTENSION, Dependencies, api
from .openai_compat import openai_api
from .routing import Router

log = logging.getLogger("cagflow.router")


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


def create_app(config: Config | None = None, *, router: Router | None = None,
               keys: ApiKeyStore | None = None) -> Flask:
    """The router application. ``router`` and ``keys`` default to the ones ``config`` describes."""
    config = config or load_config()
    service = config.service
    _configure_logging()
    tracing.setup("cagflow-router", config.tracing)
    router = router or Router.from_config(config).start()
    admission = Admission(service, keys or ApiKeyStore(service.api_keys_file), rate_limiter(service),
                          AuditLog(service.audit_log_file))

    app = Flask("cagflow.router")
    app.config["MAX_CONTENT_LENGTH"] = service.max_body_bytes
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False  # Flask's own OPTIONS reply is an empty text/html 200: a JSON 405
    app.extensions[EXTENSION] = Dependencies(router, admission, service, config.model)
    admission.install(app)
    errors.register(app)
    app.register_blueprint(api)
    app.register_blueprint(openai_api)
    return app
