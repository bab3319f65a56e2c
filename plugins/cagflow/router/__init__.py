"""The REST router: authenticates and admits requests, routes each question to a KV-cache snapshot or
to retrieval, and answers through Triton (see ``routing`` for the rules, ``app`` for the API)."""

from .app import create_app
from .server import run_server

__all__ = ["create_app", "run_server"]
