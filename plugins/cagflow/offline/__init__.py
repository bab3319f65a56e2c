"""The offline flow the DAGs run: pipeline steps, data checks, and precompute-and-publish."""
