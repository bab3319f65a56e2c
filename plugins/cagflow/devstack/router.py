"""The REST router in the background: ``cagflow router up|down|status``, like ``cagflow triton ...``.

``up`` runs ``cagflow serve`` as a process group of its own, waits until ``/healthz`` answers (it does
without Triton and OpenSearch; ``/readyz`` is what says whether they answer), and records the group so that
``down`` stops it from another shell. SIGTERM goes to the server process alone, so it finishes the
requests in flight before it exits.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ..client.api_client import default_base_url
from ..config import CACHE_HOME, ConfigError, load_config
from .background import ServiceError
from .process import ServerProcess, hold_port, record_group, running_record, stop_recorded

DEFAULT_RUN_DIR = CACHE_HOME / "router"
STATE_FILE = "server.json"


class RouterError(ServiceError):
    """The router did not start or does not answer."""


def _get_json(url: str, timeout_s: float = 3.0) -> tuple[int, Any]:
    """Status and JSON body of a GET; a non-2xx reply is an answer too (``/readyz`` says 503 when degraded)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return reply.status, json.loads(reply.read() or b"null")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"null")
        except ValueError:
            return exc.code, None


def is_alive(url: str) -> bool:
    """True once the router answers ``GET /healthz`` with 200."""
    return _get_json(f"{url}/healthz")[0] == 200


def _stop_hint(run_dir: Path) -> str:
    if run_dir == DEFAULT_RUN_DIR.expanduser().resolve():
        return "cagflow router down"
    return f"cagflow router --run-dir {shlex.quote(str(run_dir))} down"


def _describe_readiness(url: str) -> str:
    try:
        status, body = _get_json(f"{url}/readyz")
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
    url = default_base_url(config.service.model_copy(update={"port": port}))
    env = {**os.environ, "CAGFLOW__SERVICE__PORT": str(port)}
    if args.config:
        env["CAGFLOW_CONFIG"] = str(Path(args.config).resolve())
    args.run_dir.mkdir(parents=True, exist_ok=True)
    log = args.run_dir / "router.log"
    server = ServerProcess("router", log, RouterError, leader_first=True)
    started = time.perf_counter()
    server.launch([sys.executable, "-m", "cagflow.client.cli", "serve"], cwd=Path.cwd(), env=env)
    server.wait_ready(lambda: is_alive(url), args.timeout, interval_s=0.3, retry_on=(OSError, ValueError))
    server.detach()
    record_group(state_file, server.pid, url=url, log=str(log), started_at=time.time())
    print(f"router up in {time.perf_counter() - started:.1f} s (pid {server.pid}): {_describe_readiness(url)}",
          f"api     {url}", f"metrics {url}/metrics", f"log     {log}", f"stop with: {_stop_hint(args.run_dir)}",
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
    readiness = _describe_readiness(state["url"])
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
