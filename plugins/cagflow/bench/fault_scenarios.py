"""The fault scenarios of ``cagflow bench faults``: each breaks one part of the stack under load and checks
what the clients and the store show (bench/README.md, "Faults under load")."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from typing import Callable

import requests

from ..client.api_client import parse_sse
from ..store.backends import LocalStore, NotFound
from ..store.layout import snapshot_object
from ..store.manifests import load_release
from .fault_harness import CACHE_ROUTES, Bench, route_of, served_from_cache
from .faultstack import BUCKET, STORE_PREFIX, FaultStack, check_integrity, kill_group, wait_until

OUTAGE_S = 60.0


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
    command = [sys.executable, "-m", "cagflow.cli", "precompute", "--quiet", "--store", url,
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
    bench.check("resident snapshot answers before", served_from_cache(warm := bench.probe(resident)), route_of(warm))
    generator = bench.load(bench.about(resident))
    stack.s3.stop()
    stopped = time.monotonic()
    try:
        time.sleep(3)
        ready = stack.readiness()
        bench.check("/readyz degraded, still ready", ready.get("ready") and ready.get("degraded")
                    and ready["store"]["reachable"] is False, "; ".join(ready.get("reasons", [])))
        during = bench.probe(resident)
        bench.check("resident snapshot keeps answering", served_from_cache(during), route_of(during))
        fallback = bench.probe(other)
        bench.check("non-resident snapshot falls back to retrieval", fallback.get("status") == 200
                    and fallback.get("route") == "retrieval" and fallback.get("fallback_reason"), route_of(fallback))
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - stopped)))
    finally:
        stack.s3.start()
    restarted = time.monotonic()
    recovered = wait_until(lambda: stack.readiness()["store"]["reachable"], 120, 1.0)
    bench.check("recovered without a restart", recovered,
                f"store reachable again {time.monotonic() - restarted:.1f} s after SeaweedFS came back")
    after = bench.probe(other)
    bench.check("non-resident snapshot loads again", served_from_cache(after), route_of(after))
    bench.finish(generator)


def opensearch_restart(bench: Bench) -> None:
    """OpenSearch stopped and started again: the cache route keeps answering, retrieval answers 503 with a
    JSON error while it is away and answers again after."""
    stack = bench.stack
    if stack.opensearch is None:
        assert bench.result is not None
        bench.result.skipped = "the stack indexes into a shared OpenSearch, which it may not stop"
        return
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
        bench.check("the cache route keeps answering", served_from_cache(cached), route_of(cached))
        away = bench.probe(None, variable)
        bench.check("retrieval answers a JSON 503", away.get("status") == 503 and "error" in away, route_of(away))
        time.sleep(10)
    finally:
        stack.opensearch.start(timeout_s=300)
    recovered = wait_until(lambda: stack.readiness()["opensearch"]["reachable"], 120, 1.0)
    back = bench.probe(None, variable)
    bench.check("retrieval answers again", recovered and back.get("status") == 200
                and back.get("route") == "retrieval", route_of(back))
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
    bench.check("resident before the kill", served_from_cache(warm := bench.probe(doc)), route_of(warm))
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
                route_of(down))
    time.sleep(5)
    stack.start_triton(ports)
    back = wait_until(lambda: stack.readiness()["triton"]["ready"], 120, 1.0)
    after = bench.probe(doc)
    bench.check("answers again after the restart", back and after.get("status") == 200,
                f"{route_of(after)}; Triton was back {time.monotonic() - killed:.0f} s after the kill")
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
    bench.check("resident before the flip", served_from_cache(warm := bench.probe(resident)), route_of(warm))
    generator = bench.load(bench.about(resident, cold))
    flipped = [_flip(stack, resident), _flip(stack, cold)]
    flipped_at, evicted_at = time.monotonic(), float("inf")
    try:
        found = check_integrity(stack.store())
        bench.check("the integrity check finds both flipped objects", len(found.corrupt) == 2, ", ".join(found.corrupt))
        still = bench.probe(resident)
        bench.check("the resident copy keeps answering", served_from_cache(still), route_of(still))
        refused = bench.probe(cold)
        bench.check("a flipped snapshot is not loaded: retrieval, saying why", refused.get("status") == 200
                    and not refused.get("cache_hit") and refused.get("fallback_reason") == "snapshot_corrupt",
                    route_of(refused))
        evicting = bench.probe(spare)  # the one resident slot goes to another snapshot
        evicted_at = time.monotonic()
        reloaded = bench.probe(resident)
        bench.check("once evicted, the flipped resident one is not reloaded", served_from_cache(evicting)
                    and not reloaded.get("cache_hit") and reloaded.get("fallback_reason") == "snapshot_corrupt",
                    f"{spare}: {route_of(evicting)}; then {resident}: {route_of(reloaded)}")
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
                served_from_cache(restored), f"release {repaired}: {route_of(restored)}")
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
    contents = {release_id: {entry.key for entry in stack.release(release_id).snapshots}
                for release_id in (first, full)}
    answered = [o for o in summary.outcomes if o.kind == "answered" and o.release_id]
    mixed = [o for o in answered if o.route in CACHE_ROUTES and (o.snapshot or {}).get("key")
             and o.snapshot["key"] not in contents.get(o.release_id, set())]
    bench.check("every cache answer's snapshot is in the release it names", not mixed,
                f"{len(answered)} answers named a release")
    stale = []
    for index, (target, _, done) in enumerate(switches):
        until = switches[index + 1][1] if index + 1 < len(switches) else float("inf")
        stale += [o for o in answered if done < o.started_s < until and o.release_id != target]
    longest = max((done - began for _, began, done in switches), default=0)
    bench.check("no request after a switch answered from the release before it", not stale and len(switches) == 4,
                f"{len(switches)} switches, reload took {longest:.1f} s at most")


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
