"""The REST layer through Flask's test client: authentication, rate limits, the concurrency cap, JSON
errors for every malformed request, request ids, SSE framing and metrics. Routing is replaced by a
small in-memory stand-in (it records the questions it is asked); the real routing runs against real
servers in tests/integration/test_router.py."""

from __future__ import annotations

import io
import json
import logging
import re
import threading

import pytest
from cagflow.config import Config
from cagflow.router import create_app
from cagflow.router.access import ApiError
from cagflow.router.apikeys import ApiKeyStore

ANSWER = {"answer": "Port 8443.", "route": "cache", "cache_hit": True, "fallback_reason": None,
          "snapshot": {"key": "doc/1/0123456789abcdef", "doc_id": "doc", "doc_version": "1"}, "citations": [],
          "timings_ms": {"route": 1.0, "search": 0.0, "ttft": 5.0, "total": 9.0}}


class StandInRouter:
    """Answers every question with ``ANSWER``; ``gate`` (when set) holds answers until released."""

    def __init__(self) -> None:
        self.questions: list[str] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Semaphore(0)
        self.ready = True
        self.reloaded: list[str | None] = []

    def answer(self, query, request_id):
        self.questions.append(query.question)
        self.entered.release()
        if self.gate is not None:
            self.gate.wait(10)
        return {**ANSWER, "request_id": request_id}

    def stream(self, query, request_id):
        self.questions.append(query.question)
        if query.question == "unknown document":
            raise ApiError(404, "unknown_document", "document 'nope' is not known")
        for piece in ("Port", " 8443."):
            yield "token", {"text": piece}
        yield "answer", {**ANSWER, "request_id": request_id}

    def readiness(self):
        return {"ready": self.ready, "degraded": not self.ready, "reasons": [] if self.ready else ["triton down"]}

    def releases(self):
        return {"active": "R1", "releases": ["R1"], "documents": ["doc"], "snapshots": []}

    def reload(self, release_id):
        self.reloaded.append(release_id)
        return {"release_id": release_id or "R1", "triton": {}}


@pytest.fixture()
def keys(tmp_path):
    store = ApiKeyStore(tmp_path / "api-keys.json")
    _, user = store.create("user")
    _, admin = store.create("ops", admin=True)
    return store, {"Authorization": f"Bearer {user}"}, {"Authorization": f"Bearer {admin}"}


def make_app(keys, router=None, **service):
    config = Config.model_validate({"service": {"rate_limit_per_s": 1000, "rate_limit_burst": 1000,
                                                "max_body_bytes": 4096, "max_question_chars": 500,
                                                "audit_log_file": str(keys[0].path.with_name("audit.jsonl")),
                                                **service}})
    router = router or StandInRouter()
    return create_app(config, router=router, keys=keys[0]), router


@pytest.fixture()
def client(keys):
    app, router = make_app(keys)
    return app.test_client(), router, keys[1], keys[2]


def assert_json_error(response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.get_data(as_text=True)
    assert response.mimetype == "application/json"
    body = response.get_json()
    assert set(body) == {"error", "request_id"} and set(body["error"]) == {"code", "message"}
    assert body["error"]["message"] and body["request_id"] == response.headers["X-Request-ID"]
    if code:
        assert body["error"]["code"] == code
    return body


def test_a_query_is_answered_and_echoes_the_request_id(client):
    test_client, router, user, _ = client
    response = test_client.post("/v1/query", json={"question": "Which port?"},
                                headers={**user, "X-Request-ID": "trace-42"})
    assert response.status_code == 200 and response.headers["X-Request-ID"] == "trace-42"
    assert response.get_json()["request_id"] == "trace-42" and router.questions == ["Which port?"]
    generated = test_client.post("/v1/query", json={"question": "q"}, headers={**user, "X-Request-ID": "bad id!"})
    assert generated.headers["X-Request-ID"] != "bad id!" and len(generated.headers["X-Request-ID"]) == 32


@pytest.mark.parametrize("headers, code", [
    ({}, "unauthenticated"),
    ({"Authorization": "Basic dXNlcjpwYXNz"}, "unauthenticated"),
    ({"Authorization": "Bearer "}, "unauthenticated"),
    ({"Authorization": "Bearer cgf_000000000000_wrong"}, "invalid_api_key"),
])
def test_missing_or_wrong_keys_are_401(client, headers, code):
    test_client, router, _, _ = client
    response = test_client.post("/v1/query", json={"question": "q"}, headers=headers)
    assert_json_error(response, 401, code)
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert router.questions == []


def test_admin_endpoints_need_an_admin_key(client):
    test_client, router, user, admin = client
    assert_json_error(test_client.post("/admin/reload", headers=user), 403, "forbidden")
    assert_json_error(test_client.post("/admin/reload"), 401, "unauthenticated")
    assert router.reloaded == []
    response = test_client.post("/admin/reload", json={"release_id": "R0"}, headers=admin)
    assert response.status_code == 200 and response.get_json()["release_id"] == "R0"
    assert test_client.post("/admin/reload", headers=admin).status_code == 200  # no body: the current release
    assert router.reloaded == ["R0", None]
    assert test_client.get("/v1/releases", headers=admin).get_json()["active"] == "R1"


def test_rate_limit_is_429_with_retry_after_per_key(keys):
    app, router = make_app(keys, rate_limit_per_s=0.5, rate_limit_burst=2)
    test_client, user, admin = app.test_client(), keys[1], keys[2]
    statuses = [test_client.post("/v1/query", json={"question": "q"}, headers=user).status_code for _ in range(2)]
    limited = test_client.post("/v1/query", json={"question": "q"}, headers=user)
    assert statuses == [200, 200]
    assert_json_error(limited, 429, "rate_limited")
    assert int(limited.headers["Retry-After"]) >= 1
    assert test_client.post("/v1/query", json={"question": "q"}, headers=admin).status_code == 200  # its own bucket
    assert len(router.questions) == 3


def test_requests_over_the_concurrency_cap_are_refused_not_queued(keys):
    app, router = make_app(keys, max_concurrent_requests=2)
    router.gate = threading.Event()
    user = keys[1]
    results: list[int] = []

    def ask():
        results.append(app.test_client().post("/v1/query", json={"question": "slow"}, headers=user).status_code)

    workers = [threading.Thread(target=ask) for _ in range(2)]
    for worker in workers:
        worker.start()
    for _ in workers:
        assert router.entered.acquire(timeout=10)  # both requests hold a slot
    refused = app.test_client().post("/v1/query", json={"question": "one too many"}, headers=user)
    assert_json_error(refused, 503, "overloaded")
    assert refused.headers["Retry-After"] == "1"
    assert app.test_client().get("/healthz").status_code == 200  # health is never capped
    router.gate.set()
    for worker in workers:
        worker.join(10)
    assert results == [200, 200]
    assert app.test_client().post("/v1/query", json={"question": "after"}, headers=user).status_code == 200


RAW_BODIES = [
    (b"{", "invalid_json"),
    (b"not json at all", "invalid_json"),
    (b'{"question": "q",}', "invalid_json"),
    (b"\xff\xfe\x00garbage", "invalid_json"),
    (b"[" * 3000 + b"]" * 3000, "body_too_large"),
    (b'{"question": "q", "top_k": ' + b"9" * 5000 + b"}", "body_too_large"),
    (b'{"question": "' + b"a" * 5000 + b'"}', "body_too_large"),
    (b"[" * 2000 + b"]" * 2000, "invalid_json"),  # nested deeper than the parser goes
    (b"[" * 200 + b"]" * 200, "invalid_request"),  # valid JSON, but not an object
    (b'"just a string"', "invalid_request"),
    (b"null", "invalid_request"),
    (b'{"question": "q", "top_k": 1e400}', "invalid_request"),
    (b'{"question": "q", "top_k": NaN}', "invalid_request"),
    (b'{"question": "\\ud800"}', "invalid_request"),
    (b'{"question": "a\\u0000b"}', "invalid_request"),
    (b'{"question": ""}', "invalid_request"),
    (b'{"question": "\\u200b"}', "invalid_request"),
    (b'{"question": "q", "question2": "x"}', "invalid_request"),
    (b'{"question": "q", "doc_id": ""}', "invalid_request"),
    (b'{"question": "q", "doc_id": "a/b"}', "invalid_request"),
    (b'{"question": "q", "doc_id": "\\u202eevil"}', "invalid_request"),
    (b'{"question": "q", "max_new_tokens": 0}', "invalid_request"),
    (b'{"question": "q", "max_new_tokens": -5}', "invalid_request"),
    (b'{"question": "q", "max_new_tokens": 4097}', "invalid_request"),
    (b'{"question": "q", "max_new_tokens": true}', "invalid_request"),
    (b'{"question": "q", "top_k": 51}', "invalid_request"),
    (b'{"question": "q", "top_k": false}', "invalid_request"),
    (b'{"question": "q", "stream": "true"}', "invalid_request"),
    (b'{"question": "q", "stream": null}', "invalid_request"),
    (b'{"question": {"text": "q"}}', "invalid_request"),
    (b'{"question": "' + "x".encode() * 501 + b'"}', "invalid_request"),
]


@pytest.mark.parametrize("raw, code", RAW_BODIES, ids=[f"body{n}" for n in range(len(RAW_BODIES))])
def test_malformed_bodies_are_json_4xx_never_5xx_or_html(client, raw, code):
    test_client, router, user, _ = client
    response = test_client.post("/v1/query", data=raw, headers={**user, "Content-Type": "application/json"})
    assert 400 <= response.status_code < 500
    assert_json_error(response, response.status_code, code)
    assert router.questions == []


@pytest.mark.parametrize("method, path, kwargs, status, code", [
    ("post", "/v1/query", {"data": '{"question": "q"}', "content_type": "text/plain"}, 415, "unsupported_media_type"),
    ("post", "/v1/query", {"data": "question=q", "content_type": "application/x-www-form-urlencoded"}, 415,
     "unsupported_media_type"),
    ("post", "/v1/query", {}, 415, "unsupported_media_type"),
    ("get", "/v1/query", {}, 405, "method_not_allowed"),
    ("put", "/v1/query", {"json": {"question": "q"}}, 405, "method_not_allowed"),
    ("delete", "/admin/reload", {}, 405, "method_not_allowed"),
    ("post", "/healthz", {}, 405, "method_not_allowed"),
    ("post", "/", {}, 405, "method_not_allowed"),  # GET / is the web page
    ("get", "/index.html", {}, 404, "not_found"),
    ("get", "/v1/query/extra", {}, 404, "not_found"),
    ("get", "/%00", {}, 404, "not_found"),
    ("get", "/v2/models/cag_llm/infer", {}, 404, "not_found"),
    ("post", "/admin/reload", {"json": {"release_id": "../../etc"}}, 400, "invalid_request"),
    ("post", "/admin/reload", {"data": "{", "content_type": "application/json"}, 400, "invalid_json"),
])
def test_wrong_methods_paths_and_content_types_are_json_errors(client, method, path, kwargs, status, code):
    test_client, _, user, admin = client
    headers = admin if path == "/admin/reload" else user
    response = getattr(test_client, method)(path, headers=headers, **kwargs)
    assert_json_error(response, status, code)
    if status == 405:
        assert response.headers["Allow"]


def test_an_unexpected_failure_is_a_json_500_without_the_traceback(keys):
    class Broken(StandInRouter):
        def answer(self, query, request_id):
            raise RuntimeError("secret internals")

    app, _ = make_app(keys, router=Broken())
    response = app.test_client().post("/v1/query", json={"question": "q"}, headers=keys[1])
    body = assert_json_error(response, 500, "internal")
    assert "secret internals" not in json.dumps(body) and "Traceback" not in response.get_data(as_text=True)


def test_streaming_sends_token_events_then_the_answer(client):
    test_client, _, user, _ = client
    response = test_client.post("/v1/query", json={"question": "q", "stream": True}, headers=user)
    assert response.status_code == 200 and response.mimetype == "text/event-stream"
    frames = [frame for frame in response.get_data(as_text=True).split("\n\n") if frame]
    events = [(frame.split("\n")[0].removeprefix("event: "), json.loads(frame.split("\n")[1].removeprefix("data: ")))
              for frame in frames]
    assert [event for event, _ in events] == ["token", "token", "answer"]
    assert "".join(data["text"] for event, data in events if event == "token") == "Port 8443."
    assert events[-1][1]["answer"] == ANSWER["answer"]
    refused = test_client.post("/v1/query", json={"question": "unknown document", "stream": True}, headers=user)
    assert_json_error(refused, 404, "unknown_document")  # errors before the first event are plain JSON


def test_health_readiness_and_metrics(client):
    test_client, router, user, _ = client
    assert test_client.get("/healthz").get_json() == {"status": "alive"}
    assert test_client.get("/readyz").status_code == 200
    router.ready = False
    assert test_client.get("/readyz").status_code == 503
    test_client.post("/v1/query", json={"question": "q"}, headers=user)
    test_client.post("/v1/query", json={}, headers=user)
    text = test_client.get("/metrics").get_data(as_text=True)
    assert 'cagflow_router_requests_total{endpoint="/v1/query",status="200"}' in text
    assert 'cagflow_router_errors_total{code="invalid_request"}' in text
    assert "cagflow_router_request_seconds_bucket" in text and "process_resident_memory_bytes" in text


@pytest.fixture()
def access_lines(caplog):
    """Access-log lines as dicts (the access logger does not propagate, so caplog's handler is attached)."""
    logger = logging.getLogger("cagflow.router.access")
    logger.addHandler(caplog.handler)
    yield lambda: [json.loads(record.getMessage()) for record in caplog.records
                   if record.name == "cagflow.router.access"]
    logger.removeHandler(caplog.handler)


def test_one_access_log_line_per_request_without_the_key(client, access_lines):
    test_client, _, user, _ = client
    test_client.post("/v1/query", json={"question": "q"}, headers={**user, "X-Request-ID": "log-1"})
    [line] = access_lines()
    assert line["request_id"] == "log-1" and line["status"] == 200 and line["route"] == "cache"
    assert line["cache_hit"] is True and line["snapshot_key"] == "doc/1/0123456789abcdef" and line["key_id"]
    assert user["Authorization"].split()[1] not in json.dumps(line)


def test_a_corrupt_keys_file_refuses_everyone_with_a_clear_503(keys, tmp_path):
    app, router = make_app(keys)
    (tmp_path / "api-keys.json").write_text("{not json")
    response = app.test_client().post("/v1/query", json={"question": "Which port?"}, headers=keys[1])
    assert response.status_code == 503 and response.is_json
    assert response.get_json()["error"]["code"] == "auth_unavailable" and router.questions == []


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def audit_events(store: ApiKeyStore) -> list[dict]:
    return [json.loads(line) for line in store.path.with_name("audit.jsonl").read_text().splitlines()]


def test_a_rotated_key_works_through_its_overlap_then_is_refused_as_expired(tmp_path):
    now = [1_800_000_000.0]
    store = ApiKeyStore(tmp_path / "api-keys.json", clock=lambda: now[0])
    old, old_key = store.create("billing-app")
    test_client = make_app((store,))[0].test_client()
    _, _, new_key = store.rotate(old.key_id, overlap_s=3600)

    def ask(key):
        return test_client.post("/v1/query", json={"question": "q"}, headers=bearer(key))

    assert ask(old_key).status_code == ask(new_key).status_code == 200
    now[0] += 3600
    expired = ask(old_key)
    body = assert_json_error(expired, 401, "key_expired")
    assert "expired at 2027-01-15T09:00:00Z" in body["error"]["message"]
    assert expired.headers["WWW-Authenticate"].startswith("Bearer")
    assert ask(new_key).status_code == 200
    assert_json_error(ask("cgf_000000000000_unknown"), 401, "invalid_api_key")
    store.revoke(old.key_id)
    assert_json_error(ask(old_key), 401, "invalid_api_key")


def test_every_admin_request_is_audited_refusals_too(tmp_path):
    now = [1_800_000_000.0]
    store = ApiKeyStore(tmp_path / "api-keys.json", clock=lambda: now[0])
    _, user = store.create("app")
    ops, admin = store.create("ops", admin=True)
    _, expired = store.create("old-ops", admin=True, expires_in_s=60)
    now[0] += 60
    app, router = make_app((store,))
    test_client = app.test_client()
    test_client.post("/admin/reload")
    test_client.post("/admin/reload", headers=bearer("cgf_000000000000_wrong"))
    test_client.post("/admin/reload", headers=bearer(user))
    test_client.post("/admin/reload", headers=bearer(expired))
    test_client.post("/admin/reload", json={"release_id": "R0"}, headers={**bearer(admin), "X-Request-ID": "audit-1"},
                     environ_base={"REMOTE_ADDR": "10.1.2.3"})
    test_client.post("/admin/reload", data="{", content_type="application/json", headers=bearer(admin))
    test_client.get("/admin/reload", headers=bearer(admin))
    test_client.post("/v1/query", json={"question": "q"}, headers=bearer(user))  # not an admin action
    events = audit_events(store)
    assert [(event["action"], event["result"], event["reason"], event["key_name"]) for event in events] == [
        ("admin.reload", "denied", "unauthenticated", None),
        ("admin.reload", "denied", "invalid_api_key", None),
        ("admin.reload", "denied", "forbidden", "app"),
        ("admin.reload", "denied", "key_expired", "old-ops"),
        ("admin.reload", "ok", None, "ops"),
        ("admin.reload", "error", "invalid_json", "ops"),
        ("GET /admin/reload", "error", "method_not_allowed", None),
    ]
    done = events[4]
    assert (done["via"], done["target"], done["detail"], done["key_id"]) == ("rest", "R0", {"release_id": "R0"},
                                                                               ops.key_id)
    assert done["remote_addr"] == "10.1.2.3" and done["request_id"] == "audit-1" and router.reloaded == ["R0"]
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", event["ts"]) for event in events)
    assert events[0]["remote_addr"] == "127.0.0.1"


def test_no_key_or_key_hash_reaches_the_logs_or_the_audit_log(keys):
    """Real keys, good and bad, on every kind of request: the log output and the audit log hold key ids only."""
    store, user, admin = keys
    app, _ = make_app(keys)
    output = io.StringIO()
    handler = logging.StreamHandler(output)
    loggers = [logging.getLogger(name) for name in ("", "cagflow.router", "cagflow.router.access")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        test_client = app.test_client()
        test_client.post("/v1/query", json={"question": "q"}, headers=user)
        test_client.post("/v1/query", json={"question": "q", "stream": True}, headers=user).get_data()
        test_client.post("/v1/query", json={"question": "q"}, headers={"Authorization": user["Authorization"] + "x"})
        test_client.post("/admin/reload", headers=user)
        test_client.post("/admin/reload", json={"release_id": "R0"}, headers=admin)
        test_client.post("/admin/reload", data="{", content_type="application/json", headers=admin)
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    logged = output.getvalue()
    audit = store.path.with_name("audit.jsonl").read_text()
    assert logged.count('"endpoint": "/v1/query"') == 3 and logged.count('"action": "admin.reload"') == 3
    assert len(audit.splitlines()) == 3
    secrets = [headers["Authorization"].split("_", 2)[2] for headers in (user, admin)]
    hashes = [record["sha256"] for record in json.loads(store.path.read_text())["keys"]]
    for text in (logged, audit):
        assert not [secret for secret in secrets + hashes if secret in text]


CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
def test_each_request_is_a_server_span_joined_to_the_callers_trace(client, access_lines, finished_spans, stream):
    """The caller's ``traceparent`` is the parent; the span ends with the response (a stream's last event), and
    its trace id is in the access-log line."""
    test_client, _, user, _ = client
    response = test_client.post("/v1/query", json={"question": "Which port?", "stream": stream},
                                headers={**user, "traceparent": f"00-{CALLER_TRACE}-b7ad6b7169203331-01"})
    assert response.status_code == 200 and "8443" in response.get_data(as_text=True)
    [span] = [span for span in finished_spans() if span.name == "POST /v1/query"]
    assert span.parent.span_id == 0xb7ad6b7169203331 and format(span.context.trace_id, "032x") == CALLER_TRACE
    assert span.attributes["http.response.status_code"] == 200 and span.attributes["cagflow.route"] == "cache"
    assert span.attributes["cagflow.key_name"] == "user"
    [line] = access_lines()
    assert line["trace_id"] == CALLER_TRACE and line["key_name"] == "user"


def test_a_refused_request_is_a_span_too_and_its_trace_is_in_the_audit_log(client, access_lines, finished_spans):
    test_client, _, user, _ = client
    response = test_client.post("/admin/reload", headers=user)
    assert response.status_code == 403
    [span] = finished_spans()
    assert span.name == "POST /admin/reload" and span.attributes["cagflow.error_code"] == "forbidden"
    trace_id = format(span.context.trace_id, "032x")
    assert access_lines()[0]["trace_id"] == trace_id
    [event] = [json.loads(line) for line in client[0].application.extensions["cagflow_router"].admission.audit
               .path.read_text().splitlines()]
    assert event["trace_id"] == trace_id and event["result"] == "denied"
