"""The answer record: one shape for the REST API's answers and ``cagflow ask --local --json``, so a script
written against one reads the other."""

from __future__ import annotations

from typing import Any, Sequence

from .prompt import WORDINGS, declined_answer


def answer_record(*, question: str, model_answer: str, answered: bool, decline_reason: str | None, route: str,
                  route_reason: str | None, cache_hit: bool, snapshot: dict[str, Any] | None,
                  release_id: str | None, finish_reason: str | None, timings_ms: dict[str, float],
                  prompt_tokens: int, reused_tokens: int, generated_tokens: int,
                  unsupported_figures: Sequence[str] = (), citations: Sequence[dict] = (),
                  suggestions: Sequence[dict] = (), fallback_reason: str | None = None,
                  scope_score: float | None = None, best_score: float | None = None, relevance: float | None = None,
                  answer_source: str | None = "computed", request_id: str | None = None,
                  trace_id: str | None = None, rules_fired: Sequence[str] = ()) -> dict[str, Any]:
    """A declined answer reads as the decline sentence in the question's language; what the model said
    instead is kept in ``model_answer`` when it differs (an answer held unsupported)."""
    declines = {words.declined for words in WORDINGS.values()}
    return {
        "answer": model_answer if answered else declined_answer(question), "answered": answered,
        "decline_reason": decline_reason, "route": route, "route_reason": route_reason, "cache_hit": cache_hit,
        "fallback_reason": fallback_reason, "snapshot": snapshot, "citations": list(citations),
        "suggestions": list(suggestions), "unsupported_figures": list(unsupported_figures),
        "scope_score": scope_score, "best_score": best_score, "relevance": relevance, "answer_source": answer_source,
        "release_id": release_id, "finish_reason": finish_reason, "timings_ms": timings_ms,
        "tokens": {"prompt": prompt_tokens, "reused": reused_tokens, "generated": generated_tokens},
        "request_id": request_id, "trace_id": trace_id, "rules_fired": list(rules_fired),
        **({} if answered or model_answer.strip() in declines else {"model_answer": model_answer}),
    }


def citation_label(citation: dict[str, Any]) -> str:
    """How a citation reads to a person: "title — section", or its document id when it has neither."""
    return " — ".join(part for part in (citation.get("title"), citation.get("section")) if part) \
        or citation.get("doc_id", "")
