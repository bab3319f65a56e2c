"""The OpenAI-compatible endpoints as users call them: the official ``openai`` package and LangChain's
``ChatOpenAI``, over real HTTP, against the router as deployed (gunicorn through ``RouterServer``, in a
process of its own on a free port of 127.0.0.1). Only routing is the stand-in of test_openai_compat.py,
which answers in full answer records; the real router behind the same endpoints is asked in
tests/integration/test_router.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import openai
import pytest
import requests
from cagflow.answering.prompt import declined_answer
from cagflow.devstack.process import ServerProcess, free_port
from cagflow.router.apikeys import ApiKeyStore
from langchain_openai import ChatOpenAI

COMPAT_TESTS = Path(__file__).with_name("test_openai_compat.py")
MODEL = "qwen2.5-coder-1.5b"
QUESTION = "Which port does the web console use?"
OFF_TOPIC = "Can you give me a recipe for banana bread?"  # test_openai_compat's scenarios
INVENTED = "What does the gateway cost?"
BREAKS = "Triton goes away mid-answer"
# The router's own runner with the stand-in routing: RouterServer's worker builds the app with it.
SERVE = """
import os, sys
sys.path.insert(0, os.path.dirname(sys.argv[1]))  # as conftest.py does: the folder's modules import each other
import test_openai_compat as tests
from cagflow.config import load_config
from cagflow.router.app import create_app
from cagflow.router.server import RouterServer, gunicorn_options

class StandInServer(RouterServer):
    def load(self):
        return create_app(self.config_object, router=tests.RecordRouter())

config = load_config()
StandInServer(config, gunicorn_options(config)).run()
"""


class RouterError(RuntimeError):
    pass


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    """(base URL, user key) of a router serving the stand-in routing over HTTP."""
    run_dir = tmp_path_factory.mktemp("openai-router")
    store = ApiKeyStore(run_dir / "api-keys.json")
    _, key = store.create("openai-client")
    port = free_port()
    environment = {name: value for name, value in os.environ.items() if not name.startswith("CAGFLOW")}
    environment.update({"CAGFLOW__SERVICE__HOST": "127.0.0.1", "CAGFLOW__SERVICE__PORT": str(port),
                        "CAGFLOW__SERVICE__API_KEYS_FILE": str(store.path),
                        "CAGFLOW__SERVICE__AUDIT_LOG_FILE": str(run_dir / "audit.jsonl"),
                        "CAGFLOW__SERVICE__RATE_LIMIT_PER_S": "1000", "CAGFLOW__SERVICE__RATE_LIMIT_BURST": "1000"})
    server = ServerProcess("router", run_dir / "router.log", RouterError, leader_first=True)
    server.launch([sys.executable, "-c", SERVE, str(COMPAT_TESTS)], cwd=run_dir, env=environment)
    url = f"http://127.0.0.1:{port}"
    try:
        server.wait_ready(lambda: requests.get(f"{url}/healthz", timeout=1).ok, 60, interval_s=0.2,
                          retry_on=(requests.RequestException,))
        yield url, key
    finally:
        server.stop(30)


@pytest.fixture(scope="module")
def client(router):
    url, key = router
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def test_the_openai_package_gets_the_answer_and_the_record(client):
    raw = client.chat.completions.with_raw_response.create(
        model="cagflow", messages=[{"role": "system", "content": "Answer briefly."},
                                   {"role": "user", "content": QUESTION}],
        max_completion_tokens=32, temperature=0, extra_headers={"X-Request-ID": "openai-1"})
    completion = raw.parse()
    assert raw.headers["X-Request-ID"] == "openai-1" and completion.id == "chatcmpl-openai-1"
    assert completion.model == MODEL and completion.choices[0].finish_reason == "stop"
    assert completion.choices[0].message.role == "assistant" and completion.choices[0].message.content == "Port 8443."
    assert completion.usage.total_tokens == 16 and completion.usage.prompt_tokens_details.cached_tokens == 9
    record = completion.model_extra["cagflow"]
    assert record["route"] == "cache" and record["cache_hit"] is True and record["answered"] is True
    assert record["citations"][0]["doc_id"] == "gateway-manual" and record["request_id"] == "openai-1"


def test_the_openai_package_streams_and_finds_the_record_in_the_last_chunk(client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == "Port 8443."
    finished = [chunk for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert [chunk.choices[0].finish_reason for chunk in finished] == ["stop"]
    assert finished[0].model_extra["cagflow"]["citations"][0]["section"] == "Ports"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


def test_a_decline_reads_as_an_answer_and_withdrawn_text_is_flagged(client):
    declined = client.chat.completions.create(model="cagflow", messages=[{"role": "user", "content": OFF_TOPIC}])
    assert declined.choices[0].message.content == declined_answer(OFF_TOPIC)
    assert declined.model_extra["cagflow"]["decline_reason"] == "no_relevant_passage"
    chunks = list(client.chat.completions.create(model="cagflow", stream=True,
                                                 messages=[{"role": "user", "content": INVENTED}]))
    assert chunks[-1].choices[0].finish_reason == "content_filter"
    assert chunks[-1].model_extra["cagflow"]["answer"] == declined_answer(INVENTED)


def test_the_openai_package_lists_and_retrieves_the_model(client):
    assert [model.id for model in client.models.list()] == [MODEL, "cagflow"]
    assert client.models.retrieve("cagflow").owned_by == "cagflow"


def test_the_openai_package_raises_its_own_errors_with_our_codes(router, client):
    url, _ = router
    with pytest.raises(openai.AuthenticationError) as refused:
        openai.OpenAI(base_url=f"{url}/v1", api_key="cgf_000000000000_wrong", max_retries=0).models.list()
    assert refused.value.code == "invalid_api_key" and refused.value.request_id
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": QUESTION}])
    assert (unknown.value.code, unknown.value.param) == ("model_not_found", "model")
    with pytest.raises(openai.BadRequestError) as unsupported:
        client.chat.completions.create(model="cagflow", messages=[{"role": "user", "content": QUESTION}],
                                       tools=[{"type": "function", "function": {"name": "lookup"}}])
    assert (unsupported.value.code, unsupported.value.param) == ("unsupported_parameter", "tools")
    with pytest.raises(openai.APIError) as broken:
        list(client.chat.completions.create(model="cagflow", stream=True,
                                            messages=[{"role": "user", "content": BREAKS}]))
    assert "refused the connection" in broken.value.message


def test_langchain_chat_openai_invokes_and_streams(router):
    url, key = router
    llm = ChatOpenAI(model="cagflow", base_url=f"{url}/v1", api_key=key, max_retries=0, temperature=0,
                     max_tokens=32)
    message = llm.invoke([("system", "Answer from the manuals."), ("human", QUESTION)])
    assert message.content == "Port 8443."
    assert message.response_metadata["finish_reason"] == "stop" and message.response_metadata["model_name"] == MODEL
    assert message.usage_metadata["input_tokens"] == 12 and message.usage_metadata["output_tokens"] == 4
    pieces = list(llm.stream(QUESTION))
    assert "".join(piece.content for piece in pieces) == "Port 8443."
    assert llm.invoke(OFF_TOPIC).content == declined_answer(OFF_TOPIC)
    cited = ChatOpenAI(model="cagflow", base_url=f"{url}/v1", api_key=key, max_retries=0,
                       extra_body={"cagflow": {"sources": "text"}})  # the sources in the text LangChain keeps
    with_sources = ("Port 8443.\n\nSources:\n[1] Gateway manual — Ports: "
                    "\u201cThe web console listens on port 8443 (HTTPS).\u201d")
    assert cited.invoke(QUESTION).content == with_sources
    assert "".join(piece.content for piece in cited.stream(QUESTION)) == with_sources
