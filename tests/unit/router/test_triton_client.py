"""Triton being unreachable is one clear exception on both transports (so the router answers 503
``triton_unavailable``), and a closed port is never mistaken for a snapshot problem."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest
from cagflow.devstack.process import free_ports
from cagflow.router.failures import fallback_reason
from cagflow.router.triton_client import TritonClient, TritonRejected, TritonUnavailable


@pytest.fixture()
def unreachable() -> Iterator[TritonClient]:
    http_port, grpc_port = free_ports(2)  # free: nothing listens there
    client = TritonClient(f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", timeout_s=5, retries=1, pool_size=2)
    yield client
    client.close()


def test_unreachable_http_is_triton_unavailable(unreachable):
    with pytest.raises(TritonUnavailable, match="unreachable") as caught:
        unreachable.infer(question="q")
    assert fallback_reason(caught.value) == "triton_unavailable"
    assert unreachable.model_ready() is False


def test_unreachable_grpc_stream_is_triton_unavailable(unreachable):
    with pytest.raises(TritonUnavailable, match=f"gRPC at {unreachable.grpc_url} unreachable"):
        list(unreachable.stream(question="q"))


@pytest.fixture()
def failing_triton() -> Iterator[tuple[TritonClient, list]]:
    """A real HTTP server that answers every inference with the (status, error text) queued in ``replies``."""
    replies: list[tuple[int, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            status, error = replies.pop(0)
            body = json.dumps({"error": error}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    grpc_port, = free_ports(1)
    client = TritonClient(f"127.0.0.1:{server.server_port}", f"127.0.0.1:{grpc_port}", timeout_s=5, retries=0,
                          pool_size=2)
    yield client, replies
    client.close()
    server.shutdown()
    server.server_close()


def test_a_dead_stub_is_the_replica_failing_and_a_coded_error_is_a_refusal(failing_triton):
    """Triton's own 500 when a model's Python stub died carries no code: another replica can answer it.
    An error the serving code sent (coded, even ``internal``) stays the request's own answer."""
    client, replies = failing_triton
    replies.append((500, "Failed to process the request(s) for model 'cag_llm_0_0', message: "
                         "Stub process 'cag_llm_0_0' is not healthy."))
    with pytest.raises(TritonUnavailable, match="not healthy") as caught:
        client.infer(question="q")
    assert fallback_reason(caught.value) == "triton_unavailable"
    replies.append((500, "[internal] request r1: unexpected IndexError"))
    with pytest.raises(TritonRejected) as refused:
        client.infer(question="q")
    assert (refused.value.status, refused.value.reason) == (500, "internal")
    replies.append((400, "unexpected inference input 'X' for model 'cag_llm'"))
    with pytest.raises(TritonRejected):  # a 4xx is the request's fault, on any replica
        client.infer(question="q")
