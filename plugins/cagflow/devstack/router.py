"""The REST router in the background: ``cagflow router up|down|status``, like ``cagflow triton ...``.

``up`` runs ``cagflow serve`` as a process group of its own, waits until ``/healthz`` answers (it does
without Triton and OpenSearch; ``/readyz`` is what says whether they answer), and records the group so that
``down`` stops it from another shell. SIGTERM goes to the server process alone, so it finishes the
requests in flight before it exits.

``up --self-signed`` serves HTTPS with the local certificate of ``devstack.tls`` (what ``make run`` does);
the record names the certificate a local client trusts, so ``local_api`` gives clients on this machine
the router's address and trust anchor without any configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import ssl
import sys
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..config import CACHE_HOME, Config, ConfigError, load_config
from .background import ServiceError
from .process import ServerProcess, hold_port, record_group, running_record, stop_recorded
from .tls import TLS_DIR, ensure_local_certificate

DEFAULT_RUN_DIR = CACHE_HOME / "router"
STATE_FILE = "server.json"


class RouterError(ServiceError):
    """The router did not start or does not answer."""


def local_api(config: Config) -> tuple[str, str | None]:
    """Base URL and trust anchor (None: the system's CAs) of the configured API for a client on this
    machine: those ``up`` recorded while its router runs on ``service.port``, else the configured ones."""
    state = running_record(DEFAULT_RUN_DIR / STATE_FILE)
    if state and urlsplit(state["url"]).port == config.service.port:
        return state["url"], state.get("ca_file")
    return config.service.base_url(), config.service.client_ca_file()


def _get_json(url: str, timeout_s: float = 3.0, ca_file: str | None = None) -> tuple[int, Any]:
    """Status and JSON body of a GET; a non-2xx reply is an answer too (``/readyz`` says 503 when degraded)."""
    context = ssl.create_default_context(cafile=ca_file) if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as reply:
            return reply.status, json.loads(reply.read() or b"null")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"null")
        except ValueError:
            return exc.code, None


def is_alive(url: str, ca_file: str | None = None) -> bool:
    """True once the router answers ``GET /healthz`` with 200."""
    return _get_json(f"{url}/healthz", ca_file=ca_file)[0] == 200


def _stop_hint(run_dir: Path) -> str:
    if run_dir == DEFAULT_RUN_DIR.expanduser().resolve():
        return "cagflow router down"
    return f"cagflow router --run-dir {shlex.quote(str(run_dir))} down"


def _describe_readiness(url: str, ca_file: str | None = None) -> str:
    try:
        status, body = _get_json(f"{url}/readyz", ca_file=ca_file)
    except (OSError, ValueError) as exc:
        return f"not answering /readyz ({exc})"
    if status == 200:
        return "ready"
    return f"degraded (/readyz {status}: {json.dumps(body, separators=(',', ':'))})"


def _check_port_free(port: int) -> None:
    """Fail now with a clear message, rather than with a bind error in the server's log."""
    with ExitStack() as probe:
        try:
            hold_port(probe, port)
        except OSError:
            raise RouterError(f"port {port} is already in use (choose another with --port)") from None


def cmd_up(args: argparse.Namespace) -> int:
    state_file = args.run_dir / STATE_FILE
    state = running_record(state_file)
    if state:
        print(f"router already running (pid {state['pid']}): {state['url']}, log {state['log']}; "
              f"stop with: {_stop_hint(args.run_dir)}")
        return 0
    config = load_config(args.config)
    port = args.port or config.service.port
    _check_port_free(port)
    served = {"port": port}
    if args.self_signed:
        local = ensure_local_certificate()
        served.update(tls_cert_file=str(local.cert_file), tls_key_file=str(local.key_file),
                      tls_ca_file=str(local.cert_file))
    service = config.service.model_copy(update=served)
    url, ca_file = service.base_url(), service.client_ca_file()
    env = {**os.environ, **{f"CAGFLOW__SERVICE__{name.upper()}": str(value) for name, value in served.items()}}
    if args.config:
        env["CAGFLOW_CONFIG"] = str(Path(args.config).resolve())
    args.run_dir.mkdir(parents=True, exist_ok=True)
    log = args.run_dir / "router.log"
    server = ServerProcess("router", log, RouterError, leader_first=True)
    started = time.perf_counter()
    server.launch([sys.executable, "-m", "cagflow.cli", "serve"], cwd=Path.cwd(), env=env)
    server.wait_ready(lambda: is_alive(url, ca_file), args.timeout, interval_s=0.3, retry_on=(OSError, ValueError))
    server.detach()
    record_group(state_file, server.pid, url=url, ca_file=ca_file, log=str(log), started_at=time.time())
    print(f"router up in {time.perf_counter() - started:.1f} s (pid {server.pid}): "
          f"{_describe_readiness(url, ca_file)}", f"api     {url}", f"metrics {url}/metrics",
          *([f"trust   {ca_file}"] if ca_file else []), f"log     {log}", f"stop with: {_stop_hint(args.run_dir)}",
          sep="\n")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    state, was_running = stop_recorded(args.run_dir / STATE_FILE, args.timeout, leader_first=True)
    if state is None:
        print(f"no router recorded in {args.run_dir}")
    else:
        pid = state["pid"]
        print(f"stopped router at {state['url']} (pid {pid})" if was_running else f"router (pid {pid}) was not running")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    state = running_record(args.run_dir / STATE_FILE)
    if not state:
        print("router is not running")
        return 3
    readiness = _describe_readiness(state["url"], state.get("ca_file"))
    print(f"router running (pid {state['pid']}) at {state['url']}: {readiness}")
    return 0 if readiness == "ready" else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cagflow router", description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR,
                        help=f"state and log (default {DEFAULT_RUN_DIR})")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start the router in the background and wait until it answers /healthz")
    up.add_argument("--config", help="CAGFlow YAML config (default: $CAGFLOW_CONFIG)")
    up.add_argument("--port", type=int, help="port (default: service.port)")
    up.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for /healthz")
    up.add_argument("--self-signed", action="store_true",
                    help="serve HTTPS with a self-signed certificate for this machine, created once in "
                         f"{TLS_DIR} (instead of service.tls_*); local clients find it through the router's record")
    up.set_defaults(run=cmd_up)
    down = commands.add_parser("down", help="stop the router started by `up`, letting requests in flight finish")
    down.add_argument("--timeout", type=float, default=60.0, help="seconds before the rest is killed")
    down.set_defaults(run=cmd_down)
    status = commands.add_parser("status", help="is the router running, and does /readyz say ready?")
    status.set_defaults(run=cmd_status)
    args = parser.parse_args(argv)
    args.run_dir = args.run_dir.expanduser().resolve()
    try:
        return args.run(args)
    except (RouterError, ConfigError, OSError) as exc:
        print(f"router {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
