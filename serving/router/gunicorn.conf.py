"""gunicorn settings for the router, derived from the CAGFlow configuration (``service.host``, ``service.port``,
``service.max_concurrent_requests``, ``service.triton_timeout_s``) exactly as ``cagflow serve`` derives them:
one worker process with threads, so metrics, rate limits and the concurrency cap stay exact."""

from cagflow.config import load_config
from cagflow.router.server import gunicorn_options

# gunicorn reads its settings from this module's global names.
globals().update(gunicorn_options(load_config()))
