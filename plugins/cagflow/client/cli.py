"""The ``cagflow`` command: precompute snapshots, serve and ask the API, manage API keys and releases, run the demo."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..config import Config, load_config


def _store(config: Config, url: str | None, role: str):
    """``role``: ``writer`` for commands that change the store (precompute, activate), else ``reader``."""
    from ..store.backends import open_store

    return open_store(url or config.cache.state_store, config.cache.s3, role=role)


def _engine(config: Config):
    from ..engine.engine import Engine

    return Engine.from_config(config.model, config.rules.disabled)


def cmd_precompute(args: argparse.Namespace, config: Config) -> int:
    from .console import precompute_with_progress

    store = _store(config, args.store, "writer")
    store.ping(create=True)
    precompute_with_progress(_engine(config), store, args.manifest or config.corpus.manifest, args.doc_id,
                             args.force, args.quiet)
    return 0


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

    store = _store(config, args.store, "reader")
    release = load_release(store)
    doc_id = args.doc_id or _pick_document(config, args.question)
    if doc_id not in release.doc_ids:
        raise ValueError(f"document {doc_id!r} is not in the active release {release.release_id} "
                         f"(known: {', '.join(release.doc_ids)})")
    snapshot = snapshot_for_question(store, release.for_doc(doc_id), args.question)
    engine = _engine(config)
    answer = engine.answer(args.question, snapshot=snapshot, max_new_tokens=args.max_new_tokens,
                           reuse_cache=not args.no_cache)
    if args.json:
        entry = next(entry for entry in release.snapshots if entry.key == str(snapshot.key))
        print(json.dumps(answer_record(
            question=args.question, model_answer=answer.text, answered=answer.answered, decline_reason=answer.decline_reason,
            route=answer.route, route_reason="local", cache_hit=answer.route == "cache",
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
    from .api_client import ApiClient, ApiError, client_timeout_s, default_ca_file

    if args.local:
        if args.url or args.top_k or args.stream:
            raise ValueError("--url, --top-k and --stream are for the API; leave them out with --local")
        return cmd_ask_local(args, config)
    if args.no_cache or args.store:
        raise ValueError("--no-cache and --store only apply with --local")
    url, ca_file = (args.url, default_ca_file(config.service)) if args.url else local_api(config)
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


def _duration(text: str) -> float:
    from ..router.apikeys import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _change_keys(args: argparse.Namespace, config: Config, store) -> tuple[str | None, dict]:
    """Create, rotate, revoke or issue local keys; prints the outcome and returns the audit target and detail."""
    from ..router.apikeys import CREDENTIALS_FILE, ensure_local_keys

    if args.action == "create":
        record, plaintext = store.create(args.name, admin=args.admin, expires_in_s=args.expires)
        print(plaintext)
        print(f"created {'admin ' if record.admin else ''}key {record.key_id} ({record.name}) in {store.path}"
              f"{f', expires {record.expires}' if record.expires else ''}; the key is shown only now", file=sys.stderr)
        return record.key_id, {"name": record.name, "admin": record.admin, "expires": record.expires or None}
    if args.action == "rotate":
        old, new, plaintext = store.rotate(args.key, args.overlap, expires_in_s=args.expires)
        print(plaintext)
        print(f"rotated key {old.key_id} ({old.name}): the new key {new.key_id} works now "
              f"({f'expires {new.expires}' if new.expires else 'no expiry'}; shown only now), {old.key_id} until "
              f"{old.expires}. Move its clients to the new key, then `cagflow keys revoke {old.key_id}`",
              file=sys.stderr)
        return old.key_id, {"name": old.name, "new_key_id": new.key_id, "old_expires": old.expires,
                            "expires": new.expires or None}
    if args.action == "revoke":
        record = store.revoke(args.key)
        print(f"revoked key {record.key_id} ({record.name})")
        return record.key_id, {"name": record.name}
    credentials = ensure_local_keys(config)
    if credentials is None:
        print(f"local API keys already exist: {CREDENTIALS_FILE} (hashes in {store.path})")
        return None, {"issued": False}
    print(f"user key:  {credentials.api_key}\nadmin key: {credentials.admin_key}\n"
          f"saved for `cagflow ask` in {CREDENTIALS_FILE} (mode 0600); hashes in {store.path}")
    issued = [store.identify(plaintext) for plaintext in (credentials.api_key, credentials.admin_key)]
    return ", ".join(key.key_id for key in issued), {"issued": True}


def cmd_keys(args: argparse.Namespace, config: Config) -> int:
    """Key changes write an audit event (``service.audit_log_file``), failed ones too; listing does not."""
    from ..errors import CagflowError
    from ..router.apikeys import ApiKeyStore
    from ..router.audit import AuditLog, local_user

    store = ApiKeyStore(config.service.api_keys_file)
    if args.action == "list":
        keys = store.list()
        if not keys:
            print(f"no API keys in {store.path}; create one with `cagflow keys create --name NAME` "
                  "or `cagflow keys init-local`", file=sys.stderr)
        for key in keys:
            expiry = f"{'expired' if store.expired(key) else 'expires'} {key.expires}" if key.expires else "no expiry"
            print(f"{key.key_id}  {'admin' if key.admin else 'user ':<5}  {key.created:<20}  {expiry:<28}  {key.name}")
        return 0
    audit = AuditLog(config.service.audit_log_file)
    who = {"via": "cli", "user": local_user()}
    try:
        target, detail = _change_keys(args, config, store)
    except (CagflowError, ValueError, OSError) as exc:
        audit.record(f"keys.{args.action}", "error", target=getattr(args, "key", None), reason=str(exc), **who)
        raise
    audit.record(f"keys.{args.action}", "ok", target=target, detail=detail, **who)
    return 0


def cmd_releases(args: argparse.Namespace, config: Config) -> int:
    from ..store.backends import NotFound
    from ..store.manifests import activate_release, list_releases, load_release

    store = _store(config, args.store, "writer" if args.activate else "reader")
    if args.activate:
        release = activate_release(store, args.activate)
        print(f"active release is now {release.release_id} ({len(release.snapshots)} snapshots)")
        return 0
    try:
        active = load_release(store).release_id
    except NotFound:
        active = None
    for release_id in list_releases(store):
        print(f"{'*' if release_id == active else ' '} {release_id}")
    return 0


def cmd_capacity(args: argparse.Namespace, config: Config) -> int:
    from .capacity import estimate, render

    manifest = None if args.manifest is None else args.manifest or config.corpus.manifest
    report = estimate(config, _store(config, args.store, "reader"), manifest=manifest, copies=args.copies,
                      target_qps=args.target_qps, seconds_per_request=args.seconds_per_request,
                      bench=args.from_bench).to_dict()
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def cmd_model(args: argparse.Namespace, config: Config) -> int:
    from ..engine.model import prepare_model

    path, recipe, fingerprint = prepare_model(config.model.path, config.model.precision)
    print(f"model {config.model.path}: {path}\nrecipe {recipe} (model.precision {config.model.precision})\n"
          f"fingerprint {fingerprint}")
    return 0


def cmd_doctor(args: argparse.Namespace, config: Config) -> int:
    """Each row of the troubleshooting table with its verdict and fix; exit 1 when a row fails."""
    from .doctor import diagnose

    verdicts = diagnose(config)
    if args.json:
        print(json.dumps([verdict.to_dict() for verdict in verdicts], indent=2))
    else:
        for verdict in verdicts:
            print(f"{verdict.status.upper():5} {verdict.symptom}: {verdict.detail}")
            if verdict.fix and verdict.status != "ok":
                print(f"      fix: {verdict.fix}")
    return 1 if any(verdict.status == "fail" for verdict in verdicts) else 0


def cmd_config(args: argparse.Namespace, config: Config) -> int:
    print(json.dumps(config.model_dump(), indent=2))
    return 0


def _opensearch_run_args(config: Config) -> list[str]:
    from urllib.parse import urlparse

    from ..config import CACHE_HOME

    endpoint = urlparse(config.retrieval.endpoint)
    if endpoint.hostname not in ("127.0.0.1", "localhost"):
        raise ValueError(f"retrieval.endpoint {config.retrieval.endpoint} is not local; "
                         "`cagflow opensearch up` only starts a node on 127.0.0.1")
    return ["--data-dir", str(CACHE_HOME / "opensearch-data"), "--port", str(endpoint.port or 9200)]


SERVICES = {"opensearch": _opensearch_run_args}


def cmd_service(args: argparse.Namespace, config: Config) -> int:
    from ..devstack import background

    if args.action == "up":
        state = background.up(args.service, SERVICES[args.service](config))
        print(f"{args.service} is up at {state.url} (pid {state.pid}, log {state.log}); "
              f"stop with: cagflow {args.service} down")
    elif args.action == "down":
        print(f"{args.service} stopped" if background.down(args.service) else f"{args.service} was not running")
    else:
        state = background.status(args.service)
        print(f"{args.service} is up at {state.url} (pid {state.pid})" if state else f"{args.service} is not running")
        return 0 if state else 3
    return 0


DELEGATED = {"triton": ("cagflow.devstack.triton", "start, stop or check a local Triton server (up|down|status)"),
             "airflow": ("cagflow.devstack.airflow", "run Airflow locally (up|down|status|trigger DAG)"),
             "router": ("cagflow.devstack.router",
                        "start, stop or check the local REST router in the background (up|down|status)")}


def _run_delegated(argv: list[str]) -> int | None:
    """Services with a command line of their own: `cagflow [--config F] triton up ...` runs theirs,
    with the global --config passed on to `up`."""
    import importlib

    config = None
    if argv[:1] == ["--config"] and len(argv) > 2:
        config, argv = argv[1], argv[2:]
    if not argv or argv[0] not in DELEGATED:
        return None
    rest = argv[1:]
    if config and rest[:1] == ["up"] and "--config" not in rest:
        rest += ["--config", config]
    return importlib.import_module(DELEGATED[argv[0]][0]).main(rest)


def cmd_bench(args: argparse.Namespace, config: Config) -> int:
    from ..bench import search as benchmarks
    from ..bench.report import save_report
    from ..search.retrieval import RetrievalUnavailable

    if args.which == "engine":
        from ..bench.engine import main as run_engine_bench

        return run_engine_bench(config, args)
    if args.which == "answers":
        from ..bench.answers import main as run_answers_bench

        return run_answers_bench(config, args)
    if args.which == "load":
        from ..bench.load import main as run_load_bench

        return run_load_bench(config, args)
    if args.which == "faults":
        from ..bench.faults import main as run_faults_bench

        return run_faults_bench(config, args)
    measure, show = {"retrieval": (benchmarks.retrieval_recall, benchmarks.print_retrieval_table),
                     "routing": (benchmarks.routing_calibration, benchmarks.print_routing_table)}[args.which]
    try:
        report = measure(config, Path(config.corpus.manifest).parent / "qa.jsonl")
    except RetrievalUnavailable as exc:
        raise ValueError(f"{exc}; start one with `cagflow opensearch up` (or set retrieval.endpoint)") from None
    show(report)
    saved = save_report(args.which, report)
    if saved:
        print(f"saved {saved}")
    return 0


def cmd_demo(args: argparse.Namespace, config: Config) -> int:
    from .demo import run_demo

    return run_demo(config, args.questions, args.max_new_tokens, local=args.local)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cagflow", description=__doc__)
    parser.add_argument("--config", help="YAML config file (default: $CAGFLOW_CONFIG, then built-in defaults)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    precompute = commands.add_parser("precompute", help="compute the fixed documents' snapshots and publish a release")
    precompute.add_argument("--manifest", help="corpus manifest (default: corpus.manifest)")
    precompute.add_argument("--store", help="file:///dir or s3://bucket/prefix (default: cache.state_store)")
    precompute.add_argument("--doc-id", action="append", help="only this document (repeatable)")
    precompute.add_argument("--force", action="store_true", help="recompute even when a verified snapshot exists")
    precompute.add_argument("--quiet", action="store_true", help="no progress bar")
    precompute.set_defaults(run=cmd_precompute)

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

    serve = commands.add_parser("serve", help="run the REST API in the foreground (production server)")
    serve.add_argument("--host", help="default: service.host")
    serve.add_argument("--port", type=int, help="default: service.port")
    serve.set_defaults(run=cmd_serve)

    keys = commands.add_parser("keys", help="API keys: create, list, rotate, revoke, or issue local ones")
    key_actions = keys.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = key_actions.add_parser("create", help="issue a key and print it (once)")
    create.add_argument("--name", required=True, help="who or what uses the key")
    create.add_argument("--admin", action="store_true", help="may also call /admin endpoints")
    key_actions.add_parser("list", help="key ids, roles, creation and expiry times, names (never the keys)")
    rotate = key_actions.add_parser("rotate", help="issue a replacement (same name and role) and print it (once); "
                                                   "the old key keeps working for --overlap")
    rotate.add_argument("key", metavar="KEY", help="the key's id, or a name only one key has")
    rotate.add_argument("--overlap", type=_duration, default="24h", metavar="DURATION",
                        help="how long the old key keeps working (default 24h; 0s: it stops now)")
    revoke = key_actions.add_parser("revoke", help="delete a key; requests with it fail at once")
    revoke.add_argument("key", metavar="KEY", help="the key's id, or a name only one key has")
    for issuing in (create, rotate):
        issuing.add_argument("--expires", type=_duration, metavar="DURATION",
                             help="the new key stops working after this long (90s, 15m, 24h, 30d; default: never)")
    key_actions.add_parser("init-local", help="issue a local user and admin key for `cagflow ask`, unless they exist")
    keys.set_defaults(run=cmd_keys)

    releases = commands.add_parser("releases", help="list releases, or activate one (rollback)")
    releases.add_argument("--activate", metavar="RELEASE_ID")
    releases.add_argument("--store")
    releases.set_defaults(run=cmd_releases)

    capacity = commands.add_parser("capacity", help="store size, memory per serving replica and replicas needed, "
                                                    "from the active release or the corpus")
    capacity.add_argument("--manifest", nargs="?", const="", metavar="FILE",
                          help="estimate from the corpus manifest's fixed documents, tokenised by the configured "
                               "model (default FILE: corpus.manifest), instead of the active release")
    capacity.add_argument("--store", help="file:///dir or s3://bucket/prefix (default: cache.state_store)")
    capacity.add_argument("--copies", type=int,
                          help="versions of each snapshot the store holds (default: maintenance.keep_releases)")
    capacity.add_argument("--target-qps", type=float, help="requests per second to serve: how many replicas")
    capacity.add_argument("--seconds-per-request", type=float, help="what one request costs a replica")
    capacity.add_argument("--from-bench", type=Path, metavar="FILE",
                          help="read the cost of a request from a `cagflow bench answers` or `bench engine` report "
                               "(bench/results/*.json)")
    capacity.add_argument("--json", action="store_true", help="the estimate as JSON")
    capacity.set_defaults(run=cmd_capacity)

    model = commands.add_parser("model", help="prepare the configured model (convert it once) and print its fingerprint")
    model.add_argument("action", nargs="?", choices=("prepare",), default="prepare",
                       help="prepare (the default): safe to run in several processes at once")
    model.set_defaults(run=cmd_model)

    doctor = commands.add_parser("doctor", help="check the setup against the README's troubleshooting table: "
                                                "a verdict and a fix per row (exit 1 when one fails)")
    doctor.add_argument("--json", action="store_true", help="one JSON object per row")
    doctor.set_defaults(run=cmd_doctor)

    show = commands.add_parser("config", help="print the effective configuration")
    show.set_defaults(run=cmd_config)

    bench = commands.add_parser("bench", help="benchmarks (reported, never asserted)")
    bench.add_argument("which", choices=("retrieval", "routing", "engine", "answers", "load", "faults"),
                       help="retrieval: recall@k of BM25, vector and hybrid search; routing: in-scope detection "
                            "per threshold and its calibration; engine: answer speed from a resident snapshot; "
                            "answers: are the answers right, per route, through the running API "
                            "(--precisions: int8 against fp32 in this process); load: many clients at once "
                            "through the running API, and the servers' memory (exit 1 on an unintended error); faults: "
                            "faults injected into a stack of its own on 127.0.0.1 while requests are in flight "
                            "(exit 1 when a scenario does not hold)")
    engine = bench.add_argument_group("options of `bench engine` and `bench answers`")
    engine.add_argument("--model", help="a model preset or path (default: model.path of the configuration)")
    engine.add_argument("--runs", type=int, default=3, help="short runs per cell; the median is reported")
    engine.add_argument("--peer", choices=("llama-cpp",),
                        help="also run llama.cpp (llama-cpp-python, built once into its own virtual environment) "
                             "on the same GGUF file, prompts and threads, in the same run")
    engine.add_argument("--precisions", action="store_true",
                        help="bench answers: compare int8 and fp32 answers from snapshots in this process")
    engine.add_argument("--limit", type=int, help="bench answers: ask only the first N sample questions")
    engine.add_argument("--kind", action="append", help="bench answers: ask only questions of this kind (fact, "
                        "near_miss, near_miss_absent, unanswerable, conflict; repeatable)")
    engine.add_argument("--only", help="bench answers: ask only these question ids (q001,q002,... or dataset ids)")
    engine.add_argument("--language", choices=("en", "zh"),
                        help="bench answers: ask only the questions in this language")
    engine.add_argument("--no-full-prompt", action="store_true",
                        help="bench answers: leave out the full-prompt route (a whole document prefilled per "
                             "question; token-identical to the cache route)")
    engine.add_argument("--auto-only", action="store_true",
                        help="bench answers: ask each question once, routed by the API (no per-route comparison)")
    engine.add_argument("--dataset", metavar="NAME|PATH",
                        help="bench answers: a question set of bench/datasets/ (squad2-dev, cmrc2018-trial) or a "
                             "folder of the same format, scored by its own rules; its documents are added to the "
                             "running stack when the active release lacks them (README: Measure it on your documents)")
    engine.add_argument("--route", action="append", choices=("auto", "cache", "retrieval"),
                        help="bench answers --dataset: ask on this route (repeatable; default: all three)")
    engine.add_argument("--split", choices=("calibration", "report"),
                        help="bench answers --dataset: ask only this half (split by document)")
    engine.add_argument("--no-ingest", action="store_true",
                        help="bench answers --dataset: fail instead of adding missing documents to the stack")
    engine.add_argument("--ablate", action="store_true",
                        help="bench answers --dataset: print what each answer rule did on the auto route (from the "
                             "rules each answer record says fired; always in the result JSON)")
    load = bench.add_argument_group("options of `bench load`")
    load.add_argument("--clients", type=int, help="clients asking at once (default: 50 in the burst of `bench "
                                                  "load`, 4 during each scenario of `bench faults`)")
    load.add_argument("--duration", type=float, default=60, help="seconds of the burst (default 60)")
    load.add_argument("--soak", type=float, default=0,
                      help="then this many seconds at a lower rate, to see whether memory grows (default 0: none)")
    load.add_argument("--soak-clients", type=int, default=4, help="clients in the soak (default 4)")
    load.add_argument("--soak-pause", type=float, default=1.0,
                      help="seconds between a soak client's requests (default 1)")
    load.add_argument("--max-new-tokens", type=int, help="per answer (default: the API's)")
    load.add_argument("--stream-share", type=float, default=0.2,
                      help="share of the requests that ask for a streamed answer (default 0.2)")
    load.add_argument("--pid", action="append", metavar="NAME=PID",
                      help="sample this process group's memory as NAME (default: the router and Triton that "
                           "`cagflow router up` and `cagflow triton up` recorded); repeatable")
    faults = bench.add_argument_group("options of `bench faults` (also --model, --clients, --max-new-tokens)")
    faults.add_argument("--scenario", action="append", metavar="NAME",
                        help="run only this scenario (repeatable; default: all of them, see bench/README.md)")
    faults.add_argument("--fault-doc-id", action="append", metavar="DOC_ID",
                        help="one of the three fixed documents of its release (give three; default: the three "
                             "smallest English ones of the manifest)")
    bench.set_defaults(run=cmd_bench)

    for service in SERVICES:
        runner = commands.add_parser(service, help=f"start, stop or check a local {service} in the background")
        runner.add_argument("action", choices=("up", "down", "status"))
        runner.set_defaults(run=cmd_service, service=service)

    for name, (_, summary) in DELEGATED.items():
        commands.add_parser(name, help=summary)  # listed in --help; run by _run_delegated

    demo = commands.add_parser("demo", help="ask sample questions through the REST API "
                                            "(--local: compare cache and full prompt in-process)")
    demo.add_argument("--local", action="store_true",
                      help="no server: answer in this process from each snapshot and from the full prompt, and compare")
    demo.add_argument("--questions", type=int, default=4,
                      help="how many sample questions in each language (default 4)")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.set_defaults(run=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    delegated = _run_delegated(argv)
    if delegated is not None:
        return delegated

    from ..errors import CagflowError

    args = build_parser().parse_args(argv)
    try:
        config = load_config(args.config)
        return args.run(args, config)
    except (CagflowError, ValueError, OSError) as exc:
        print(f"cagflow {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"cagflow {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
