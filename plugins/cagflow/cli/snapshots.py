"""What the snapshot store holds and what makes it: the prepared model, precomputed snapshots and their
releases (rollback), and the capacity a release needs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..config import Config
from .common import load_engine, open_configured_store


def cmd_precompute(args: argparse.Namespace, config: Config) -> int:
    from ..client.console import precompute_with_progress

    store = open_configured_store(config, args.store, "writer")
    store.ping(create=True)
    precompute_with_progress(load_engine(config), store, args.manifest or config.corpus.manifest, args.doc_id,
                             args.force, args.quiet)
    return 0


def cmd_releases(args: argparse.Namespace, config: Config) -> int:
    from ..store.backends import NotFound
    from ..store.manifests import activate_release, list_releases, load_release

    store = open_configured_store(config, args.store, "writer" if args.activate else "reader")
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
    from ..client.capacity import estimate, render

    manifest = None if args.manifest is None else args.manifest or config.corpus.manifest
    store = open_configured_store(config, args.store, "reader")
    report = estimate(config, store, manifest=manifest, copies=args.copies, target_qps=args.target_qps,
                      seconds_per_request=args.seconds_per_request, bench=args.from_bench).to_dict()
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def cmd_model(args: argparse.Namespace, config: Config) -> int:
    from ..engine.model import prepare_model

    path, recipe, fingerprint = prepare_model(config.model.path, config.model.precision)
    print(f"model {config.model.path}: {path}\nrecipe {recipe} (model.precision {config.model.precision})\n"
          f"fingerprint {fingerprint}")
    return 0


def add_precompute(commands: argparse._SubParsersAction) -> None:
    precompute = commands.add_parser("precompute",
                                     help="compute the fixed documents' snapshots and publish a release")
    precompute.add_argument("--manifest", help="corpus manifest (default: corpus.manifest)")
    precompute.add_argument("--store", help="file:///dir or s3://bucket/prefix (default: cache.state_store)")
    precompute.add_argument("--doc-id", action="append", help="only this document (repeatable)")
    precompute.add_argument("--force", action="store_true", help="recompute even when a verified snapshot exists")
    precompute.add_argument("--quiet", action="store_true", help="no progress bar")
    precompute.set_defaults(run=cmd_precompute)


def add_releases(commands: argparse._SubParsersAction) -> None:
    releases = commands.add_parser("releases", help="list releases, or activate one (rollback)")
    releases.add_argument("--activate", metavar="RELEASE_ID")
    releases.add_argument("--store")
    releases.set_defaults(run=cmd_releases)


def add_capacity(commands: argparse._SubParsersAction) -> None:
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


def add_model(commands: argparse._SubParsersAction) -> None:
    model = commands.add_parser("model",
                                help="prepare the configured model (convert it once) and print its fingerprint")
    model.add_argument("action", nargs="?", choices=("prepare",), default="prepare",
                       help="prepare (the default): safe to run in several processes at once")
    model.set_defaults(run=cmd_model)
