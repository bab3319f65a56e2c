"""Asking questions: through the running REST API, or in this process (``--local``); serving the API; the demo."""

from __future__ import annotations

import argparse
import json
import sys

from ..config import Config
from .common import load_engine, open_configured_store


def _pick_document(config: Config, question: str) -> str:
    """Without --doc-id: the fixed document sharing most words with the question."""
    from ..documents.parsing import parse_file
    from ..documents.text import best_part
    from ..store.manifests import CorpusManifest

    manifest = CorpusManifest.load(config.corpus.manifest)
    fixed = manifest.tier("fixed")
    texts = [parse_file(manifest.file(e), e.title).render() for e in fixed]
    return fixed[best_part(question, texts)].doc_id


def cmd_ask_local(args: argparse.Namespace, config: Config) -> int:
    """In this process, without the API: the snapshot of one fixed document, or the full prompt."""
    from ..answering.record import answer_record
    from ..inference.resident import snapshot_for_question
    from ..store.manifests import load_release

    store = open_configured_store(config, args.store, "reader")
    release = load_release(store)
    doc_id = args.doc_id or _pick_document(config, args.question)
    if doc_id not in release.doc_ids:
        raise ValueError(f"document {doc_id!r} is not in the active release {release.release_id} "
                         f"(known: {', '.join(release.doc_ids)})")
    snapshot = snapshot_for_question(store, release.for_doc(doc_id), args.question)
    engine = load_engine(config)
    answer = engine.answer(args.question, snapshot=snapshot, max_new_tokens=args.max_new_tokens,
                           reuse_cache=not args.no_cache)
    if args.json:
        entry = next(entry for entry in release.snapshots if entry.key == str(snapshot.key))
        print(json.dumps(answer_record(
            question=args.question, model_answer=answer.text, answered=answer.answered,
            decline_reason=answer.decline_reason, route=answer.route, route_reason="local",
            cache_hit=answer.route == "cache",
            snapshot={"key": entry.key, "doc_id": entry.doc_id, "doc_version": entry.doc_version},
            release_id=release.release_id, finish_reason=answer.finish_reason,
            timings_ms={"ttft": round(answer.ttft_s * 1000, 2), "generate": round(answer.total_s * 1000, 2),
                        "total": round(answer.total_s * 1000, 2)},
            prompt_tokens=answer.prompt_tokens, reused_tokens=answer.reused_tokens,
            generated_tokens=len(answer.token_ids), unsupported_figures=answer.unsupported,
            relevance=answer.relevance, rules_fired=answer.rules_fired), indent=2))
    else:
        print(answer.text)
        print(f"[{answer.route} · {doc_id} · {answer.reused_tokens}/{answer.prompt_tokens} prompt tokens reused · "
              f"TTFT {answer.ttft_s * 1000:.0f} ms · total {answer.total_s * 1000:.0f} ms]", file=sys.stderr)
    return 0


def _explain_api_error(error) -> str:
    """One line that says what to do about a failed API call."""
    from ..router import apikeys

    if error.code in ("unreachable", "timeout"):
        return f"{error.message}; start the API with `make run` or `cagflow serve` (or point --url at it)"
    if error.code == "tls_failed":
        return (f"{error.message}; the client trusts service.tls_ca_file (default: service.tls_cert_file), "
                "else the system's CAs")
    if error.status == 401:
        return (f"{error}; the key comes from $CAGFLOW_API_KEY (or $CAGFLOW_API_KEY_FILE), else from "
                f"{apikeys.CREDENTIALS_FILE} (`cagflow keys init-local` writes it)")
    return str(error)


def _route_line(record: dict) -> str:
    timings = record.get("timings_ms") or {}
    source = (record.get("snapshot") or {}).get("doc_id") or ", ".join(
        sorted({citation["doc_id"] for citation in record.get("citations", [])})) or "no document"
    parts = [record.get("route", "?"), source, "cache hit" if record.get("cache_hit") else "no cache hit"]
    if record.get("fallback_reason"):
        parts.append(f"fallback: {record['fallback_reason']}")
    parts += [f"{name} {timings[name]:.0f} ms" for name in ("ttft", "total") if timings.get(name) is not None]
    parts.append(f"request {record.get('request_id')}")
    if record.get("trace_id"):
        parts.append(f"trace {record['trace_id']}")  # `cagflow trace` shows it
    return f"[{' · '.join(parts)}]"


def _print_stream(events, as_json: bool) -> dict:
    """Print tokens as they arrive (or every event as a JSON line); returns the final answer record. The
    line of tokens is ended even when the stream fails, so an error message starts on a line of its own."""
    record: dict = {}
    printed_tokens = False
    try:
        for event in events:
            if as_json:
                print(json.dumps(event, ensure_ascii=False), flush=True)
            elif event["event"] == "token":
                print(event["data"]["text"], end="", flush=True)
                printed_tokens = True
            if event["event"] == "answer":
                record = event["data"]
    finally:
        if printed_tokens:
            print()
    return record


def cmd_ask(args: argparse.Namespace, config: Config) -> int:
    """Ask the running API (``--local``: answer in this process instead)."""
    from ..devstack.router import local_api
    from ..router.apikeys import read_local_credentials
    from ..client.api_client import ApiClient, ApiError, client_timeout_s

    if args.local:
        if args.url or args.top_k or args.stream:
            raise ValueError("--url, --top-k and --stream are for the API; leave them out with --local")
        return cmd_ask_local(args, config)
    if args.no_cache or args.store:
        raise ValueError("--no-cache and --store only apply with --local")
    url, ca_file = (args.url, config.service.client_ca_file()) if args.url else local_api(config)
    credentials = read_local_credentials()
    options = {"doc_id": args.doc_id, "top_k": args.top_k, "max_new_tokens": args.max_new_tokens}
    try:
        with ApiClient(url, credentials.api_key if credentials else None,
                       timeout_s=client_timeout_s(config.service), ca_file=ca_file) as client:
            if not args.stream:
                record = client.query(args.question, **options)
                print(json.dumps(record, indent=2, ensure_ascii=False) if args.json else record.get("answer", ""))
            else:
                record = _print_stream(client.stream(args.question, **options), args.json)
    except ApiError as error:
        raise ValueError(_explain_api_error(error)) from None
    if not args.json and record:
        print(_route_line(record), file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace, config: Config) -> int:
    from ..router import run_server

    run_server(config, args.host, args.port)
    return 0


def cmd_demo(args: argparse.Namespace, config: Config) -> int:
    from ..client.demo import run_demo

    return run_demo(config, args.questions, args.max_new_tokens, local=args.local)


def add_ask(commands: argparse._SubParsersAction) -> None:
    ask = commands.add_parser("ask", help="ask the running REST API a question (--local: answer in this process)")
    ask.add_argument("question")
    ask.add_argument("--url", help="the API (default: the router `cagflow router up` runs, else "
                                   "http(s)://service.host:service.port)")
    ask.add_argument("--doc-id", help="answer from this fixed document (default: the API routes the question)")
    ask.add_argument("--top-k", type=int, help="passages when the answer comes from retrieval")
    ask.add_argument("--max-new-tokens", type=int)
    ask.add_argument("--stream", action="store_true", help="print the answer's tokens as they arrive")
    ask.add_argument("--json", action="store_true",
                     help="print the whole answer record (with --stream: each event) as JSON")
    ask.add_argument("--local", action="store_true",
                     help="no API: load the model here and answer from a snapshot (default: best word match)")
    ask.add_argument("--no-cache", action="store_true", help="with --local: prefill the whole prompt instead")
    ask.add_argument("--store", help="with --local: file:///dir or s3://bucket/prefix (default: cache.state_store)")
    ask.set_defaults(run=cmd_ask)


def add_serve(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="run the REST API in the foreground (production server)")
    serve.add_argument("--host", help="default: service.host")
    serve.add_argument("--port", type=int, help="default: service.port")
    serve.set_defaults(run=cmd_serve)


def add_demo(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser("demo", help="ask sample questions through the REST API "
                                            "(--local: compare cache and full prompt in-process)")
    demo.add_argument("--local", action="store_true",
                      help="no server: answer in this process from each snapshot and from the full prompt, "
                           "and compare")
    demo.add_argument("--questions", type=int, default=4,
                      help="how many sample questions in each language (default 4)")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.set_defaults(run=cmd_demo)
