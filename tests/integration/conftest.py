"""Integration fixtures shared by every module."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pytest


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
