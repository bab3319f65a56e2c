"""``cagflow trace``'s tree from a collector's reply (the real collector: tests/integration/test_router.py)."""

from __future__ import annotations

import json

import pytest
import requests
from cagflow.cli import main
from cagflow.client.traces import render, span_tree

TRACE = {"traceID": "ab" * 16, "processes": {"p1": {"serviceName": "cagflow-router"},
                                             "p2": {"serviceName": "cagflow-triton"}},
         "spans": [
             {"spanID": "s3", "operationName": "cag_llm answer", "processID": "p2", "startTime": 1_000_400,
              "duration": 900, "references": [{"refType": "CHILD_OF", "spanID": "s2"}],
              "tags": [{"key": "cagflow.route", "value": "cache"}]},
             {"spanID": "s1", "operationName": "POST /v1/query", "processID": "p1", "startTime": 1_000_000,
              "duration": 1500, "references": [{"refType": "CHILD_OF", "spanID": "caller"}], "tags": []},
             {"spanID": "s2", "operationName": "triton cag_llm", "processID": "p1", "startTime": 1_000_300,
              "duration": 1100, "references": [{"refType": "CHILD_OF", "spanID": "s1"}],
              "tags": [{"key": "otel.status_code", "value": "ERROR"}]},
             {"spanID": "s4", "operationName": "plan", "processID": "p1", "startTime": 1_000_010, "duration": 200,
              "references": [{"refType": "CHILD_OF", "spanID": "s1"}], "tags": []}]}


def test_the_tree_nests_spans_under_their_parents_in_start_order():
    [root] = span_tree(TRACE)  # the caller's span is not in the trace: the router's is the root
    assert root.name == "POST /v1/query" and [child.name for child in root.children] == ["plan", "triton cag_llm"]
    text = render("ab" * 16, [root], attributes=True)
    lines = text.splitlines()
    assert lines[0] == f"trace {'ab' * 16}: 1.5 ms"
    assert lines[1].startswith("POST /v1/query") and "+      0.0 ms       1.5 ms" in lines[1]
    assert lines[2].startswith("├─ plan") and lines[3].startswith("└─ triton cag_llm") and lines[3].endswith("ERROR")
    assert lines[4].startswith("   └─ cag_llm answer") and "cagflow-triton" in lines[4] and "+      0.4 ms" in lines[4]
    assert lines[5].strip() == "route=cache"


def test_a_bad_id_or_an_unreachable_collector_is_one_line_not_a_traceback(capsys, monkeypatch):
    assert main(["trace", "not-a-trace"]) == 2
    assert "is not a trace id" in capsys.readouterr().err

    def refuse(*args, **kwargs):
        raise requests.ConnectionError("refused")

    monkeypatch.setattr(requests, "get", refuse)
    assert main(["trace", "ab" * 16, "--query-url", "http://127.0.0.1:9"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "cannot reach the trace collector" in error


@pytest.mark.parametrize("status, body", [(404, {"data": None}), (200, {"data": []})])
def test_an_unknown_trace_says_so(capsys, monkeypatch, status, body):
    reply = requests.Response()
    reply.status_code, reply._content = status, json.dumps(body).encode()
    monkeypatch.setattr(requests, "get", lambda *args, **kwargs: reply)
    assert main(["trace", "ab" * 16]) == 2
    assert "holds no trace" in capsys.readouterr().err
