"""What the router admits: API errors as data, request ids, per-key rate limits, the concurrency cap,
and strict parsing of the query body.

Everything here is pure (no Flask, no network), so every admission rule is tested without a server.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..config import ServiceConfig
from ..core.keys import validate_doc_id
from ..errors import CagflowError

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
QUERY_FIELDS = frozenset({"question", "doc_id", "top_k", "max_new_tokens", "stream", "route"})
# "auto": the router chooses; "cache": a snapshot alone, never followed by newer passages (where the router
# would take the cache route); "retrieval": hybrid retrieval even where a snapshot could answer (to compare
# the routes, or to get passages as citations).
ROUTES = ("auto", "cache", "retrieval")
MAX_TOP_K = 50
MAX_NEW_TOKENS = 4096


class ApiError(CagflowError):
    """An error the client is told about as ``{"error": {"code", "message"}, "request_id"}``."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}


def request_id_from(header: str | None) -> str:
    """The caller's ``X-Request-ID`` when it is a safe token (it ends up in logs), else a fresh one."""
    if header and REQUEST_ID.fullmatch(header):
        return header
    return uuid.uuid4().hex


class RateLimiter:
    """One token bucket per API key: ``burst`` requests at once, refilled at ``per_s`` a second."""

    def __init__(self, per_s: float, burst: int, clock=time.monotonic):
        self.per_s = per_s
        self.burst = burst
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key id -> (tokens, last refill)
        self._lock = threading.Lock()

    def acquire(self, key_id: str) -> float:
        """Take one token; returns 0 when admitted, else the seconds until a token is available."""
        now = self._clock()
        with self._lock:
            tokens, last = self._buckets.get(key_id, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - last) * self.per_s)
            if tokens >= 1.0:
                self._buckets[key_id] = (tokens - 1.0, now)
                return 0.0
            self._buckets[key_id] = (tokens, now)
            return (1.0 - tokens) / self.per_s


class ConcurrencyGate:
    """At most ``limit`` requests in flight; one more is refused at once instead of queueing."""

    def __init__(self, limit: int):
        self.limit = limit
        self._slots = threading.BoundedSemaphore(limit)
        self._in_flight = 0
        self._lock = threading.Lock()

    def try_enter(self) -> bool:
        if not self._slots.acquire(blocking=False):
            return False
        with self._lock:
            self._in_flight += 1
        return True

    def leave(self) -> None:
        with self._lock:
            self._in_flight -= 1
        self._slots.release()

    @property
    def in_flight(self) -> int:
        return self._in_flight


@dataclass(frozen=True)
class Query:
    question: str
    doc_id: str | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None
    stream: bool = False
    route: str = "auto"


def _invalid(message: str) -> ApiError:
    return ApiError(400, "invalid_request", message)


def _optional_int(body: dict[str, Any], name: str, upper: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):  # bool is an int subclass in Python
        raise _invalid(f"{name} must be an integer or null, got {type(value).__name__}")
    if not 1 <= value <= upper:
        raise _invalid(f"{name} must be between 1 and {upper}, got {value}")
    return value


def _clean_text(value: str, name: str) -> str:
    """Reject text that cannot be a question: lone surrogates (not encodable) and control characters."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _invalid(f"{name} contains invalid unicode (a lone surrogate)") from None
    if any(ord(char) < 32 and char not in "\t\n\r" or ord(char) == 127 for char in value):
        raise _invalid(f"{name} contains control characters")
    return value


def parse_query(body: Any, limits: ServiceConfig) -> Query:
    """Validate a ``POST /v1/query`` body strictly: unknown fields and wrong types are errors, not ignored."""
    if not isinstance(body, dict):
        raise _invalid(f"the body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - QUERY_FIELDS)
    if unknown:
        raise _invalid(f"unknown fields: {', '.join(unknown)} (allowed: {', '.join(sorted(QUERY_FIELDS))})")
    question = body.get("question")
    if not isinstance(question, str):
        raise _invalid("question is required and must be a string")
    question = _clean_text(question, "question").strip()
    if not any(char.isalnum() for char in question):  # empty, or only spaces, punctuation, invisible marks
        raise _invalid("question is empty (it has no letters or digits)")
    if len(question) > limits.max_question_chars:
        raise _invalid(f"question has {len(question)} characters, more than the limit of {limits.max_question_chars}")
    doc_id = body.get("doc_id")
    if doc_id is not None:
        try:
            validate_doc_id(doc_id)
        except ValueError as exc:
            raise _invalid(str(exc)) from None
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _invalid(f"stream must be true or false, got {type(stream).__name__}")
    route = body.get("route", "auto")
    if route not in ROUTES:
        raise _invalid(f"route must be one of {', '.join(ROUTES)}, got {route!r}")
    return Query(question=question, doc_id=doc_id, top_k=_optional_int(body, "top_k", MAX_TOP_K),
                 max_new_tokens=_optional_int(body, "max_new_tokens", MAX_NEW_TOKENS), stream=stream, route=route)


def parse_reload(body: Any) -> str | None:
    """``POST /admin/reload``: an empty body, or ``{"release_id": "..."}`` to activate that release first."""
    if body is None or body == {}:
        return None
    if not isinstance(body, dict) or set(body) - {"release_id"}:
        raise _invalid('the body must be empty or {"release_id": "..."}')
    release_id = body.get("release_id")
    if release_id is None:
        return None
    if not isinstance(release_id, str) or not REQUEST_ID.fullmatch(release_id):
        raise _invalid("release_id must be a release id such as 20261202T101500Z-1a2b3c4d")
    return release_id
