"""What a person or an application runs: the ``cagflow`` command, the REST API client and the demo."""
