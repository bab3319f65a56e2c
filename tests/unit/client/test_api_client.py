"""The API client and `cagflow ask` against a small real HTTP server speaking the API's wire format."""

import json
import threading

import pytest
from cagflow.client.api_client import ApiClient, ApiError, ServerSentEvent, parse_sse
from cagflow.cli import main
from cagflow.config import load_config
from cagflow.devstack.process import free_port
from flask import Flask, Response, jsonify, request
from werkzeug.serving import make_server

KEY = "cgf_0123456789ab_secret"
ANSWER = {"answer": "Port 8443 — über TLS 🔒", "route": "cache", "cache_hit": True, "fallback_reason": None,
          "snapshot": {"key": "skerry-admin-manual/1/abc", "doc_id": "skerry-admin-manual", "doc_version": "1"},
          "citations": [], "timings_ms": {"route": 1.2, "search": None, "ttft": 41.0, "total": 120.5},
          "request_id": "req-1"}


def sse(event, data):
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def api_app(received: list) -> Flask:
    app = Flask("api-double")

    def error(status, code, message):
        return jsonify({"error": {"code": code, "message": message}, "request_id": "req-err"}), status

    @app.post("/v1/query")
    def query():
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return error(401, "invalid_api_key", "the API key is not valid")
        body = request.get_json()
        received.append(body)
        if body["question"].startswith("rate limited"):  # "rate limited N S": refused N times, Retry-After S
            _, _, refusals, seconds = body["question"].split()
            if sum(item["question"] == body["question"] for item in received) <= int(refusals):
                response = error(429, "rate_limited", "more than 5 requests/s (burst 20) for this key")
                return response[0], 429, {"Retry-After": seconds}
        if body["question"] == "bad gateway":
            return Response("<html><body>502 Bad Gateway</body></html>", status=502, mimetype="text/html")
        if not body["stream"]:
            return jsonify(ANSWER)

        def events():
            yield ": keep-alive comment\n\n"
            for piece in ("Port 8443", " — über", " TLS 🔒"):
                yield sse("token", {"text": piece})
            if body["question"] == "fail midway":
                yield sse("error", {"error": {"code": "triton_unavailable", "message": "Triton went away"},
                                    "request_id": "req-2"})
                return
            yield sse("answer", ANSWER)

        return Response(events(), mimetype="text/event-stream")

    @app.get("/healthz")
    def healthz():
        return jsonify({"status": "ok"})

    @app.get("/readyz")
    def readyz():
        return jsonify({"ready": False, "degraded": ["triton: not reachable"]}), 503

    return app


@pytest.fixture
def api():
    received: list = []
    server = make_server("127.0.0.1", 0, api_app(received), threaded=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", received
    server.shutdown()
    thread.join()


def test_query_sends_every_field_and_returns_the_record(api):
    url, received = api
    with ApiClient(url, KEY) as client:
        assert client.query("Which port?", doc_id="skerry-admin-manual", top_k=3, max_new_tokens=16) == ANSWER
        assert client.query("Which port?", route="retrieval") == ANSWER
    assert received == [{"question": "Which port?", "doc_id": "skerry-admin-manual", "top_k": 3,
                         "max_new_tokens": 16, "stream": False, "route": "auto"},
                        {"question": "Which port?", "doc_id": None, "top_k": None, "max_new_tokens": None,
                         "stream": False, "route": "retrieval"}]


def test_stream_yields_tokens_then_the_answer(api):
    url, _ = api
    with ApiClient(url, KEY) as client:
        events = list(client.stream("Which port?"))
    assert [event["event"] for event in events] == ["token", "token", "token", "answer"]
    assert "".join(event["data"]["text"] for event in events[:3]) == ANSWER["answer"]
    assert events[-1]["data"] == ANSWER


def test_an_error_event_raises(api):
    url, _ = api
    with ApiClient(url, KEY) as client, pytest.raises(ApiError) as raised:
        list(client.stream("fail midway"))
    assert (raised.value.code, raised.value.request_id) == ("triton_unavailable", "req-2")


def test_error_bodies_become_api_errors(api):
    url, _ = api
    with ApiClient(url, "cgf_wrong_key") as client, pytest.raises(ApiError) as raised:
        client.query("Which port?")
    assert (raised.value.status, raised.value.code, raised.value.request_id) == (401, "invalid_api_key", "req-err")
    with ApiClient(url, KEY) as client, pytest.raises(ApiError) as raised:
        client.query("bad gateway")
    assert raised.value.status == 502 and raised.value.code == "unexpected_response"
    assert "502 Bad Gateway" in raised.value.message


def test_a_rate_limited_request_waits_as_told_and_is_sent_again(api):
    url, received = api
    with ApiClient(url, KEY) as client:
        assert client.query("rate limited 2 0") == ANSWER  # two 429s with "Retry-After: 0", then the answer
    assert [body["question"] for body in received] == ["rate limited 2 0"] * 3
    with ApiClient(url, KEY, rate_limit_wait_s=5) as client, pytest.raises(ApiError) as raised:
        client.query("rate limited 1 60")  # asked to wait longer than the client may: the error, at once
    assert (raised.value.status, raised.value.code) == (429, "rate_limited")
    with ApiClient(url, KEY, rate_limit_wait_s=0) as client, pytest.raises(ApiError):
        client.query("rate limited 1 0")


def test_health_and_readiness(api):
    url, _ = api
    with ApiClient(url, None) as client:
        assert client.health() == {"status": "ok"}
        assert client.ready() == (503, {"ready": False, "degraded": ["triton: not reachable"]})


def test_no_server_is_status_zero_unreachable():
    with ApiClient(f"http://127.0.0.1:{free_port()}", KEY, timeout_s=5) as client, pytest.raises(ApiError) as raised:
        client.health()
    assert (raised.value.status, raised.value.code) == (0, "unreachable")
    assert "refused" in raised.value.message.lower()


def test_sse_parsing_follows_the_specification():
    lines = [": comment", "event: token", "data: first", "data:second", "data:  third", "id: 7", "",
             "retry: 100", "", "data: {\"a\": 1}", "unknown: x", "", "event: answer", "data: cut off"]
    assert list(parse_sse(lines)) == [
        ServerSentEvent("token", "first\nsecond\n third", "7"),  # one leading space is part of the syntax
        ServerSentEvent("message", '{"a": 1}', "7"),  # the last id sticks, the event name does not
        ServerSentEvent("answer", "cut off", "7"),
    ]


def test_default_url_reaches_a_wildcard_bind_on_loopback():
    config = load_config(environ={"CAGFLOW__SERVICE__HOST": "0.0.0.0", "CAGFLOW__SERVICE__PORT": "9001"})
    assert config.service.base_url() == "http://127.0.0.1:9001"


# --- `cagflow ask` over the API


@pytest.fixture
def api_key(monkeypatch):
    monkeypatch.setenv("CAGFLOW_API_KEY", KEY)


def ask(capsys, *argv):
    code = main(["ask", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_ask_prints_the_answer_and_how_it_was_made(api, api_key, capsys):
    url, received = api
    code, out, err = ask(capsys, "Which port?", "--url", url, "--doc-id", "skerry-admin-manual", "--top-k", "2")
    assert code == 0 and out == ANSWER["answer"] + "\n"
    assert "cache · skerry-admin-manual · cache hit · ttft 41 ms · total 120 ms · request req-1" in err
    assert received[0]["doc_id"] == "skerry-admin-manual" and received[0]["top_k"] == 2


def test_ask_streams_tokens(api, api_key, capsys):
    url, received = api
    code, out, err = ask(capsys, "Which port?", "--url", url, "--stream")
    assert code == 0 and out == ANSWER["answer"] + "\n" and "request req-1" in err
    assert received[0]["stream"] is True


def test_ask_json(api, api_key, capsys):
    url, _ = api
    code, out, _ = ask(capsys, "Which port?", "--url", url, "--json")
    assert code == 0 and json.loads(out) == ANSWER
    code, out, _ = ask(capsys, "Which port?", "--url", url, "--json", "--stream")
    events = [json.loads(line) for line in out.splitlines()]
    assert events[-1] == {"event": "answer", "data": ANSWER, "id": None}


def test_ask_with_a_wrong_key_says_where_keys_come_from(api, capsys, monkeypatch):
    url, _ = api
    monkeypatch.setenv("CAGFLOW_API_KEY", "cgf_0_wrong")
    code, _, err = ask(capsys, "Which port?", "--url", url)
    assert code == 2 and "HTTP 401 invalid_api_key" in err and "CAGFLOW_API_KEY" in err
    assert "cagflow keys init-local" in err and "Traceback" not in err
    code, out, err = ask(capsys, "Which port?", "--url", url, "--stream")
    assert code == 2 and out == "" and "HTTP 401" in err


def test_ask_without_a_server_says_how_to_start_it(api_key, capsys):
    code, _, err = ask(capsys, "Which port?", "--url", f"http://127.0.0.1:{free_port()}")
    assert code == 2 and "`make run` or `cagflow serve`" in err and len(err.splitlines()) == 1


def test_ask_stream_error_is_one_line(api, api_key, capsys):
    url, _ = api
    code, out, err = ask(capsys, "fail midway", "--url", url, "--stream")
    assert code == 2 and out == "Port 8443 — über TLS 🔒\n"
    assert err.strip().endswith("triton_unavailable: Triton went away (request req-2)")


def test_local_and_api_options_do_not_mix(capsys):
    code, _, err = ask(capsys, "Which port?", "--no-cache")
    assert code == 2 and "--no-cache and --store only apply with --local" in err
    code, _, err = ask(capsys, "Which port?", "--local", "--stream")
    assert code == 2 and "leave them out with --local" in err
