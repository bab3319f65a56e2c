"""A fuzz pass over the REST layer: Hypothesis sends `POST /v1/query`, the OpenAI-compatible endpoints, the
admin endpoints, and any method on any path, with JSON bodies (near-valid and garbage: wrong types, huge
strings, Chinese, NUL bytes, lone surrogates, deep nesting), raw non-JSON bytes, and odd headers (content
types, missing or bad API keys, huge values). Whatever arrives, the answer is never a 5xx (but for the
intended 503 while the backend is down), never HTML, never a stack trace, and every 4xx/5xx is the JSON error
body (OpenAI's shape on its endpoints).

The application is the real one (``create_app``); routing is the in-memory stand-in of test_app.py, which
can be switched to "backend down" per request. ``pytest --hypothesis-show-statistics`` shows which answers
the generated requests got (most get past authentication and content type to the body's validation)."""

from __future__ import annotations

import json

import pytest
import test_app as app_tests
from cagflow.router.access import MAX_NEW_TOKENS, MAX_TOP_K, ROUTES
from cagflow.router.apikeys import ApiKeyStore
from cagflow.router.chat_requests import ALIAS, IGNORED, UNSUPPORTED
from cagflow.router.errors import OPENAI_PATHS
from cagflow.router.failures import triton_failure
from cagflow.router.triton_client import TritonUnavailable
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st



FUZZ = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class SwitchableRouter(app_tests.StandInRouter):
    """The stand-in, or with ``down`` set a backend that does not answer (what the real router raises)."""

    down = False

    def _unavailable(self):
        return triton_failure(TritonUnavailable("Triton at 127.0.0.1:8000 refused the connection"))

    def answer(self, query, request_id):
        if self.down:
            raise self._unavailable()
        return super().answer(query, request_id)

    def stream(self, query, request_id):
        if self.down:
            raise self._unavailable()
        yield from super().stream(query, request_id)

    def readiness(self):
        return {"ready": not self.down, "degraded": self.down, "reasons": ["triton down"] if self.down else []}

    def releases(self):
        if self.down:
            raise self._unavailable()
        return super().releases()

    def reload(self, release_id):
        if self.down:
            raise self._unavailable()
        return super().reload(release_id)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    """(app, router, {"user": header, "admin": header}) for the whole module: Hypothesis reuses it."""
    store = ApiKeyStore(tmp_path_factory.mktemp("fuzz-keys") / "api-keys.json")
    _, user = store.create("fuzz-user")
    _, admin = store.create("fuzz-ops", admin=True)
    keys = {"user": f"Bearer {user}", "admin": f"Bearer {admin}"}
    app, router = app_tests.make_app((store, None, None), router=SwitchableRouter())
    return app, router, keys


# --- what is sent


def mostly(usual, unusual):
    """``usual`` three times in four, so that most requests get past the earlier checks; else ``unusual``."""
    return st.integers(0, 3).flatmap(lambda pick: usual if pick else unusual)


# Text a header can carry (latin-1, no line breaks), and text of every kind for JSON.
header_text = st.text(st.characters(min_codepoint=32, max_codepoint=255, exclude_characters="\x7f"), max_size=40)
huge = st.builds(lambda piece, count: piece * count, st.sampled_from(["a", "问", "\x00", "🔒", "<b>"]),
                 st.integers(500, 20_000))
chinese = st.text(st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF), min_size=1, max_size=30)
odd_text = st.sampled_from(["", " ", "\x00", "a\x00b", "\ud800", "\udfff x", "\u200b", "\u202eevil", "\t\n\r",
                            "</script><html>", "%s%n{0}", "../../etc/passwd", "null", "doc\n", "-x", "A"])
surrogates = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=4)  # JSON can escape them, UTF-8 cannot
texts = st.one_of(st.text(max_size=60), chinese, surrogates, odd_text, huge)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-(10**30), 10**30),
                    st.floats(allow_nan=True, allow_infinity=True), texts)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4), max_leaves=12)
garbage = st.one_of(texts, json_values)

query_objects = st.builds(lambda known, extra: {**extra, **known}, st.fixed_dictionaries({
    "question": mostly(st.sampled_from(["Which port does the web console use?", "网关的默认端口是多少？"])
                       | chinese, garbage),
}, optional={
    "doc_id": mostly(st.sampled_from(["doc", "security-access-policy", None]), garbage),
    "top_k": mostly(st.integers(1, MAX_TOP_K) | st.none(), st.integers() | garbage),
    "max_new_tokens": mostly(st.integers(1, MAX_NEW_TOKENS) | st.none(), st.integers() | garbage),
    "stream": mostly(st.booleans(), garbage),
    "route": mostly(st.sampled_from(ROUTES), garbage),
}), mostly(st.just({}), st.dictionaries(texts, json_values, min_size=1, max_size=2)))
chat_messages = st.lists(st.fixed_dictionaries({
    "role": mostly(st.sampled_from(["user", "system", "assistant", "developer"]), garbage),
    "content": mostly(st.sampled_from(["Which port does the web console use?", "网关的默认端口是多少？"]) | chinese
                      | st.just([{"type": "text", "text": "Which port?"}]), garbage),
}), min_size=1, max_size=3)
chat_objects = st.builds(lambda known, other, extra: {**extra, **other, **known}, st.fixed_dictionaries({
    "model": mostly(st.sampled_from([ALIAS, "qwen2.5-coder-1.5b"]), garbage),
    "messages": mostly(chat_messages.map(lambda messages: [*messages, {"role": "user", "content": "Which port?"}]),
                       chat_messages | garbage),
}, optional={
    "stream": mostly(st.booleans(), garbage),
    "stream_options": mostly(st.just({"include_usage": True}), garbage),
    "max_tokens": mostly(st.integers(1, MAX_NEW_TOKENS) | st.none(), st.integers() | garbage),
    "max_completion_tokens": mostly(st.integers(1, MAX_NEW_TOKENS) | st.none(), st.integers() | garbage),
    "cagflow": mostly(st.fixed_dictionaries({}, optional={"doc_id": st.sampled_from(["doc", None]),
                                                          "top_k": st.integers(1, MAX_TOP_K),
                                                          "route": st.sampled_from(ROUTES)}), garbage),
}), st.dictionaries(st.sampled_from([*IGNORED, *UNSUPPORTED]), mostly(st.none(), garbage), max_size=2),
    mostly(st.just({}), st.dictionaries(texts, json_values, min_size=1, max_size=2)))
reload_objects = st.one_of(st.just({}), st.fixed_dictionaries({"release_id": mostly(
    st.sampled_from(["R0", "20261202T101500Z-1a2b3c4d", None]), garbage)}))


def _encoded(value, ascii_only: bool) -> bytes:
    """JSON as a client might send it; ``surrogatepass`` lets a lone surrogate through as invalid UTF-8."""
    return json.dumps(value, ensure_ascii=ascii_only, allow_nan=True).encode("utf-8", "surrogatepass")


def _deep(depth: int, opener: str, value: str) -> bytes:
    closer = {"[": "]", '{"a":': "}"}[opener]
    return (opener * depth + value + closer * depth).encode()


anything = st.one_of(
    st.builds(_encoded, json_values, st.booleans()),
    st.binary(max_size=300),
    st.sampled_from([b"", b"{", b"}", b"null", b"[]", b"{}", b'"question"', b"NaN", b"\xef\xbb\xbf{}", b"\x00",
                     b'{"question": "q"', b"question=q&doc_id=x", "{\"question\": \"端口\"}".encode("utf-16"),
                     b'{"question": "q", "top_k": 1' + b"0" * 5000 + b"}"]),
    st.builds(_deep, st.integers(1, 5000), st.sampled_from(["[", '{"a":']), st.sampled_from(["1", '"x"', "[]"])),
    st.builds(lambda depth: b'{"question": "q", "route": ' + b"[" * depth + b"]" * depth + b"}", st.integers(1, 2000)),
)
query_bodies = mostly(st.builds(_encoded, query_objects, st.booleans()), anything)
chat_bodies = mostly(st.builds(_encoded, chat_objects, st.booleans()), anything)
reload_bodies = mostly(st.just(b"") | st.builds(_encoded, reload_objects, st.booleans()), anything)

json_types = st.sampled_from(["application/json", "application/json; charset=utf-8", "application/JSON",
                              "application/problem+json"])
odd_types = st.one_of(st.none(), header_text, st.sampled_from([
    "application/json; charset=utf-16", "text/plain", "text/html", "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x", "multipart/form-data", "application/octet-stream", ""]))
odd_keys = st.one_of(st.none(), header_text, header_text.map("Bearer {}".format),
                     st.sampled_from(["Bearer", "Bearer ", "Basic dXNlcjpwYXNz", "Bearer cgf_000000000000_wrong",
                                      "bearer  spaced"]),
                     st.integers(1_000, 100_000).map(lambda n: "Bearer " + "k" * n))
headers = st.builds(
    lambda content_type, key, extra: {**extra, "Content-Type": content_type, "Authorization": key},
    mostly(json_types, odd_types), mostly(st.sampled_from(["user", "admin"]), odd_keys),
    st.fixed_dictionaries({}, optional={
        "X-Request-ID": st.one_of(header_text, st.integers(100, 20_000).map("r".__mul__)),
        "Accept": st.sampled_from(["*/*", "text/html", "text/event-stream", "application/json;q=0", ""]),
        "X-Padding": st.integers(1_000, 100_000).map("p".__mul__),
        "Content-Encoding": st.sampled_from(["gzip", "identity", "br"]),
    }))


def _send(fuzzed, method: str, path: str, body: bytes, sent_headers: dict, down: bool):
    app, router, api_keys = fuzzed
    sent = {name: api_keys.get(value, value) if name == "Authorization" else value
            for name, value in sent_headers.items() if value is not None}  # "user"/"admin": that key
    router.down = down
    with app.test_client() as client:
        return client.open(path, method=method, data=body, headers=sent)


PAGE_TYPES = ("text/html", "text/javascript", "text/css")  # the web page's only, and never for an error


def assert_well_formed(response, down: bool) -> None:
    """The properties every answer has, whatever was sent (a reply to HEAD has headers only)."""
    text = response.get_data(as_text=True)
    assert "Traceback" not in text and 'File "' not in text, text[:500]
    page = response.request.path == "/" or response.request.path.startswith("/static/")  # the web page's files
    assert response.mimetype in ("application/json", "text/event-stream", "text/plain") or (
        page and response.status_code < 400 and response.mimetype in PAGE_TYPES), response.mimetype
    status = response.status_code
    error = (response.get_json(silent=True) or {}).get("error") if response.is_json else None
    event(f"{status} {error.get('code') if isinstance(error, dict) else ''}")  # --hypothesis-show-statistics
    assert status < 500 or (down and status == 503), (status, text[:500])
    if response.request.method == "HEAD":
        assert text == "" and (status < 400 or response.mimetype == "application/json")
    elif status >= 400 and response.request.path.startswith(OPENAI_PATHS):
        body = response.get_json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["message"] and body["error"]["code"] and response.headers["X-Request-ID"]
    elif status >= 400 and not (status == 503 and response.request.path == "/readyz"):  # that 503 is the report
        app_tests.assert_json_error(response, status)
    elif response.mimetype == "application/json":
        assert isinstance(json.loads(text), dict)


@FUZZ
@given(body=query_bodies, sent_headers=headers, down=st.booleans())
@example(body=b'{"question": "q", "\\ud800": 1}', sent_headers={"Content-Type": "application/json",  # found: a 500
                                                                "Authorization": "user"}, down=False)
def test_fuzz_query(fuzzed, body, sent_headers, down):
    assert_well_formed(_send(fuzzed, "POST", "/v1/query", body, sent_headers, down), down)


@FUZZ
@given(body=chat_bodies, sent_headers=headers, down=st.booleans())
def test_fuzz_chat_completions(fuzzed, body, sent_headers, down):
    assert_well_formed(_send(fuzzed, "POST", "/v1/chat/completions", body, sent_headers, down), down)


@pytest.mark.parametrize("method, path, bodies", [("POST", "/admin/reload", reload_bodies),
                                                  ("GET", "/v1/releases", anything), ("GET", "/v1/models", anything),
                                                  ("GET", "/v1/models/cagflow", anything)],
                         ids=["reload", "releases", "models", "model"])
@FUZZ
@given(data=st.data(), sent_headers=headers, down=st.booleans(),
       other_method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]))
def test_fuzz_admin_endpoints(fuzzed, method, path, bodies, data, sent_headers, down, other_method):
    method = data.draw(mostly(st.just(method), st.just(other_method)), label="method")
    body = data.draw(bodies, label="body")
    assert_well_formed(_send(fuzzed, method, path, body, sent_headers, down), down)


@FUZZ
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE", "FOO"]),
       path=st.one_of(st.sampled_from(["/v1/query", "/admin/reload", "/healthz", "/readyz", "/metrics", "/",
                                       "/v1/query/", "/admin/", "/v1/releases?x=1", "/v1/chat/completions",
                                       "/v1/models/", "/v1/models/%00", "/openapi.json"]),
                      st.text(st.characters(min_codepoint=33, max_codepoint=0x10FFFF, exclude_categories=["Cs"]),
                              max_size=40).map("/{}".format)),
       body=anything, sent_headers=headers, down=st.booleans())
@example(method="OPTIONS", path="/v1/query", body=b"", sent_headers={}, down=False)  # found: an empty text/html 200
def test_fuzz_any_method_and_path(fuzzed, method, path, body, sent_headers, down):
    assert_well_formed(_send(fuzzed, method, path, body, sent_headers, down), down)


def test_every_admin_endpoint_is_fuzzed(fuzzed):
    app, _, _ = fuzzed
    admin = {rule.rule for rule in app.url_map.iter_rules() if rule.rule.startswith("/admin/")}
    assert admin == {"/admin/reload"}  # a new one joins test_fuzz_admin_endpoints
