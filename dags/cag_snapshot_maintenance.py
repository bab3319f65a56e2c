"""Snapshot store upkeep: verify the active release's checksums, then delete snapshot versions that no
recent release references and that nobody could have read for a while (a dry run unless told otherwise).

Runs at ``maintenance.schedule`` (weekly by default). Trigger with ``{"dry_run": false}`` to delete. When
the active release does not verify, nothing is collected. The steps live in ``cagflow.offline.maintenance_steps``.
"""

from datetime import datetime, timezone

from airflow.sdk import Param, dag, task
from cagflow.config import load_config
from cagflow.offline import maintenance_steps

settings = load_config().maintenance


@dag(
    schedule=settings.schedule,
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    max_active_runs=1,
    params={
        "dry_run": Param(True, type="boolean", description="List what would be deleted without deleting it."),
        "keep_releases": Param(settings.keep_releases, type="integer", minimum=1,
                               description="Snapshots of the newest N releases (and the active one) are kept."),
        "unused_days": Param(settings.unused_days, type="number", minimum=0,
                             description="Other snapshots are kept until unread for this many days."),
    },
    tags=["cagflow", "maintenance"],
    doc_md=__doc__,
)
def cag_snapshot_maintenance():
    @task(retries=0)
    def verify_active_release():
        return maintenance_steps.verify_active_release()

    @task
    def collect_garbage(params=None):
        return maintenance_steps.collect_garbage(params["keep_releases"], params["unused_days"], params["dry_run"])

    verify_active_release() >> collect_garbage()


cag_snapshot_maintenance()
