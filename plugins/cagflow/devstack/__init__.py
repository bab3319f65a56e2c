"""Local runners for the stack's servers (OpenSearch, Triton, Airflow, the router, SeaweedFS) on 127.0.0.1."""
