"""`cagflow bench load`: many clients at once through the REST API, and the servers' memory meanwhile.

``LoadGenerator`` runs client threads, each with its own keep-alive session, that ask sample questions one
after the other (a share of them streamed). Every request ends as an ``Outcome``: *answered* (an answer
record), *intended* (the API refusing on purpose: 429 or 503 with its JSON error body, or a stream's error
event of such a code - the rate limit and the concurrency gate at work) or *unintended* (anything else: an
other error status, a body that is not the API's JSON, a dropped connection, a timeout, a stream cut short,
a request still unanswered when the run's grace period ends). A refused client waits as the ``Retry-After``
header asks (capped), as a well-behaved application does, instead of hammering the server. The fault
drills reuse the generator.

``main`` runs a burst (``--clients`` for ``--duration``) and optionally a soak at a lower rate, samples the
resident memory of the router's and Triton's process groups every few seconds (``memory``), fits the memory
growth over the soak's second half and plots the curve. Reported and saved, never asserted on timings.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import requests
import urllib3

from ..client.api_client import USER_AGENT, parse_sse
from ..client.demo import percentile
from ..config import Config
from .memory import MEMORY_INTERVAL_S, MemorySampler, memory_growth, plot_memory, service_pids

BURST_CLIENTS = 50
INTENDED_STATUSES = (429, 503)
# The codes the API sends with 429 or 503 on the query path; a stream that has started refuses through an
# error event instead, so these make such an event intended.
INTENDED_CODES = frozenset({"rate_limited", "overloaded", "auth_unavailable", "triton_unavailable",
                            "retrieval_unavailable", "store_unavailable", "snapshot_unavailable"})
RETRY_AFTER_CAP_S = 5.0
UNINTENDED_EXAMPLES = 5
PLOT_FILE = Path("bench/soak-memory.png")
STOP_MARGIN_S = 10.0  # beyond the clients' timeout, before a reply still missing at the end counts as a hang


@dataclass(frozen=True)
class Outcome:
    kind: str  # "answered" | "intended" | "unintended"
    status: int | None  # HTTP status; None for a connection error / timeout
    code: str | None  # error.code of a JSON error body, or e.g. "connection_reset", "timeout", "not_json"
    route: str | None  # the answer record's "route" (cache, retrieval, cache+retrieval, declined ...)
    release_id: str | None
    snapshot: dict | str | None  # the answer record's "snapshot" field as returned
    answer: str | None
    question_id: str | None
    started_s: float  # time.monotonic() at send
    latency_s: float
    streamed: bool
    answer_source: str | None = None  # "computed", or "answer-cache" for a repeat Triton answered from memory


def _answered(record: Any, status: int, question_id: str | None, started: float, streamed: bool) -> Outcome:
    if not isinstance(record, dict) or "answer" not in record:
        return _failed("unintended", status, "not_answer_record", question_id, started, streamed)
    return Outcome("answered", status, None, record.get("route"), record.get("release_id"), record.get("snapshot"),
                   record.get("answer"), question_id, started, time.monotonic() - started, streamed,
                   record.get("answer_source"))


def _failed(kind: str, status: int | None, code: str, question_id: str | None, started: float,
            streamed: bool) -> Outcome:
    return Outcome(kind, status, code, None, None, None, None, question_id, started, time.monotonic() - started,
                   streamed)


def _error_code(body: Any) -> str | None:
    """``error.code`` of the API's error body, None for any other JSON."""
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def _connection_code(error: requests.RequestException) -> str:
    """What broke, from the causes urllib3 wraps (a read timeout mid-body comes as a ConnectionError; a
    refused connection as a NewConnectionError, which urllib3 derives from its timeout error)."""
    if isinstance(error, requests.exceptions.SSLError):
        return "tls_failed"
    causes: list[BaseException] = []
    cause: BaseException | None = error
    while cause is not None:
        causes.append(cause)
        cause = cause.__cause__ or cause.__context__
    if any(isinstance(cause, ConnectionRefusedError) for cause in causes):
        return "connection_refused"
    if any(isinstance(cause, (requests.Timeout, urllib3.exceptions.TimeoutError, TimeoutError))
           and not isinstance(cause, urllib3.exceptions.NewConnectionError) for cause in causes):
        return "timeout"
    return "connection_reset"


def _retry_after_s(response: requests.Response) -> float:
    try:
        return min(RETRY_AFTER_CAP_S, max(0.0, float(response.headers.get("Retry-After", 0))))
    except ValueError:
        return 0.0


def classify_reply(response: requests.Response, question_id: str | None, started: float) -> Outcome:
    """A non-streamed reply, read whole."""
    try:
        body = response.json()
    except ValueError:
        return _failed("unintended", response.status_code, "not_json", question_id, started, False)
    if response.status_code == 200:
        return _answered(body, 200, question_id, started, False)
    code = _error_code(body)
    if code is None:
        return _failed("unintended", response.status_code, "not_error_body", question_id, started, False)
    kind = "intended" if response.status_code in INTENDED_STATUSES else "unintended"
    return _failed(kind, response.status_code, code, question_id, started, False)


def classify_stream(response: requests.Response, question_id: str | None, started: float,
                    timeout_s: float) -> Outcome:
    """A streamed reply: answered only when its final ``answer`` event arrives; a stream that has not ended
    ``timeout_s`` after the send is a timeout even while it still trickles."""
    if response.status_code != 200:
        outcome = classify_reply(response, question_id, started)
        return _failed(outcome.kind, outcome.status, outcome.code, question_id, started, True)
    if not response.headers.get("Content-Type", "").startswith("text/event-stream"):
        return _failed("unintended", 200, "not_event_stream", question_id, started, True)
    response.encoding = "utf-8"
    try:
        for event in parse_sse(response.iter_lines(decode_unicode=True)):
            if time.monotonic() - started > timeout_s:
                return _failed("unintended", 200, "timeout", question_id, started, True)
            try:
                data = json.loads(event.data)
            except ValueError:
                return _failed("unintended", 200, "not_json", question_id, started, True)
            if event.event == "answer":
                return _answered(data, 200, question_id, started, True)
            if event.event == "error":
                code = _error_code(data) or "error_event"
                return _failed("intended" if code in INTENDED_CODES else "unintended", 200, code, question_id,
                               started, True)
    except requests.RequestException as exc:
        code = "timeout" if _connection_code(exc) == "timeout" else "stream_interrupted"
        return _failed("unintended", 200, code, question_id, started, True)
    return _failed("unintended", 200, "stream_incomplete", question_id, started, True)


@dataclass
class LoadSummary:
    outcomes: list[Outcome]
    wall_s: float  # from the first send until the last reply (or the end of the grace period)
    clients: int

    def to_dict(self) -> dict[str, Any]:
        answered = [o for o in self.outcomes if o.kind == "answered"]
        kinds = Counter(o.kind for o in self.outcomes)
        refusals = [o.latency_s for o in self.outcomes if o.kind == "intended"]
        return {
            "clients": self.clients, "wall_s": round(self.wall_s, 2), "sent": len(self.outcomes),
            "streamed": sum(o.streamed for o in self.outcomes), "answered": kinds["answered"],
            "intended": kinds["intended"], "unintended": kinds["unintended"],
            "by_code": dict(Counter(f"{o.kind} {o.status if o.status is not None else '-'} {o.code}"
                                    for o in self.outcomes if o.kind != "answered").most_common()),
            **_rates(answered, self.wall_s),
            "intended_p95_s": round(percentile(refusals, 0.95), 3) if refusals else None,
            "routes": {route: _rates([o for o in answered if o.route == route], self.wall_s)
                       for route in sorted({o.route for o in answered}, key=str)},
            "unintended_examples": [asdict(o) for o in self.outcomes if o.kind == "unintended"][:UNINTENDED_EXAMPLES],
        }


def _rates(answered: list[Outcome], wall_s: float) -> dict[str, Any]:
    """Throughput and latency of answers; those Triton served from its answer cache (a repeated question)
    are counted apart too, since they cost no model time."""
    latencies = [o.latency_s for o in answered]
    computed = [o.latency_s for o in answered if o.answer_source != "answer-cache"]
    return {"answers": len(answered), "throughput_per_s": round(len(answered) / wall_s, 3) if wall_s else None,
            "p50_s": round(percentile(latencies, 0.5), 3) if latencies else None,
            "p95_s": round(percentile(latencies, 0.95), 3) if latencies else None,
            "from_answer_cache": len(answered) - len(computed),
            "computed_p50_s": round(percentile(computed, 0.5), 3) if computed else None}


class LoadGenerator:
    """``clients`` threads asking ``questions`` (dicts with ``id`` and ``question``) through ``POST
    /v1/query``, each waiting for its reply before it sends the next (after ``pause_s``, or the refusal's
    ``Retry-After``). ``stream_share`` of the requests ask for a streamed answer. Bounded: ``stop`` waits at
    most ``grace_s`` for the requests in flight."""

    def __init__(self, base_url: str, api_key: str, questions: list[dict], clients: int, *,
                 ca_file: str | None = None, timeout_s: float = 120.0, max_new_tokens: int | None = None,
                 stream_share: float = 0.0, pause_s: float = 0.0, seed: int = 0) -> None:
        if not questions:
            raise ValueError("the load generator needs at least one question")
        if clients < 1:
            raise ValueError("the load generator needs at least one client")
        self.url = f"{base_url.rstrip('/')}/v1/query"
        self.api_key = api_key
        self.questions = questions
        self.clients = clients
        self.ca_file = ca_file
        self.timeout_s = timeout_s
        self.max_new_tokens = max_new_tokens
        self.stream_share = stream_share
        self.pause_s = pause_s
        self.seed = seed
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._outcomes: list[Outcome] = []
        self._in_flight: dict[int, tuple[float, str | None, bool]] = {}  # client -> (sent at, question id, streamed)
        self._abandoned: set[int] = set()  # clients whose request was counted as a hang: drop their late reply
        self._threads: list[threading.Thread] = []
        self._started_at: float | None = None

    def start(self) -> None:
        if self._threads:
            raise RuntimeError("the load generator runs once")
        self._started_at = time.monotonic()
        self._threads = [threading.Thread(target=self._client, args=(index,), name=f"load-client-{index}", daemon=True)
                         for index in range(self.clients)]
        for thread in self._threads:
            thread.start()

    def stop(self, grace_s: float | None = None) -> LoadSummary:
        """Send nothing more; wait up to ``grace_s`` (default: the clients' own timeout, a little more, so a
        reply the server still sends in time is not miscounted) for the replies in flight, then count each
        still missing as an unintended ``hang`` (its thread is left to time out on its own)."""
        if self._started_at is None:
            raise RuntimeError("the load generator was not started")
        self._stopping.set()
        deadline = time.monotonic() + (self.timeout_s + STOP_MARGIN_S if grace_s is None else grace_s)
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            now = time.monotonic()
            for index, (sent_at, question_id, streamed) in sorted(self._in_flight.items()):
                self._abandoned.add(index)
                self._outcomes.append(Outcome("unintended", None, "hang", None, None, None, None, question_id,
                                              sent_at, now - sent_at, streamed))
            self._in_flight.clear()
            outcomes = list(self._outcomes)
        last = max((o.started_s + o.latency_s for o in outcomes), default=self._started_at)
        return LoadSummary(outcomes, last - self._started_at, self.clients)

    def run(self, duration_s: float) -> LoadSummary:
        self.start()
        self._stopping.wait(duration_s)
        return self.stop()

    def outcomes(self) -> list[Outcome]:
        with self._lock:
            return list(self._outcomes)

    def _client(self, index: int) -> None:
        rng = random.Random(self.seed * 100_003 + index)
        with requests.Session() as session:
            session.headers.update({"User-Agent": f"{USER_AGENT} (load)", "Authorization": f"Bearer {self.api_key}"})
            while not self._stopping.is_set():
                item = rng.choice(self.questions)
                streamed = rng.random() < self.stream_share
                outcome, wait_s = self._ask(session, index, item, streamed)
                with self._lock:
                    if index in self._abandoned:
                        return
                    self._in_flight.pop(index, None)
                    self._outcomes.append(outcome)
                self._stopping.wait(max(wait_s, self.pause_s))

    def _ask(self, session: requests.Session, index: int, item: dict, streamed: bool) -> tuple[Outcome, float]:
        """One request and its outcome, and how long the reply asks the client to wait before the next."""
        question_id = item.get("id")
        body = {"question": item["question"], "stream": streamed}
        if self.max_new_tokens is not None:
            body["max_new_tokens"] = self.max_new_tokens
        headers = {"Accept": "text/event-stream"} if streamed else {}
        started = time.monotonic()
        with self._lock:
            self._in_flight[index] = (started, question_id, streamed)
        try:  # verify per request: a session-wide setting would lose to $REQUESTS_CA_BUNDLE
            response = session.post(self.url, json=body, headers=headers, stream=streamed, timeout=self.timeout_s,
                                    verify=self.ca_file or True)
        except requests.RequestException as exc:
            return _failed("unintended", None, _connection_code(exc), question_id, started, streamed), 0.0
        with response:
            try:
                outcome = (classify_stream(response, question_id, started, self.timeout_s) if streamed
                           else classify_reply(response, question_id, started))
            except requests.RequestException as exc:  # the body of a plain reply broke off
                outcome = _failed("unintended", response.status_code, _connection_code(exc), question_id, started,
                                  streamed)
        return outcome, _retry_after_s(response) if outcome.kind == "intended" else 0.0


# ---- `cagflow bench load` ---------------------------------------------------------------------------

def _print_phase(title: str, report: dict[str, Any]) -> None:
    print(f"\n{title}: {report['clients']} clients, {report['wall_s']:.0f} s: sent {report['sent']} "
          f"({report['streamed']} streamed), answered {report['answered']}, intended {report['intended']}, "
          f"unintended {report['unintended']}")
    print(f"  {'route':<16} {'answers':>7} {'per s':>6} {'p50 s':>6} {'p95 s':>6} {'answer cache':>12} "
          f"{'computed p50 s':>14}")
    for route, row in [("all", report), *report["routes"].items()]:
        print(f"  {route:<16} {row['answers']:>7} {row['throughput_per_s'] or 0:>6.2f} {_s(row['p50_s'])} "
              f"{_s(row['p95_s'])} {row['from_answer_cache']:>12} {_s(row['computed_p50_s'], 14)}")
    for code, count in report["by_code"].items():
        print(f"  {count:>6}  {code}")
    for example in report["unintended_examples"]:
        print(f"  unintended: {json.dumps(example, ensure_ascii=False, default=str)[:300]}")


def _growth(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}"


def _s(value: float | None, width: int = 6) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.2f}"


def main(config: Config, args: argparse.Namespace) -> int:
    """Burst, then the optional soak; 1 when any request failed in an unintended way."""
    from ..client.api_client import client_timeout_s
    from ..client.demo import open_local_client
    from ..answering.qa import load_qa
    from ..router.apikeys import read_local_credentials
    from .report import save_report

    clients = args.clients or BURST_CLIENTS
    client = open_local_client(config, "bench load")  # the URL, trust anchor and key `cagflow ask` uses
    if client is None:
        return 2
    url, ca_file = client.base_url, client.ca_file
    client.close()
    api_key = read_local_credentials().api_key
    questions = [{"id": item.id, "question": item.question}
                 for item in load_qa(Path(config.corpus.manifest).parent / "qa.jsonl")]
    pids = service_pids(args.pid)
    if not pids:
        print("cagflow bench load: no router or Triton recorded as running here; memory is not sampled "
              "(name them with --pid NAME=PID)", file=sys.stderr)
    options = {"ca_file": ca_file, "timeout_s": client_timeout_s(config.service),
               "max_new_tokens": args.max_new_tokens, "stream_share": args.stream_share}
    print(f"{len(questions)} sample questions through {url}/v1/query; memory of "
          f"{', '.join(f'{name} (pid {pid})' for name, pid in pids.items()) or 'nothing'} every "
          f"{MEMORY_INTERVAL_S:g} s", flush=True)
    sampler = MemorySampler(pids).start()
    report: dict[str, Any] = {"api": url, "model": config.model.path, "questions": len(questions),
                              "options": {"clients": clients, **{key: getattr(args, key) for key in
                                          ("duration", "soak", "soak_clients", "soak_pause",
                                           "max_new_tokens", "stream_share")}},
                              "limits": {"rate_limit_per_s": config.service.rate_limit_per_s,
                                         "rate_limit_burst": config.service.rate_limit_burst,
                                         "max_concurrent_requests": config.service.max_concurrent_requests}}
    try:
        print(f"burst: {clients} clients for {args.duration:g} s ...", flush=True)
        burst = LoadGenerator(url, api_key, questions, clients, **options).run(args.duration).to_dict()
        report["burst"] = burst
        _print_phase("burst", burst)
        if args.soak > 0:
            soak_from_s = sampler.elapsed_s()
            print(f"\nsoak: {args.soak_clients} clients for {args.soak:g} s, {args.soak_pause:g} s between a "
                  "client's requests ...", flush=True)
            soak = LoadGenerator(url, api_key, questions, args.soak_clients, pause_s=args.soak_pause, seed=1,
                                 **options).run(args.soak).to_dict()
            report["soak"] = {**soak, "from_s": round(soak_from_s, 1)}
            _print_phase("soak", soak)
    finally:
        samples = sampler.stop()
    report["memory"] = {"interval_s": MEMORY_INTERVAL_S, "pids": pids, "samples": samples}
    if pids and samples:
        first, last = samples[0], samples[-1]
        print("\nmemory, MiB (resident / not file-backed): " + "; ".join(
            f"{name} {first['rss_mib'].get(name) or 0:.0f} / {first['anon_mib'].get(name) or 0:.0f} -> "
            f"{last['rss_mib'].get(name) or 0:.0f} / {last['anon_mib'].get(name) or 0:.0f}" for name in pids))
    if "soak" in report and pids:
        soak_from_s = report["soak"]["from_s"]
        half_s = soak_from_s + (samples[-1]["t_s"] - soak_from_s) / 2
        growth = memory_growth(samples, half_s)
        anonymous = memory_growth(samples, half_s, "anon_mib")
        report["memory"]["growth_mib_per_10min"] = growth
        report["memory"]["anon_growth_mib_per_10min"] = anonymous
        report["memory"]["growth_from_s"] = round(half_s, 1)
        print("memory growth over the soak's second half, MiB per 10 min (resident / not file-backed): "
              + "; ".join(f"{name} {_growth(growth[name])} / {_growth(anonymous[name])}" for name in growth))
        if PLOT_FILE.parent.is_dir():
            print(f"plot {plot_memory(samples, soak_from_s, PLOT_FILE)}")
    saved = save_report("load", report)
    if saved:
        print(f"saved {saved}")
    unintended = sum(report[phase]["unintended"] for phase in ("burst", "soak") if phase in report)
    return 1 if unintended else 0

