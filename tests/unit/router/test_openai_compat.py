"""The OpenAI-compatible endpoints through Flask's test client: the chat completion and its chunks, the model
list, OpenAI-shaped errors, and that a chat request is admitted and answered exactly as ``POST /v1/query``
(same keys, rate limits, concurrency cap, the same ``Query`` handed to the router). The stand-in router
answers in full answer records (``answer_record``, the real builder), as the real router does."""

from __future__ import annotations

import json
import threading

import pytest
import test_app as app_tests
from cagflow.answering.prompt import declined_answer
from cagflow.answering.record import answer_record
from cagflow.router.access import ApiError
from cagflow.config import ModelConfig
from cagflow.router.chat_requests import ALIAS, model_id
from cagflow.router.failures import triton_failure
from cagflow.router.triton_client import TritonUnavailable


keys, access_lines = app_tests.keys, app_tests.access_lines  # its fixtures, used here too

MODEL = "qwen2.5-coder-1.5b"  # the configured model's id (model.path's default)
QUESTION = "Which port does the web console use?"
OFF_TOPIC = "Can you give me a recipe for banana bread?"  # declined without the model
INVENTED = "What does the gateway cost?"  # the model's text streams, then is held unsupported
BREAKS = "Triton goes away mid-answer"
CITATION = {"doc_id": "gateway-manual", "chunk_id": "gateway-manual#3", "title": "Gateway manual",
            "section": "Ports", "score": 0.91, "quote": "The web console listens on port 8443 (HTTPS)."}
CHINESE = "网页控制台使用哪个端口？"  # answered in Chinese, from a Chinese section
CHINESE_CITATION = {"doc_id": "gateway-manual-zh", "chunk_id": "gateway-manual-zh#3", "title": "网关手册",
                    "section": "端口", "score": 0.9, "quote": "网页控制台监听 8443 端口。"}
# question -> (the text pieces streamed, answer_record fields)
SCENARIOS = {
    OFF_TOPIC: ([declined_answer(OFF_TOPIC)], {"model_answer": declined_answer(OFF_TOPIC), "answered": False,
                                               "decline_reason": "no_relevant_passage", "suggestions": [CITATION],
                                               "finish_reason": None}),
    INVENTED: (["It costs", " 9999 euros."], {"model_answer": "It costs 9999 euros.", "answered": False,
                                             "decline_reason": "unsupported_figures",
                                             "unsupported_figures": ["9999"]}),
    CHINESE: (["网页控制台使用", "端口 8443。"], {"model_answer": "网页控制台使用端口 8443。", "answered": True,
                                              "citations": [CHINESE_CITATION]}),
}
ANSWERED = (["Port", " 8443."], {"model_answer": "Port 8443.", "answered": True, "citations": [CITATION]})


def record(question: str, request_id: str, **fields) -> dict:
    values = {"decline_reason": None, "route": "cache", "route_reason": "in_scope", "cache_hit": True,
              "snapshot": {"key": "gateway-manual/1/0123456789abcdef", "doc_id": "gateway-manual", "doc_version": "1"},
              "release_id": "R1", "finish_reason": "eos", "timings_ms": {"route": 1.0, "ttft": 5.0, "total": 9.0},
              "prompt_tokens": 12, "reused_tokens": 9, "generated_tokens": 4, **fields}
    return answer_record(question=question, request_id=request_id, **values)


class RecordRouter(app_tests.StandInRouter):
    """The stand-in, answering in full answer records; the ``Query`` objects it is handed are kept."""

    def __init__(self) -> None:
        super().__init__()
        self.queries = []

    def answer(self, query, request_id):
        super().answer(query, request_id)  # the questions asked, and the gate of the concurrency tests
        self.queries.append(query)
        *_, (_, body) = self.stream(query, request_id, record_question=False)
        return body

    def stream(self, query, request_id, record_question=True):
        if query.question == "unknown document":
            raise ApiError(404, "unknown_document", "document 'nope' is not known")
        if record_question:
            self.questions.append(query.question)
            self.queries.append(query)
        pieces, fields = SCENARIOS.get(query.question, ANSWERED)
        for piece in pieces:
            yield "token", {"text": piece}
            if query.question == BREAKS:
                raise triton_failure(TritonUnavailable("Triton at 127.0.0.1:8000 refused the connection"))
        yield "answer", record(query.question, request_id, **fields)


@pytest.fixture()
def chat(keys):
    app, router = app_tests.make_app(keys, router=RecordRouter())
    return app.test_client(), router, keys[1]


def ask(question: str = QUESTION, **fields) -> dict:
    return {"model": ALIAS, "messages": [{"role": "user", "content": question}], **fields}


def chunks(response) -> list:
    """The ``data:`` payloads of a server-sent stream, JSON-decoded but for ``[DONE]``."""
    frames = [frame for frame in response.get_data(as_text=True).split("\n\n") if frame]
    assert all(frame.startswith("data: ") and "\n" not in frame for frame in frames), frames
    return [frame[6:] if frame == "data: [DONE]" else json.loads(frame[6:]) for frame in frames]


def assert_openai_error(response, status: int, code: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.get_data(as_text=True)
    assert response.mimetype == "application/json" and response.headers["X-Request-ID"]
    error = response.get_json()["error"]
    assert set(response.get_json()) == {"error"} and set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["param"] == param and error["message"]
    return error


def test_a_chat_completion_carries_the_answer_and_the_record(chat):
    test_client, router, user = chat
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": QUESTION}]
    response = test_client.post("/v1/chat/completions", json={"model": ALIAS, "messages": messages},
                                headers={**user, "X-Request-ID": "chat-1"})
    assert response.status_code == 200 and response.headers["X-Request-ID"] == "chat-1"
    body = response.get_json()
    assert (body["id"], body["object"], body["model"], body["system_fingerprint"]) == (
        "chatcmpl-chat-1", "chat.completion", MODEL, "R1")
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Port 8443.", "refusal": None},
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 12, "completion_tokens": 4, "total_tokens": 16,
                             "prompt_tokens_details": {"cached_tokens": 9}}
    assert body["cagflow"] == record(QUESTION, "chat-1", **ANSWERED[1])  # the /v1/query body, whole
    assert router.questions == [QUESTION]  # the last user message alone


def test_a_chat_request_is_the_same_query_as_v1_query(chat):
    """Tokens, the question's cleaning and the extra options reach the router as /v1/query would send them."""
    test_client, router, user = chat
    test_client.post("/v1/chat/completions", headers=user, json=ask(
        f"  {QUESTION}\n", max_completion_tokens=64, cagflow={"doc_id": "gateway-manual", "route": "cache",
                                                              "top_k": 3}))
    test_client.post("/v1/query", headers=user, json={"question": QUESTION, "max_new_tokens": 64,
                                                      "doc_id": "gateway-manual", "route": "cache", "top_k": 3})
    test_client.post("/v1/chat/completions", headers=user, json=ask(max_tokens=7, temperature=1.3, seed=5))
    parts = [{"type": "text", "text": "Which port"}, {"type": "text", "text": "does the web console use?"}]
    test_client.post("/v1/chat/completions", headers=user, json={"model": MODEL, "messages": [
        {"role": "user", "content": parts}]})
    chat_query, query_query, short, joined = router.queries
    assert chat_query == query_query
    assert short.max_new_tokens == 7 and short.route == "auto" and short.doc_id is None
    assert joined.question == "Which port\ndoes the web console use?"


def test_a_decline_is_an_ordinary_assistant_message(chat):
    test_client, _, user = chat
    body = test_client.post("/v1/chat/completions", json=ask(OFF_TOPIC), headers=user).get_json()
    assert body["choices"][0]["message"]["content"] == declined_answer(OFF_TOPIC)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["cagflow"]["answered"] is False and body["cagflow"]["decline_reason"] == "no_relevant_passage"
    assert body["cagflow"]["suggestions"] == [CITATION]


def test_streaming_sends_openai_chunks_then_done(chat):
    test_client, _, user = chat
    response = test_client.post("/v1/chat/completions", json=ask(stream=True), headers={**user, "X-Request-ID": "s1"})
    assert response.status_code == 200 and response.mimetype == "text/event-stream"
    *events, done = chunks(response)
    assert done == "[DONE]"
    assert {(event["id"], event["object"], event["model"]) for event in events} == {
        ("chatcmpl-s1", "chat.completion.chunk", MODEL)}
    assert [event["choices"][0]["delta"] for event in events] == [
        {"role": "assistant", "content": "Port"}, {"content": " 8443."}, {}]
    assert [event["choices"][0]["finish_reason"] for event in events] == [None, None, "stop"]
    assert "cagflow" not in events[0] and events[-1]["cagflow"]["citations"] == [CITATION]
    assert all("usage" not in event for event in events)


SOURCES = "\n\nSources:\n[1] Gateway manual — Ports: \u201cThe web console listens on port 8443 (HTTPS).\u201d"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_sources_can_follow_the_answer_in_the_text(chat, stream):
    """For clients that keep only the text: the citations with their quotes after the answer, in the answer's
    language; a decline gets none; the record is unchanged."""
    test_client, _, user = chat

    def content(question: str) -> tuple[str, dict]:
        response = test_client.post("/v1/chat/completions", headers=user,
                                    json=ask(question, stream=stream, cagflow={"sources": "text"}))
        if not stream:
            body = response.get_json()
            return body["choices"][0]["message"]["content"], body["cagflow"]
        *events, _ = chunks(response)
        return "".join(event["choices"][0]["delta"].get("content", "") for event in events), events[-1]["cagflow"]

    text, cagflow = content(QUESTION)
    assert text == "Port 8443." + SOURCES and cagflow["answer"] == "Port 8443."
    assert content(CHINESE)[0] == ("网页控制台使用端口 8443。\n\n来源：\n[1] 网关手册 — 端口："
                                   "\u201c网页控制台监听 8443 端口。\u201d")
    assert content(OFF_TOPIC)[0] == declined_answer(OFF_TOPIC)


def test_usage_comes_last_when_asked_for(chat):
    test_client, _, user = chat
    *events, _ = chunks(test_client.post("/v1/chat/completions", headers=user,
                                         json=ask(stream=True, stream_options={"include_usage": True})))
    assert [event["usage"] for event in events[:-1]] == [None] * 3
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == 16
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-2]["cagflow"]["answered"] is True


def test_a_streamed_decline_adds_up_and_withdrawn_text_is_flagged(chat):
    """Content streamed adds up to the final answer; text the answer policy held unsupported after it was shown
    ends with finish_reason content_filter, and the record's answer is the decline sentence."""
    test_client, _, user = chat
    *declined, _ = chunks(test_client.post("/v1/chat/completions", json=ask(OFF_TOPIC, stream=True), headers=user))
    assert "".join(event["choices"][0]["delta"].get("content", "") for event in declined) == declined_answer(OFF_TOPIC)
    assert declined[-1]["choices"][0]["finish_reason"] == "stop"
    *withdrawn, _ = chunks(test_client.post("/v1/chat/completions", json=ask(INVENTED, stream=True), headers=user))
    assert [event["choices"][0]["delta"].get("content") for event in withdrawn] == ["It costs", " 9999 euros.", None]
    final = withdrawn[-1]
    assert final["choices"][0]["finish_reason"] == "content_filter"
    assert final["cagflow"]["answer"] == declined_answer(INVENTED)
    assert final["cagflow"]["decline_reason"] == "unsupported_figures"


def test_an_error_mid_stream_is_an_openai_error_event_without_done(chat):
    test_client, _, user = chat
    response = test_client.post("/v1/chat/completions", json=ask(BREAKS, stream=True), headers=user)
    first, error = chunks(response)
    assert first["choices"][0]["delta"]["content"] == "Port"
    assert error["error"]["code"] == "triton_unavailable" and error["error"]["type"] == "server_error"
    refused = test_client.post("/v1/chat/completions", json=ask("unknown document", stream=True), headers=user)
    assert_openai_error(refused, 404, "unknown_document")  # before the first event: a plain JSON error


def test_the_models_list_names_the_configured_model_and_its_alias(chat):
    test_client, _, user = chat
    listed = test_client.get("/v1/models", headers=user).get_json()
    assert listed["object"] == "list" and [entry["id"] for entry in listed["data"]] == [MODEL, ALIAS]
    assert all(entry["object"] == "model" and entry["owned_by"] == "cagflow" for entry in listed["data"])
    assert test_client.get(f"/v1/models/{MODEL}", headers=user).get_json()["id"] == MODEL
    assert_openai_error(test_client.get("/v1/models/gpt-4o", headers=user), 404, "model_not_found", "model")
    assert_openai_error(test_client.get("/v1/models"), 401, "unauthenticated")


@pytest.mark.parametrize("path, expected", [("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b"),
                                            ("/models/tiny-llama/", "tiny-llama")])
def test_the_model_id_is_the_preset_or_the_directory_name(path, expected):
    assert model_id(ModelConfig(path=path)) == expected


@pytest.mark.parametrize("fields, status, code, param", [
    ({"model": "gpt-4o"}, 404, "model_not_found", "model"),
    ({"model": None}, 400, "invalid_request", "model"),
    ({"messages": []}, 400, "invalid_request", "messages"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, 400,
     "invalid_request", "messages"),
    ({"messages": [{"role": "wizard", "content": "q"}]}, 400, "invalid_request", "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "unsupported_parameter", "messages"),
    ({"messages": [{"role": "user", "content": 42}]}, 400, "invalid_request", "messages"),
    ({"messages": [{"role": "user", "content": "?!"}]}, 400, "invalid_request", "messages"),
    ({"messages": [{"role": "user", "content": "x" * 501}]}, 400, "invalid_request", "messages"),
    ({"max_tokens": 0}, 400, "invalid_request", "max_tokens"),
    ({"max_completion_tokens": 5000}, 400, "invalid_request", "max_completion_tokens"),
    ({"max_tokens": 5, "max_completion_tokens": 5}, 400, "invalid_request", "max_tokens"),
    ({"stream": "yes"}, 400, "invalid_request", "stream"),
    ({"stream_options": {"include_usage": True}}, 400, "invalid_request", "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, 400, "invalid_request", "stream_options"),
    ({"temperature": 3}, 400, "invalid_request", "temperature"),
    ({"seed": True}, 400, "invalid_request", "seed"),
    ({"n": 2}, 400, "unsupported_parameter", "n"),
    ({"n": True}, 400, "unsupported_parameter", "n"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "unsupported_parameter", "tools"),
    ({"stop": ["\n"]}, 400, "unsupported_parameter", "stop"),
    ({"logprobs": True}, 400, "unsupported_parameter", "logprobs"),
    ({"response_format": {"type": "json_object"}}, 400, "unsupported_parameter", "response_format"),
    ({"frobnicate": 1}, 400, "invalid_request", "frobnicate"),
    ({"cagflow": {"doc_id": "a/b"}}, 400, "invalid_request", "cagflow.doc_id"),
    ({"cagflow": {"top_k": 99}}, 400, "invalid_request", "cagflow.top_k"),
    ({"cagflow": {"question": "x"}}, 400, "invalid_request", "cagflow"),
    ({"cagflow": {"sources": "footnotes"}}, 400, "invalid_request", "cagflow.sources"),
])
def test_bad_or_unsupported_fields_are_openai_errors_naming_the_field(chat, fields, status, code, param):
    test_client, router, user = chat
    response = test_client.post("/v1/chat/completions", json={**ask(), **fields}, headers=user)
    assert_openai_error(response, status, code, param)
    assert router.questions == []


def test_no_op_values_of_unsupported_fields_and_ignored_fields_are_accepted(chat):
    test_client, router, user = chat
    fields = {"n": 1, "tools": [], "tool_choice": "none", "stop": [], "logprobs": False, "logit_bias": {},
              "response_format": {"type": "text"}, "modalities": ["text"], "audio": None, "temperature": 0.7,
              "top_p": 0.9, "presence_penalty": 0, "frequency_penalty": -1.5, "user": "u-1", "metadata": {"a": "b"},
              "store": False, "parallel_tool_calls": True, "stream": None, "max_tokens": None}
    response = test_client.post("/v1/chat/completions", json=ask(**fields), headers=user)
    assert response.status_code == 200 and router.questions == [QUESTION]


@pytest.mark.parametrize("method, kwargs, status, code", [
    ("post", {"data": "{", "content_type": "application/json"}, 400, "invalid_json"),
    ("post", {"data": "[1]", "content_type": "application/json"}, 400, "invalid_request"),
    ("post", {"data": "question=q", "content_type": "application/x-www-form-urlencoded"}, 415,
     "unsupported_media_type"),
    ("post", {"data": '{"model": "' + "x" * 5000 + '"}', "content_type": "application/json"}, 413, "body_too_large"),
    ("get", {}, 405, "method_not_allowed"),
])
def test_malformed_requests_are_openai_shaped_json_errors(chat, method, kwargs, status, code):
    test_client, _, user = chat
    assert_openai_error(getattr(test_client, method)("/v1/chat/completions", headers=user, **kwargs), status, code)


@pytest.mark.parametrize("headers, code", [
    ({}, "unauthenticated"),
    ({"Authorization": "Basic dXNlcjpwYXNz"}, "unauthenticated"),
    ({"Authorization": "Bearer cgf_000000000000_wrong"}, "invalid_api_key"),
])
def test_the_same_keys_are_required(chat, headers, code):
    test_client, router, _ = chat
    error = assert_openai_error(test_client.post("/v1/chat/completions", json=ask(), headers=headers), 401, code)
    assert error["type"] == "authentication_error" and router.questions == []


def test_chat_and_query_share_a_keys_rate_limit(keys):
    app, router = app_tests.make_app(keys, router=RecordRouter(), rate_limit_per_s=0.5, rate_limit_burst=2)
    test_client, user = app.test_client(), keys[1]
    assert test_client.post("/v1/query", json={"question": QUESTION}, headers=user).status_code == 200
    assert test_client.post("/v1/chat/completions", json=ask(), headers=user).status_code == 200
    limited = test_client.post("/v1/chat/completions", json=ask(), headers=user)
    error = assert_openai_error(limited, 429, "rate_limited")
    assert error["type"] == "rate_limit_error" and int(limited.headers["Retry-After"]) >= 1
    assert len(router.questions) == 2


def test_chat_requests_count_against_the_concurrency_cap(keys):
    app, router = app_tests.make_app(keys, router=RecordRouter(), max_concurrent_requests=1)
    router.gate = threading.Event()
    worker = threading.Thread(target=lambda: app.test_client().post("/v1/query", json={"question": "slow"},
                                                                    headers=keys[1]))
    worker.start()
    assert router.entered.acquire(timeout=10)
    refused = app.test_client().post("/v1/chat/completions", json=ask(), headers=keys[1])
    error = assert_openai_error(refused, 503, "overloaded")
    assert error["type"] == "server_error" and refused.headers["Retry-After"] == "1"
    router.gate.set()
    worker.join(10)
    assert app.test_client().post("/v1/chat/completions", json=ask(), headers=keys[1]).status_code == 200


def test_an_unexpected_failure_is_an_openai_500_without_the_traceback(keys):
    class Broken(RecordRouter):
        def answer(self, query, request_id):
            raise RuntimeError("secret internals")

    app, _ = app_tests.make_app(keys, router=Broken())
    response = app.test_client().post("/v1/chat/completions", json=ask(), headers=keys[1])
    error = assert_openai_error(response, 500, "internal")
    assert "secret internals" not in response.get_data(as_text=True) and error["type"] == "server_error"


def test_other_endpoints_keep_their_own_error_shape(chat):
    test_client, _, user = chat
    app_tests.assert_json_error(test_client.post("/v1/query", json={"question": ""}, headers=user), 400,
                                "invalid_request")
    app_tests.assert_json_error(test_client.get("/v1/completions", headers=user), 404, "not_found")


def test_the_access_log_has_the_chat_answers_route(chat, access_lines):
    test_client, _, user = chat
    test_client.post("/v1/chat/completions", json=ask(), headers={**user, "X-Request-ID": "log-chat"})
    test_client.post("/v1/chat/completions", json=ask(stream=True),
                     headers={**user, "X-Request-ID": "log-stream"}).get_data()  # written when the stream ends
    lines = {line["request_id"]: line for line in access_lines()}
    for request_id in ("log-chat", "log-stream"):
        line = lines[request_id]
        assert line["endpoint"] == "/v1/chat/completions" and line["status"] == 200
        assert line["route"] == "cache" and line["cache_hit"] is True and line["answered"] is True
