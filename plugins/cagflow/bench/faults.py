"""`cagflow bench faults`: faults injected into a real local stack while requests are in flight.

Each scenario runs with a small load generator asking the sample questions through the router, and
reports what the clients saw — requests sent, answered, intended errors (429/503 with a JSON body),
unintended ones (any other error, a reset, a hang) and p95 — the checks of what the scenario must show,
and the snapshot store's integrity afterwards (every object re-hashed against the active release).

The stack (`faultstack.FaultStack`) is SeaweedFS, OpenSearch, Triton and the router on 127.0.0.1 with a
release of a few fixed documents made by `cagflow precompute`; Triton keeps one snapshot resident, so that
"resident" and "not resident" are both there to break. Everything runs in a temporary folder and stops by
itself. A benchmark: it reports, it never asserts on time; the exit code says whether every scenario held.
"""

from __future__ import annotations

import argparse
import json
import logging
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import requests

from ..client.api_client import parse_sse
from ..config import Config
from ..store.backends import LocalStore, NotFound
from ..store.layout import snapshot_object
from ..store.manifests import CorpusManifest, load_release
from .faultstack import BUCKET, STORE_PREFIX, FaultStack, check_integrity, kill_group, wait_until
from .load import LoadGenerator, LoadSummary
from .report import save_report

MAX_NEW_TOKENS = 24
LOAD_CLIENTS = 4  # two cores: more clients only queue behind the model
OUTAGE_S = 60.0
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
        return self.skipped is None and all(check.passed for check in self.checks) \
            and self.load.get("unintended", 0) == 0 and bool(self.integrity.get("intact"))

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


def _route(reply: dict) -> str:
    if reply.get("status") != 200:
        return f"{reply.get('status')} {(reply.get('error') or {}).get('code')}"
    return f"{reply.get('route')} (fallback: {reply.get('fallback_reason')})" if reply.get("fallback_reason") \
        else str(reply.get("route"))


def _served_from_cache(reply: dict) -> bool:
    return reply.get("status") == 200 and reply.get("route") in CACHE_ROUTES and bool(reply.get("cache_hit"))


# ---- scenarios --------------------------------------------------------------------------------------------

def precompute_kill(bench: Bench, where: str) -> None:
    """kill -9 of `cagflow precompute` while it writes a snapshot: nothing partial is visible, nothing is
    published, and the rerun completes a verified release."""
    stack = bench.stack
    docs = stack.doc_ids[:2]
    if where == "local":
        root = stack.work_dir / "kill-local"
        url, extra = f"file://{root}", {}
    else:
        root, url = None, f"s3://{BUCKET}/kill-s3"
        # Multipart from 5 MiB (the S3 minimum part), so a snapshot is written in several requests.
        extra = {"CAGFLOW__CACHE__S3__MULTIPART_THRESHOLD_BYTES": str(5 * 2**20)}
    command = [sys.executable, "-m", "cagflow.client.cli", "precompute", "--quiet", "--store", url,
               *[arg for doc in docs for arg in ("--doc-id", doc)]]
    environment = stack.environment("writer", **extra)
    admin = stack.s3.client()

    def writing() -> bool:
        if root is not None:
            return root.is_dir() and any(path.name.startswith(".tmp-") for path in root.rglob("*"))
        return bool(admin.list_multipart_uploads(Bucket=BUCKET, Prefix="kill-s3/").get("Uploads"))

    generator = bench.load(bench.about(*docs))
    killed_writing = False
    run = subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           start_new_session=True)
    try:
        while run.poll() is None:
            if writing():
                kill_group(run.pid)
                killed_writing = True
                break
            time.sleep(0.005)
    finally:
        if run.poll() is None:
            kill_group(run.pid)
        run.wait()
    bench.check("killed while a snapshot was being written", killed_writing,
                f"exit {run.returncode}" + ("" if killed_writing else "; the run ended before a write was seen"))
    target = stack.store("writer", url)
    after_kill = check_integrity(target)
    bench.check("no partial object visible", not after_kill.corrupt and not after_kill.missing,
                f"{after_kill.verified} of {after_kill.objects} objects verify")
    bench.check("nothing published by the killed run", after_kill.release_id is None)
    if root is None:
        leftovers = admin.list_multipart_uploads(Bucket=BUCKET, Prefix="kill-s3/").get("Uploads", [])
        bench.check("the interrupted upload is not an object", all(
            admin.list_objects_v2(Bucket=BUCKET, Prefix=upload["Key"]).get("KeyCount", 0) == 0 for upload in leftovers),
            f"{len(leftovers)} incomplete multipart upload(s) left for the bucket's lifecycle rule to abort")
    rerun = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=1800)
    bench.check("the rerun completes", rerun.returncode == 0, rerun.stderr.strip()[-300:])
    final = check_integrity(target)
    release = load_release(target) if final.release_id else None
    bench.check("its release is complete and verified", final.intact and release is not None
                and set(release.doc_ids) == set(docs), f"release {final.release_id}: {final.verified} objects verify")
    bench.finish(generator)


def s3_outage(bench: Bench) -> None:
    """SeaweedFS stopped for a minute while serving: the resident snapshot keeps answering, a non-resident
    one falls back to retrieval, /readyz says degraded, and everything recovers without a restart."""
    stack = bench.stack
    resident, other = stack.doc_ids[0], stack.doc_ids[1]
    bench.check("resident snapshot answers before", _served_from_cache(warm := bench.probe(resident)), _route(warm))
    generator = bench.load(bench.about(resident))
    stack.s3.stop()
    stopped = time.monotonic()
    try:
        time.sleep(3)
        ready = stack.readiness()
        bench.check("/readyz degraded, still ready", ready.get("ready") and ready.get("degraded")
                    and ready["store"]["reachable"] is False, "; ".join(ready.get("reasons", [])))
        during = bench.probe(resident)
        bench.check("resident snapshot keeps answering", _served_from_cache(during), _route(during))
        fallback = bench.probe(other)
        bench.check("non-resident snapshot falls back to retrieval", fallback.get("status") == 200
                    and fallback.get("route") == "retrieval" and fallback.get("fallback_reason"), _route(fallback))
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - stopped)))
    finally:
        stack.s3.start()
    restarted = time.monotonic()
    recovered = wait_until(lambda: stack.readiness()["store"]["reachable"], 120, 1.0)
    bench.check("recovered without a restart", recovered,
                f"store reachable again {time.monotonic() - restarted:.1f} s after SeaweedFS came back")
    after = bench.probe(other)
    bench.check("non-resident snapshot loads again", _served_from_cache(after), _route(after))
    bench.finish(generator)


def opensearch_restart(bench: Bench) -> None:
    """OpenSearch stopped and started again: the cache route keeps answering, retrieval answers 503 with a
    JSON error while it is away and answers again after."""
    stack = bench.stack
    doc = stack.doc_ids[0]
    variable = next(row["question"] for row in bench.questions if row.get("tier") == "variable")
    generator = bench.load()
    time.sleep(3)
    stack.opensearch.stop()
    try:
        ready = stack.readiness()
        bench.check("/readyz degraded, still ready", ready.get("ready") and ready.get("degraded")
                    and not ready["opensearch"]["reachable"], "; ".join(ready.get("reasons", [])))
        cached = bench.probe(doc)
        bench.check("the cache route keeps answering", _served_from_cache(cached), _route(cached))
        away = bench.probe(None, variable)
        bench.check("retrieval answers a JSON 503", away.get("status") == 503 and "error" in away, _route(away))
        time.sleep(10)
    finally:
        stack.opensearch.start(timeout_s=300)
    recovered = wait_until(lambda: stack.readiness()["opensearch"]["reachable"], 120, 1.0)
    back = bench.probe(None, variable)
    bench.check("retrieval answers again", recovered and back.get("status") == 200
                and back.get("route") == "retrieval", _route(back))
    bench.finish(generator)


def _stream_cut_by(stack: FaultStack, question: str, doc_id: str, kill: Callable[[], None]) -> dict:
    """Stream an answer, call ``kill`` once its first token has arrived, and read the stream to its end:
    how many tokens came, the last event and its code, and how long the end took after the kill."""
    body = {"question": f"{question} ({secrets.token_hex(3)})", "doc_id": doc_id, "stream": True,
            "max_new_tokens": 256}
    with requests.post(f"{stack.url}/v1/query", json=body, stream=True, timeout=120,
                       headers={"Authorization": f"Bearer {stack.user_key}", "Accept": "text/event-stream"}) as reply:
        tokens, last, killed_at = 0, None, None
        try:
            for event in parse_sse(reply.iter_lines(decode_unicode=True)):
                last = event
                if event.event == "token":
                    tokens += 1
                    if killed_at is None:
                        kill()
                        killed_at = time.monotonic()
        except requests.RequestException as exc:  # a reset or a read timeout: what a client must never see
            return {"tokens": tokens, "event": None, "code": type(exc).__name__, "end_s": None}
    code = None
    if last is not None and last.event == "error":
        code = (json.loads(last.data).get("error") or {}).get("code")
    return {"tokens": tokens, "event": last.event if last else None, "code": code,
            "end_s": round(time.monotonic() - killed_at, 1) if killed_at else None}


def triton_kill(bench: Bench) -> None:
    """Triton killed (-9, with its model stubs) while an answer streams, then started again on its ports:
    the stream ends with a JSON error event (no hang, no reset), new requests get a JSON 503, and the router
    answers again once Triton is back, without a restart of its own."""
    stack = bench.stack
    assert stack.triton is not None
    doc = stack.doc_ids[0]
    bench.check("resident before the kill", _served_from_cache(warm := bench.probe(doc)), _route(warm))
    generator = bench.load(stream_share=0.5)
    time.sleep(3)
    ports = dict(stack.triton.ports)
    cut = _stream_cut_by(stack, next(row["question"] for row in bench.questions if row.get("doc_id") == doc), doc,
                         lambda: kill_group(stack.triton.pid))
    killed = time.monotonic()
    stack.triton.stop(timeout_s=10)  # reaps the leader; the group is already gone
    bench.check("the stream in flight ends with a JSON error event", cut["event"] == "error" and cut["code"],
                f"{cut['tokens']} token(s), then {cut['event']} {cut['code']} {cut['end_s']} s after the kill")
    down = bench.probe(doc)
    bench.check("a request while Triton is down gets a JSON 503", down.get("status") == 503 and "error" in down,
                _route(down))
    time.sleep(5)
    stack.start_triton(ports)
    back = wait_until(lambda: stack.readiness()["triton"]["ready"], 120, 1.0)
    after = bench.probe(doc)
    bench.check("answers again after the restart", back and after.get("status") == 200,
                f"{_route(after)}; Triton was back {time.monotonic() - killed:.0f} s after the kill")
    summary = bench.finish(generator)
    cut_by_kill = [o for o in summary.outcomes if o.started_s < killed < o.started_s + o.latency_s]
    bench.check("every load request in flight at the kill ended with a JSON error or an answer",
                all(o.kind != "unintended" for o in cut_by_kill),
                f"{len(cut_by_kill)} in flight: {sorted(f'{o.kind} {o.code or o.route}' for o in cut_by_kill)}")


def _flip(stack: FaultStack, doc_id: str) -> str:
    """Flip bytes in the middle of a document's stored snapshot behind the store's back (with the S3
    server's admin key, keeping the recorded checksum); returns the snapshot's object name."""
    release = load_release(stack.store())
    name = snapshot_object(next(entry.key for entry in release.snapshots if entry.doc_id == doc_id))
    key = f"{STORE_PREFIX}/{name}"
    admin = stack.s3.client()
    flipped = bytearray(admin.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    middle = len(flipped) // 2
    flipped[middle:middle + 64] = bytes(byte ^ 0xFF for byte in flipped[middle:middle + 64])
    head = admin.head_object(Bucket=BUCKET, Key=key)
    admin.put_object(Bucket=BUCKET, Key=key, Body=bytes(flipped), Metadata=head.get("Metadata", {}))
    return name


def bit_flip(bench: Bench) -> None:
    """A snapshot's bytes flipped in the store while it is resident and while it is not: the resident copy
    (verified when it was loaded) keeps answering; a corrupt copy is never loaded — its questions fall back
    to retrieval, saying why — and the integrity check finds both."""
    stack = bench.stack
    resident, cold, spare = stack.doc_ids[0], stack.doc_ids[1], stack.doc_ids[2]
    bench.check("resident before the flip", _served_from_cache(warm := bench.probe(resident)), _route(warm))
    generator = bench.load(bench.about(resident, cold))
    flipped = [_flip(stack, resident), _flip(stack, cold)]
    flipped_at, evicted_at = time.monotonic(), float("inf")
    try:
        found = check_integrity(stack.store())
        bench.check("the integrity check finds both flipped objects", len(found.corrupt) == 2, ", ".join(found.corrupt))
        still = bench.probe(resident)
        bench.check("the resident copy keeps answering", _served_from_cache(still), _route(still))
        refused = bench.probe(cold)
        bench.check("a flipped snapshot is not loaded: retrieval, saying why", refused.get("status") == 200
                    and not refused.get("cache_hit") and refused.get("fallback_reason") == "snapshot_corrupt",
                    _route(refused))
        evicting = bench.probe(spare)  # the one resident slot goes to another snapshot
        evicted_at = time.monotonic()
        reloaded = bench.probe(resident)
        bench.check("once evicted, the flipped resident one is not reloaded", _served_from_cache(evicting)
                    and not reloaded.get("cache_hit") and reloaded.get("fallback_reason") == "snapshot_corrupt",
                    f"{spare}: {_route(evicting)}; then {resident}: {_route(reloaded)}")
    finally:
        # The repair the error message asks for: delete the corrupt objects and rerun precompute, which
        # publishes a release with the new objects; a new release lifts the serving side's quarantine.
        writer = stack.store("writer")
        for name in flipped:
            writer.delete(name)
        repaired_at = time.monotonic()  # from here on no flipped byte is left to load
        repaired = stack.precompute([resident, cold])
        stack.reload()
    restored = bench.probe(cold)
    bench.check("after the repair (delete, precompute, reload) the documents load again",
                _served_from_cache(restored), f"release {repaired}: {_route(restored)}")
    summary = bench.finish(generator)
    # Computed on the cache route from a flipped object: the cold one at any time until the repair, the
    # resident one once it had been evicted (before that its verified copy in memory answers).
    # (Triton follows the repaired release as soon as it is published: its answers name that release.)
    corrupt_served = [o for o in summary.outcomes if o.kind == "answered" and o.route in CACHE_ROUTES
                      and o.answer_source == "computed" and o.release_id != repaired
                      and flipped_at < o.started_s < repaired_at
                      and (o.snapshot or {}).get("doc_id") in (cold, resident if o.started_s > evicted_at else cold)]
    bench.check("no answer computed from a flipped snapshot", not corrupt_served,
                f"{len(corrupt_served)} of {len(summary.outcomes)} requests")


def disk_full(bench: Bench) -> None:
    """The store's disk fills while a snapshot is written: `cagflow precompute` fails with one clear line,
    nothing is published, and no partial file is left taking the space."""
    stack = bench.stack
    doc = stack.doc_ids[0]
    size = next(entry.bytes for entry in load_release(stack.store()).snapshots if entry.doc_id == doc)
    mount = stack.work_dir / "small-disk"
    mount.mkdir(exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={max(size // 2, 65536)}", "tmpfs", str(mount)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        assert bench.result is not None
        bench.result.skipped = f"cannot mount a small tmpfs: {mounted.stderr.strip() or 'mount failed'} (needs root)"
        return
    generator = bench.load(bench.about(doc))
    try:
        store = mount / "store"
        run = stack.cagflow("precompute", "--quiet", "--store", f"file://{store}", "--doc-id", doc)
        error = run.stderr.strip()
        bench.check("precompute fails with a clear error", run.returncode != 0 and "Traceback" not in error
                    and "space" in error.lower(), error.splitlines()[-1] if error else f"exit {run.returncode}")
        objects = [info.name for info in LocalStore(store).list()] if store.is_dir() else []
        try:
            load_release(LocalStore(store))
            published = True
        except NotFound:
            published = False
        bench.check("nothing published, no object visible", not objects and not published, ", ".join(objects))
        left = sum(path.stat().st_size for path in mount.rglob("*") if path.is_file())
        bench.check("no partial file left behind", left == 0, f"{left} bytes left on the {size // 2}-byte disk")
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)
    bench.finish(generator)


def release_switch(bench: Bench) -> None:
    """Releases switched back and forth under load (`cagflow releases --activate` with the writer's
    credentials, then /admin/reload): every cache answer comes from a snapshot of the release it names, and
    no request sent after a switch completed is answered from the release before it."""
    stack = bench.stack
    first, full = stack.releases
    generator = bench.load(bench.about(*stack.doc_ids))
    switches: list[tuple[str, float, float]] = []
    try:
        for target in (first, full, first, full):
            time.sleep(8)
            began = time.monotonic()
            activated = stack.cagflow("releases", "--activate", target)
            if activated.returncode != 0:
                bench.check(f"activate {target}", False, activated.stderr.strip()[-300:])
                break
            stack.reload()
            switches.append((target, began, time.monotonic()))
        time.sleep(8)
    finally:
        summary = bench.finish(generator)
    contents = {release_id: {entry.key for entry in stack.release(release_id).snapshots} for release_id in (first, full)}
    answered = [o for o in summary.outcomes if o.kind == "answered" and o.release_id]
    mixed = [o for o in answered if o.route in CACHE_ROUTES and (o.snapshot or {}).get("key")
             and o.snapshot["key"] not in contents.get(o.release_id, set())]
    bench.check("every cache answer's snapshot is in the release it names", not mixed,
                f"{len(answered)} answers named a release")
    stale = []
    for index, (target, _, done) in enumerate(switches):
        until = switches[index + 1][1] if index + 1 < len(switches) else float("inf")
        stale += [o for o in answered if done < o.started_s < until and o.release_id != target]
    bench.check("no request after a switch answered from the release before it", not stale and len(switches) == 4,
                f"{len(switches)} switches, reload took {max((d - b for _, b, d in switches), default=0):.1f} s at most")


SCENARIOS: dict[str, tuple[str, Callable[[Bench], None]]] = {
    "precompute-kill-local": ("kill -9 of precompute mid-write, local store", lambda b: precompute_kill(b, "local")),
    "precompute-kill-s3": ("kill -9 of precompute mid-write, S3 store", lambda b: precompute_kill(b, "s3")),
    "s3-outage": (f"S3 (SeaweedFS) stopped for {OUTAGE_S:.0f} s while serving", s3_outage),
    "opensearch-restart": ("OpenSearch stopped and restarted", opensearch_restart),
    "triton-kill": ("Triton killed mid-stream and restarted", triton_kill),
    "release-switch": ("release switch and rollback under load", release_switch),
    "bit-flip": ("snapshot bytes flipped in the store, resident and not", bit_flip),
    "disk-full": ("disk full while writing a snapshot", disk_full),
}


# ---- the command ---------------------------------------------------------------------------------------

def sample_questions(config: Config) -> tuple[list[dict], CorpusManifest]:
    manifest = CorpusManifest.load(config.corpus.manifest)
    tiers = {entry.doc_id: entry.tier for entry in manifest.documents}
    rows = [json.loads(line) for line in (Path(config.corpus.manifest).parent / "qa.jsonl").read_text().splitlines()
            if line.strip()]
    return [{**row, "tier": tiers.get(row.get("doc_id", ""))} for row in rows if row.get("doc_id") in tiers], manifest


def smallest_fixed(manifest: CorpusManifest, count: int) -> list[str]:
    fixed = [entry for entry in manifest.tier("fixed") if not entry.doc_id.startswith("zh-")]
    return [entry.doc_id for entry in sorted(fixed, key=lambda entry: manifest.file(entry).stat().st_size)[:count]]


def run_scenario(bench: Bench, name: str) -> ScenarioResult:
    what, scenario = SCENARIOS[name]
    bench.result = result = ScenarioResult(name, what)
    bench.stack.say(f"\n== {name}: {what}")
    started = time.perf_counter()
    try:
        scenario(bench)
    except Exception as exc:  # a scenario that breaks is a failed check, and the next one still runs
        bench.check("scenario ran to its end", False, f"{type(exc).__name__}: {exc}")
    result.seconds = time.perf_counter() - started
    result.integrity = check_integrity(bench.stack.store()).to_dict()
    return result


def render(results: list[ScenarioResult]) -> str:
    lines = ["| scenario | sent | answered | intended errors | unintended errors | p95 s | checks | store |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    for result in results:
        load = result.load
        checks = f"{sum(c.passed for c in result.checks)}/{len(result.checks)}" if not result.skipped else \
            f"skipped: {result.skipped}"
        store = f"{result.integrity.get('verified', 0)}/{result.integrity.get('objects', 0)} verified" \
            if result.integrity.get("intact") else "NOT INTACT"
        p95 = load.get("p95_s")
        lines.append(f"| {result.name} | {load.get('sent', 0)} | {load.get('answered', 0)} | {load.get('intended', 0)} | "
                     f"{load.get('unintended', 0)} | {'-' if p95 is None else f'{p95:.1f}'} | {checks} | {store} |")
    return "\n".join(lines)


def main(config: Config, args: argparse.Namespace) -> int:
    names = args.scenario or list(SCENARIOS)
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        print(f"cagflow bench faults: unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}",
              file=sys.stderr)
        return 2
    questions, manifest = sample_questions(config)
    doc_ids = args.fault_doc_id or smallest_fixed(manifest, 3)
    if len(doc_ids) != 3:
        print("cagflow bench faults: give three fixed documents (--fault-doc-id, three times)", file=sys.stderr)
        return 2
    model = args.model or config.model.path
    clients = args.clients or LOAD_CLIENTS
    logging.getLogger("opensearch").setLevel(logging.WARNING)  # one line per request otherwise
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cagflow-faults-") as work:
        stack = FaultStack(Path(work), config, model, doc_ids, args.max_new_tokens or MAX_NEW_TOKENS,
                           max_resident_states=1, say=lambda line: print(line, flush=True))
        with stack:
            setup_s = time.perf_counter() - started
            bench = Bench(stack, questions, clients)
            results = [run_scenario(bench, name) for name in names]
    report = {"model": model, "documents": doc_ids, "clients": clients, "setup_s": round(setup_s, 1),
              "wall_s": round(time.perf_counter() - started, 1), "scenarios": [r.to_dict() for r in results]}
    print("\n" + render(results))
    print(f"\nset-up {setup_s:.0f} s, all {report['wall_s']:.0f} s ({model}, {clients} clients)")
    saved = save_report("faults", report)
    if saved:
        print(f"report: {saved}")
    return 0 if all(result.passed for result in results) else 1
