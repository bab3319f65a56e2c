"""This machine's setup: the local services in the background, the doctor's checks, the effective configuration."""

from __future__ import annotations

import argparse
import json

from ..config import CACHE_HOME, Config


def cmd_doctor(args: argparse.Namespace, config: Config) -> int:
    """Each row of the troubleshooting table with its verdict and fix; exit 1 when a row fails."""
    from ..client.doctor import diagnose

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

    endpoint = urlparse(config.retrieval.endpoint)
    if endpoint.hostname not in ("127.0.0.1", "localhost"):
        raise ValueError(f"retrieval.endpoint {config.retrieval.endpoint} is not local; "
                         "`cagflow opensearch up` only starts a node on 127.0.0.1")
    return ["--data-dir", str(CACHE_HOME / "opensearch-data"), "--port", str(endpoint.port or 9200)]


def _jaeger_run_args(config: Config) -> list[str]:
    """The collector ``tracing.endpoint`` names (default OTLP/HTTP port 4318), with its UI on 16686."""
    from urllib.parse import urlparse

    endpoint = urlparse(config.tracing.endpoint or "http://127.0.0.1:4318")
    if endpoint.hostname not in ("127.0.0.1", "localhost"):
        raise ValueError(f"tracing.endpoint {config.tracing.endpoint} is not local; "
                         "`cagflow jaeger up` only starts a collector on 127.0.0.1")
    return ["--data-dir", str(CACHE_HOME / "jaeger"), "--otlp-port", str(endpoint.port or 4318), "--ui-port", "16686"]


SERVICES = {"opensearch": _opensearch_run_args, "jaeger": _jaeger_run_args}


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


def run_delegated(argv: list[str]) -> int | None:
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


def cmd_trace(args: argparse.Namespace, config: Config) -> int:
    """One request's trace from the collector, as a tree (README "Tracing")."""
    import re

    from ..client.traces import fetch_trace, render, span_tree

    if not re.fullmatch(r"[0-9a-fA-F]{32}", args.trace_id):
        raise ValueError(f"{args.trace_id!r} is not a trace id (32 hex digits, the answer's trace_id)")
    trace_id = args.trace_id.lower()
    trace = fetch_trace(args.query_url or config.tracing.query_url, trace_id)
    print(json.dumps(trace, indent=2) if args.json else render(trace_id, span_tree(trace), attributes=args.attributes))
    return 0


def add_trace(commands: argparse._SubParsersAction) -> None:
    trace = commands.add_parser("trace", help="print one request's trace (the trace_id of its answer) from the "
                                              "collector as a tree of spans with their times")
    trace.add_argument("trace_id")
    trace.add_argument("--query-url", help="the collector's query API (default: tracing.query_url)")
    trace.add_argument("--attributes", action="store_true", help="also each span's cagflow.* attributes")
    trace.add_argument("--json", action="store_true", help="the collector's JSON instead of the tree")
    trace.set_defaults(run=cmd_trace)


def add_doctor(commands: argparse._SubParsersAction) -> None:
    doctor = commands.add_parser("doctor", help="check the setup against the README's troubleshooting table: "
                                                "a verdict and a fix per row (exit 1 when one fails)")
    doctor.add_argument("--json", action="store_true", help="one JSON object per row")
    doctor.set_defaults(run=cmd_doctor)


def add_config(commands: argparse._SubParsersAction) -> None:
    show = commands.add_parser("config", help="print the effective configuration")
    show.set_defaults(run=cmd_config)


def add_services(commands: argparse._SubParsersAction) -> None:
    for service in SERVICES:
        runner = commands.add_parser(service, help=f"start, stop or check a local {service} in the background")
        runner.add_argument("action", choices=("up", "down", "status"))
        runner.set_defaults(run=cmd_service, service=service)
    for name, (_, summary) in DELEGATED.items():
        commands.add_parser(name, help=summary)  # listed in --help; run by run_delegated
