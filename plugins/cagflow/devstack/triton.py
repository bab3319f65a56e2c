"""A real Triton Inference Server on 127.0.0.1 serving ``triton_models/`` with the Python backend.

The ``tritonserver`` binary, the Python backend and its per-Python-version stubs come from the
``nvidia-pytriton`` wheel (installed without its dependencies). This module assembles a backend
directory from them, starts the server on free HTTP/gRPC/metrics ports in its own process group, and
waits until ``/v2/health/ready`` answers (every model loaded).

The stub process runs the first ``python3`` on ``PATH``. The wheel's stub is built against NumPy 1.x and
misreads NumPy 2 arrays (string tensors arrive garbled), so when this environment has NumPy 2 the stub
gets a small environment of its own: NumPy 1.26 first on ``sys.path``, then this environment's packages.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from importlib import metadata
from pathlib import Path
from typing import Sequence

from ..config import CACHE_HOME
from .background import ServiceError
from .process import HOST, ServerContext, ServerProcess, hold_port, record_group, running_record, stop_recorded

STUB_NUMPY = "numpy==1.26.4"
DEFAULT_RUN_DIR = CACHE_HOME / "triton"
STUB_ENV_DIR = CACHE_HOME / "triton-stub"
DEFAULT_MODEL_REPOSITORY = Path(__file__).resolve().parents[3] / "triton_models"
STATE_FILE = "server.json"
PORT_NAMES = ("http", "grpc", "metrics")


class TritonError(ServiceError):
    """The server cannot be assembled, did not start, or did not become ready."""


def pytriton_dir() -> Path:
    """The installed ``pytriton`` package, found without importing it (its imports need its dependencies)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonError("nvidia-pytriton is not installed (pip install --no-deps nvidia-pytriton==0.7.0)")
    return Path(next(iter(spec.submodule_search_locations)))


def build_backend_dir(target: Path) -> Path:
    """``target/python/`` with the Python backend library, its utils module and the stub for this Python."""
    server_dir = pytriton_dir() / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    sources = {
        "libtriton_python.so": server_dir / "backends" / "python" / "libtriton_python.so",
        "triton_python_backend_utils.py": server_dir / "backends" / "python" / "triton_python_backend_utils.py",
        "triton_python_backend_stub": server_dir / "python_backend_stubs" / version / "triton_python_backend_stub",
    }
    python_dir = target / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for name, source in sources.items():
        if not source.exists():
            raise TritonError(f"{source} is missing: nvidia-pytriton ships no Python backend for Python {version}")
        link = python_dir / name
        if link.is_symlink() or link.exists():
            if link.resolve() == source.resolve():
                continue
            link.unlink()
        link.symlink_to(source)
    return target


def tritonserver_binary() -> Path:
    binary = pytriton_dir() / "tritonserver" / "bin" / "tritonserver"
    if not os.access(binary, os.X_OK):
        raise TritonError(f"{binary} is missing or not executable")
    return binary


def _numpy_major() -> int:
    try:
        return int(metadata.version("numpy").split(".")[0])
    except metadata.PackageNotFoundError:
        return 0


def stub_python_bin(cache_dir: Path = STUB_ENV_DIR) -> Path:
    """The ``bin`` directory whose ``python3`` the stub should run (see the module docstring)."""
    if _numpy_major() < 2:
        return Path(sys.executable).parent
    packages = sysconfig.get_paths()["purelib"]
    key = hashlib.sha256(f"{sys.prefix}|{packages}|{STUB_NUMPY}|{sys.version}".encode()).hexdigest()[:12]
    env_dir = cache_dir / f"stub-env-{key}"
    if (env_dir / ".cagflow-ready").exists():
        return env_dir / "bin"
    staging = cache_dir / f".stub-env-{key}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(staging)], check=True)
    probe = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.run([str(staging / "bin" / "python3"), "-c", probe], check=True, capture_output=True,
                               text=True).stdout.strip())
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                              "--no-deps", "--target", str(site), STUB_NUMPY], capture_output=True, text=True)
    if install.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise TritonError(f"could not install {STUB_NUMPY} for the Triton stub: {install.stderr.strip()[-800:]}")
    # Appended after the stub's own site-packages, so its NumPy 1.x wins and everything else (torch,
    # transformers, cagflow itself) comes from this environment; addsitedir also runs its .pth files.
    (site / "zz-cagflow-main-env.pth").write_text(f"import site; site.addsitedir({packages!r})\n")
    (staging / ".cagflow-ready").touch()
    try:
        staging.rename(env_dir)
    except OSError:  # another process finished the same environment first
        shutil.rmtree(staging, ignore_errors=True)
    return env_dir / "bin"


def choose_ports(requested: dict[str, int | None] | None = None) -> dict[str, int]:
    """Distinct ports for HTTP, gRPC and metrics: those ``requested`` (by name), free ones for the rest."""
    requested = requested or {}
    with ExitStack() as held:
        ports = {}
        for name in PORT_NAMES:
            try:
                ports[name] = hold_port(held, requested.get(name) or 0)
            except OSError:
                raise TritonError(f"{name} port {requested[name]} on {HOST} is already in use") from None
        return ports


def is_ready(http_url: str) -> bool:
    """True once the server answers ``/v2/health/ready`` (every model loaded)."""
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/health/ready", timeout=2) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


class LocalTriton(ServerContext):
    """One ``tritonserver`` on 127.0.0.1 owned by this process (or by ``up``/``down``).

    ``models`` restricts which models of the repository load (all of them by default). ``environment``
    is added to the server's environment: that is how the models get their CAGFlow configuration
    (``CAGFLOW_CONFIG``, ``CAGFLOW__SECTION__KEY``). ``ports`` fixes some of the ``http``, ``grpc`` and
    ``metrics`` ports (for clients configured with an address); the others are free ones.
    """

    def __init__(self, run_dir: str | os.PathLike[str] = DEFAULT_RUN_DIR,
                 model_repository: str | os.PathLike[str] = DEFAULT_MODEL_REPOSITORY,
                 models: Sequence[str] | None = None, environment: dict[str, str] | None = None,
                 exit_timeout_s: int = 10, ports: dict[str, int | None] | None = None):
        self.run_dir = Path(run_dir).expanduser().resolve()
        self.model_repository = Path(model_repository).expanduser().resolve()
        self.models = list(models) if models else None
        self.environment = dict(environment or {})
        self.exit_timeout_s = exit_timeout_s
        self.requested_ports = dict(ports or {})
        self.ports: dict[str, int] = {}
        # A distinct shared-memory prefix per server, so several servers can run on one machine and
        # regions left by a crashed stub can be removed.
        self.shm_prefix = f"cagflow-{os.getpid()}-{secrets.token_hex(4)}-"
        # SIGTERM goes to the server alone: it unloads the models, so their ``finalize`` runs in the stubs.
        self._server = ServerProcess("tritonserver", self.console_log, TritonError, leader_first=True,
                                     on_stopped=lambda: _remove_shared_memory(self.shm_prefix))

    @property
    def pid(self) -> int | None:
        return self._server.pid

    @property
    def console_log(self) -> Path:
        return self.run_dir / "tritonserver.log"

    @property
    def http_url(self) -> str:
        return f"{HOST}:{self.ports['http']}"

    @property
    def grpc_url(self) -> str:
        return f"{HOST}:{self.ports['grpc']}"

    @property
    def metrics_url(self) -> str:
        return f"http://{HOST}:{self.ports['metrics']}/metrics"

    def _command(self, backend_dir: Path) -> list[str]:
        command = [
            str(tritonserver_binary()),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backend_dir}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            "--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0",
            f"--http-address={HOST}", f"--http-port={self.ports['http']}",
            f"--grpc-address={HOST}", f"--grpc-port={self.ports['grpc']}",
            f"--metrics-address={HOST}", f"--metrics-port={self.ports['metrics']}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
        ]
        if self.models is not None:
            command.append("--model-control-mode=explicit")
            command.extend(f"--load-model={name}" for name in self.models)
        return command

    def _server_environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.environment)
        stub_bin = stub_python_bin()
        path = [str(stub_bin), str(Path(sys.executable).parent), env.get("PATH", "")]
        env["PATH"] = os.pathsep.join(dict.fromkeys(p for p in path if p))
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
        env.setdefault("HF_HUB_OFFLINE", "1")
        return env

    def start(self, timeout_s: float = 300.0) -> "LocalTriton":
        """Start the server and return once every model is loaded; on failure, raise with the log's tail."""
        if self._server.launched:
            return self
        if not self.model_repository.is_dir():
            raise TritonError(f"model repository {self.model_repository} not found")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        backend_dir = build_backend_dir(self.run_dir / "backends")
        environment = self._server_environment()
        self.ports = choose_ports(self.requested_ports)
        self._server.launch(self._command(backend_dir), cwd=self.run_dir, env=environment)
        self._server.wait_ready(self.is_ready, timeout_s, interval_s=0.2)
        return self

    def is_ready(self) -> bool:
        return is_ready(self.http_url)

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as reply:
            return reply.read().decode()

    def detach(self) -> dict:
        """Leave the server running after this process exits; returns the record ``down`` stops it by."""
        self._server.detach()
        return record_group(self.run_dir / STATE_FILE, self.pid, ports=self.ports, log=str(self.console_log),
                            model_repository=str(self.model_repository), shm_prefix=self.shm_prefix)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server (it unloads the models, so their ``finalize`` runs); SIGKILL its process group
        (stubs included) if anything is left after ``timeout_s``."""
        self._server.stop(timeout_s)


def _remove_shared_memory(prefix: str) -> None:
    for region in Path("/dev/shm").glob(f"{prefix}*"):
        region.unlink(missing_ok=True)


def _stop_hint(run_dir: Path) -> str:
    if run_dir == DEFAULT_RUN_DIR.expanduser().resolve():
        return "cagflow triton down"
    return f"cagflow triton --run-dir {shlex.quote(str(run_dir))} down"


def cmd_up(args: argparse.Namespace) -> int:
    state = running_record(args.run_dir / STATE_FILE)
    if state:
        print(f"tritonserver already running (pid {state['pid']}): http {HOST}:{state['ports']['http']}, "
              f"log {state['log']}; stop with: {_stop_hint(args.run_dir)}")
        return 0
    environment = {"CAGFLOW_CONFIG": str(Path(args.config).resolve())} if args.config else {}
    ports = {"http": args.http_port, "grpc": args.grpc_port, "metrics": args.metrics_port}
    server = LocalTriton(args.run_dir, args.model_repository, args.model, environment, ports=ports)
    started = time.perf_counter()
    server.start(args.timeout)
    state = server.detach()
    print(f"tritonserver ready in {time.perf_counter() - started:.1f} s (pid {state['pid']})",
          f"http    {server.http_url}", f"grpc    {server.grpc_url}", f"metrics {server.metrics_url}",
          f"log     {server.console_log}", f"stop with: {_stop_hint(args.run_dir)}", sep="\n")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    state, was_running = stop_recorded(args.run_dir / STATE_FILE, args.timeout, leader_first=True)
    if state is None:
        print(f"no tritonserver recorded in {args.run_dir}")
        return 0
    pid = state["pid"]
    print(f"stopped tritonserver (pid {pid})" if was_running else f"tritonserver (pid {pid}) was not running")
    if state.get("shm_prefix"):
        _remove_shared_memory(state["shm_prefix"])
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    state = running_record(args.run_dir / STATE_FILE)
    if not state:
        print("not running")
        return 3
    ports = state["ports"]
    ready = is_ready(f"{HOST}:{ports['http']}")
    print(f"{'ready' if ready else 'starting or unhealthy'} (pid {state['pid']}): http {HOST}:{ports['http']}, "
          f"grpc {HOST}:{ports['grpc']}, metrics http://{HOST}:{ports['metrics']}/metrics")
    return 0 if ready else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cagflow triton", description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR,
                        help=f"state and logs (default {DEFAULT_RUN_DIR})")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start tritonserver in the background and wait until it is ready")
    up.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    up.add_argument("--model", action="append", help="load only this model (repeatable; default: all)")
    up.add_argument("--config", help="CAGFlow YAML config for the models (default: $CAGFLOW_CONFIG)")
    for name in PORT_NAMES:
        up.add_argument(f"--{name}-port", type=int, help=f"{name} port (default: a free one)")
    up.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for readiness")
    up.set_defaults(run=cmd_up)
    down = commands.add_parser("down", help="stop the server started by `up`")
    down.add_argument("--timeout", type=float, default=30.0)
    down.set_defaults(run=cmd_down)
    status = commands.add_parser("status", help="is the server started by `up` running and ready?")
    status.set_defaults(run=cmd_status)
    args = parser.parse_args(argv)
    args.run_dir = args.run_dir.expanduser().resolve()
    try:
        return args.run(args)
    except (TritonError, OSError, subprocess.CalledProcessError) as exc:
        print(f"triton {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
