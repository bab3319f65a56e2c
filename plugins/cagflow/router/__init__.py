"""The REST router: authenticates and admits requests, routes each question to a KV-cache snapshot or
to retrieval, and answers through Triton (see ``planning`` for the rules, ``routing`` for answering,
``app`` for the API).

``create_app`` and ``run_server`` are imported on first use: ``cagflow ask`` reads its key through
``router.apikeys`` and should not pay for Flask, OpenSearch and the embedder it never uses."""

__all__ = ["create_app", "run_server"]


def __getattr__(name: str):
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "run_server":
        from .server import run_server

        return run_server
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
