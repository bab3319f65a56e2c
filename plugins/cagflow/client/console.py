"""What the commands print while they work: precompute progress and the release summary line."""

from __future__ import annotations

import sys
from typing import Sequence


def precompute_with_progress(engine, store, manifest_path: str, doc_ids: Sequence[str] | None = None,
                             force: bool = False, quiet: bool = False):
    """Precompute and publish the fixed documents (``offline.precompute``) with a progress bar on stderr,
    then print one summary line; returns the active release and the per-part results."""
    from tqdm import tqdm

    from ..offline.precompute import precompute_and_publish
    from ..store.manifests import CorpusManifest

    bar = tqdm(total=0, unit="part", desc="precompute", file=sys.stderr, disable=quiet)

    def planned(parts: int) -> None:
        bar.reset(total=parts)

    def done(result) -> None:
        state = "kept (verified)" if result.skipped else f"{result.tokens_per_s:,.0f} tok/s"
        bar.set_postfix_str(f"{result.entry.key} {result.entry.n_tokens} tok, {state}")
        bar.update(1)

    try:
        release, published, results = precompute_and_publish(engine, store, CorpusManifest.load(manifest_path),
                                                              doc_ids, force, planned, done)
    finally:
        bar.close()
    written = sum(not r.skipped for r in results)
    print(f"release {release.release_id}{'' if published else ' (unchanged)'}: {len(release.snapshots)} snapshots "
          f"({written} new, {len(release.snapshots) - written} kept), "
          f"{sum(e.bytes for e in release.snapshots) / 1e6:.1f} MB in {store.url}")
    return release, results
