"""What runs against the REST API and the local setup: the API client, the demo, the doctor's checks and the
capacity estimate (the ``cagflow`` command, ``cagflow.cli``, sits above them)."""
