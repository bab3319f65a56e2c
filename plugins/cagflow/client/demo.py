"""The sample-corpus walkthrough behind ``make run``.

``run_demo`` asks a mix of sample questions through the REST API, as an application would: fixed-document
questions (answered from a precomputed snapshot) and variable or out-of-scope ones (answered by retrieval),
and shows for each how it was routed and how long each stage took. ``run_local_demo`` (``cagflow demo
--local``) needs no server: it answers in this process from each snapshot and from the full prompt, and shows
that both give the same tokens, faster from the cache.
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path
from typing import Any

from ..config import Config
from ..answering.qa import QAItem, load_qa
from ..answering.record import citation_label


def _round_robin(groups: dict[Any, list[QAItem]], count: int) -> list[QAItem]:
    """Up to ``count`` items taken in turn from each group, so every group is shown."""
    groups = {key: list(items) for key, items in groups.items()}
    picked: list[QAItem] = []
    while len(picked) < count and any(groups.values()):
        for items in groups.values():
            if items and len(picked) < count:
                picked.append(items.pop(0))
    return picked


def _by_document(items: list[QAItem]) -> dict[str | None, list[QAItem]]:
    groups: dict[str | None, list[QAItem]] = {}
    for item in items:
        groups.setdefault(item.doc_id, []).append(item)
    return groups


def _mixed(items: list[QAItem], count: int) -> list[QAItem]:
    in_scope = _round_robin(_by_document([i for i in items if i.in_scope]), math.ceil(count / 2))
    wanted = count - len(in_scope)
    variable = _round_robin(_by_document([i for i in items if not i.in_scope and i.doc_id]), wanted)
    unanswerable = [i for i in items if not i.in_scope and not i.doc_id]
    out_of_scope = _round_robin({"variable": variable, "none": unanswerable}, wanted)
    mixed = [item for pair in zip(in_scope, out_of_scope) for item in pair]
    longer = in_scope if len(in_scope) > len(out_of_scope) else out_of_scope
    return mixed + longer[len(mixed) // 2:]


def pick_mixed_questions(qa_path: Path, count: int) -> list[QAItem]:
    """``count`` questions in each language of the sample set (English first, then Chinese): about half
    fixed-document questions and half others, interleaved; the fixed ones spread over the fixed documents,
    the others alternating between variable documents and questions no document answers."""
    by_language: dict[str, list[QAItem]] = {}
    for item in load_qa(qa_path):
        by_language.setdefault(item.language, []).append(item)
    return [item for language in sorted(by_language) for item in _mixed(by_language[language], count)]


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile: with few samples, a value that was actually measured."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _print_answer(number: int, total: int, item: QAItem, reply: dict) -> None:
    expected = f"fixed document {item.doc_id}" if item.in_scope else (
        f"variable document {item.doc_id}" if item.doc_id else "no document")
    snapshot = reply.get("snapshot") or {}
    timings = reply.get("timings_ms") or {}
    print(f"\n[{number}/{total}] {item.question}  (expected: {expected})")
    print(f"  answer   : {reply.get('answer', '').strip()}")
    if reply.get("model_answer"):
        print(f"             (declined, {reply.get('decline_reason')}: the model said {reply['model_answer']!r})")
    verdict = "right" if item.is_correct(reply.get("answer", ""), reply.get("answered")) else "wrong"
    print(f"  reference: {item.reference_answer}  [{verdict}]")
    citations = reply.get("citations") or reply.get("suggestions") or []
    if citations:
        label = "cites    " if reply.get("citations") else "see also "
        print(f"  {label}: " + "; ".join(citation_label(citation) for citation in citations[:3]))
        if citations[0].get("quote"):
            print(f"  quote    : \u201c{citations[0]['quote']}\u201d")  # the evidence of the first source
    print(f"  route    : {reply.get('route')} · cache hit {'yes' if reply.get('cache_hit') else 'no'}"
          f" · fallback {reply.get('fallback_reason') or '-'}"
          + (f" · snapshot {snapshot['key']}" if snapshot.get("key") else "")
          + (f" · answer from {reply['answer_source']}" if reply.get("answer_source") else ""))
    stages = " · ".join(f"{stage} {_ms(timings.get(stage))}" for stage in ("route", "search", "ttft", "total"))
    print(f"  timings  : {stages} · request {reply.get('request_id', '-')}"
          + (f" · trace {reply['trace_id']}" if reply.get("trace_id") else ""))


STAGES = ("triton_wait", "model_prefix", "model_answer", "model_relevance", "model_reask")


def stage_breakdown(timings: list[dict]) -> dict[str, float]:
    """Median milliseconds per stage of answers computed for their request (``timings_ms`` records), and of the
    time outside Triton: where a route's time goes."""
    computed = [t for t in timings if "model_answer" in t]
    if not computed:
        return {}
    medians = {stage: statistics.median(t.get(stage, 0.0) for t in computed) for stage in STAGES}
    medians["outside_triton"] = statistics.median(t["total"] - t["triton"] for t in computed)
    return {stage: round(ms, 1) for stage, ms in medians.items()}


def format_breakdown(breakdown: dict[str, float]) -> str:
    return " · ".join(f"{stage.removeprefix('model_')} {ms:.0f}" for stage, ms in breakdown.items())


def _print_summary(items: list[QAItem], replies: list[dict], errors: int) -> None:
    """``items`` are the questions that got a reply, in the order of ``replies``."""
    print(f"\n{len(replies)} of {len(replies) + errors} questions answered" + (f", {errors} failed" if errors else ""))
    if not replies:
        return
    for route in sorted({reply.get("route") for reply in replies}, key=str):
        totals = [r["timings_ms"]["total"] for r in replies if r.get("route") == route]
        ttfts = [r["timings_ms"]["ttft"] for r in replies if r.get("route") == route and r["timings_ms"].get("ttft")]
        ttft = f", TTFT p50 {percentile(ttfts, 0.5):.0f} ms p95 {percentile(ttfts, 0.95):.0f} ms" if ttfts else ""
        outside = [r["timings_ms"]["overhead"] for r in replies
                   if r.get("route") == route and r["timings_ms"].get("overhead") is not None]
        overhead = (f", outside the model p50 {percentile(outside, 0.5):.0f} ms p95 {percentile(outside, 0.95):.0f} ms"
                    if outside else "")
        print(f"  {route:<9} {len(totals):2d} answers: total p50 {percentile(totals, 0.5):.0f} ms "
              f"p95 {percentile(totals, 0.95):.0f} ms{ttft}{overhead}")
        breakdown = stage_breakdown([r["timings_ms"] for r in replies if r.get("route") == route])
        if breakdown:
            print(f"  {'':<9} p50 ms by stage: {format_breakdown(breakdown)}")
    hits = sum(bool(reply.get("cache_hit")) for reply in replies)
    in_scope = [reply for item, reply in zip(items, replies) if item.in_scope]
    routed = sum(reply.get("route") in ("cache", "cache+retrieval") for reply in in_scope)
    print(f"  cache hit rate {hits}/{len(replies)} ({hits / len(replies):.0%}); "
          f"fixed-document questions routed to the cache {routed}/{len(in_scope)}")


def _print_urls(api_url: str, ca_file: str | None) -> None:
    from ..devstack.airflow import AirflowServiceError, LocalAirflow, default_home
    from ..router.apikeys import CREDENTIALS_FILE

    print(f"\nAPI       {api_url}  (POST /v1/query with 'Authorization: Bearer <key>'; local keys in "
          f"{CREDENTIALS_FILE})")
    if ca_file:
        print(f"TLS       verified against {ca_file}  (curl --cacert {ca_file} ...)")
    print(f"metrics   {api_url}/metrics")
    airflow = LocalAirflow(default_home())
    state = airflow.running_state()
    if state:
        try:
            user, password = airflow.credentials()
            login = f"login {user} / {password}"
        except (OSError, ValueError, KeyError, AirflowServiceError):
            login = f"login: see {airflow.home}"
        print(f"Airflow   {state['url']}  ({login})")


def open_local_client(config: Config, command: str):
    """A client of the local API with the local user key, checked to answer; None (and the reason printed
    for ``cagflow <command>``) when it cannot be used."""
    from ..devstack.router import local_api
    from ..router.apikeys import ApiKeyError, read_local_credentials
    from .api_client import ApiClient, ApiError, client_timeout_s

    url, ca_file = local_api(config)
    try:
        credentials = read_local_credentials()
    except ApiKeyError as exc:
        print(f"cagflow {command}: error: {exc}", file=sys.stderr)
        return None
    if credentials is None or not credentials.api_key:
        print(f"cagflow {command}: error: no local API key; create one with `cagflow keys init-local` "
              "(or set CAGFLOW_API_KEY)", file=sys.stderr)
        return None
    client = ApiClient(url, credentials.api_key, timeout_s=client_timeout_s(config.service), ca_file=ca_file)
    try:
        client.health()
    except ApiError as exc:
        print(f"cagflow {command}: error: the API at {url} does not answer ({exc.message}); "
              "start it with `cagflow router up` (or `make run`)", file=sys.stderr)
        return None
    return client


def run_demo(config: Config, questions: int, max_new_tokens: int, local: bool = False) -> int:
    """Ask ``questions`` sample questions through the REST API; 0 when every one was answered."""
    if local:
        return run_local_demo(config, questions, max_new_tokens)
    from .api_client import ApiError

    client = open_local_client(config, "demo")
    if client is None:
        return 2
    api_url = client.base_url
    items = pick_mixed_questions(Path(config.corpus.manifest).parent / "qa.jsonl", questions)
    print(f"asking {len(items)} sample questions through {api_url}/v1/query")
    replies, asked, errors = [], [], 0
    for number, item in enumerate(items, start=1):
        try:
            reply = client.query(item.question, max_new_tokens=max_new_tokens)
        except ApiError as exc:
            errors += 1
            print(f"\n[{number}/{len(items)}] {item.question}\n"
                  f"  error    : HTTP {exc.status} {exc.code}: {exc.message} (request {exc.request_id or '-'})")
            continue
        asked.append(item)
        replies.append(reply)
        _print_answer(number, len(items), item, reply)
    _print_summary(asked, replies, errors)
    _print_urls(api_url, client.ca_file)
    return 0 if replies and not errors else 1


def _pick_in_scope(qa_path: Path, release_doc_ids: list[str], count: int) -> list[QAItem]:
    """In-scope questions about the released documents, spread over the documents."""
    items = [item for item in load_qa(qa_path) if item.in_scope and item.doc_id in release_doc_ids]
    return _round_robin(_by_document(items), count)


def run_local_demo(config: Config, questions: int, max_new_tokens: int) -> int:
    """Precompute the sample corpus in this process, then answer each question from its snapshot and from
    the full prompt; 0 when every pair of answers is token-identical."""
    from ..engine.engine import Engine
    from ..inference.resident import snapshot_for_question
    from ..store.backends import open_store
    from .console import precompute_with_progress

    manifest = Path(config.corpus.manifest)
    store = open_store(config.cache.state_store, config.cache.s3, role="writer")  # it precomputes
    print(f"loading model {config.model.path} ...", file=sys.stderr)
    engine = Engine.from_config(config.model, config.rules.disabled)
    release, _ = precompute_with_progress(engine, store, str(manifest))
    items = _pick_in_scope(manifest.parent / "qa.jsonl", release.doc_ids, questions)
    engine.answer("Hello?", max_new_tokens=1)  # the first forward pass pays one-off set-up: keep it out of the timings
    identical, ttft_cache, ttft_full, ratios = 0, [], [], {}
    for number, item in enumerate(items, start=1):
        snapshot = snapshot_for_question(store, release.for_doc(item.doc_id), item.question)
        cached = engine.answer(item.question, snapshot=snapshot, max_new_tokens=max_new_tokens)
        full = engine.answer(item.question, snapshot=snapshot, max_new_tokens=max_new_tokens, reuse_cache=False)
        same = cached.token_ids == full.token_ids
        identical += same
        ttft_cache.append(cached.ttft_s)
        ttft_full.append(full.ttft_s)
        ratios.setdefault(snapshot.n_tokens, []).append(full.ttft_s / cached.ttft_s)
        print(f"\n[{number}/{len(items)}] {item.question}  ({snapshot.key}, {snapshot.n_tokens} document tokens)")
        print(f"  via cache : {cached.text}")
        print(f"              TTFT {cached.ttft_s * 1000:7.0f} ms · total {cached.total_s * 1000:6.0f} ms · "
              f"{cached.reused_tokens}/{cached.prompt_tokens} prompt tokens reused")
        print(f"  full      : {full.text}")
        print(f"              TTFT {full.ttft_s * 1000:7.0f} ms · total {full.total_s * 1000:6.0f} ms · "
              f"{'identical tokens' if same else 'DIFFERENT TOKENS'} · reference: {item.reference_answer}")
    if not items:
        print("no in-scope sample questions found next to the manifest", file=sys.stderr)
        return 1
    largest = max(ratios)
    print(f"\n{identical}/{len(items)} answers token-identical; median TTFT cache "
          f"{statistics.median(ttft_cache) * 1000:.0f} ms vs full prompt {statistics.median(ttft_full) * 1000:.0f} ms; "
          f"full/cache TTFT ratio {statistics.median(ratios[largest]):.1f}x at {largest} document tokens")
    return 0 if identical == len(items) else 1
