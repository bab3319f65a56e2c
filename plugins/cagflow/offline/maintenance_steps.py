"""The steps of ``cag_snapshot_maintenance``: verify the active release's snapshots, then delete the
snapshot versions no kept release references and nobody could have read for a while, with the releases
that would need them; and the passage states no indexed chunk has any more."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..config import Config, ConfigError
from .connections import resolve_config, snapshot_store
from .passage_steps import SECONDS_PER_DAY, passage_garbage

if TYPE_CHECKING:
    from ..store.backends import SnapshotStore

log = logging.getLogger(__name__)



def _active_release(store: SnapshotStore):
    from ..store.backends import NotFound
    from ..store.manifests import load_release

    try:
        return load_release(store)
    except NotFound:
        return None


def verify_active_release(config: Config | None = None) -> dict:
    """Re-read every snapshot of the active release and check it against its recorded sha256 and header."""
    from .validation import validate_snapshots

    store = snapshot_store(config)
    release = _active_release(store)
    if release is None:
        log.info("no release published in %s yet; nothing to verify", store.url)
        return {"release_id": None, "snapshots": 0, "bytes": 0}
    validate_snapshots(store, release.snapshots, [entry.key for entry in release.snapshots])
    size = sum(entry.bytes for entry in release.snapshots)
    log.info("active release %s verified: %d snapshot(s), %d bytes", release.release_id, len(release.snapshots), size)
    return {"release_id": release.release_id, "snapshots": len(release.snapshots), "bytes": size}


@dataclass(frozen=True)
class GarbagePlan:
    kept_releases: list[str]
    snapshots: dict[str, int]  # object name -> bytes
    releases: dict[str, int]  # release object name -> bytes

    @property
    def bytes(self) -> int:
        return sum(self.snapshots.values()) + sum(self.releases.values())


def plan_garbage(store: SnapshotStore, keep_releases: int, unused_days: float, now: float | None = None) -> GarbagePlan:
    """Snapshot objects that no kept release references and that have not been servable for ``unused_days``.

    Kept: the newest ``keep_releases`` releases and the active one. Stores record no read times, and serving
    reads snapshots only through releases, so a snapshot counts as read until the newest release holding it
    was superseded by the next one (the active release counts as read now); a snapshot no release ever held
    counts from when it was written. Older releases that hold a deleted snapshot are deleted with it, since
    they could no longer be activated.
    """
    from ..store.layout import SNAPSHOTS_PREFIX
    from ..store.manifests import list_releases, load_release

    now = time.time() if now is None else now
    releases = sorted((load_release(store, release_id) for release_id in list_releases(store)),
                      key=lambda release: release.created_at)
    active = _active_release(store)
    active_id = active.release_id if active else None
    kept = {release.release_id for release in releases[-keep_releases:]} | ({active_id} - {None})
    referenced = {entry.object_name for release in releases if release.release_id in kept
                  for entry in release.snapshots}
    last_read: dict[str, float] = {}
    for position, release in enumerate(releases):
        superseded = now if release.release_id == active_id or position + 1 == len(releases) else \
            releases[position + 1].created_at
        for entry in release.snapshots:
            last_read[entry.object_name] = max(last_read.get(entry.object_name, 0.0), superseded)
    cutoff = now - unused_days * SECONDS_PER_DAY
    doomed = {info.name: info.size for info in store.list(SNAPSHOTS_PREFIX)
              if info.name not in referenced and max(info.modified, last_read.get(info.name, 0.0)) <= cutoff}
    doomed_releases = {}
    for release in releases:
        if release.release_id not in kept and any(entry.object_name in doomed for entry in release.snapshots):
            info = store.head(release.object_name)
            doomed_releases[release.object_name] = info.size if info else 0
    return GarbagePlan(sorted(kept), doomed, doomed_releases)


def collect_garbage(keep_releases: int | None = None, unused_days: float | None = None, dry_run: bool = True,
                    config: Config | None = None, now: float | None = None) -> dict:
    """Delete (or, in a dry run, list) what ``plan_garbage`` finds; report the bytes freed."""
    config = resolve_config(config)
    keep_releases = config.maintenance.keep_releases if keep_releases is None else keep_releases
    unused_days = config.maintenance.unused_days if unused_days is None else unused_days
    if keep_releases < 1 or unused_days < 0:
        raise ConfigError(f"keep_releases must be >= 1 and unused_days >= 0 (got {keep_releases}, {unused_days})")
    store = snapshot_store(config)
    plan = plan_garbage(store, keep_releases, unused_days, now)
    passages = passage_garbage(store, unused_days, config, now)
    verb = "would delete" if dry_run else "deleted"
    for name, size in [*plan.snapshots.items(), *plan.releases.items(), *passages.items()]:
        if not dry_run:
            store.delete(name)
        log.info("%s %s (%d bytes)", verb, name, size)
    from ..store.heat import prune_heat

    heat_objects = prune_heat(store, unused_days, now, dry_run=dry_run)
    log.info("%s %d snapshot(s) and %d release(s): %d bytes %s; kept releases %s (last %d and the active one, "
             "snapshots read within %g days)", verb, len(plan.snapshots), len(plan.releases), plan.bytes,
             "would be freed" if dry_run else "freed", ", ".join(plan.kept_releases) or "none", keep_releases,
             unused_days)
    return {"dry_run": dry_run, "store": store.url, "kept_releases": plan.kept_releases,
            "snapshots": sorted(plan.snapshots), "releases": sorted(plan.releases), "bytes_freed": plan.bytes,
            "heat_objects": heat_objects, "passage_states": len(passages),
            "passage_bytes_freed": sum(passages.values())}
