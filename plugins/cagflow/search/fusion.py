"""Score fusion for hybrid search, kept pure: the client-side fallback fuses a BM25 and a k-NN result list
with the same arithmetic as neural-search's server-side processors, so results do not depend on where the
fusion runs."""

from __future__ import annotations

from enum import Enum
from typing import Mapping, Sequence


class Fusion(str, Enum):
    MIN_MAX = "min_max"
    RRF = "rrf"


def min_max_normalize(scores: Mapping[str, float]) -> dict[str, float]:
    """Scale one result list to [0, 1]; when every score is equal they all become 1.0."""
    if not scores:
        return {}
    low, high = min(scores.values()), max(scores.values())
    if high == low:
        return {key: 1.0 for key in scores}
    return {key: (score - low) / (high - low) for key, score in scores.items()}


def _ranked(scores: Mapping[str, float]) -> list[tuple[str, float]]:
    return sorted(scores.items(), key=lambda item: (-item[1], item[0]))


def min_max_fusion(result_lists: Sequence[Mapping[str, float]], weights: Sequence[float]) -> list[tuple[str, float]]:
    """Weighted arithmetic mean of min-max normalised scores, best first.

    A hit missing from a list counts as 0 there, as in neural-search's ``normalization-processor``.
    """
    if len(weights) != len(result_lists):
        raise ValueError(f"{len(result_lists)} result lists need as many weights, got {len(weights)}")
    if any(weight < 0 for weight in weights) or sum(weights) <= 0:
        raise ValueError("weights must be non-negative and not all zero")
    total_weight = sum(weights)
    fused: dict[str, float] = {}
    for scores, weight in zip(result_lists, weights):
        for key, normalized in min_max_normalize(scores).items():
            fused[key] = fused.get(key, 0.0) + weight * normalized
    return _ranked({key: score / total_weight for key, score in fused.items()})


def reciprocal_rank_fusion(rankings: Sequence[Sequence[str]], rank_constant: int = 60) -> list[tuple[str, float]]:
    """Sum of ``1 / (rank_constant + rank)`` over the lists a hit appears in (rank starts at 1), best first."""
    if rank_constant < 1:
        raise ValueError("rank_constant must be at least 1")
    fused: dict[str, float] = {}
    for ranking in rankings:
        for rank, key in enumerate(ranking, start=1):
            fused[key] = fused.get(key, 0.0) + 1.0 / (rank_constant + rank)
    return _ranked(fused)
