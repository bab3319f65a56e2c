"""Integration fixtures shared by every module."""

from __future__ import annotations

import socket
import threading
from typing import Callable, Iterator, Sequence

import numpy as np
import pytest
from cagflow.devstack.opensearch import free_port
# The router's stack (router_stack.py: OpenSearch index, release, Triton, router, keys, trace collector), for
# every module that asks for it; module-scoped, so each such module runs a stack of its own.
from router_stack import corpus_index, jaeger, keys, release_store, router, triton  # noqa: F401


# The longest modules, longest first (their --durations in CI): `make test` runs the server tests on two
# workers, each taking the next module in collection order when it is free, so these start first and the two
# workers end close together instead of one waiting for the other's last long module.
LONGEST_FIRST = ("test_router.py", "test_airflow_rest.py", "test_dags.py", "test_triton.py", "test_replicas.py",
                 "test_faults.py", "test_engine_real.py", "test_model_prepare.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Whole modules reordered, the longest first; the rest and each module's own order as collected."""
    rank = {name: position for position, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session", autouse=True)
def embeddings_computed_once():
    """The real e5 embedder, each distinct text embedded once per test session: the suite indexes the sample
    corpus in several modules (DAG runs, the router's index, the fault stack), and e5 gives a text the same
    vector bit for bit whatever it is batched with, so a repeat can reuse it. Processes the tests start
    (servers, task subprocesses) embed for themselves."""
    from cagflow.search.embeddings import Embedder

    computed: dict[tuple[str, bool], np.ndarray] = {}
    encode = Embedder._encode

    def encode_once(self: Embedder, texts: Sequence[str], query: bool) -> np.ndarray:
        if isinstance(texts, str) or not texts:
            return encode(self, texts, query)  # the embedder's own error, or its empty array
        missing = list(dict.fromkeys(text for text in texts if (text, query) not in computed))
        if missing:
            computed.update(((text, query), vector) for text, vector in zip(missing, encode(self, missing, query)))
        return np.stack([computed[text, query] for text in texts])

    Embedder._encode = encode_once
    yield
    Embedder._encode = encode


class Forwarder:
    """A TCP port that forwards to a server while open: "the server is unreachable" and "it is back" without
    stopping a server other tests share. Closing it also cuts the connections it carries, as a stopped
    server would."""

    def __init__(self, target_url: str):
        host, port = target_url.split("://")[-1].split(":")
        self.target = (host, int(port))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._listener: socket.socket | None = None
        self._carried: list[socket.socket] = []

    def open(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def close(self) -> None:
        if self._listener is not None:
            _shut(self._listener)  # wakes the accepting thread: close() alone leaves it accepting on Linux
            self._listener.close()
            self._listener = None
        for end in self._carried:
            _shut(end)
        self._carried.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self._carried += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                _shut(end)


def _shut(end: socket.socket) -> None:
    try:
        end.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


@pytest.fixture
def forwarder() -> Iterator[Callable[[str], Forwarder]]:
    """Makes closed forwarders to a URL (``open()`` them); every one is closed after the test."""
    made: list[Forwarder] = []

    def make(target_url: str) -> Forwarder:
        made.append(Forwarder(target_url))
        return made[-1]

    yield make
    for forward in made:
        forward.close()
