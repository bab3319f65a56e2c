"""A real trace collector on 127.0.0.1: Jaeger v2 all-in-one (OTLP/HTTP in, traces kept in memory, its query
API out; the binary built from the Go module serves no web UI, whose pages are built with npm).

Used by the integration tests and, with ``tracing.endpoint`` set, by ``make run TRACING=1``
(``cagflow jaeger up``). The ``jaeger`` binary is built once from the Go module proxy by
``docker/static-tools.sh jaeger`` (``make jaeger``) into ``~/.cache/cagflow/tools``; ``CAGFLOW_JAEGER_BIN``
names another one. Every port is chosen free at start unless given, and nothing else is opened (no gRPC
receivers, no metrics port): the config file is written here rather than taken from the binary's defaults.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import requests
import yaml

from ..errors import CagflowError
from .background import serve_until_stopped
from .process import HOST, ServerContext, ServerProcess, free_ports

STATIC_TOOLS = Path(__file__).resolve().parents[3] / "docker" / "static-tools.sh"
MAX_TRACES = 20000  # kept in memory; the oldest go first


class JaegerError(CagflowError, RuntimeError):
    """The ``jaeger`` binary is missing, or the collector did not start or answer."""

    code = "service_failed"


def find_jaeger_binary() -> Path:
    """``CAGFLOW_JAEGER_BIN``, else the one ``docker/static-tools.sh jaeger`` built for this checkout."""
    named = os.environ.get("CAGFLOW_JAEGER_BIN")
    if named:
        if not os.access(named, os.X_OK):
            raise JaegerError(f"CAGFLOW_JAEGER_BIN={named} is not an executable file")
        return Path(named)
    if STATIC_TOOLS.is_file():
        found = subprocess.run(["bash", str(STATIC_TOOLS), "path", "jaeger"], capture_output=True, text=True)
        path = Path(found.stdout.strip())
        if found.returncode == 0 and os.access(path, os.X_OK):
            return path
    raise JaegerError("no 'jaeger' binary: build it once with `make jaeger` (Go 1.26, ~10 min), or set "
                      "CAGFLOW_JAEGER_BIN to a Jaeger v2 binary")


def query_trace(query_url: str, trace_id: str, timeout_s: float = 5.0) -> dict[str, Any] | None:
    """One trace from Jaeger's query API (``GET /api/traces/<id>``, what its UI reads): ``spans`` and
    ``processes``, or None while it holds none. An unreachable collector, a failing status and a reply that
    is not its JSON raise requests' errors (``ValueError`` or ``AttributeError`` for the JSON)."""
    reply = requests.get(f"{query_url.rstrip('/')}/api/traces/{trace_id}", timeout=timeout_s)
    if reply.status_code == 404:
        return None
    reply.raise_for_status()
    data = reply.json().get("data") or []
    return data[0] if data else None


def collector_config(otlp_port: int, query_port: int, query_grpc_port: int) -> dict[str, Any]:
    """Jaeger v2's configuration (an OpenTelemetry Collector one): OTLP over HTTP into memory, the query
    service and UI over HTTP, every listener on HOST."""
    return {
        "service": {
            "extensions": ["jaeger_storage", "jaeger_query"],
            "pipelines": {"traces": {"receivers": ["otlp"], "processors": ["batch"],
                                     "exporters": ["jaeger_storage_exporter"]}},
            "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "warn"}},
        },
        "extensions": {
            "jaeger_storage": {"backends": {"memory_store": {"memory": {"max_traces": MAX_TRACES}}}},
            "jaeger_query": {"storage": {"traces": "memory_store"}, "http": {"endpoint": f"{HOST}:{query_port}"},
                             "grpc": {"endpoint": f"{HOST}:{query_grpc_port}"}},
        },
        "receivers": {"otlp": {"protocols": {"http": {"endpoint": f"{HOST}:{otlp_port}"}}}},
        "processors": {"batch": {"timeout": "200ms"}},
        "exporters": {"jaeger_storage_exporter": {"trace_storage": "memory_store"}},
    }


class LocalJaeger(ServerContext):
    """One Jaeger all-in-one bound to 127.0.0.1, owned by this process; its config and log in ``data_dir``."""

    def __init__(self, data_dir: str | os.PathLike[str], otlp_port: int | None = None,
                 query_port: int | None = None) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.otlp_port, self.query_port = otlp_port, query_port
        self._server = ServerProcess("jaeger", self.data_dir / "jaeger.log", JaegerError)

    @property
    def otlp_endpoint(self) -> str:
        """What ``tracing.endpoint`` names: the OTLP/HTTP base URL."""
        return self._server.http_url(self.otlp_port)

    @property
    def ui_url(self) -> str:
        """The query API (``tracing.query_url``), where the official image also serves the UI."""
        return self._server.http_url(self.query_port)

    def is_running(self) -> bool:
        return self._server.is_running()

    def start(self, timeout_s: float = 30.0) -> str:
        """Start the collector; returns its OTLP endpoint once the query API answers."""
        if self._server.launched:
            return self.otlp_endpoint
        binary = find_jaeger_binary()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        otlp, query, query_grpc = free_ports(3)
        self.otlp_port, self.query_port = self.otlp_port or otlp, self.query_port or query
        config = self.data_dir / "jaeger.yaml"
        config.write_text(yaml.safe_dump(collector_config(self.otlp_port, self.query_port, query_grpc)))
        self._server.launch([str(binary), "--config", str(config)], cwd=self.data_dir)
        self._server.wait_ready(lambda: requests.get(f"{self.ui_url}/api/services", timeout=1).ok, timeout_s,
                                interval_s=0.2, retry_on=(requests.RequestException,))
        return self.otlp_endpoint

    def trace(self, trace_id: str, timeout_s: float = 5.0) -> dict[str, Any] | None:
        """One trace (``query_trace``), or None while this collector holds none."""
        return query_trace(self.ui_url, trace_id, timeout_s)

    def traces(self, service: str, limit: int = 100, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        """The latest traces holding spans of ``service`` (none while it sent nothing)."""
        reply = requests.get(f"{self.ui_url}/api/traces", params={"service": service, "limit": limit},
                             timeout=timeout_s)
        if reply.status_code == 404:
            return []
        reply.raise_for_status()
        return reply.json().get("data") or []

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.stop(timeout_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cagflow.devstack.jaeger", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the collector in the foreground until interrupted")
    run.add_argument("--data-dir", required=True, type=Path)
    run.add_argument("--otlp-port", type=int, help="OTLP/HTTP port (default: a free one)")
    run.add_argument("--ui-port", type=int, help="the UI and query API's port (default: a free one)")
    run.add_argument("--ready-file", type=Path, help="write the OTLP endpoint and UI address here once ready")
    args = parser.parse_args(argv)
    try:
        with LocalJaeger(args.data_dir, args.otlp_port, args.ui_port) as jaeger:
            serve_until_stopped(f"{jaeger.ui_url} (OTLP/HTTP at {jaeger.otlp_endpoint})", args.ready_file,
                                jaeger.is_running)
    except JaegerError as exc:
        print(f"jaeger: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
