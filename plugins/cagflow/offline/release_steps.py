"""The release steps of ``cag_fixed_precompute``: publish this run's snapshots as a release, then ask
serving to switch to it. A release identical to the active one is not published again, so a rerun
writes nothing."""

from __future__ import annotations

import json
import logging
from typing import Sequence

from ..config import Config
from .connections import resolve_config, snapshot_store
from .snapshot_steps import PrecomputeUnavailable, model_fingerprint
from .triton_requests import triton_call

log = logging.getLogger(__name__)

RELOAD_TIMEOUT_S = 10.0


def publish_fixed_release(results: Sequence[dict] | None, config: Config | None = None) -> dict:
    """Publish a release of this run's snapshots and point ``current`` at it.

    The fixed documents the run did not compute (not selected, or unchanged) keep their snapshots from the
    active release; a release identical to the active one is not published again, so a rerun writes nothing.
    """
    from ..store.manifests import CorpusManifest, ReleaseEntry
    from .precompute import publish_run

    config = resolve_config(config)
    store = snapshot_store(config)
    results = list(results or ())
    fingerprints = {result["model_fingerprint"] for result in results} or {model_fingerprint(config)}
    if len(fingerprints) != 1:
        raise PrecomputeUnavailable(f"snapshots of {len(fingerprints)} models cannot form one release")
    fingerprint = fingerprints.pop()
    entries = [ReleaseEntry(**result["entry"]) for result in results]
    release, published = publish_run(store, fingerprint, entries, CorpusManifest.load(config.corpus.manifest))
    summary = {"store": store.url, "snapshots": len(release.snapshots), "documents": len(release.doc_ids),
               "bytes": sum(entry.bytes for entry in release.snapshots)}
    if not published:
        log.info("release %s already holds these %d snapshot(s); nothing published", release.release_id,
                 len(release.snapshots))
        return {**summary, "release_id": release.release_id, "published": False}
    log.info("published release %s: %d snapshot(s) of %d document(s), %d bytes, in %s", release.release_id,
             summary["snapshots"], summary["documents"], summary["bytes"], store.url)
    return {**summary, "release_id": release.release_id, "published": True}


def request_serving_reload(release: dict, config: Config | None = None) -> dict:
    """Ask serving (``cag_llm`` on Triton) to switch to the new release. Serving being down is not a
    failure: it follows ``releases/current.json`` and loads the active release when it starts."""
    from tritonclient.utils import InferenceServerException

    config = resolve_config(config)
    url = config.precompute.triton_url
    if not release["published"]:
        return {"requested": False, "reason": "release unchanged"}
    if not url:
        return {"requested": False, "reason": "precompute.triton_url is not set"}
    try:
        outputs = triton_call(config, "cag_llm", RELOAD_TIMEOUT_S, ACTION="reload", RELEASE_ID=release["release_id"])
    except InferenceServerException as exc:
        reason = f"refused: {exc.message()}"
    except OSError as exc:
        reason = f"unreachable: {exc}"
    else:
        log.info("serving at %s switched to release %s: %s", url, outputs["RELEASE_ID"], outputs["STATUS"])
        return {"requested": True, "release_id": outputs["RELEASE_ID"], "status": json.loads(outputs["STATUS"])}
    log.warning("serving at %s did not take release %s (%s); it picks up the active release by itself", url,
                release["release_id"], reason)
    return {"requested": False, "reason": reason}
