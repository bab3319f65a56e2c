"""Variable documents: parse, chunk, validate, embed and upsert them into OpenSearch (tier ``variable``);
documents removed from the manifest lose their chunks.

Runs at ``ingest.schedule`` (hourly by default) and on demand. Documents whose indexed chunks were made
from the same file, manifest entry and settings are skipped; trigger with ``{"force": true}`` to ingest
every document again. The steps live in ``cagflow.offline.pipeline``.
"""

from datetime import datetime, timedelta, timezone

from airflow.sdk import Param, dag
from cagflow.config import load_config
from cagflow.offline.dag_tasks import ingest_documents


@dag(
    schedule=load_config().ingest.schedule,
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 2, "retry_delay": timedelta(minutes=1)},
    params={"force": Param(False, type="boolean", description="Ingest every document, changed or not.")},
    tags=["cagflow", "variable"],
    doc_md=__doc__,
)
def cag_variable_ingest():
    ingest_documents("variable")


cag_variable_ingest()
