"""What `cagflow demo` prints for one answer: the first source's quote and the trace to open."""

from __future__ import annotations

from cagflow.answering.qa import QAItem
from cagflow.client.demo import _print_answer

ITEM = QAItem(id="q1", question="Which port?", reference_answer="Port 8443.", keywords=("8443",), in_scope=True,
              doc_id="manual")
REPLY = {"answer": "Port 8443.", "answered": True, "route": "cache", "cache_hit": True, "request_id": "r1",
         "citations": [{"doc_id": "manual", "title": "Manual", "section": "Ports",
                        "quote": "The web console listens on port 8443."}],
         "timings_ms": {"route": 3.0, "search": 0.0, "ttft": 500.0, "total": 900.0}, "trace_id": "ab" * 16}


def test_an_answer_shows_its_first_sources_quote_and_its_trace(capsys):
    _print_answer(1, 1, ITEM, REPLY)
    lines = capsys.readouterr().out.splitlines()
    assert "  quote    : \u201cThe web console listens on port 8443.\u201d" in lines
    assert lines[-1].endswith(f"· request r1 · trace {'ab' * 16}")


def test_without_a_quote_or_trace_neither_line_is_there(capsys):
    _print_answer(1, 1, ITEM, {**REPLY, "citations": [{**REPLY["citations"][0], "quote": None}], "trace_id": None})
    out = capsys.readouterr().out
    assert "quote" not in out and "trace" not in out
