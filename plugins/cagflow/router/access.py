"""What the router admits: API errors as data, request ids, per-key rate limits, the concurrency cap,
and strict parsing of the query body.

Everything here but ``RedisRateLimiter`` is pure (no Flask, no network), so every admission rule is tested
without a server.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..config import ServiceConfig, redact_url
from ..documents.keys import validate_doc_id
from ..errors import CagflowError
from . import metrics

log = logging.getLogger("cagflow.router")

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
QUERY_FIELDS = frozenset({"question", "doc_id", "top_k", "max_new_tokens", "stream", "route"})
# "auto": the router chooses; "cache": a snapshot alone, never followed by newer passages (where the router
# would take the cache route); "retrieval": hybrid retrieval even where a snapshot could answer (to compare
# the routes, or to get passages as citations).
ROUTES = ("auto", "cache", "retrieval")
MAX_TOP_K = 50
MAX_NEW_TOKENS = 4096


class ApiError(CagflowError):
    """An error the client is told about as ``{"error": {"code", "message"}, "request_id"}``; ``param`` names
    the request field it is about, for the OpenAI-shaped errors of ``openai_compat`` (which map our fields to
    theirs)."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}
        self.param = param


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

    def readiness(self) -> dict[str, Any]:
        return {"store": "memory", "shared": False}


# KEYS[1]: the key's bucket; ARGV: per_s, burst, expiry in ms. The same arithmetic as RateLimiter.acquire, on
# the Redis server's clock. Numbers are stored and returned as text: Lua's own number formatting keeps 14
# digits (not the microseconds of a Unix time), and a Lua number reply would be truncated to an integer.
_TOKEN_BUCKET = """
local per_s, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local server_time = redis.call('TIME')
local now = tonumber(server_time[1]) + tonumber(server_time[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(state[1]) or burst
local last = tonumber(state[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - last) * per_s)
local wait = 0
if tokens >= 1 then tokens = tokens - 1 else wait = (1 - tokens) / per_s end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.9f', tokens), 'at', string.format('%.6f', now))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return string.format('%.6f', wait)
"""
KEY_PREFIX = "cagflow:ratelimit:"
READINESS_KEY = "readiness-probe"  # not hex, so never an API key's id
STORE_TIMEOUT_S = 0.25  # connect and reply: a slow store costs a request this much at most
STORE_RETRY_S = 1.0  # after a failed call, requests skip the store this long rather than each wait for it
EXPIRY_MARGIN_MS = 1000


class RedisRateLimiter:
    """``RateLimiter``'s token buckets kept in Redis, so that all routers behind a proxy draw on one bucket
    per key. One Lua script refills and takes a token atomically, on the Redis server's clock (the routers'
    clocks never enter); a bucket expires once it would be full again, so idle keys leave nothing behind.

    Redis unreachable or failing: the request is limited by this router's own in-memory bucket (fail open, so
    a store outage never turns into refused requests; N routers then admit up to N times a key's rate). Each
    failed call counts in ``cagflow_router_rate_limit_store_errors_total``, an outage logs one warning (and
    one line when it ends), /readyz reports it as degraded, and Redis is tried again ``retry_s`` later."""

    def __init__(self, url: str, per_s: float, burst: int, *, timeout_s: float = STORE_TIMEOUT_S,
                 retry_s: float = STORE_RETRY_S, clock=time.monotonic):
        self.per_s = per_s
        self.burst = burst
        self.store = redact_url(url)
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           retry=Retry(NoBackoff(), 0))
        self._bucket = self._redis.register_script(_TOKEN_BUCKET)  # EVALSHA, loaded again after a Redis restart
        self._expiry_ms = math.ceil(burst / per_s * 1000) + EXPIRY_MARGIN_MS
        self._fallback = RateLimiter(per_s, burst, clock)
        self._clock = clock
        self._retry_s = retry_s
        self._outage: tuple[float, str] | None = None  # (when to try Redis again, its last error) while down
        self._lock = threading.Lock()

    def acquire(self, key_id: str) -> float:
        """Take one token; returns 0 when admitted, else the seconds until a token is available."""
        outage = self._outage
        wait_s = None if outage is not None and self._clock() < outage[0] else self._take(key_id)
        return self._fallback.acquire(key_id) if wait_s is None else wait_s

    def _take(self, key_id: str) -> float | None:
        """A token from the key's shared bucket: the seconds to wait (0: admitted), or None when Redis failed."""
        try:
            wait_s = float(self._bucket(keys=[KEY_PREFIX + key_id], args=[self.per_s, self.burst, self._expiry_ms]))
        except redis.RedisError as exc:
            metrics.RATE_LIMIT_STORE_ERRORS.inc()
            error = str(exc) or type(exc).__name__
            with self._lock:
                began, self._outage = self._outage is None, (self._clock() + self._retry_s, error)
            if began:
                log.warning("rate limit store %s failed (%s): each router limits keys on its own until it is back",
                            self.store, error)
            return None
        if self._outage is not None:
            with self._lock:
                ended, self._outage = self._outage is not None, None
            if ended:
                log.info("rate limit store %s is back: rate limits are shared again", self.store)
        return wait_s

    def readiness(self) -> dict[str, Any]:
        """The store as /readyz reports it, probed with the script itself (a Redis that answers PING but
        refuses writes is no store); ``error`` while requests are limited per router."""
        shared = self._take(READINESS_KEY) is not None
        outage = self._outage
        return {"store": self.store, "shared": shared, **({"error": outage[1]} if outage and not shared else {})}


def rate_limiter(service: ServiceConfig, environ: dict[str, str] | None = None) -> RateLimiter | RedisRateLimiter:
    """The limiter ``service`` asks for: shared through Redis when a store is configured, else in memory."""
    url = service.rate_limit_store(environ)
    if url:
        return RedisRateLimiter(url, service.rate_limit_per_s, service.rate_limit_burst)
    return RateLimiter(service.rate_limit_per_s, service.rate_limit_burst)


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


def _invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, "invalid_request", message, param=param)


def _optional_int(body: dict[str, Any], name: str, upper: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):  # bool is an int subclass in Python
        raise _invalid(f"{name} must be an integer or null, got {type(value).__name__}", name)
    if not 1 <= value <= upper:
        raise _invalid(f"{name} must be between 1 and {upper}, got {value}", name)
    return value


def _clean_text(value: str, name: str) -> str:
    """Reject text that cannot be a question: lone surrogates (not encodable) and control characters."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _invalid(f"{name} contains invalid unicode (a lone surrogate)", name) from None
    if any(ord(char) < 32 and char not in "\t\n\r" or ord(char) == 127 for char in value):
        raise _invalid(f"{name} contains control characters", name)
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
        raise _invalid("question is required and must be a string", "question")
    question = _clean_text(question, "question").strip()
    if not any(char.isalnum() for char in question):  # empty, or only spaces, punctuation, invisible marks
        raise _invalid("question is empty (it has no letters or digits)", "question")
    if len(question) > limits.max_question_chars:
        raise _invalid(f"question has {len(question)} characters, more than the limit of {limits.max_question_chars}",
                       "question")
    doc_id = body.get("doc_id")
    if doc_id is not None:
        try:
            validate_doc_id(doc_id)
        except ValueError as exc:
            raise _invalid(str(exc), "doc_id") from None
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _invalid(f"stream must be true or false, got {type(stream).__name__}", "stream")
    route = body.get("route", "auto")
    if route not in ROUTES:
        raise _invalid(f"route must be one of {', '.join(ROUTES)}, got {route!r}", "route")
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
