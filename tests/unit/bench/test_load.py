"""The load generator against a small real HTTP server that answers, refuses, fails, drops connections,
hangs and streams as the question asks: every reply is classified right, stop is bounded, and outcomes
from many client threads are neither lost nor duplicated. `cagflow bench load` end to end on the same
server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from cagflow.bench.load import LoadGenerator
from cagflow.bench.memory import MemorySampler, memory_growth, plot_memory, service_pids
from cagflow.cli import main
from cagflow.devstack.process import free_port

KEY = "cgf_0123456789ab_secret"
REPO = Path(__file__).resolve().parents[3]
RECORD = {"answer": "Port 8443.", "answered": True, "route": "cache", "release_id": "r1",
          "snapshot": {"key": "skerry-admin-manual/1/abc", "doc_id": "skerry-admin-manual"},
          "answer_source": "computed", "request_id": "req-1"}


class FakeApi(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # a hanging handler must not hold up the test's teardown

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        self.in_flight = self.most_in_flight = 0
        self.release = threading.Event()  # ends the hanging handlers
        self.default = "ok"  # what a question without a case of its own gets

    def handle_error(self, request, client_address) -> None:
        pass  # a client that hangs up first (the timeout and stop tests) is expected here

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeApi

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes, content_type: str = "application/json", **headers: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, code: str, **headers: str) -> None:
        self._send(status, json.dumps({"error": {"code": code, "message": code}, "request_id": "req-e"}).encode(),
                   **headers)

    def _chunk(self, text: str) -> None:
        data = text.encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _stream(self, events: list[tuple[str, str]], finished: bool = True) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._chunk(": keep-alive\n\n")
        for event, data in events:
            self._chunk(f"event: {event}\ndata: {data}\n\n")
        if finished:
            self.wfile.write(b"0\r\n\r\n")
        else:  # the connection goes away in the middle of the body
            self.close_connection = True

    def do_GET(self) -> None:
        self._send(200, b'{"status": "alive"}')

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.bodies.append(body)
            self.server.in_flight += 1
            self.server.most_in_flight = max(self.server.most_in_flight, self.server.in_flight)
        try:
            self._reply(body)
        finally:
            with self.server.lock:
                self.server.in_flight -= 1

    def _reply(self, body: dict) -> None:
        if self.headers.get("Authorization") != f"Bearer {KEY}":
            return self._error(401, "invalid_api_key")
        question = body["question"] if body["question"] in CASES else self.server.default
        if question == "ok" and body["stream"]:
            question = "stream"
        if question == "ok":
            time.sleep(0.01)
            self._send(200, json.dumps(RECORD).encode())
        elif question == "limited":
            self._error(429, "rate_limited", Retry_After="1")
        elif question == "busy":
            self._error(503, "overloaded")
        elif question == "forbidden":
            self._error(403, "forbidden")
        elif question == "proxy page":
            self._send(500, b"<html><body>500 Internal Server Error</body></html>", "text/html")
        elif question == "not a record":
            self._send(200, b'["a", "list"]')
        elif question == "drop":
            self.close_connection = True  # no reply at all
        elif question == "hang":
            self.server.release.wait(30)
            self.close_connection = True
        elif question == "slow":
            self.server.release.wait(30)
            self._send(200, json.dumps(RECORD).encode())
        elif question == "stream":
            self._stream([("token", '{"text": "Port"}'), ("answer", json.dumps(RECORD))])
        elif question == "stream refused":
            self._stream([("error", '{"error": {"code": "overloaded", "message": "busy"}}')])
        elif question == "stream failed":
            self._stream([("token", '{"text": "Po"}'), ("error", '{"error": {"code": "internal", "message": "x"}}')])
        elif question == "stream garbage":
            self._stream([("token", "<html>")])
        elif question == "stream short":
            self._stream([("token", '{"text": "Port"}')])
        elif question == "stream cut":
            self._stream([("token", '{"text": "Port"}')], finished=False)


CASES = {"ok", "limited", "busy", "forbidden", "proxy page", "not a record", "drop", "hang", "slow", "stream",
         "stream refused", "stream failed", "stream garbage", "stream short", "stream cut"}


@pytest.fixture
def api():
    server = FakeApi()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()


def first_outcome(api: FakeApi, question: str, *, stream: bool = False, timeout_s: float = 5.0):
    """Start one client, stop it as soon as its first reply is in; that reply's outcome."""
    generator = LoadGenerator(api.url, KEY, [{"id": "q1", "question": question}], 1, timeout_s=timeout_s,
                              stream_share=1.0 if stream else 0.0, max_new_tokens=7)
    generator.start()
    deadline = time.monotonic() + 5
    while not generator.outcomes() and time.monotonic() < deadline:
        time.sleep(0.01)
    summary = generator.stop(grace_s=5)
    assert api.bodies[0] == {"question": question, "stream": stream, "max_new_tokens": 7}
    return summary.outcomes[0]


@pytest.mark.parametrize("question, stream, kind, status, code", [
    ("ok", False, "answered", 200, None),
    ("limited", False, "intended", 429, "rate_limited"),
    ("busy", False, "intended", 503, "overloaded"),
    ("forbidden", False, "unintended", 403, "forbidden"),
    ("proxy page", False, "unintended", 500, "not_json"),
    ("not a record", False, "unintended", 200, "not_answer_record"),
    ("drop", False, "unintended", None, "connection_reset"),
    ("stream", True, "answered", 200, None),
    ("busy", True, "intended", 503, "overloaded"),
    ("stream refused", True, "intended", 200, "overloaded"),
    ("stream failed", True, "unintended", 200, "internal"),
    ("stream garbage", True, "unintended", 200, "not_json"),
    ("stream short", True, "unintended", 200, "stream_incomplete"),
    ("stream cut", True, "unintended", 200, "stream_interrupted"),
])
def test_each_reply_is_classified(api, question, stream, kind, status, code):
    outcome = first_outcome(api, question, stream=stream)
    assert (outcome.kind, outcome.status, outcome.code, outcome.streamed) == (kind, status, code, stream)
    assert outcome.question_id == "q1" and outcome.latency_s >= 0
    if kind == "answered":
        assert (outcome.route, outcome.release_id, outcome.snapshot, outcome.answer, outcome.answer_source) == (
            "cache", "r1", RECORD["snapshot"], "Port 8443.", "computed")
    else:
        assert outcome.route is None and outcome.answer is None


def test_read_timeout_and_refused_connection_are_unintended(api):
    timed_out = first_outcome(api, "hang", timeout_s=0.3)
    assert (timed_out.kind, timed_out.status, timed_out.code) == ("unintended", None, "timeout")
    nobody = LoadGenerator(f"http://127.0.0.1:{free_port()}", KEY, [{"id": "q1", "question": "ok"}], 1).run(0.2)
    assert {(o.kind, o.status, o.code) for o in nobody.outcomes} == {("unintended", None, "connection_refused")}


def test_stop_is_bounded_and_counts_a_request_still_unanswered_as_a_hang(api):
    generator = LoadGenerator(api.url, KEY, [{"id": "q9", "question": "hang"}], 2, timeout_s=30)
    generator.start()
    while len(api.bodies) < 2:
        time.sleep(0.01)
    summary = generator.stop(grace_s=0.3)  # returns although both requests wait for 30 s: they count as hangs
    assert [(o.kind, o.status, o.code, o.question_id) for o in summary.outcomes] == [("unintended", None, "hang", "q9")] * 2
    api.release.set()  # the abandoned threads now get their replies: they are not counted again
    time.sleep(0.3)
    assert len(generator.outcomes()) == 2
    report = summary.to_dict()
    assert (report["sent"], report["unintended"], report["by_code"]) == (2, 2, {"unintended - hang": 2})


def test_a_refused_client_waits_as_retry_after_asks(api):
    summary = LoadGenerator(api.url, KEY, [{"id": "q1", "question": "limited"}], 1).run(0.5)
    assert len(summary.outcomes) == len(api.bodies) == 1  # Retry-After: 1, and the run ended before


def test_many_clients_lose_and_duplicate_no_outcome(api):
    questions = [{"id": f"q{n}", "question": question} for n, question in enumerate(("ok", "busy"))]
    generator = LoadGenerator(api.url, KEY, questions, 8, stream_share=0.5, seed=3)
    generator.start()
    seen = []
    for _ in range(20):  # read while the clients write
        seen.append(len(generator.outcomes()))
        time.sleep(0.02)
    summary = generator.stop()
    assert seen == sorted(seen)
    assert len(summary.outcomes) == len(api.bodies) > 20
    assert api.most_in_flight > 1
    report = summary.to_dict()
    assert report["sent"] == report["answered"] + report["intended"] and report["unintended"] == 0
    assert report["streamed"] == sum(body["stream"] for body in api.bodies)
    cache = report["routes"]["cache"]
    assert cache["answers"] == report["answered"] and cache["p50_s"] <= cache["p95_s"]
    assert report["by_code"] == {"intended 503 overloaded": report["intended"]}
    assert report["throughput_per_s"] == pytest.approx(report["answered"] / summary.wall_s, rel=0.01)


# In a fresh process: a long test process reuses memory it freed before, so its figures need not move.
HEAP_AND_MAPPED_FILE = r"""
import mmap, os, sys
from cagflow.bench.memory import memory_mib
mapped_file = sys.argv[1]
before = memory_mib(os.getpid())
heap = bytearray(os.urandom(64 * 2**20))
after_heap = memory_mib(os.getpid())
with open(mapped_file, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as weights:
    sum(weights[offset] for offset in range(0, len(weights), 4096))  # touch every page
    after_map = memory_mib(os.getpid())
print(*before, *after_heap, *after_map)
"""


def test_heap_and_mapped_file_pages_are_told_apart(tmp_path):
    """A heap allocation grows both figures; reading a mapped file grows only the resident one."""
    mapped_file = tmp_path / "weights.bin"
    mapped_file.write_bytes(os.urandom(64 * 2**20))
    result = subprocess.run([sys.executable, "-c", HEAP_AND_MAPPED_FILE, str(mapped_file)], capture_output=True,
                            text=True, timeout=120, check=True)
    resident, anonymous, heap_resident, heap_anonymous, map_resident, map_anonymous = map(float, result.stdout.split())
    assert 0 < anonymous < resident
    assert heap_resident - resident > 48 and heap_anonymous - anonymous > 48
    assert map_resident - heap_resident > 48 and abs(map_anonymous - heap_anonymous) < 8


def test_memory_is_sampled_fitted_and_plotted(tmp_path):
    sampler = MemorySampler({"tests": os.getpid()}, interval_s=0.05).start()
    time.sleep(0.2)
    samples = sampler.stop()
    assert len(samples) >= 2
    assert all(sample["rss_mib"]["tests"] > sample["anon_mib"]["tests"] > 1 for sample in samples)
    rising = [{"t_s": t, "rss_mib": {"router": 100 + t / 60, "gone": None},
               "anon_mib": {"router": 50.0, "gone": None}} for t in range(0, 600, 5)]
    assert memory_growth(rising, since_s=300) == {"gone": None, "router": 10.0}
    assert memory_growth(rising, since_s=300, field="anon_mib") == {"gone": None, "router": 0.0}
    plot = plot_memory(rising, 120, tmp_path / "memory.png")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert service_pids(["router=4242", "extra=7"])["router"] == 4242
    with pytest.raises(ValueError, match="NAME=PID"):
        service_pids(["router"])


def test_bench_load_command_reports_and_fails_on_an_unintended_error(api, tmp_path, monkeypatch, capsys):
    (tmp_path / "bench" / "results").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CAGFLOW_API_KEY", KEY)
    monkeypatch.setenv("CAGFLOW__SERVICE__HOST", "127.0.0.1")
    monkeypatch.setenv("CAGFLOW__SERVICE__PORT", str(api.server_address[1]))
    monkeypatch.setenv("CAGFLOW__CORPUS__MANIFEST", str(REPO / "corpus" / "manifest.yaml"))
    monkeypatch.delenv("CAGFLOW_CONFIG", raising=False)
    options = ["bench", "load", "--clients", "3", "--duration", "0.3", "--soak", "0.3", "--soak-clients", "2",
               "--soak-pause", "0", "--pid", f"tests={os.getpid()}"]
    assert main(options) == 0
    out = capsys.readouterr().out
    assert "burst: 3 clients" in out and "soak: 2 clients" in out and "memory growth" in out
    report = json.loads(next((tmp_path / "bench" / "results").glob("load-*.json")).read_text())
    assert report["burst"]["answered"] == report["burst"]["sent"] > 0 and report["soak"]["answered"] > 0
    assert report["memory"]["pids"]["tests"] == os.getpid() and report["memory"]["samples"]
    assert (tmp_path / "bench" / "soak-memory.png").is_file()
    questions = {body["question"] for body in api.bodies}
    assert len(questions) > 1 and questions <= {json.loads(line)["question"] for line in
                                                (REPO / "corpus" / "qa.jsonl").read_text().splitlines() if line}
    api.default = "proxy page"
    assert main(options[:6]) == 1
    assert "unintended 500 not_json" in capsys.readouterr().out


def test_stop_waits_as_long_as_the_clients_would_for_a_slow_reply(api):
    generator = LoadGenerator(api.url, KEY, [{"id": "q9", "question": "slow"}], 1, timeout_s=5)
    generator.start()
    while not api.bodies:
        time.sleep(0.01)
    threading.Timer(1.0, api.release.set).start()  # the reply comes 1 s after stop, within the clients' timeout
    summary = generator.stop()
    assert [(o.kind, o.question_id) for o in summary.outcomes] == [("answered", "q9")]
