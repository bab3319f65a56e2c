"""Reading an OpenAI chat-completions request into the ``Query`` that ``POST /v1/query`` answers.

The last message is the question and must be the user's; earlier messages (system and developer ones too)
are accepted and not read: every question is answered from the documents alone, under the same answer
policy. Each field OpenAI defines is either honoured, accepted and ignored (sampling: decoding is greedy and
answers are held to their documents, so there is nothing for it to change), or refused as
``unsupported_parameter`` when honouring it is impossible and ignoring it would mislead (tools, stop
sequences, log probabilities, several choices). Unknown fields are errors, as in OpenAI's API. Pure: no Flask.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..config import ModelConfig, ServiceConfig
from .access import ApiError, Query, parse_query

ALIAS = "cagflow"  # always names the configured model, so a client's setting survives a model change
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
HONOURED = ("model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "cagflow")
CAGFLOW_OPTIONS = ("doc_id", "top_k", "route", "sources")  # /v1/query's own options, and where sources go
SOURCES = ("record", "text")  # the sources in the cagflow record only, or also after the answer's text


def _number(low: float, high: float) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high


def _of(*types: type) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, types) and not (isinstance(value, bool) and bool not in types)


# Accepted (when well-formed) and ignored: what each must be.
IGNORED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "temperature": (_number(0, 2), "a number from 0 to 2"),
    "top_p": (_number(0, 1), "a number from 0 to 1"),
    "presence_penalty": (_number(-2, 2), "a number from -2 to 2"),
    "frequency_penalty": (_number(-2, 2), "a number from -2 to 2"),
    "seed": (_of(int), "an integer"),
    "user": (_of(str), "a string"),
    "safety_identifier": (_of(str), "a string"),
    "prompt_cache_key": (_of(str), "a string"),
    "service_tier": (_of(str), "a string"),
    "metadata": (_of(dict), "an object"),
    "store": (_of(bool), "true or false"),
    "parallel_tool_calls": (_of(bool), "true or false"),  # nothing to run in parallel without tools
}
# Refused unless null or the value that asks for nothing: (such values, why).
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "n": ((1,), "one answer per request (n: 1)"),
    "tools": (([],), "answers come from the documents; no tools are called"),
    "tool_choice": (("none",), "answers come from the documents; no tools are called"),
    "functions": (([],), "answers come from the documents; no functions are called"),
    "function_call": (("none",), "answers come from the documents; no functions are called"),
    "response_format": (({"type": "text"},), "answers are plain text"),
    "stop": (([], ""), "stop sequences are not applied; use max_completion_tokens to bound an answer"),
    "logprobs": ((False,), "token log probabilities are not returned"),
    "top_logprobs": ((0,), "token log probabilities are not returned"),
    "logit_bias": (({},), "decoding is not biased"),
    "modalities": ((["text"],), "answers are text only"),
    "audio": ((), "answers are text only"),
    "prediction": ((), "predicted outputs are not supported"),
    "web_search_options": ((), "answers come from the documents, not the web"),
    "reasoning_effort": ((), "the model does not reason in separate steps"),
    "verbosity": ((), "the answer's length is the model's, within max_completion_tokens"),
}


@dataclass(frozen=True)
class ChatRequest:
    query: Query
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the token counts
    sources_in_text: bool = False  # cagflow.sources "text": for clients that keep only the message's text


def _invalid(message: str, param: str | None) -> ApiError:
    return ApiError(400, "invalid_request", message, param=param)


def model_id(model: ModelConfig) -> str:
    """The id clients name: the configured preset (``qwen2.5-coder-1.5b``), or the model directory's name."""
    return Path(model.path.rstrip("/")).name or model.path


def check_model(requested: Any, served: str) -> None:
    """``model`` names the configured model or its alias; anything else is OpenAI's 404 ``model_not_found``."""
    if not isinstance(requested, str) or not requested:
        raise _invalid("model is required: name the model GET /v1/models lists", "model")
    if requested not in (served, ALIAS):
        raise ApiError(404, "model_not_found", f"the model {requested!r} does not exist here; use {served!r} "
                       f"(or {ALIAS!r}, which names whichever model is configured)", param="model")


def _check_fields(body: dict[str, Any]) -> None:
    unknown = sorted(set(body) - set(HONOURED) - set(IGNORED) - set(UNSUPPORTED))
    if unknown:
        raise _invalid(f"unrecognized request arguments: {', '.join(unknown)}", unknown[0])
    for name, (accepts, expected) in IGNORED.items():
        if body.get(name) is not None and not accepts(body[name]):
            raise _invalid(f"{name} must be {expected}", name)
    for name, (harmless, why) in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not any(type(value) is type(same) and value == same for same in harmless):
            raise ApiError(400, "unsupported_parameter", f"{name} is not supported: {why}", param=name)


def _text(content: Any) -> str:
    """A message's text: a string, or an array of text parts (joined by line breaks)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(isinstance(part, dict) for part in content):
        others = sorted({str(part.get("type")) for part in content} - {"text"})
        if others:
            raise ApiError(400, "unsupported_parameter", f"only text is read; the question has {', '.join(others)} "
                           "parts", param="messages")
        if all(isinstance(part.get("text"), str) for part in content):
            return "\n".join(part["text"] for part in content)
    raise _invalid("the last message's content must be a string or an array of text parts", "messages")


def _question(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages must be a non-empty array; the last one is the user's question", "messages")
    for number, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise _invalid(f"messages[{number}] must be an object with a role ({', '.join(ROLES)})", "messages")
    if messages[-1]["role"] != "user":
        raise _invalid(f"the last message must be the user's question, not a {messages[-1]['role']} message",
                       "messages")
    return _text(messages[-1].get("content"))


def _max_tokens(body: dict[str, Any]) -> tuple[str, Any]:
    given = [name for name in ("max_completion_tokens", "max_tokens") if body.get(name) is not None]
    if len(given) > 1:
        raise _invalid("send max_completion_tokens or max_tokens, not both", given[1])
    return (given[0], body[given[0]]) if given else ("max_completion_tokens", None)


def _include_usage(body: dict[str, Any], stream: Any) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if stream is not True:
        raise _invalid("stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
        raise _invalid('stream_options must be {"include_usage": true|false}', "stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise _invalid("stream_options.include_usage must be true or false", "stream_options")
    return include


def _options(body: dict[str, Any]) -> dict[str, Any]:
    options = body.get("cagflow")
    if options is None:
        return {}
    if not isinstance(options, dict) or set(options) - set(CAGFLOW_OPTIONS):
        raise _invalid(f"cagflow must be an object with any of {', '.join(CAGFLOW_OPTIONS)}", "cagflow")
    return options


def parse_chat(body: Any, limits: ServiceConfig, served: str) -> ChatRequest:
    """Validate a chat-completions body and read it into a ``Query`` (through ``parse_query``, so a question
    passes the same checks on both endpoints); errors name OpenAI's field as ``param``."""
    if not isinstance(body, dict):
        raise _invalid(f"the body must be a JSON object, got {type(body).__name__}", None)
    check_model(body.get("model"), served)
    _check_fields(body)
    question = _question(body.get("messages"))
    tokens_field, max_tokens = _max_tokens(body)
    stream = body.get("stream") if body.get("stream") is not None else False
    include_usage = _include_usage(body, stream)
    options = _options(body)
    sources = options.pop("sources", "record")
    if sources not in SOURCES:
        raise _invalid(f"cagflow.sources must be one of {', '.join(SOURCES)}, got {sources!r}", "cagflow.sources")
    fields = {"question": question, "stream": stream, "max_new_tokens": max_tokens, **options}
    try:
        return ChatRequest(parse_query(fields, limits), include_usage, sources == "text")
    except ApiError as exc:  # our field names, as the client sent them
        if exc.param == "question":
            exc.message = f"the last message (the question): {exc.message}"
        exc.param = {"question": "messages", "max_new_tokens": tokens_field}.get(
            exc.param, f"cagflow.{exc.param}" if exc.param in CAGFLOW_OPTIONS else exc.param)
        raise
