"""Variable documents: parse, chunk, validate, embed and upsert them into OpenSearch (tier ``variable``);
documents removed from the manifest lose their chunks.

Runs at ``ingest.schedule`` (hourly by default) and on demand. The steps live in ``cagflow.pipeline``.
"""

from datetime import datetime, timedelta, timezone

from airflow.sdk import dag, task

from cagflow import pipeline
from cagflow.config import load_config


@dag(
    schedule=load_config().ingest.schedule,
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 2, "retry_delay": timedelta(minutes=1)},
    tags=["cagflow", "variable"],
    doc_md=__doc__,
)
def cag_variable_ingest():
    @task(retries=0)
    def load_manifest():
        return pipeline.load_documents("variable")

    @task(retries=0, show_return_value_in_logs=False)
    def parse(documents):
        return pipeline.parse_documents(documents)

    @task(retries=0, show_return_value_in_logs=False)
    def chunk(parsed):
        return pipeline.chunk_documents(parsed)

    @task(retries=0)
    def validate_chunks(parsed, chunks):
        return pipeline.check_chunks(parsed, chunks)

    @task(show_return_value_in_logs=False)
    def embed(chunks):
        return pipeline.embed_chunks(chunks)

    @task
    def index(embedded):
        return pipeline.index_chunks(embedded, "variable", remove_unlisted=True)

    parsed = parse(load_manifest())
    chunks = chunk(parsed)
    embedded = embed(chunks)
    validate_chunks(parsed, chunks) >> embedded
    index(embedded)


cag_variable_ingest()
