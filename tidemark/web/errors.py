"""What an exception a route raises becomes, as FastAPI exception handlers: an error page for
a browser, ``{"detail": ...}`` for a program, with the status the error's kind calls for and
never a host, user or traceback. What no handler takes is the middleware's (Failures)."""

from __future__ import annotations

import logging

import psycopg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse, Response

from tidemark.core.db import one_line
from tidemark.core.errors import BadInput, Busy, NotFound, TidemarkError
from tidemark.web import auth as web_auth
from tidemark.web.auth import Forbidden, NotAuthenticated
from tidemark.web.context import UNAVAILABLE, Web, is_api

log = logging.getLogger(__name__)


async def not_authenticated(request: Request, exc: Exception) -> Response:
    """401 for a program or a POST; a page asked for goes to Airflow's login, and back."""
    if is_api(request) or request.method != "GET":
        return JSONResponse(
            {"detail": f"not authenticated: {exc}"},
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
    return RedirectResponse(web_auth.login_url(request), status_code=303)


def status_of(exc: Exception) -> int:
    if isinstance(exc, NotFound):
        return 404
    if isinstance(exc, BadInput):
        return 400
    if isinstance(exc, Busy):
        return 409
    return 503


def install(app: FastAPI, web: Web) -> None:
    """The app's exception handlers, rendering through ``web``. Each takes the exception
    type it is registered for (Starlette types them all as taking an Exception)."""

    async def forbidden(request: Request, exc: Exception) -> Response:
        return web.error(request, 403, str(exc))

    async def tidemark_error(request: Request, exc: Exception) -> Response:
        return web.error(request, status_of(exc), str(exc))

    async def db_error(request: Request, exc: Exception) -> Response:
        if isinstance(exc, psycopg.DataError):
            # The value is at fault, not the ledger: a NUL character (which no text column
            # holds), a date out of range. The caller can mend it.
            return web.error(request, 400, f"a value the ledger cannot hold: {one_line(exc)}")
        # The error names the server, its port and the user: the log has them, masked.
        log.warning(
            "tidemark dead letters: %s %s: ledger error: %s",
            request.method,
            request.url.path,
            one_line(exc),
        )
        return web.error(request, 503, UNAVAILABLE)

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        err = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in err.get("loc", ()) if p not in ("path", "query", "body"))
        return web.error(request, 400, f"{where or 'request'}: {err.get('msg', 'invalid')}")

    app.add_exception_handler(NotAuthenticated, not_authenticated)
    app.add_exception_handler(Forbidden, forbidden)
    app.add_exception_handler(TidemarkError, tidemark_error)
    app.add_exception_handler(psycopg.Error, db_error)
    app.add_exception_handler(RequestValidationError, validation_error)
