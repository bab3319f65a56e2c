"""The production server: gunicorn with one worker process and a pool of threads.

One process keeps the Prometheus counters, the rate-limit buckets and the concurrency cap exact (they
live in memory) and loads the embedder once; the work is I/O-bound (Triton, OpenSearch), so threads
suffice. There are a few more threads than ``service.max_concurrent_requests``, so a request over the
cap is refused at once (503) instead of waiting for a thread. SIGTERM stops accepting connections and
lets requests in flight finish for up to ``GRACEFUL_TIMEOUT_S``.

It serves HTTPS when ``service.tls_cert_file`` and ``service.tls_key_file`` are set, and refuses plain HTTP
on an address other machines can reach unless ``service.allow_plaintext`` says a proxy in front of it
terminates TLS: API keys must not cross a network in clear text.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import ssl
from typing import Any

from gunicorn.app.base import BaseApplication

from ..config import Config, ConfigError, ServiceConfig

GRACEFUL_TIMEOUT_S = 30
SPARE_THREADS = 4  # health checks, metrics scrapes and 503 refusals while every slot is busy
MALLOC_ARENAS = 2
_M_ARENA_MAX = -8  # glibc's mallopt parameter number


def is_loopback(host: str) -> bool:
    """Only this machine can connect: ``localhost`` or a loopback address (a wildcard bind is not one)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def tls_options(service: ServiceConfig, host: str) -> dict[str, Any]:
    """gunicorn's TLS settings for ``service`` bound on ``host``. The certificate and key are loaded once
    here, so a wrong or unreadable pair fails the start with one line instead of every handshake later."""
    cert, key = service.tls_cert_file, service.tls_key_file
    if bool(cert) != bool(key):
        raise ConfigError("service.tls_cert_file and service.tls_key_file: set both (HTTPS) or neither")
    if not cert:
        if not is_loopback(host) and not service.allow_plaintext:
            raise ConfigError(f"refusing to serve plain HTTP on {host or 'every address'}: set "
                              "service.tls_cert_file and service.tls_key_file, or service.allow_plaintext: true "
                              "behind a proxy that terminates TLS")
        return {}
    for name, path in (("tls_cert_file", cert), ("tls_key_file", key)):
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise ConfigError(f"service.{name}: cannot read {path}: {exc.strerror}") from None
    try:  # an empty password: an encrypted key fails here instead of prompting on the terminal
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key, password="")
    except ssl.SSLError as exc:
        raise ConfigError("service.tls_cert_file and service.tls_key_file are not a PEM certificate and its "
                          f"unencrypted private key ({exc.reason or exc})") from None
    return {"certfile": cert, "keyfile": key}


def gunicorn_options(config: Config, host: str | None = None, port: int | None = None) -> dict[str, Any]:
    service = config.service
    host = host or service.host
    return {
        "bind": f"{host}:{port or service.port}",
        "workers": 1,
        "worker_class": "gthread",
        "threads": service.max_concurrent_requests + SPARE_THREADS,
        "timeout": int(service.triton_timeout_s) + GRACEFUL_TIMEOUT_S,
        "graceful_timeout": GRACEFUL_TIMEOUT_S,
        # Longer than the 5 s Retry-After of a 503: a client that waits as asked and reuses its connection
        # must not meet the server closing it at that very moment (a reset no POST can be retried on).
        "keepalive": 15,
        "accesslog": None,  # the application writes one structured line per request
        "errorlog": "-",
        "proc_name": "cagflow-router",
        **tls_options(service, host),
    }


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Let the worker's threads share ``arenas`` glibc heaps instead of one each (up to 8 per core). Each
    arena keeps the high-water mark of the threads using it, so with one per request thread the worker's
    heap grew by steps of 5-8 MiB for as long as requests came (+29 MiB per 10 minutes of soak); with two it
    stays within a few MiB (bench/README.md, Load). Must run before the worker starts threads; an operator's
    ``MALLOC_ARENA_MAX`` wins. False where the C library is not glibc (nothing to set)."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        return ctypes.CDLL(None).mallopt(_M_ARENA_MAX, arenas) == 1
    except (OSError, AttributeError):
        return False


class RouterServer(BaseApplication):
    def __init__(self, config: Config, options: dict[str, Any]):
        self.config_object = config
        self.options = options
        super().__init__()

    def load_config(self) -> None:
        for name, value in self.options.items():
            self.cfg.set(name, value)

    def load(self):
        """Runs in the worker process, so the embedder and the release poller start after the fork."""
        from .app import create_app

        limit_malloc_arenas()
        return create_app(self.config_object)


def run_server(config: Config, host: str | None = None, port: int | None = None) -> None:
    """Serve the REST API until SIGTERM or SIGINT (blocking)."""
    RouterServer(config, gunicorn_options(config, host, port)).run()
