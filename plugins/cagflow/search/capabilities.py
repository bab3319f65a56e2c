"""What an OpenSearch cluster can do, read from its plugins: vectors need k-NN, and server-side hybrid
search (and its RRF fusion, from a given neural-search version on) needs neural-search. Kept apart from
the client so the decision is plain data, probed once per client."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

NEURAL_SEARCH_PLUGIN = "opensearch-neural-search"
KNN_PLUGIN = "opensearch-knn"
RRF_SINCE_NEURAL_SEARCH = (2, 19)


@dataclass(frozen=True)
class BackendInfo:
    """What the cluster can do, probed from ``GET /`` and ``_cat/plugins``."""

    version: str
    plugins: Mapping[str, str]

    @property
    def has_knn(self) -> bool:
        return KNN_PLUGIN in self.plugins

    @property
    def server_hybrid(self) -> bool:
        return NEURAL_SEARCH_PLUGIN in self.plugins

    @property
    def server_rrf(self) -> bool:
        return self.server_hybrid and _version_tuple(self.plugins[NEURAL_SEARCH_PLUGIN]) >= RRF_SINCE_NEURAL_SEARCH

    @property
    def hybrid_mode(self) -> str:
        return "server" if self.server_hybrid else "client"


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("-")[0].split(".") if part.isdigit())
