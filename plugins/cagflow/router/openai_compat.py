"""OpenAI-compatible endpoints: ``POST /v1/chat/completions`` and ``GET /v1/models``, so that the openai
package, LangChain's ``ChatOpenAI`` and other OpenAI clients ask the documents without code of ours.

A chat request becomes the same ``Query`` as ``POST /v1/query`` (``chat_requests``) and is answered by
``handlers.answer``: the same keys, rate limits, concurrency cap, routing and answer policy. A decline is an
ordinary assistant message (the decline sentence). The ``/v1/query`` answer body travels whole as the extra
top-level ``cagflow`` object, which OpenAI clients ignore; in a stream, in the chunk with ``finish_reason``.
A client that keeps only the message's text (LangChain's ``ChatOpenAI``, chat front ends) asks for
``"cagflow": {"sources": "text"}`` and gets the sources with their quotes after the answer (``sources_text``).
Errors take OpenAI's shape (``errors``).
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterable

from flask import Blueprint, Response, g

from ..answering.record import citation_label
from ..documents.text import language
from .access import ApiError
from .chat_requests import ALIAS, model_id, parse_chat
from .errors import json_response
from .handlers import answer, dependencies, read_json

openai_api = Blueprint("openai", __name__)
STARTED = int(time.time())  # the models' "created": when this router started serving them


def _finish_reason(record: dict[str, Any]) -> str:
    """The engine's "eos" (or no model call, for a decline without one) is OpenAI's "stop"."""
    return "length" if record.get("finish_reason") == "length" else "stop"


def _usage(record: dict[str, Any]) -> dict[str, Any]:
    """Token counts; the prompt tokens reused from a snapshot or stored passage states are OpenAI's cached ones."""
    tokens = record.get("tokens") or {}
    prompt, generated = tokens.get("prompt", 0), tokens.get("generated", 0)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": tokens.get("reused", 0)}}


def sources_text(record: dict[str, Any]) -> str:
    """An answer's citations as text to follow it, numbered, each with its quote; empty for a decline.

    Sources:
    [1] Operations and Incident Response Policy — Acknowledgement and escalation: “| SEV1 | 5 minutes | … |”
    """
    if not record.get("answered") or not record.get("citations"):
        return ""
    chinese = language(record["answer"]) == "zh"
    lines = ["来源：" if chinese else "Sources:"]
    for number, citation in enumerate(record["citations"], start=1):
        quote = citation.get("quote")
        lines.append(f"[{number}] {citation_label(citation)}"
                     + (f"{'：' if chinese else ': '}\u201c{quote}\u201d" if quote else ""))
    return "\n\n" + "\n".join(lines)


def completion(record: dict[str, Any], model: str, created: int, sources_in_text: bool = False) -> dict[str, Any]:
    """The answer as a ``chat.completion`` object."""
    content = record["answer"] + (sources_text(record) if sources_in_text else "")
    return {"id": f"chatcmpl-{g.request_id}", "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": record.get("release_id"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content, "refusal": None},
                         "logprobs": None, "finish_reason": _finish_reason(record)}],
            "usage": _usage(record), "cagflow": record}


class ChatChunks:
    """The router's stream as ``chat.completion.chunk`` events: the text as it is decoded, then a chunk with
    ``finish_reason`` and the ``cagflow`` record, a usage chunk when asked for, and ``data: [DONE]``.

    The text streamed is the model's; the answer policy judges it only once it is complete. When the final
    answer goes on from what was shown, the rest follows as content, so the content adds up to the non-streamed
    answer. When it does not (the model's text was held unsupported and declined after it was shown),
    ``finish_reason`` is ``content_filter``, as OpenAI's asynchronous content filter says that text already sent
    was withdrawn, and ``cagflow.answer`` holds the decline sentence."""

    def __init__(self, model: str, created: int, include_usage: bool, sources_in_text: bool = False):
        self.head = {"id": f"chatcmpl-{g.request_id}", "object": "chat.completion.chunk", "created": created,
                     "model": model}
        self.include_usage = include_usage
        self.sources_in_text = sources_in_text
        self.shown = ""
        self.started = False

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        usage = {"usage": None} if self.include_usage else {}
        return f"data: {json.dumps({**self.head, 'choices': choices, **usage, **extra}, ensure_ascii=False)}\n\n"

    def _delta(self, delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> str:
        return self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}], **extra)

    def _content(self, text: str) -> str:
        delta = {"content": text} if self.started else {"role": "assistant", "content": text}
        self.started = True
        self.shown += text
        return self._delta(delta)

    def frames(self, event: str, data: dict[str, Any]) -> Iterable[str]:
        if event == "token":
            return [self._content(data["text"])] if data["text"] else []
        final, shown = data["answer"].strip(), self.shown.strip()
        withdrawn = not final.startswith(shown)
        frames = []
        if not withdrawn:
            rest = final[len(shown):]
            rest = rest.lstrip() if self.shown != self.shown.rstrip() else rest
            if rest or not self.started:
                frames.append(self._content(rest))
            sources = sources_text(data) if self.sources_in_text else ""
            if sources:
                frames.append(self._content(sources))
        frames.append(self._delta({}, "content_filter" if withdrawn else _finish_reason(data), cagflow=data))
        if self.include_usage:
            frames.append(self._chunk([], usage=_usage(data)))
        return frames

    def error(self, body: dict[str, Any]) -> str:
        return f"data: {json.dumps(body)}\n\n"  # the openai package raises APIError on such an event

    def end(self) -> Iterable[str]:
        return ["data: [DONE]\n\n"]


@openai_api.post("/v1/chat/completions")
def chat_completions() -> Response:
    deps = dependencies()
    deps.admission.authenticate()
    model = model_id(deps.model)
    chat = parse_chat(read_json(), deps.service, model)
    created = int(time.time())
    return answer(chat.query, lambda record: json_response(completion(record, model, created, chat.sources_in_text)),
                  ChatChunks(model, created, chat.include_usage, chat.sources_in_text))


def _models() -> list[dict[str, Any]]:
    """The configured model, and the alias that names whichever model is configured."""
    served = model_id(dependencies().model)
    return [{"id": name, "object": "model", "created": STARTED, "owned_by": "cagflow"}
            for name in dict.fromkeys([served, ALIAS])]


@openai_api.get("/v1/models")
def models() -> Response:
    dependencies().admission.authenticate()
    return json_response({"object": "list", "data": _models()})


@openai_api.get("/v1/models/<path:name>")
def model(name: str) -> Response:
    dependencies().admission.authenticate()
    found = [entry for entry in _models() if entry["id"] == name]
    if not found:
        raise ApiError(404, "model_not_found", f"the model {name!r} does not exist here", param="model")
    return json_response(found[0])
