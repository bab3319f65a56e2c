"""What every fault scenario runs with: the stack, the sample questions, a load generator asking them, and
the checks each scenario records (``faults`` runs the scenarios of ``fault_scenarios`` with it)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from .faultstack import FaultStack
from .load import LoadGenerator, LoadSummary

CACHE_ROUTES = ("cache", "cache+retrieval")


@dataclass
class Check:
    name: str
    passed: bool
    detail: str = ""


@dataclass
class ScenarioResult:
    name: str
    what: str
    seconds: float = 0.0
    load: dict = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    integrity: dict = field(default_factory=dict)
    skipped: str | None = None

    @property
    def passed(self) -> bool:
        return (self.skipped is None and all(check.passed for check in self.checks)
                and self.load.get("unintended", 0) == 0 and bool(self.integrity.get("intact")))

    def to_dict(self) -> dict:
        return {"name": self.name, "what": self.what, "seconds": round(self.seconds, 1), "passed": self.passed,
                "skipped": self.skipped, "load": self.load, "integrity": self.integrity,
                "checks": [vars(check) for check in self.checks]}


class Bench:
    """What every scenario uses: the stack, the questions per document, and the load it runs under."""

    def __init__(self, stack: FaultStack, questions: list[dict], clients: int) -> None:
        self.stack = stack
        self.questions = questions
        self.clients = clients
        self.result: ScenarioResult | None = None

    def check(self, name: str, passed: bool, detail: str = "") -> bool:
        assert self.result is not None
        self.result.checks.append(Check(name, bool(passed), detail))
        self.stack.say(f"    [{'ok' if passed else 'FAILED'}] {name}{': ' + detail if detail else ''}")
        return bool(passed)

    def about(self, *doc_ids: str) -> list[dict]:
        """Sample questions about these fixed documents, and about the variable ones (retrieval)."""
        return [row for row in self.questions if row.get("doc_id") in doc_ids or row.get("tier") == "variable"]

    def load(self, questions: list[dict] | None = None, stream_share: float = 0.25) -> LoadGenerator:
        generator = LoadGenerator(self.stack.url, self.stack.user_key, questions or self.questions, self.clients,
                                  timeout_s=300, max_new_tokens=self.stack.max_new_tokens,
                                  stream_share=stream_share, seed=len(self.result.checks) if self.result else 0)
        generator.start()
        return generator

    def finish(self, generator: LoadGenerator) -> LoadSummary:
        summary = generator.stop(grace_s=300)
        assert self.result is not None
        self.result.load = summary.to_dict()
        return summary

    def probe(self, doc_id: str | None, question: str | None = None, **body) -> dict:
        """One request of this bench's own, with a question no earlier request asked (so no answer comes
        from the answer cache); the reply's status is kept under ``status``."""
        question = question or next(row["question"] for row in self.questions if row.get("doc_id") == doc_id)
        status, reply = self.stack.ask(f"{question} ({secrets.token_hex(3)})", doc_id, **body)
        return {**reply, "status": status}


def route_of(reply: dict) -> str:
    """How a probe was answered, for a check's detail: its route (and fallback), or its error."""
    if reply.get("status") != 200:
        return f"{reply.get('status')} {(reply.get('error') or {}).get('code')}"
    if reply.get("fallback_reason"):
        return f"{reply.get('route')} (fallback: {reply.get('fallback_reason')})"
    return str(reply.get("route"))


def served_from_cache(reply: dict) -> bool:
    """A probe answered on a cache route from a resident snapshot."""
    return reply.get("status") == 200 and reply.get("route") in CACHE_ROUTES and bool(reply.get("cache_hit"))
