"""The ``cagflow`` command: precompute snapshots, ask questions, manage releases, run the demo."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import Config, ConfigError, load_config


def _store(config: Config, url: str | None):
    from .stores import open_store

    return open_store(url or config.cache.state_store, config.cache.s3)


def _engine(config: Config):
    from .engine import Engine

    return Engine.from_config(config.model)


def precompute_and_publish(engine, store, manifest_path: str, doc_ids: list[str] | None = None,
                           force: bool = False, quiet: bool = False):
    """Precompute the fixed documents with a progress bar, publish a release, print a summary line."""
    from tqdm import tqdm

    from .catalog import plan_parts, precompute_all
    from .manifest import CorpusManifest, publish_if_changed, release_for_run

    manifest = CorpusManifest.load(manifest_path)
    store.ping()
    parts = plan_parts(engine, manifest, doc_ids)
    bar = tqdm(total=len(parts), unit="part", desc="precompute", file=sys.stderr, disable=quiet)

    def report(result) -> None:
        state = "kept (verified)" if result.skipped else f"{result.tokens_per_s:,.0f} tok/s"
        bar.set_postfix_str(f"{result.entry.key} {result.entry.n_tokens} tok, {state}")
        bar.update(1)

    results = precompute_all(engine, store, parts, force, report)
    bar.close()
    release = release_for_run(store, engine.fingerprint, [r.entry for r in results], manifest, doc_ids)
    release, published = publish_if_changed(store, release)
    written = sum(not r.skipped for r in results)
    print(f"release {release.release_id}{'' if published else ' (unchanged)'}: {len(release.snapshots)} snapshots "
          f"({written} new, {len(release.snapshots) - written} kept), "
          f"{sum(e.bytes for e in release.snapshots) / 1e6:.1f} MB in {store.url}")
    return release, results


def cmd_precompute(args: argparse.Namespace, config: Config) -> int:
    store = _store(config, args.store)
    store.ping()
    precompute_and_publish(_engine(config), store, args.manifest or config.corpus.manifest, args.doc_id,
                           args.force, args.quiet)
    return 0


def _pick_document(config: Config, question: str) -> str:
    """Without --doc-id: the fixed document sharing most words with the question."""
    from .documents import parse_file
    from .engine import best_part
    from .manifest import CorpusManifest

    manifest = CorpusManifest.load(config.corpus.manifest)
    fixed = manifest.tier("fixed")
    texts = [parse_file(manifest.file(e), e.title).render() for e in fixed]
    return fixed[best_part(question, texts)].doc_id


def cmd_ask(args: argparse.Namespace, config: Config) -> int:
    from .catalog import snapshot_for_question
    from .manifest import load_release

    store = _store(config, args.store)
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
        print(json.dumps({"doc_id": doc_id, "release_id": release.release_id, **answer.to_dict()}, indent=2))
    else:
        print(answer.text)
        print(f"[{answer.route} · {doc_id} · {answer.reused_tokens}/{answer.prompt_tokens} prompt tokens reused · "
              f"TTFT {answer.ttft_s * 1000:.0f} ms · total {answer.total_s * 1000:.0f} ms]", file=sys.stderr)
    return 0


def cmd_releases(args: argparse.Namespace, config: Config) -> int:
    from .manifest import activate_release, list_releases, load_release
    from .stores import NotFound

    store = _store(config, args.store)
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


def cmd_model(args: argparse.Namespace, config: Config) -> int:
    from .model import model_fingerprint, resolve_model_dir

    path = resolve_model_dir(config.model.path)
    print(f"model {config.model.path}: {path}\nfingerprint {model_fingerprint(path)}")
    return 0


def cmd_config(args: argparse.Namespace, config: Config) -> int:
    print(json.dumps(config.model_dump(), indent=2))
    return 0


def _opensearch_run_args(config: Config) -> list[str]:
    from urllib.parse import urlparse

    from .config import CACHE_HOME

    endpoint = urlparse(config.retrieval.endpoint)
    if endpoint.hostname not in ("127.0.0.1", "localhost"):
        raise ValueError(f"retrieval.endpoint {config.retrieval.endpoint} is not local; "
                         "`cagflow opensearch up` only starts a node on 127.0.0.1")
    return ["--data-dir", str(CACHE_HOME / "opensearch-data"), "--port", str(endpoint.port or 9200)]


SERVICES = {"opensearch": _opensearch_run_args}


def cmd_service(args: argparse.Namespace, config: Config) -> int:
    from .services import background

    if args.action == "up":
        state = background.up(args.service, SERVICES[args.service](config))
        print(f"{args.service} is up at {state.url} (pid {state.pid}, log {state.log})")
    elif args.action == "down":
        print(f"{args.service} stopped" if background.down(args.service) else f"{args.service} was not running")
    else:
        state = background.status(args.service)
        print(f"{args.service} is up at {state.url} (pid {state.pid})" if state else f"{args.service} is not running")
        return 0 if state else 3
    return 0


DELEGATED = {"triton": ("cagflow.services.triton", "start, stop or check a local Triton server (up|down|status)"),
             "airflow": ("cagflow.services.airflow", "run Airflow locally (up|down|status|trigger DAG)")}


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
    from .benchmarks import print_retrieval_table, retrieval_recall, save_report

    report = retrieval_recall(config, Path(config.corpus.manifest).parent / "qa.jsonl")
    print_retrieval_table(report)
    saved = save_report("retrieval", report)
    if saved:
        print(f"saved {saved}")
    return 0


def cmd_demo(args: argparse.Namespace, config: Config) -> int:
    from .demo import run_demo

    return run_demo(config, args.questions, args.max_new_tokens)


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

    ask = commands.add_parser("ask", help="answer a question from a fixed document's snapshot")
    ask.add_argument("question")
    ask.add_argument("--doc-id", help="document to answer from (default: best word match)")
    ask.add_argument("--no-cache", action="store_true", help="prefill the whole prompt instead of reusing the snapshot")
    ask.add_argument("--json", action="store_true", help="print the whole answer record as JSON")
    ask.add_argument("--max-new-tokens", type=int)
    ask.add_argument("--store")
    ask.set_defaults(run=cmd_ask)

    releases = commands.add_parser("releases", help="list releases, or activate one (rollback)")
    releases.add_argument("--activate", metavar="RELEASE_ID")
    releases.add_argument("--store")
    releases.set_defaults(run=cmd_releases)

    model = commands.add_parser("model", help="prepare the configured model and print its fingerprint")
    model.set_defaults(run=cmd_model)

    show = commands.add_parser("config", help="print the effective configuration")
    show.set_defaults(run=cmd_config)

    bench = commands.add_parser("bench", help="benchmarks (reported, never asserted)")
    bench.add_argument("which", choices=("retrieval",), help="retrieval: recall@k of BM25, vector and hybrid search")
    bench.set_defaults(run=cmd_bench)

    for service in SERVICES:
        runner = commands.add_parser(service, help=f"start, stop or check a local {service} in the background")
        runner.add_argument("action", choices=("up", "down", "status"))
        runner.set_defaults(run=cmd_service, service=service)

    for name, (_, summary) in DELEGATED.items():
        commands.add_parser(name, help=summary)  # listed in --help; run by _run_delegated

    demo = commands.add_parser("demo", help="precompute the sample corpus, answer sample questions both ways")
    demo.add_argument("--questions", type=int, default=5, help="how many sample questions (default 5)")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.set_defaults(run=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .catalog import SnapshotUnusable
    from .documents import DocumentError
    from .engine import SnapshotMismatch
    from .manifest import ManifestError
    from .model import ModelError
    from .prompt import PromptError
    from .services.background import ServiceError
    from .stores import StoreError

    argv = sys.argv[1:] if argv is None else argv
    delegated = _run_delegated(argv)
    if delegated is not None:
        return delegated
    args = build_parser().parse_args(argv)
    expected = (ConfigError, ManifestError, DocumentError, PromptError, StoreError, ModelError, SnapshotUnusable,
                SnapshotMismatch, ServiceError, ValueError, OSError)
    try:
        config = load_config(args.config)
        return args.run(args, config)
    except expected as exc:
        print(f"cagflow {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"cagflow {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
