"""Airflow tasks more than one DAG runs, defined once. Only DAG files import this module (it needs Airflow);
the tasks' logic is in ``cagflow.offline.pipeline``."""

from __future__ import annotations

from airflow.sdk import task

from . import pipeline


def ingest_documents(tier: str):
    """Add the ingest tasks for the manifest's ``tier`` documents to the DAG being defined: load manifest →
    parse → chunk → validate chunks → embed → index → passage states. A non-empty ``doc_ids`` param limits them to those
    documents and keeps the other documents' chunks; otherwise documents gone from the manifest lose theirs.
    Documents whose indexed chunks were made from the same source are skipped (``force`` ingests them
    again). Returns the index task's output, for what must wait on the index."""

    @task(retries=0)
    def load_manifest(params=None):
        return pipeline.load_documents(tier, params.get("doc_ids"), incremental=not params.get("force"))

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
    def index(embedded, parsed, params=None):
        return pipeline.index_chunks(embedded, tier, remove_unlisted=not params.get("doc_ids"), documents=parsed)

    @task
    def precompute_passage_states():
        return pipeline.precompute_indexed_passages(tier)

    parsed = parse(load_manifest())
    chunks = chunk(parsed)
    embedded = embed(chunks)
    validate_chunks(parsed, chunks) >> embedded
    indexed = index(embedded, parsed)
    indexed >> precompute_passage_states()
    return indexed
