"""WSGI entry point for any WSGI server: ``gunicorn -c serving/router/gunicorn.conf.py serving.router.wsgi:app``
(``cagflow serve`` runs the same application with the same settings). Configuration comes from
``$CAGFLOW_CONFIG`` and ``CAGFLOW__SECTION__KEY`` variables."""

from cagflow.router import create_app
from cagflow.router.server import limit_malloc_arenas

limit_malloc_arenas()
app = create_app()
