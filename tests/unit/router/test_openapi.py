"""The OpenAPI description (router/openapi.yaml, served as GET /openapi.json) against the API's real responses:
openapi-core checks the document, then each request and response of every endpoint, answers and errors, with
the stand-in router of test_openai_compat.py answering in full answer records. Streamed events are checked
against the schemas the description names for them. Every endpoint the application routes is described, and
every described operation is called here."""

from __future__ import annotations

import json
import re
from typing import NamedTuple

import pytest
import test_openai_compat as compat
from cagflow.router.chat_requests import HONOURED, IGNORED, UNSUPPORTED
from cagflow.router.handlers import openapi_document
from openapi_core import Config, OpenAPI
from openapi_core.contrib.werkzeug import WerkzeugOpenAPIRequest, WerkzeugOpenAPIResponse
from openapi_schema_validator import OAS31Validator
from werkzeug.test import EnvironBuilder


keys = compat.keys
DOCUMENT = openapi_document()
# The document itself is validated here (openapi-spec-validator); a server-sent stream and the page are read as text.
AS_TEXT = ("text/event-stream", "text/html")
SPEC = OpenAPI.from_dict(DOCUMENT, config=Config(extra_media_type_deserializers={
    media_type: lambda value, **parameters: value.decode("utf-8") for media_type in AS_TEXT}))
VERBS = ("get", "post", "put", "patch", "delete")


def schema(name: str) -> OAS31Validator:
    """A validator of one component schema, its references resolved within the document."""
    return OAS31Validator({"$ref": f"#/components/schemas/{name}", "components": DOCUMENT["components"]})


class Call(NamedTuple):
    method: str
    path: str
    kwargs: dict
    key: str | None  # "user", "admin" or None
    status: int
    template: str | None = None  # the described path, where it has parameters


CALLS = [
    Call("get", "/", {}, None, 200),
    Call("get", "/healthz", {}, None, 200),
    Call("get", "/readyz", {}, None, 200),
    Call("get", "/metrics", {}, None, 200),
    Call("get", "/openapi.json", {}, None, 200),
    Call("get", "/v1/releases", {}, "user", 200),
    Call("post", "/admin/reload", {}, "admin", 200),
    Call("post", "/admin/reload", {"json": {"release_id": "R0"}}, "admin", 200),
    Call("post", "/v1/query", {"json": {"question": compat.QUESTION, "top_k": 3}}, "user", 200),
    Call("post", "/v1/query", {"json": {"question": compat.OFF_TOPIC}}, "user", 200),
    Call("post", "/v1/query", {"json": {"question": compat.QUESTION, "stream": True}}, "user", 200),
    Call("post", "/v1/chat/completions", {"json": compat.ask(max_completion_tokens=32, temperature=0)}, "user", 200),
    Call("post", "/v1/chat/completions", {"json": compat.ask(compat.OFF_TOPIC)}, "user", 200),
    Call("post", "/v1/chat/completions", {"json": compat.ask(stream=True, stream_options={"include_usage": True})},
         "user", 200),
    Call("post", "/v1/chat/completions", {"json": compat.ask(compat.INVENTED, stream=True)}, "user", 200),
    Call("get", "/v1/models", {}, "user", 200),
    Call("get", "/v1/models/cagflow", {}, "user", 200, "/v1/models/{model}"),
    Call("post", "/v1/query", {"json": {"question": ""}}, "user", 400),
    Call("post", "/v1/query", {"json": {"question": "q"}}, None, 401),
    Call("post", "/v1/query", {"json": {"question": "unknown document"}}, "user", 404),
    Call("post", "/v1/query", {"data": "question=q", "content_type": "text/plain"}, "user", 415),
    Call("get", "/v1/releases", {}, None, 401),
    Call("post", "/admin/reload", {}, "user", 403),
    Call("post", "/v1/chat/completions", {"json": compat.ask(n=2)}, "user", 400),
    Call("post", "/v1/chat/completions", {"json": {**compat.ask(), "model": "gpt-4o"}}, "user", 404),
    Call("post", "/v1/chat/completions", {"json": compat.ask()}, None, 401),
    Call("get", "/v1/models/gpt-4o", {}, "user", 404, "/v1/models/{model}"),
    Call("get", "/v1/models", {}, None, 401),
]


@pytest.fixture()
def client(keys):
    app, router = compat.app_tests.make_app(keys, router=compat.RecordRouter())
    return app, router, {"user": keys[1], "admin": keys[2], None: {}}


def send(app, headers: dict, call: Call):
    """The response, and the request as openapi-core reads it (built apart, as the app consumes its body)."""
    kwargs = {**call.kwargs, "headers": headers[call.key]}
    response = app.test_client().open(call.path, method=call.method.upper(), **kwargs)
    request = EnvironBuilder(call.path, method=call.method.upper(), **kwargs).get_request()
    return request, response


def events(response) -> list[tuple[str | None, str]]:
    """(event name, data) of each server-sent event."""
    found = []
    for frame in filter(None, response.get_data(as_text=True).split("\n\n")):
        fields = dict(line.split(": ", 1) for line in frame.split("\n"))
        found.append((fields.get("event"), fields["data"]))
    return found


def check_stream(call: Call, response) -> None:
    """Each event's data against the schema the description names for it."""
    sent = events(response)
    if call.path == "/v1/query":
        assert [name for name, _ in sent][-1] == "answer"
        schema("AnswerRecord").validate(json.loads(sent[-1][1]))
        return
    assert sent[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _, data in sent[:-1]]
    for chunk in chunks:
        schema("ChatCompletionChunk").validate(chunk)
    assert sum("cagflow" in chunk for chunk in chunks) == 1


@pytest.mark.parametrize("call", CALLS, ids=[f"{call.method} {call.path} {call.status}" for call in CALLS])
def test_every_response_matches_the_description(client, call):
    app, _, headers = client
    request, response = send(app, headers, call)
    assert response.status_code == call.status, response.get_data(as_text=True)
    if call.status < 400:
        SPEC.validate_request(WerkzeugOpenAPIRequest(request))
    SPEC.validate_response(WerkzeugOpenAPIRequest(request), WerkzeugOpenAPIResponse(response))
    if response.mimetype == "text/event-stream":
        check_stream(call, response)


def test_a_router_that_cannot_answer_is_described_too(client):
    app, router, headers = client
    router.ready = False
    request, response = send(app, headers, Call("get", "/readyz", {}, None, 503))
    assert response.status_code == 503
    SPEC.validate_response(WerkzeugOpenAPIRequest(request), WerkzeugOpenAPIResponse(response))


def test_the_description_is_served_as_json(client):
    app, _, _ = client
    assert app.test_client().get("/openapi.json").get_json() == DOCUMENT
    assert DOCUMENT["openapi"].startswith("3.1")


def _normalised(path: str) -> str:
    return re.sub(r"<(?:\w+:)?\w+>|\{\w+\}", "{}", path)


def test_every_endpoint_is_described_and_every_operation_called(client):
    app, _, _ = client
    routed = {(_normalised(rule.rule), method.lower()) for rule in app.url_map.iter_rules()
              if rule.endpoint != "static" for method in rule.methods - {"HEAD", "OPTIONS"}}
    described = {(_normalised(path), method) for path, item in DOCUMENT["paths"].items()
                 for method in item if method in VERBS}
    called = {(_normalised(call.template or call.path), call.method) for call in CALLS if call.status < 400}
    assert routed == described == called


def test_the_chat_request_schema_names_the_fields_the_parser_knows():
    described = set(DOCUMENT["components"]["schemas"]["ChatCompletionRequest"]["properties"])
    assert described == set(HONOURED) | set(IGNORED) | set(UNSUPPORTED)
