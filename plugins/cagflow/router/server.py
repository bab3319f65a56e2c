"""The production server: gunicorn with one worker process and a pool of threads.

One process keeps the Prometheus counters, the rate-limit buckets and the concurrency cap exact (they
live in memory) and loads the embedder once; the work is I/O-bound (Triton, OpenSearch), so threads
suffice. There are a few more threads than ``service.max_concurrent_requests``, so a request over the
cap is refused at once (503) instead of waiting for a thread. SIGTERM stops accepting connections and
lets requests in flight finish for up to ``GRACEFUL_TIMEOUT_S``.
"""

from __future__ import annotations

from typing import Any

from gunicorn.app.base import BaseApplication

from ..config import Config

GRACEFUL_TIMEOUT_S = 30
SPARE_THREADS = 4  # health checks, metrics scrapes and 503 refusals while every slot is busy


def gunicorn_options(config: Config, host: str | None = None, port: int | None = None) -> dict[str, Any]:
    service = config.service
    return {
        "bind": f"{host or service.host}:{port or service.port}",
        "workers": 1,
        "worker_class": "gthread",
        "threads": service.max_concurrent_requests + SPARE_THREADS,
        "timeout": int(service.triton_timeout_s) + GRACEFUL_TIMEOUT_S,
        "graceful_timeout": GRACEFUL_TIMEOUT_S,
        "keepalive": 5,
        "accesslog": None,  # the application writes one structured line per request
        "errorlog": "-",
        "proc_name": "cagflow-router",
    }


def prepare_worker() -> None:
    """Torch gets one thread in the router process: a question is a few tokens, and more threads only
    contend with each other (one per request thread) and with Triton for the same cores (measured on a
    busy 2-core machine: 20 ms against 320 ms p50 to embed one question)."""
    import torch

    torch.set_num_threads(1)


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

        prepare_worker()
        return create_app(self.config_object)


def run_server(config: Config, host: str | None = None, port: int | None = None) -> None:
    """Serve the REST API until SIGTERM or SIGINT (blocking)."""
    RouterServer(config, gunicorn_options(config, host, port)).run()
