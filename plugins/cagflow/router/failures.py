"""Triton's failures in the words clients and dashboards see: the client's error for a failed answer, and
the ``fallback_reason`` of a cache route that retrieval answers instead."""

from __future__ import annotations

from .access import ApiError
from .triton_client import TritonRejected, TritonUnavailable

# The serving side's error codes (``cagflow.errors``) that mean the snapshot cannot be used right now.
SNAPSHOT_CORRUPT = frozenset({"snapshot_corrupt", "checksum_mismatch", "snapshot_format"})
SNAPSHOT_UNAVAILABLE = frozenset({"snapshot_missing", "snapshot_mismatch", "snapshot_unusable",
                                  "snapshot_not_in_release", "no_active_release", "release_mismatch",
                                  "invalid_manifest", "store_unavailable", "store_forbidden", "store_failed",
                                  "not_found"})


def fallback_reason(error: Exception) -> str:
    """Why the cache route failed, in the words clients and dashboards see; from the serving side's error
    code (or Triton's status when it sent none), never from a message's wording."""
    if isinstance(error, TritonUnavailable):
        return "triton_unavailable"
    if isinstance(error, TritonRejected):
        if error.reason in SNAPSHOT_CORRUPT:
            return "snapshot_corrupt"
        if error.reason in SNAPSHOT_UNAVAILABLE or (error.reason is None and error.status in (404, 503)):
            return "snapshot_unavailable"
    return "triton_error"


def triton_failure(error: TritonUnavailable | TritonRejected) -> ApiError:
    """A Triton failure on the answering path as the client's error."""
    if isinstance(error, TritonUnavailable):
        return ApiError(503, "triton_unavailable", str(error), {"Retry-After": "5"})
    if error.status == 400:
        return ApiError(400, "invalid_request", error.message)
    return ApiError(502, "triton_error", error.message)
