"""Where the DAG steps get their settings, snapshot store and chunk index. In Airflow the connections
``cagflow_s3`` and ``cagflow_opensearch``, when defined, supply them, so credentials stay in Airflow's secret
storage; otherwise the project configuration (and boto3's usual credential chain) applies."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from ..config import Config, ConfigError, load_config

if TYPE_CHECKING:
    from ..search.retrieval import ChunkIndex
    from ..store.backends import SnapshotStore

S3_CONNECTION_ID = "cagflow_s3"
OPENSEARCH_CONNECTION_ID = "cagflow_opensearch"
INDEXING_TIMEOUT_S = 60.0  # bulk writes and deletes are not latency-bound like searches


def resolve_config(config: Config | None) -> Config:
    """The configuration a step was given, else the project's (what an Airflow task reads)."""
    return config if config is not None else load_config()


def airflow_connection(conn_id: str):
    """The Airflow connection ``conn_id`` when this process runs under Airflow (its task runner, or
    ``dag.test()``, has loaded the task SDK); None when it is not defined, or outside Airflow: the command
    line then neither pays Airflow's import (~2 s) nor reads the configuration of an Airflow home it may
    not have."""
    if "airflow.sdk" not in sys.modules:
        return None
    from airflow.sdk import Connection
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        return Connection.get(conn_id)
    except AirflowNotFoundException:
        return None


def snapshot_store(config: Config | None = None) -> SnapshotStore:
    """The configured store; connection ``cagflow_s3`` (type aws) may supply the endpoint, region,
    credentials and, in its extra ``state_store``, the ``s3://bucket/prefix`` itself."""
    from ..store.backends import open_store, s3_client

    config = resolve_config(config)
    connection = airflow_connection(S3_CONNECTION_ID)
    if connection is None:
        return open_store(config.cache.state_store, config.cache.s3, role="writer")
    extra = connection.extra_dejson
    url = extra.get("state_store", config.cache.state_store)
    settings = config.cache.s3.model_copy(update={
        "endpoint_url": extra.get("endpoint_url", config.cache.s3.endpoint_url),
        "region": extra.get("region_name", config.cache.s3.region),
    })
    if not url.startswith("s3://"):
        raise ConfigError(f"connection {S3_CONNECTION_ID}: state store {url!r} is not an s3:// URL")
    # The connection's keys, when it has them, else the writer role's (then boto3's chain).
    client = s3_client(settings, connection.login, connection.password or None) if connection.login else None
    return open_store(url, settings, client=client, role="writer")


def chunk_index(config: Config | None = None) -> ChunkIndex:
    """The chunk index; connection ``cagflow_opensearch`` may supply host, port, ``use_ssl`` and ``index``."""
    from ..search.retrieval import ChunkIndex

    config = resolve_config(config)
    endpoint, index = config.retrieval.endpoint, config.retrieval.index
    connection = airflow_connection(OPENSEARCH_CONNECTION_ID)
    if connection is not None:
        if connection.login or connection.password:
            raise ConfigError(f"connection {OPENSEARCH_CONNECTION_ID}: OpenSearch authentication is not supported; "
                              "use a network-restricted endpoint without credentials")
        extra = connection.extra_dejson
        scheme = "https" if str(extra.get("use_ssl", "false")).lower() == "true" else "http"
        endpoint = f"{scheme}://{connection.host}:{connection.port or 9200}"
        index = extra.get("index", index)
    return ChunkIndex(endpoint, index, top_k=config.retrieval.top_k, timeout_s=INDEXING_TIMEOUT_S,
                      replicas=config.retrieval.index_replicas)
