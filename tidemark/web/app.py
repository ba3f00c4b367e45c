"""The dead-letter pages and JSON API that Airflow's API server mounts at /tidemark
(plugins/tidemark_dlq.py): browse, read, discard, redrive and export dead letters.

This module builds the app (:func:`create_app`) from its parts: the shared context
(context.py) on ``app.state.web``, the routers (pages.py, api.py), the exception handlers
(errors.py) and the middlewares (middleware.py). Every route depends on ``auth.guard``
(declared on the app, so no route can miss it). Redrive does not run Spark here: it records
the selection as a redrive request in the ledger and triggers the pipeline's
``tidemark_<pipeline>_redrive`` DAG with the request's id (trigger.py); a redrive DAG run's
page follows it (runs.py).
"""

from __future__ import annotations

from fastapi import Depends, FastAPI

from tidemark.web import api, errors, pages, pipelines_pages
from tidemark.web.auth import guard
from tidemark.web.context import Web, templates
from tidemark.web.middleware import BodyLimit, Failures, SecurityHeaders, SlashRedirect


def create_app(web: Web | None = None) -> FastAPI:
    """The app, with ``web`` (by default: the templates here, the settings of the process)."""
    web = web if web is not None else Web(jinja=templates())
    app = FastAPI(
        title="Tidemark dead letters",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        dependencies=[Depends(guard)],
    )
    app.state.web = web
    # Every router of the app, here and only here.
    app.include_router(pages.router)
    app.include_router(api.router)
    app.include_router(pipelines_pages.router)
    errors.install(app, web)
    app.router.redirect_slashes = False  # SlashRedirect's instead: a path, never a host
    # Each added runs inside the next: SecurityHeaders is outermost, so every answer of the
    # others, a failure's too, gets its headers.
    app.add_middleware(SlashRedirect, routes=app.router.routes)
    app.add_middleware(BodyLimit, web=web)
    app.add_middleware(Failures, web=web)
    app.add_middleware(SecurityHeaders)
    return app


app = create_app()
