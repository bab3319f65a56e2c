"""Fixed documents: parse, chunk, validate, embed and index them, then precompute their KV-cache snapshots
(one mapped task per document part, in the worker or on Triton as ``precompute.via`` says), verify them,
publish a release and tell serving.

Runs at the configured low-peak cron (``precompute.schedule``); ``precompute.parallel_parts`` parts are
computed at once. Trigger it with ``{"doc_ids": [...]}`` to process only some documents, or
``{"force": true}`` to recompute snapshots even when stored ones verify (a stored version is never
overwritten). A backfill run processes the manifest as it stands: snapshots are versioned by document
version, not by date, so it only fills in what is missing. Documents whose snapshots the active release
already holds for their version and model are not planned at all (no model load): a run with nothing
changed costs seconds. The steps live in ``cagflow.offline``: ``pipeline`` (ingest), ``snapshot_steps``
and ``release_steps``.
"""

from datetime import datetime, timedelta, timezone

from airflow.sdk import Asset, Param, dag, task
from cagflow.config import load_config
from cagflow.offline import release_steps, snapshot_steps
from cagflow.offline.dag_tasks import ingest_documents

FIXED_RELEASE = Asset(name="cagflow_fixed_release", uri="cagflow://releases/current")
settings = load_config().precompute


@dag(
    schedule=settings.schedule,
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 2, "retry_delay": timedelta(minutes=1)},
    params={
        "doc_ids": Param([], type="array", items={"type": "string"},
                         description="Fixed documents to process; empty means all of them."),
        "force": Param(False, type="boolean",
                       description="Ingest every document and recompute snapshots even when unchanged."),
    },
    tags=["cagflow", "fixed"],
    doc_md=__doc__,
)
def cag_fixed_precompute():
    @task(show_return_value_in_logs=False)
    def plan_parts(params=None):
        return snapshot_steps.plan_snapshot_parts(params["doc_ids"], params["force"])

    @task(map_index_template="{{ task.op_kwargs['part']['label'] }}", max_active_tis_per_dagrun=settings.parallel_parts)
    def precompute(part, params=None):
        return snapshot_steps.precompute_snapshot(part, params["force"])

    # Both run when nothing was left to precompute (the mapped task is then skipped): a document dropped
    # from the manifest must still leave the release.
    @task(retries=0, trigger_rule="none_failed")
    def validate_snapshots(results, parts):
        return snapshot_steps.check_snapshots(results, parts)

    @task(outlets=[FIXED_RELEASE], trigger_rule="none_failed")
    def publish_release(results, outlet_events=None):
        release = release_steps.publish_fixed_release(results)
        outlet_events[FIXED_RELEASE].extra = release
        return release

    @task
    def request_serving_reload(release):
        return release_steps.request_serving_reload(release)

    parts = plan_parts()
    ingest_documents("fixed") >> parts
    results = precompute.expand(part=parts)
    release = publish_release(results)
    validate_snapshots(results, parts) >> release
    request_serving_reload(release)


cag_fixed_precompute()
