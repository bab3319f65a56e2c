"""Triton being unreachable is one clear exception on both transports (so the router answers 503
``triton_unavailable``), and a closed port is never mistaken for a snapshot problem."""

from __future__ import annotations

from typing import Iterator

import pytest
from cagflow.devstack.process import free_ports
from cagflow.router.routing import fallback_reason
from cagflow.router.triton_client import TritonClient, TritonUnavailable


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
