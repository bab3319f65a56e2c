"""A small client for the CAGFlow REST API, used by ``cagflow ask`` and by applications.

Every failure comes back as one exception, ``ApiError``: the API's own error body
(``{"error": {"code", "message"}, "request_id"}``) when it sent one, status 0 and code ``unreachable``
when no HTTP answer came at all, ``tls_failed`` when the server's certificate does not verify (it is
always checked: against ``ca_file``, else the system's CAs). Streamed answers are Server-Sent Events,
parsed here as the HTML specification defines them (multi-line data, comments, event names, ids). A request
the API refuses for its key's rate (``429`` with ``Retry-After``) is sent again after the wait it names, up to
``rate_limit_wait_s`` in all.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import requests

from ..errors import CagflowError

if TYPE_CHECKING:
    from ..config import ServiceConfig

USER_AGENT = "cagflow-api-client"
# A rate-limited request waits this long at most in all (the API says how long in Retry-After) before it fails:
# a benchmark or a script asking question after question slows to the key's rate instead of failing.
RATE_LIMIT_WAIT_S = 30.0


def client_timeout_s(service: ServiceConfig) -> float:
    """Long enough for a cache attempt that runs into Triton's timeout and is then answered by retrieval."""
    return 2 * service.triton_timeout_s + 30


class ApiError(CagflowError):
    """An error answer from the API (``status`` is its HTTP status) or no answer at all (status 0)."""

    def __init__(self, status: int, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(message, code=code)
        self.status = status
        self.code = code
        self.message = message
        self.request_id = request_id

    def __str__(self) -> str:
        where = f" (request {self.request_id})" if self.request_id else ""
        status = f"HTTP {self.status} " if self.status else ""
        return f"{status}{self.code}: {self.message}{where}"


@dataclass(frozen=True)
class ServerSentEvent:
    event: str
    data: str
    id: str | None = None


def parse_sse(lines: Iterable[str]) -> Iterator[ServerSentEvent]:
    """Events from the decoded lines of an ``text/event-stream`` body (line terminators removed).

    A blank line ends an event; ``data`` lines accumulate, joined by newlines; lines starting with ``:``
    are comments (keep-alives); an event without data is dropped, as a browser drops it.
    """
    event, data, last_id = "", [], None
    for line in lines:
        if not line:
            if data:
                yield ServerSentEvent(event or "message", "\n".join(data), last_id)
            event, data = "", []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "event":
            event = value
        elif field == "data":
            data.append(value)
        elif field == "id" and "\0" not in value:
            last_id = value
    if data:  # a stream cut before its final blank line: the partial event is still worth reporting
        yield ServerSentEvent(event or "message", "\n".join(data), last_id)


def _error_from(response: requests.Response) -> ApiError:
    """The API's error body, or a description of whatever else answered (a proxy's HTML page...)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    request_id = response.headers.get("X-Request-ID")
    if isinstance(error, dict):
        return ApiError(response.status_code, str(error.get("code", "error")), str(error.get("message", "")),
                        body.get("request_id") or request_id)
    snippet = " ".join(response.text.split())[:200]
    return ApiError(response.status_code, "unexpected_response",
                    f"{response.reason or 'error'} from {response.url}: {snippet or '(empty body)'}", request_id)


def _retry_after(response: requests.Response) -> float | None:
    """The seconds a ``429`` answer asks the client to wait (``Retry-After``; 0.1 at least, so that the waits
    of a request add up to its budget), else None."""
    if response.status_code != 429:
        return None
    try:
        return max(0.1, float(response.headers.get("Retry-After", "")))
    except ValueError:
        return None


class ApiClient:
    """One keep-alive session to the API; share an instance across calls (not across processes). An
    ``https://`` URL is verified against ``ca_file`` (a CA bundle or a self-signed certificate), else
    against the system's CAs."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float = 120,
                 ca_file: str | None = None, rate_limit_wait_s: float = RATE_LIMIT_WAIT_S) -> None:
        """``rate_limit_wait_s``: how long in all a request may wait out ``429 rate_limited`` answers (their
        ``Retry-After``) before the error is raised; 0 raises it at once."""
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.ca_file = ca_file
        self.rate_limit_wait_s = rate_limit_wait_s
        self._session = requests.Session()
        self._session.headers["User-Agent"] = USER_AGENT
        if api_key:
            self._session.headers["Authorization"] = f"Bearer {api_key}"

    def close(self) -> None:
        self._session.close()

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **arguments: Any) -> requests.Response:
        """One request; a ``429`` with ``Retry-After`` is waited out and sent again while the waits stay within
        ``rate_limit_wait_s`` (the API refuses it before doing anything, so sending it again is safe)."""
        waited = 0.0
        while True:
            response = self._send(method, path, **arguments)
            wait = _retry_after(response)
            if wait is None or waited + wait > self.rate_limit_wait_s:
                return response
            response.close()
            time.sleep(wait)
            waited += wait

    def _send(self, method: str, path: str, **arguments: Any) -> requests.Response:
        url = f"{self.base_url}{path}"
        try:  # verify per request: a session-wide setting would lose to $REQUESTS_CA_BUNDLE
            return self._session.request(method, url, timeout=self.timeout_s, verify=self.ca_file or True,
                                         **arguments)
        except requests.Timeout:
            raise ApiError(0, "timeout", f"no answer from {url} within {self.timeout_s:g} s") from None
        except requests.exceptions.SSLError as exc:
            raise ApiError(0, "tls_failed", f"TLS with {url} failed: {_root_cause(exc)}") from None
        except requests.RequestException as exc:
            raise ApiError(0, "unreachable", f"cannot reach {url}: {_root_cause(exc)}") from None

    def _json(self, response: requests.Response) -> dict:
        try:
            body = response.json()
        except ValueError:
            raise _error_from(response) from None
        if not isinstance(body, dict):
            raise _error_from(response)
        return body

    @staticmethod
    def _query_body(question: str, doc_id: str | None, top_k: int | None, max_new_tokens: int | None,
                    stream: bool, route: str = "auto") -> dict[str, Any]:
        return {"question": question, "doc_id": doc_id, "top_k": top_k, "max_new_tokens": max_new_tokens,
                "stream": stream, "route": route}

    def query(self, question: str, doc_id: str | None = None, top_k: int | None = None,
              max_new_tokens: int | None = None, route: str = "auto") -> dict:
        """The answer record of ``POST /v1/query``; ``route="retrieval"`` skips the cache route."""
        response = self._request("POST", "/v1/query",
                                 json=self._query_body(question, doc_id, top_k, max_new_tokens, False, route))
        if not response.ok:
            raise _error_from(response)
        return self._json(response)

    def stream(self, question: str, doc_id: str | None = None, top_k: int | None = None,
               max_new_tokens: int | None = None) -> Iterator[dict]:
        """The streamed answer as ``{"event", "data", "id"}`` dicts, ``data`` decoded from JSON when it is
        JSON; an ``error`` event raises ``ApiError``."""
        response = self._request("POST", "/v1/query", stream=True,
                                 headers={"Accept": "text/event-stream"},
                                 json=self._query_body(question, doc_id, top_k, max_new_tokens, stream=True))
        with response:
            if not response.ok:
                raise _error_from(response)
            if not response.headers.get("Content-Type", "").startswith("text/event-stream"):
                raise ApiError(response.status_code, "unexpected_response",
                               f"expected an event stream from {response.url}, got "
                               f"{response.headers.get('Content-Type') or 'no content type'}")
            response.encoding = "utf-8"
            try:
                for event in parse_sse(response.iter_lines(decode_unicode=True)):
                    yield _decoded(event, response.headers.get("X-Request-ID"))
            except requests.RequestException as exc:
                raise ApiError(0, "stream_interrupted", f"the answer stream broke off: {_root_cause(exc)}") from None

    def releases(self) -> dict:
        """``GET /v1/releases``: the active release and its documents, as the router sees them now."""
        response = self._request("GET", "/v1/releases")
        if not response.ok:
            raise _error_from(response)
        return self._json(response)

    def health(self) -> dict:
        response = self._request("GET", "/healthz")
        if not response.ok:
            raise _error_from(response)
        return self._json(response)

    def ready(self) -> tuple[int, dict]:
        """Readiness as (HTTP status, body): 503 is an answer here, not an error."""
        response = self._request("GET", "/readyz")
        if response.status_code not in (200, 503):
            raise _error_from(response)
        return response.status_code, self._json(response)


def _decoded(event: ServerSentEvent, request_id: str | None) -> dict:
    try:
        data: Any = json.loads(event.data)
    except ValueError:
        data = event.data
    error = data.get("error") if isinstance(data, dict) else None
    if event.event == "error" or isinstance(error, dict):
        details = error if isinstance(error, dict) else {"message": event.data}
        raise ApiError(200, str(details.get("code", "error")), str(details.get("message", "")),
                       (data.get("request_id") if isinstance(data, dict) else None) or request_id)
    return {"event": event.event, "data": data, "id": event.id}


def _root_cause(error: BaseException) -> str:
    """The innermost reason ("Connection refused") instead of urllib3's nested wrappers."""
    while error.__context__ is not None or error.__cause__ is not None:
        error = error.__cause__ or error.__context__
    return getattr(error, "strerror", None) or str(error)
