"""What every part of the dead-letter app shares, built once by the app factory (app.py) and
kept on ``app.state.web``: the page templates, the ledger's connections, rendering a page or
an error; and what a request tells about itself (where the app is mounted, whether it is an
API call, who makes it)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, cast

import psycopg
from fastapi import Depends, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from jinja2 import Environment, FileSystemLoader, StrictUndefined

from tidemark.core.db import connect
from tidemark.core.dsn import mask
from tidemark.core.errors import NotFound, TidemarkError
from tidemark.core.settings import Settings, get_settings
from tidemark.web import auth as web_auth
from tidemark.web.auth import Caller, guard

TEMPLATES = Path(__file__).resolve().parent / "templates" / "dlq"
UNAVAILABLE = "the ledger database is unavailable; try again later"
FORM = "application/x-www-form-urlencoded"
log = logging.getLogger(__name__)


class LedgerUnavailable(TidemarkError):
    """The ledger cannot be reached: 503, without its host or user (the log has them)."""


def _when(iso: str | None) -> str:
    return f"{iso[:19].replace('T', ' ')} UTC" if iso else "-"


def templates(folder: Path = TEMPLATES) -> Environment:
    """The pages' Jinja2 environment: autoescaped, and an undefined name is an error."""
    env = Environment(
        loader=FileSystemLoader(folder),
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["when"] = _when
    return env


@dataclass(frozen=True)
class Web:
    """The app's shared parts. ``settings`` is asked on each use, not kept: the same process
    may be pointed at another ledger (the tests' Airflow does)."""

    jinja: Environment
    settings: Callable[[], Settings] = get_settings

    def ledger(self, **kw: Any) -> psycopg.Connection:
        """A connection to the ledger (autocommit); LedgerUnavailable, without its address,
        when there is none."""
        try:
            return connect(
                self.settings().airflow_ledger("Airflow's API server"),
                autocommit=True,
                what="ledger",
                **kw,
            )
        except TidemarkError as exc:  # names host, port and user: for the log, not the caller
            log.warning("tidemark dead letters: %s", mask(str(exc)))
            raise LedgerUnavailable(UNAVAILABLE) from None

    def html(self, request: Request, template: str, status: int = 200, **ctx: Any) -> HTMLResponse:
        caller: Caller | None = getattr(request.state, "tm_caller", None)
        body = self.jinja.get_template(template).render(
            **links(request),
            user=caller.name if caller else "",
            csrf=web_auth.csrf_token(caller) if caller and caller.via_cookie else "",
            **ctx,
        )
        return HTMLResponse(body, status_code=status)

    def error(self, request: Request, status: int, message: str) -> Response:
        """An error page for a browser, ``{"detail": ...}`` for a program; never a password."""
        message = mask(message)
        if wants_html(request):
            return self.html(request, "error.html", status, status_code=status, message=message)
        return JSONResponse({"detail": message}, status_code=status)


# -- the request ---------------------------------------------------------------------------------
def rel(request: Request) -> str:
    """The path inside this app (without Airflow's root path and the mount prefix)."""
    root, path = request.scope.get("root_path", ""), request.url.path
    return path[len(root) :] if root and path.startswith(root) else path


def is_api(request: Request) -> bool:
    return rel(request).startswith(
        ("/dlq/api/", "/dlq/static/", "/pipelines/api/", "/pipelines/static/")
    )


def wants_html(request: Request) -> bool:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return not is_api(request) or (request.method == "POST" and ctype == FORM)


def links(request: Request) -> dict[str, str]:
    return {
        "prefix": request.scope.get("root_path", ""),  # this app, e.g. /tidemark
        "airflow": request.base_url.path.rstrip("/"),  # Airflow's UI root
    }


# -- what routes depend on -------------------------------------------------------------------
async def _web(request: Request) -> Web:  # async: no threadpool hop for an attribute
    return cast(Web, request.app.state.web)


async def _caller(request: Request, caller: Annotated[Caller, Depends(guard)]) -> Caller:
    request.state.tm_caller = caller  # for the pages' user name and CSRF token
    return caller


WebDep = Annotated[Web, Depends(_web)]
CallerDep = Annotated[Caller, Depends(_caller)]


def static_file(folder: Path, types: dict[str, str], name: str) -> Response:
    """One of the app's own static files (``types``: name to media type; any other name is
    not found), cached privately: the pages' stylesheets and scripts."""
    if name not in types:
        raise NotFound(f"no static file {name[:40]!r}")
    return Response(
        (folder / name).read_bytes(),
        media_type=types[name],
        headers={"Cache-Control": "private, max-age=300"},
    )
