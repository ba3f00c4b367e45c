"""The dead-letter pages and JSON API that Airflow's API server mounts at /tidemark
(plugins/tidemark_dlq.py): browse, read, discard, redrive and export dead letters.

Every route depends on ``web_auth.guard`` (declared on the app, so no route can miss it).
Pages are server-rendered Jinja2 with autoescaping and a Content-Security-Policy that allows
only this app's own script and stylesheet. Redrive does not run Spark here: it records the
selection as a redrive request in the ledger and triggers the pipeline's
``tidemark_<pipeline>_redrive`` DAG with the request's id, through Airflow's REST API at
Airflow's configured address (never the client's Host header), as the caller
(airflow_api.py). Preview triggers the same DAG with ``dry_run``: the redrive up to PREPARE,
then rolled back; its request stays, so the previewed letters can then be redriven as they
were. A redrive DAG run's page follows it: Airflow's state of it and, from the ledger, what
each sink got (or, previewed, would get).
"""

from __future__ import annotations

import asyncio
import json
import logging
import mimetypes
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, overload
from urllib.parse import parse_qs, quote, unquote, urlencode

import psycopg
from fastapi import Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, ValidationError
from starlette.datastructures import Headers, MutableHeaders
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tidemark.config import IDENT, dag_id
from tidemark.core.db import connect, one_line
from tidemark.core.dsn import mask
from tidemark.core.errors import BadInput, Busy, NotFound, TidemarkError
from tidemark.core.settings import get_settings
from tidemark.core.text import shown
from tidemark.ledger import dlq, letters, redrives
from tidemark.ledger import runs as ledger_runs
from tidemark.quality.docs import site_dir
from tidemark.render import payloads
from tidemark.web import auth as web_auth
from tidemark.web.airflow_api import AirflowApi, AirflowFailed, TriggerFailed
from tidemark.web.auth import Caller, Forbidden, NotAuthenticated, guard
from tidemark.web.pipelines_pages import router as pipelines_router

TEMPLATES = Path(__file__).resolve().parent / "templates" / "dlq"
STATIC = {"dlq.css": "text/css", "dlq.js": "text/javascript", "icon.svg": "image/svg+xml"}
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'self'; base-uri 'none'"
)
# Data Docs are GX's own HTML, carrying a check's unexpected values unescaped. The pages are
# rendered on the server and read fine without their scripts (which come from CDNs without
# integrity), so none runs: an opaque-origin sandbox without allow-scripts, keeping them away
# from the Airflow session too. Their stylesheets and icon fonts load only from the CDN paths
# GX names (tests/test_dlq_web.py checks them against GX's templates), and nothing on the
# page can send data anywhere: no connections, images only from here.
DOCS_STYLES = (
    "https://cdn.jsdelivr.net/npm/@forevolve/bootstrap-dark@1.1.0/",
    "https://cdnjs.cloudflare.com/ajax/libs/bootstrap-datepicker/1.9.0/",
    "https://cdnjs.cloudflare.com/ajax/libs/font-awesome/6.6.0/",
    "https://maxcdn.bootstrapcdn.com/bootstrap/4.3.1/",
    "https://unpkg.com/bootstrap-table@1.19.0/",
    "https://unpkg.com/bootstrap-table@1.19.1/",
)
DOCS_FONTS = ("https://cdnjs.cloudflare.com/ajax/libs/font-awesome/6.6.0/webfonts/",)
DOCS_CSP = (
    "sandbox allow-popups; default-src 'none'; script-src 'none'; "
    f"style-src 'unsafe-inline' {' '.join(DOCS_STYLES)}; font-src {' '.join(DOCS_FONTS)}; "
    "img-src 'self' data:; connect-src 'none'; form-action 'none'; base-uri 'none'; "
    "frame-ancestors 'self'"
)
SHOW_BYTES = 256 * 1024  # payload bytes a page renders; the download and export have them all
SHOW_CHARS = payloads.RENDER_CHARS  # what one rendering of them (pretty JSON, hexdump) may grow to
KEY_CHARS = 64 * 1024  # a key's or the headers' rendering
MAX_BODY = 2 * 1024 * 1024  # a POST's body: 100,000 ids and a note fit with room to spare
BODY_SECONDS = 10.0  # to receive a whole body: 2 MiB take well under a second on any link
BODYLESS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE"})  # methods no page takes a body on
UNAVAILABLE = "the ledger database is unavailable; try again later"
FORM = "application/x-www-form-urlencoded"
log = logging.getLogger(__name__)

jinja = Environment(
    loader=FileSystemLoader(TEMPLATES),
    autoescape=True,
    undefined=StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
jinja.filters["when"] = lambda iso: f"{iso[:19].replace('T', ' ')} UTC" if iso else "-"
app = FastAPI(
    title="Tidemark dead letters",
    docs_url=None,
    redoc_url=None,
    openapi_url=None,
    dependencies=[Depends(guard)],
)


class LedgerUnavailable(TidemarkError):
    """The ledger cannot be reached: 503, without its host or user (the log has them)."""


# -- plumbing ---------------------------------------------------------------------------------
def _ledger(**kw) -> psycopg.Connection:
    try:
        return connect(
            get_settings().airflow_ledger("Airflow's API server"),
            autocommit=True,
            what="ledger",
            **kw,
        )
    except TidemarkError as exc:  # names host, port and user: for the log, not for the caller
        log.warning("tidemark dead letters: %s", mask(str(exc)))
        raise LedgerUnavailable(UNAVAILABLE) from None


def _rel(request: Request) -> str:
    """The path inside this app (without Airflow's root path and the mount prefix)."""
    root, path = request.scope.get("root_path", ""), request.url.path
    return path[len(root) :] if root and path.startswith(root) else path


def _is_api(request: Request) -> bool:
    return _rel(request).startswith(("/dlq/api/", "/dlq/static/"))


def _wants_html(request: Request) -> bool:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return not _is_api(request) or (request.method == "POST" and ctype == FORM)


def _links(request: Request) -> dict[str, str]:
    return {
        "prefix": request.scope.get("root_path", ""),  # this app, e.g. /tidemark
        "airflow": request.base_url.path.rstrip("/"),
    }  # Airflow's UI root


def _html(request: Request, template: str, status: int = 200, **ctx: Any) -> HTMLResponse:
    caller: Caller | None = getattr(request.state, "tm_caller", None)
    body = jinja.get_template(template).render(
        **_links(request),
        user=caller.name if caller else "",
        csrf=web_auth.csrf_token(caller) if caller and caller.via_cookie else "",
        **ctx,
    )
    return HTMLResponse(body, status_code=status)


def _error(request: Request, status: int, message: str) -> Response:
    message = mask(message)
    if _wants_html(request):
        return _html(request, "error.html", status, status_code=status, message=message)
    return JSONResponse({"detail": message}, status_code=status)


class BodyLimit:
    """Caps a request body at ``limit`` bytes and ``seconds`` before anything reads it (the
    CSRF check in ``guard``, the handlers): a Content-Length over it is refused unread, a
    chunked body is counted as it arrives, and one that has not arrived whole in time is
    refused (a trickled body would otherwise hold a connection, before authentication, for as
    long as the client likes). A body on a method that takes none is refused unread. The body
    (at most ``limit`` bytes) is read here and handed on whole."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY, seconds: float = BODY_SECONDS) -> None:
        self.app, self.limit, self.seconds = app, limit, seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        length = headers.get("content-length", "").strip()
        if scope["method"] in BODYLESS and (
            (length.isdigit() and int(length) > 0) or "transfer-encoding" in headers
        ):
            await _error(Request(scope), 400, f"{scope['method']} takes no request body")(
                scope, receive, send
            )
            return
        if length.isdigit() and int(length) > self.limit:
            await self._refuse(scope, receive, send)
            return
        if scope["method"] not in BODYLESS:
            # Who asks, from the headers alone, before a byte of the body is read: a caller
            # who is not signed in gets no buffer at all (400 connections of 2 MiB each
            # would otherwise sit in memory before any of them was refused).
            request = Request(scope)
            try:
                await web_auth.authenticate(request)
            except NotAuthenticated as exc:
                await (await _not_authenticated(request, exc))(scope, receive, send)
                return
        data = bytearray()  # one copy of the body, grown in place
        try:
            async with asyncio.timeout(self.seconds):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # the client left: nobody to answer
                        return
                    data += message.get("body", b"")
                    if len(data) > self.limit:
                        await self._refuse(scope, receive, send)
                        return
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            await _error(
                Request(scope), 408, f"request body not received within {self.seconds:g} s"
            )(scope, receive, send)
            return
        body: Message | None = {"type": "http.request", "body": bytes(data), "more_body": False}
        del data

        async def replay() -> Message:
            nonlocal body
            if body is None:  # after the body: a disconnect, for streamed answers
                return await receive()
            message, body = body, None
            return message

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The server drops the unread rest of the body after this answer.
        response = _error(
            Request(scope),
            413,
            f"request body too large: at most "
            f"{self.limit:,} bytes; send fewer dead-letter "
            f"ids at a time",
        )
        await response(scope, receive, send)


class SlashRedirect:
    """``/tidemark/dlq`` -> ``/tidemark/dlq/`` (and a trailing slash too many, removed), as a
    path without scheme and host. Starlette's own redirect builds an absolute URL from the Host
    header, so anyone could have it send people, before they sign in, to a host they name."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _rel(Request(scope)) not in ("", "/") and not _routed(scope):
            path = scope["path"]
            other = {**scope, "path": path.rstrip("/") if path.endswith("/") else path + "/"}
            if _routed(other):
                # One leading slash whatever the path holds: "//host" or "/\\host" would be
                # another host to a browser.
                location = "/" + quote(other["path"]).lstrip("/\\")
                if scope.get("query_string"):
                    location += "?" + scope["query_string"].decode("latin-1")
                await RedirectResponse(location, status_code=307)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _routed(scope: Scope) -> bool:
    return any(route.matches(scope)[0] is not Match.NONE for route in app.router.routes)


class TransferAborted(BaseException):
    """A response that failed after its first byte. The status (200) and part of the body are
    out, so the only honest answer left is a broken connection; a clean end would pass a cut
    export off as a whole one. A BaseException because Airflow's own middlewares (Starlette's
    BaseHTTPMiddleware) end a failed stream cleanly on an Exception; this one passes them,
    and the server then closes the connection without the final chunk."""


class Answers:
    """Every answer's security headers, and what a failure becomes: before the response
    starts, an error page or JSON (never a traceback); after it, a broken transfer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def headed(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = MutableHeaders(scope=message)
                headers.setdefault("Content-Security-Policy", CSP)
                headers.setdefault("Cache-Control", "no-store")
                headers["X-Content-Type-Options"] = "nosniff"
                headers["Referrer-Policy"] = "same-origin"
            await send(message)

        request = Request(scope)
        try:
            await self.app(scope, receive, headed)
        except Exception as exc:  # the log has the traceback, never the caller
            if started:
                log.error(
                    "tidemark dead letters: %s %s failed after the answer began; "
                    "the connection is cut so the client sees a broken transfer: %s",
                    request.method,
                    request.url.path,
                    mask(one_line(exc)),
                )
                raise TransferAborted(one_line(exc)) from exc
            log.exception("tidemark dead letters: %s %s failed", request.method, request.url.path)
            await _error(
                request,
                500,
                f"internal error ({type(exc).__name__}); the API server's log has the details",
            )(scope, receive, headed)


app.include_router(pipelines_router)  # the Pipelines pages (pipelines_pages.py)
app.router.redirect_slashes = False  # SlashRedirect's instead
# Added in this order so each runs inside the next: Answers is outermost, and the others'
# answers get its headers.
app.add_middleware(SlashRedirect)
app.add_middleware(BodyLimit)
app.add_middleware(Answers)


@app.exception_handler(NotAuthenticated)
async def _not_authenticated(request: Request, exc: NotAuthenticated) -> Response:
    if _is_api(request) or request.method != "GET":
        return JSONResponse(
            {"detail": f"not authenticated: {exc}"},
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
    return RedirectResponse(web_auth.login_url(request), status_code=303)


@app.exception_handler(Forbidden)
async def _forbidden(request: Request, exc: Forbidden) -> Response:
    return _error(request, 403, str(exc))


@app.exception_handler(TidemarkError)
async def _tidemark_error(request: Request, exc: TidemarkError) -> Response:
    status = (
        404
        if isinstance(exc, NotFound)
        else 400
        if isinstance(exc, BadInput)
        else 409
        if isinstance(exc, Busy)
        else 503
    )
    return _error(request, status, str(exc))


@app.exception_handler(psycopg.Error)
async def _db_error(request: Request, exc: psycopg.Error) -> Response:
    if isinstance(exc, psycopg.DataError):
        # The value is at fault, not the ledger: a NUL character (which no text column
        # holds), a date out of range. The caller can mend it.
        return _error(request, 400, f"a value the ledger cannot hold: {one_line(exc)}")
    # The error names the server, its port and the user: the log has them, masked.
    log.warning(
        "tidemark dead letters: %s %s: ledger error: %s",
        request.method,
        request.url.path,
        one_line(exc),
    )
    return _error(request, 503, UNAVAILABLE)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    err = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(p) for p in err.get("loc", ()) if p not in ("path", "query", "body"))
    return _error(request, 400, f"{where or 'request'}: {err.get('msg', 'invalid')}")


async def _caller(request: Request, caller: Annotated[Caller, Depends(guard)]) -> Caller:
    request.state.tm_caller = caller  # for the pages' user name and CSRF token
    return caller


CallerDep = Annotated[Caller, Depends(_caller)]


# -- input --------------------------------------------------------------------------------------
@overload
def _int(value: str | None, name: str, default: int) -> int: ...
@overload
def _int(value: str | None, name: str, default: None = None) -> int | None: ...
def _int(value: str | None, name: str, default: int | None = None) -> int | None:
    if value is None or value.strip() == "":
        return default
    value = value.strip()
    if not value.isascii() or not value.isdigit():
        raise BadInput(f"{name} {shown(value, 40)}: not a positive integer")
    if int(value) > dlq.MAX_ID:  # ids are bigints: PostgreSQL would refuse it, as a 503
        raise BadInput(f"{name} {shown(value, 40)}: at most {dlq.MAX_ID:,}")
    return int(value)


def _record_id(value: str) -> int:
    rid = _int(value, "id")
    if not rid:
        raise BadInput(f"id {shown(value, 40)}: not a dead-letter id")
    return rid


def _filters(request: Request, default_status: str | None) -> dlq.Filters:
    q = request.query_params
    return dlq.Filters.parse(
        pipeline=q.get("pipeline"),
        sink=q.get("sink"),
        error_class=q.get("error_class", q.get("class")),
        status=q.get("status", default_status),
        since=q.get("since"),
        until=q.get("until"),
        reason=q.get("reason"),
        ids=q.getlist("ids") or None,
    )


class ActionBody(BaseModel):
    """A POST's fields (discard, redrive, export). Strict types: a number where text belongs
    is the caller's mistake, named, not something to guess at. Other fields are ignored: a
    form also carries the page's CSRF token and whatever else it holds."""

    model_config = ConfigDict(extra="ignore")

    ids: list[StrictInt | StrictStr] | StrictInt | StrictStr | None = None
    note: StrictStr | None = None
    back: StrictStr | None = None
    all_matching: StrictBool | StrictStr | None = None
    expected: StrictInt | StrictStr | None = None
    dry_run: StrictBool | StrictStr | None = None
    request: StrictInt | StrictStr | None = None
    pipeline: StrictStr | None = None
    sink: StrictStr | None = None
    error_class: StrictStr | None = None
    since: StrictStr | None = None
    until: StrictStr | None = None
    reason: StrictStr | None = None


WANTED = {
    "ids": 'expected dead-letter ids: [4, 7] or "4,7"',
    "all_matching": "expected true or false",
    "expected": "expected a count",
    "dry_run": "expected true or false",
    "request": "expected a redrive request id",
}


def _checked(data: dict[str, Any]) -> dict[str, Any]:
    try:
        return ActionBody.model_validate(data).model_dump(exclude_none=True)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = str(err["loc"][0]) if err["loc"] else "body"
        given = data.get(name, err.get("input"))
        raise BadInput(f"{name} {shown(given, 40)}: {WANTED.get(name, 'expected text')}") from None


async def _body(request: Request) -> dict[str, Any]:
    """A POST's fields from JSON or a form (``ids`` may repeat in a form), checked."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    raw = await request.body()
    if ctype == FORM:
        form = parse_qs(raw.decode("utf-8", "replace"), keep_blank_values=True)
        for k, v in form.items():
            # one field, two values (dry_run=1&dry_run=0): which one was meant is a guess
            if k != "ids" and len(set(v)) > 1:
                raise BadInput(f"{k}: given {len(v)} times with different values")
        return _checked({k: (v if k == "ids" else v[-1]) for k, v in form.items()})
    if not raw.strip():
        return {}
    if ctype != "application/json":
        raise BadInput(f"content type {ctype or '(none)'!r}: send application/json or a form")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise BadInput(f"body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadInput("body: expected a JSON object")
    return _checked(data)


MATCHING = ("pipeline", "sink", "error_class", "since", "until", "reason")


def _all_matching(body: dict) -> bool:
    return str(body.get("all_matching", "")).lower() in ("1", "true", "on")


def _matching(body: dict, action: str) -> tuple[dlq.Filters, str, int | None]:
    """An "all matching" action's filters (one pipeline's quarantined letters), that pipeline,
    and the count the caller confirmed (``expected``; the page's confirm step always sends
    it)."""
    f = dlq.Filters.parse(**{k: body.get(k) for k in MATCHING}, status="quarantined")
    if not f.pipeline:
        raise BadInput(f"pipeline: choose the pipeline whose dead letters to {action}")
    expected = body.get("expected")
    if expected in (None, ""):
        return f, f.pipeline, None
    if isinstance(expected, bool) or not str(expected).strip().isdigit():
        raise BadInput(f"expected {shown(expected, 40)}: not a count")
    return f, f.pipeline, int(str(expected).strip())


def _dry_run(body: dict) -> bool:
    """Strict, unlike the checkboxes: a misspelt "yes" must not turn a preview into a real
    redrive."""
    value = body.get("dry_run")
    if value is None or isinstance(value, bool):
        return bool(value)
    text = value.strip().lower()
    # a bare "dry_run" (empty) is no "false": the one mistake that commits for real
    if text in ("1", "true", "on", "0", "false", "off"):
        return text in ("1", "true", "on")
    raise BadInput(f"dry_run {shown(value, 40)}: expected true or false")


def _ids_from(body: dict) -> list[int]:
    if "ids" not in body or body["ids"] in (None, "", []):
        raise BadInput("ids: select at least one dead letter")
    return sorted(set(dlq.parse_ids(body["ids"])))


def _back(request: Request, body: dict) -> str:
    """Where a form's result page links back to: the list with the filters it had."""
    query = str(body.get("back") or "")
    safe = urlencode(
        [
            (k, v)
            for k, vs in parse_qs(query).items()
            for v in vs
            if k in ("pipeline", "sink", "error_class", "status", "since", "until", "reason")
        ]
    )
    return f"{_links(request)['prefix']}/dlq/" + (f"?{safe}" if safe else "")


# -- authorization against the ledger ----------------------------------------------------------
def _visible(conn: psycopg.Connection, caller: Caller, f: dlq.Filters) -> dlq.Filters:
    """``f`` narrowed to the pipelines the caller may read; one they named but may not read
    matches nothing, like a pipeline without dead letters."""
    if f.pipeline:
        return f if _may(caller, "GET", f.pipeline) else f.model_copy(update={"pipelines": []})
    if web_auth.may_read_all(caller):
        return f
    return f.model_copy(update={"pipelines": web_auth.readable(caller, dlq.pipelines(conn))})


def _owned(
    conn: psycopg.Connection, caller: Caller, ids: list[int], method: str
) -> dict[int, tuple[str, str]]:
    """id -> (pipeline, status) of the ids that exist and that the caller may see: the others
    are left out, so they read like ids that do not exist. 403 if the caller may see one but
    not ``method`` it (edit, PUT)."""
    owners = dlq.owners(conn, ids)
    names = {p for p, _ in owners.values()}
    seen = names if web_auth.may_read_all(caller) else set(web_auth.readable(caller, names))
    owners = {i: o for i, o in owners.items() if o[0] in seen}
    if method != "GET":
        web_auth.require(caller, method, {p for p, _ in owners.values()})
    return owners


# -- rows for people and programs -----------------------------------------------------------------
def _iso(v: Any) -> Any:
    if isinstance(v, datetime):
        return (v.astimezone(UTC) if v.tzinfo else v).isoformat()
    return v


def _summary(row: dict) -> dict:
    out = {k: _iso(v) for k, v in row.items() if k != "payload_head"}
    out["payload_preview"] = payloads.preview(row["payload_head"], row["payload_size"])
    return out


def _docs_href(request: Request, pipeline: str, docs_path: str | None) -> str | None:
    """The page's address under the pipeline's own Data Docs site (None if it is elsewhere,
    e.g. rendered before Data Docs were kept per pipeline)."""
    if not docs_path:
        return None
    site = Path(site_dir(str(get_settings().docs_dir(pipeline)))).resolve()
    try:
        rel = Path(unquote(docs_path)).resolve().relative_to(site)
    except ValueError:
        return None
    return f"{_links(request)['prefix']}/dlq/docs/{quote(pipeline)}/{quote(rel.as_posix())}"


def _airflow_links(request: Request, run: dict | None) -> dict[str, str]:
    af = (run or {}).get("airflow")
    if not af:
        return {}
    root = _links(request)["airflow"]
    dag_run = f"{root}/dags/{quote(af['dag_id'], safe='')}/runs/{quote(af['run_id'], safe='')}"
    out = {"dag_run": dag_run}
    if isinstance(af.get("task_id"), str):
        tries = f"?try_number={af['try_number']}" if af.get("try_number") is not None else ""
        out["task_log"] = f"{dag_run}/tasks/{quote(af['task_id'], safe='')}{tries}"
    return out


def _record(request: Request, rec: dict, fmt: str) -> dict:
    """A letter read with ``payload_limit=SHOW_BYTES``: ``payload`` (base64) only when that
    is all of it, else null; ``payload_download`` has every byte."""
    size = rec["payload_size"]
    kind, text = payloads.render_payload(
        rec["payload"], fmt, limit=SHOW_BYTES, size=size, max_chars=SHOW_CHARS
    )
    docs = []
    if rec["error_class"] in ("validation", "dq_gate"):  # links only: no server paths
        docs = [
            {
                "scope": q["scope"] or "(pipeline)",
                "success": q["success"],
                "href": _docs_href(request, rec["pipeline"], q["docs_path"]),
            }
            for q in rec["quality"]
            if q["docs_path"]
        ]
    whole = size is None or size <= SHOW_BYTES
    return {
        **dlq.envelope(rec if whole else {**rec, "payload": None}),
        "payload_size": size,
        "payload_complete": whole,
        "payload_download": f"{_links(request)['prefix']}/dlq/api/records/{rec['id']}/payload"
        if size is not None
        else None,
        "payload_rendered": {"kind": kind, "text": text},
        "key_text": None
        if rec["key"] is None
        else payloads.render_payload(rec["key"], limit=4096, max_chars=KEY_CHARS)[1],
        "run": {k: _iso(v) for k, v in rec["run"].items()} if rec["run"] else None,
        "links": _airflow_links(request, rec["run"]),
        "data_docs": docs,
    }


# -- pages ----------------------------------------------------------------------------------------
def _window(hours: int) -> str:
    return (datetime.now(UTC) - timedelta(hours=hours)).strftime("%Y-%m-%dT%H:%M")


@app.get("/dlq/")
def list_page(request: Request, caller: CallerDep) -> Response:
    q = request.query_params
    f = _filters(request, "quarantined")
    limit, before = _int(q.get("limit"), "limit", 50), _int(q.get("before"), "before")
    with _ledger(options="-c statement_timeout=30000") as conn:
        scoped = _visible(conn, caller, f)
        pg = dlq.page(conn, scoped, limit, before)
        by_class = dlq.counts(conn, scoped.without("error_class"))
        names = dlq.pipelines(conn)
    names = names if web_auth.may_read_all(caller) else web_auth.readable(caller, names)
    editable = [p for p in names if _may(caller, "PUT", p)]
    matching = by_class[f.error_class] if f.error_class else sum(by_class.values())
    keep = f.query()
    plain = {k: v for k, v in keep.items() if k != "error_class"}
    class_links = [
        ("all classes", sum(by_class.values()), f"?{urlencode(plain)}", not f.error_class)
    ]
    class_links += [
        (c, n, f"?{urlencode({**plain, 'error_class': c})}", c == f.error_class)
        for c, n in by_class.items()
    ]
    return _html(
        request,
        "list.html",
        rows=[_summary(r) for r in pg.rows],
        next_before=pg.next_before,
        class_links=class_links,
        f=f,
        pipelines=names,
        can_act=bool(editable),
        classes=dlq.ERROR_CLASSES,
        statuses=dlq.STATUSES,
        # "all matching" actions: one pipeline's quarantined letters, after a confirm step
        redrive_all=bool(f.pipeline in editable and f.status == "quarantined" and matching),
        matching=matching,
        keep=keep,
        query=urlencode(keep),
        limit=limit,
        before=before,
        since_value=f.since.astimezone(UTC).strftime("%Y-%m-%dT%H:%M") if f.since else "",
        until_value=f.until.astimezone(UTC).strftime("%Y-%m-%dT%H:%M") if f.until else "",
        windows=[("last hour", _window(1)), ("24 hours", _window(24)), ("7 days", _window(24 * 7))],
        urlencode=urlencode,
    )


@app.get("/dlq/confirm")
def confirm_page(request: Request, caller: CallerDep) -> Response:
    """The confirm step of an "all matching" action: the count the server finds for these
    filters now, and the form that acts on them with that count (``expected``)."""
    action = request.query_params.get("action", "")
    if action not in ("redrive", "discard"):
        raise BadInput(f"action {shown(action, 40)}: expected redrive or discard")
    f, pipeline, _ = _matching(dict(request.query_params), action)
    web_auth.require(caller, "PUT", [pipeline])
    with _ledger(options="-c statement_timeout=30000") as conn:
        n = dlq.matching(conn, f)
    keep = f.query()
    return _html(
        request,
        "confirm.html",
        action=action,
        n=n,
        f=f,
        described=f.without("status").described(),
        keep=keep,
        fields={k: keep[k] for k in MATCHING if keep.get(k)},
        query=urlencode(keep),
    )


def _may(caller: Caller, method: str, pipeline: str) -> bool:
    try:
        web_auth.require(caller, method, [pipeline])
    except Forbidden:
        return False
    return True


def _seen(conn: psycopg.Connection, caller: Caller, record_id: str) -> int:
    """The id, if the letter exists and the caller may read its pipeline; a letter they may
    not see is not found, exactly like one that does not exist."""
    rid = _record_id(record_id)
    pipeline = dlq.pipeline_of(conn, rid)
    if pipeline is None or not _may(caller, "GET", pipeline):
        raise NotFound(f"no dead letter {rid}")
    return rid


def _readable(caller: Caller, record_id: str) -> dict:
    """The dead letter ``record_id`` with the first SHOW_BYTES of its payload."""
    with _ledger() as conn:
        rec = dlq.get(conn, _seen(conn, caller, record_id), payload_limit=SHOW_BYTES)
    if rec is None:  # gone since: read as never there
        raise NotFound(f"no dead letter {_record_id(record_id)}")
    return rec


@app.get("/dlq/record/{record_id}")
def record_page(request: Request, record_id: str, caller: CallerDep) -> Response:
    rec = _readable(caller, record_id)
    fmt = request.query_params.get("format", "auto")
    view = _record(request, rec, fmt)
    formats = ["auto", "text", "hex"]
    # Whether to offer the JSON tab, without rendering a view nobody asked for (parsing
    # 256 KiB again costs milliseconds; indenting it could cost a 48 MB page).
    if payloads.payload_kind(rec["payload"], SHOW_BYTES, rec["payload_size"]) == "json":
        formats.insert(1, "json")
    return _html(
        request,
        "record.html",
        r=view,
        fmt=fmt,
        formats=formats,
        show_bytes=SHOW_BYTES,
        can_act=_may(caller, "PUT", rec["pipeline"]),
        headers_text=_headers_text(rec),
    )


def _headers_text(rec: dict) -> str | None:
    """The headers as the source had them (exact text); a letter that does not know them
    (from before ledger V007) as jsonb stored them."""
    exact = letters.header_text(rec["source_headers"])
    if exact is not None:
        return exact if len(exact) <= KEY_CHARS else exact[:KEY_CHARS] + CUT
    if rec["headers"] is None:
        return None
    pretty = payloads.pretty_json(rec["headers"], KEY_CHARS)
    if pretty is not None:
        return pretty
    # Indented they would pass the bound: their plain JSON, cut.
    plain = json.dumps(rec["headers"], ensure_ascii=False)
    return plain if len(plain) <= KEY_CHARS else plain[:KEY_CHARS] + CUT


CUT = (
    f"\n... cut here: this view shows at most {KEY_CHARS:,} characters; export the record "
    f"for all of them"
)


@app.get("/dlq/docs/{pipeline}/{path:path}")
def data_docs(request: Request, pipeline: str, path: str, caller: CallerDep) -> Response:
    """A page of a pipeline's Great Expectations Data Docs site, to those who may read the
    pipeline's DAG; nothing else of the GX project (config, stored results)."""
    missing = NotFound(f"no Data Docs page {path!r} of pipeline {pipeline!r}")
    if not re.fullmatch(IDENT, pipeline):
        raise missing
    try:
        web_auth.require(caller, "GET", [pipeline])
    except Forbidden:
        raise missing from None  # whether it exists is not for this caller to learn
    site = Path(site_dir(str(get_settings().docs_dir(pipeline)))).resolve()
    if not path or path.startswith("/") or ".." in Path(path).parts or "\x00" in path:
        raise missing
    target = (site / path).resolve()
    if not target.is_relative_to(site) or not target.is_file():
        raise missing
    ctype = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
    return Response(
        target.read_bytes(), media_type=ctype, headers={"Content-Security-Policy": DOCS_CSP}
    )


@app.get("/dlq/static/{name}")
def static(name: str, caller: CallerDep) -> Response:
    if name not in STATIC:
        raise NotFound(f"no static file {name!r}")
    return Response(
        (TEMPLATES / name).read_bytes(),
        media_type=STATIC[name],
        headers={"Cache-Control": "private, max-age=300"},
    )


# -- JSON API -----------------------------------------------------------------------------------
@app.get("/dlq/api/records")
def api_records(request: Request, caller: CallerDep) -> Response:
    q = request.query_params
    f = _filters(request, None)
    limit, before = _int(q.get("limit"), "limit", 50), _int(q.get("before"), "before")
    with _ledger(options="-c statement_timeout=30000") as conn:
        pg = dlq.page(conn, _visible(conn, caller, f), limit, before)
    return JSONResponse({"records": [_summary(r) for r in pg.rows], "next_before": pg.next_before})


@app.get("/dlq/api/records/{record_id}")
def api_record(request: Request, record_id: str, caller: CallerDep) -> Response:
    rec = _readable(caller, record_id)
    fmt = request.query_params.get("format", "auto")
    return JSONResponse(_record(request, rec, fmt))


@app.get("/dlq/api/records/{record_id}/payload")
def api_payload(record_id: str, caller: CallerDep) -> Response:
    """Every byte of a letter's payload, streamed in slices (the pages show 256 KiB)."""
    with _ledger() as conn:
        rid = _seen(conn, caller, record_id)

    def chunks() -> Iterator[bytes]:
        with _ledger() as conn:
            yield from dlq.payload_chunks(conn, rid)

    return StreamingResponse(
        chunks(),
        media_type="application/octet-stream",
        headers={"Content-Disposition": f'attachment; filename="dead-letter-{rid}.bin"'},
    )


@app.get("/dlq/api/counts")
def api_counts(caller: CallerDep) -> Response:
    """Quarantined records per pipeline and error class: poll it for alerting."""
    with _ledger(options="-c statement_timeout=30000") as conn:
        only = (
            None
            if web_auth.may_read_all(caller)
            else web_auth.readable(caller, dlq.pipelines(conn))
        )
        by_pipeline = dlq.counts_by_pipeline(conn, only)
    return JSONResponse(
        {
            "status": "quarantined",
            "pipelines": by_pipeline,
            "total": sum(sum(c.values()) for c in by_pipeline.values()),
        }
    )


def _export(f: dlq.Filters) -> Iterator[str]:
    with _ledger() as conn:
        yield from dlq.export(conn, f)


def _download(f: dlq.Filters) -> StreamingResponse:
    name = f"dead-letters-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.jsonl"
    return StreamingResponse(
        _export(f),
        media_type="application/x-ndjson",
        headers={"Content-Disposition": f'attachment; filename="{name}"'},
    )


@app.get("/dlq/api/export")
def api_export(request: Request, caller: CallerDep) -> Response:
    f = _filters(request, None)
    with _ledger() as conn:  # ids of pipelines the caller may not read are left out
        f = _visible(conn, caller, f)
    return _download(f)


@app.post("/dlq/api/export")
async def api_export_selected(request: Request, caller: CallerDep) -> Response:
    ids = _ids_from(await _body(request))

    def check() -> list[int]:
        with _ledger() as conn:
            return sorted(_owned(conn, caller, ids, "GET"))

    return _download(dlq.Filters(ids=await run_in_threadpool(check)))


@app.post("/dlq/api/discard")
async def api_discard(request: Request, caller: CallerDep) -> Response:
    body = await _body(request)
    if _dry_run(body):  # refused, not ignored: it would discard for real
        raise BadInput("dry_run: a discard has no preview; list or export the letters to see them")
    if _all_matching(body):
        f, pipeline, expected = _matching(body, "discard")

        def everything() -> dlq.Discarded:
            web_auth.require(caller, "PUT", [pipeline])
            with _ledger() as conn:
                return dlq.discard_matching(conn, f, body.get("note"), caller.name, expected)

        res = await run_in_threadpool(everything)
        done = [
            f"Discarded {len(res.changed):,} dead letter(s) matching "
            f"{f.without('status').described()}"
        ]
        return _discarded(request, body, caller, res, done, skipped=[])
    ids = _ids_from(body)

    def work() -> dlq.Discarded:
        with _ledger() as conn:
            owners = _owned(conn, caller, ids, "PUT")
            res = (
                dlq.discard(conn, sorted(owners), body.get("note"), caller.name)
                if owners
                else dlq.Discarded()
            )
        res.skipped.update({i: "no such dead letter" for i in ids if i not in owners})
        return res

    res = await run_in_threadpool(work)
    done = (
        [f"Discarded {len(res.changed):,} dead letter(s): " + ", ".join(map(str, res.changed))]
        if res.changed
        else []
    )
    return _discarded(request, body, caller, res, done, skipped=res.to_dict()["skipped"])


def _discarded(
    request: Request,
    body: dict,
    caller: Caller,
    res: dlq.Discarded,
    done: list[str],
    skipped: list,
) -> Response:
    """The answer to a discard: a result page saying what was ``done`` and ``skipped``, or
    the JSON of ``res``."""
    if _wants_html(request):
        return _html(
            request,
            "result.html",
            title="Discard",
            back=_back(request, body),
            done=done,
            runs=[],
            skipped=skipped,
            errors=[],
        )
    return JSONResponse({**res.to_dict(), "by": caller.name})


@app.post("/dlq/api/redrive")
async def api_redrive(request: Request, caller: CallerDep) -> Response:
    """Redrive the selected ``ids``, or (``all_matching``) every quarantined letter of one
    pipeline that the filters (pipeline, sink, error_class, since, until, reason) match, or
    the letters of an existing redrive ``request`` (one a preview made). With ``dry_run``: a
    preview, the same DAG run up to PREPARE and rolled back."""
    body = await _body(request)
    dry_run = _dry_run(body)
    if body.get("request") not in (None, ""):
        if _all_matching(body) or body.get("ids") not in (None, "", []):
            raise BadInput("request: runs a redrive request as it is; no ids or filters with it")
        rid = _record_id_of(body["request"], "request")
        out = await run_in_threadpool(_redrive_request, request, caller, rid, dry_run)
    elif _all_matching(body):
        f, pipeline, expected = _matching(body, "redrive")
        out = await run_in_threadpool(
            _redrive_matching, request, caller, f, pipeline, expected, dry_run
        )
    else:
        out = await run_in_threadpool(_redrive, request, caller, _ids_from(body), dry_run)
    status = 502 if out["errors"] and not out["runs"] else 200
    if _wants_html(request):
        return _html(
            request,
            "result.html",
            status,
            title="Preview" if dry_run else "Redrive",
            back=_back(request, body),
            done=[],
            **out,
        )
    return JSONResponse(out, status_code=status)


def _record_id_of(value: Any, name: str) -> int:
    rid = _int(str(value), name)
    if not rid:
        raise BadInput(f"{name} {shown(value, 40)}: not an id")
    return rid


def _redrive(request: Request, caller: Caller, ids: list[int], dry_run: bool = False) -> dict:
    """The quarantined ``ids``, one redrive request per pipeline."""
    with _ledger() as conn:
        owners = _owned(conn, caller, ids, "PUT")
    skipped = [{"id": i, "reason": "no such dead letter"} for i in ids if i not in owners]
    skipped += [
        {"id": i, "reason": f"already {s}"}
        for i, (_, s) in sorted(owners.items())
        if s != "quarantined"
    ]
    groups: dict[str, list[int]] = {}
    for i, (p, s) in sorted(owners.items()):
        if s == "quarantined":
            groups.setdefault(p, []).append(i)
    out = _trigger(request, caller, {p: {"ids": chosen} for p, chosen in groups.items()}, dry_run)
    return {**out, "skipped": skipped}


def _redrive_matching(
    request: Request,
    caller: Caller,
    f: dlq.Filters,
    pipeline: str,
    expected: int | None = None,
    dry_run: bool = False,
) -> dict:
    """Every quarantined letter of ``pipeline`` that ``f`` matches now, as one request;
    none if more match now than the caller confirmed (``expected``)."""
    web_auth.require(caller, "PUT", [pipeline])
    out = _trigger(request, caller, {pipeline: {"filters": f, "expected": expected}}, dry_run)
    return {**out, "skipped": []}


def _redrive_request(request: Request, caller: Caller, rid: int, dry_run: bool) -> dict:
    """The letters of redrive request ``rid`` as it holds them (what a preview of it saw;
    those resolved or discarded since are skipped by the redrive). A request of a pipeline
    the caller may not read is not found, like one that does not exist."""
    with _ledger() as conn:
        req = redrives.get(conn, rid)
    if req is None or not _may(caller, "GET", req.pipeline):
        raise NotFound(f"no redrive request {rid}")
    web_auth.require(caller, "PUT", [req.pipeline])
    out = _trigger(request, caller, {req.pipeline: {"request": req}}, dry_run)
    return {**out, "skipped": []}


def _request_for(
    conn: psycopg.Connection, caller: Caller, pipeline: str, sel: dict
) -> tuple[redrives.Request | None, str | None]:
    """The request to run for one pipeline's selection: the one given (``request``) or one
    made now (``ids`` or ``filters``); or why there is none (then none is kept)."""
    if sel.get("request") is not None:
        return sel["request"], None
    req = redrives.create(
        conn, pipeline, caller.name, ids=sel.get("ids"), filters=sel.get("filters")
    )
    if req is None:
        return None, "no quarantined dead letters match"
    expected = sel.get("expected")
    if expected is not None and req.letters > expected:
        redrives.delete(conn, req.request_id)
        return req, (
            f"{req.letters:,} dead letter(s) match now, not the {expected:,} confirmed; "
            f"nothing was redriven, look again"
        )
    return req, None


def _trigger(
    request: Request, caller: Caller, selections: dict[str, dict], dry_run: bool = False
) -> dict:
    """Per pipeline: a redrive request in the ledger (``ids`` or ``filters``; or an existing
    ``request``), then tidemark_<pipeline>_redrive triggered with only its id in the conf
    (and ``dry_run``), as the caller (their JWT: Airflow authorizes the trigger too). A
    request made here whose trigger fails is deleted; an existing one stays."""
    runs, errors = [], []
    prefix = _links(request)["prefix"]
    with AirflowApi(caller.token) as airflow, _ledger() as conn:
        for pipeline, sel in selections.items():
            dag = dag_id(pipeline, "redrive")
            req, error = _request_for(conn, caller, pipeline, sel)
            what: dict[str, Any] = {
                "pipeline": pipeline,
                "dag_id": dag,
                "ids": sel.get("ids") or [],
            }
            what |= {"request": req.request_id, "letters": req.letters} if req else {"letters": 0}
            if req is not None and not error and not redrives.queue(conn, req.request_id):
                error = f"redrive request {req.request_id} no longer exists (pruned)"
            if req is None or error:
                errors.append({**what, "error": error})
                continue
            conf: dict[str, Any] = {"request": req.request_id, "requested_by": caller.name}
            if dry_run:
                conf["dry_run"] = True
            try:
                run_id = airflow.trigger(dag, conf)
            except TriggerFailed as exc:
                if sel.get("request") is None:  # made here, for this run only
                    redrives.delete(conn, req.request_id)
                errors.append({**what, "error": str(exc)})
                continue
            runs.append(
                {
                    **what,
                    "dry_run": dry_run,
                    "dag_run_id": run_id,
                    "url": _dag_run_url(request, dag, run_id),
                    "outcome": f"{prefix}/dlq/runs/{quote(pipeline)}/{quote(run_id, safe='')}",
                    "paused": airflow.paused(dag),
                }
            )
    return {"runs": runs, "errors": errors}


def _dag_run_url(request: Request, dag: str, run_id: str) -> str:
    """The DAG run's page in Airflow's UI."""
    return f"{_links(request)['airflow']}/dags/{quote(dag, safe='')}/runs/{quote(run_id, safe='')}"


# -- a redrive DAG run: its state in Airflow, its outcome in the ledger ------------------------
FINAL = ("success", "failed")  # Airflow's DAG run states that do not change any more
REFRESH_SECONDS = 3  # how often the page reloads itself while the run is not final


def _sink_outcome(row: dict, dry_run: bool) -> dict:
    """One sink of the ledger's run: what it got, or, previewed, what it would get."""
    counts = row["counts"] or {}
    would = dry_run and row["error"] == ledger_runs.DRY_RUN
    return {
        "sink": row["sink"],
        "state": "would commit" if would else row["state"],
        "ok": would or row["state"] == "committed",
        "error": None if would else row["error"],
        **{k: counts.get(k, 0) for k in ("records", "rows", "dead", "superseded", "resolved")},
    }


def _redrive_run(request: Request, caller: Caller, pipeline: str, run_id: str) -> dict:
    """A run of the pipeline's redrive DAG, to those who may read the pipeline: Airflow's
    state and conf (asked as the caller), the ledger's run of it per sink, and its request's
    letters by status now."""
    missing = NotFound(f"no redrive run {shown(run_id, 80)} of pipeline {shown(pipeline, 40)}")
    if not re.fullmatch(IDENT, pipeline) or not _may(caller, "GET", pipeline):
        raise missing
    dag = dag_id(pipeline, "redrive")
    with AirflowApi(caller.token) as airflow:
        try:
            af, airflow_error = airflow.dag_run(dag, run_id), None
        except AirflowFailed as exc:
            af, airflow_error = {}, str(exc)
        if af is None:
            raise missing
        paused = af.get("state") == "queued" and airflow.paused(dag)
    conf = af.get("conf") or {}
    with _ledger() as conn:
        run, sinks = ledger_runs.of_dag_run(conn, pipeline, dag, run_id)
        rid = conf.get("request")
        req = redrives.get(conn, rid) if isinstance(rid, int) and rid > 0 else None
        req = req if req is not None and req.pipeline == pipeline else None
        now = redrives.statuses(conn, req.request_id) if req else {}
    dry_run = conf.get("dry_run") is True or any(s["error"] == ledger_runs.DRY_RUN for s in sinks)
    outcome = [_sink_outcome(s, dry_run) for s in sinks]
    state = af.get("state")
    return {
        "pipeline": pipeline,
        "dag_id": dag,
        "dag_run_id": run_id,
        "url": _dag_run_url(request, dag, run_id),
        "state": state,
        "final": state in FINAL,
        "paused": paused,
        "airflow_error": airflow_error,
        "dry_run": dry_run,
        "run_id": run["run_id"] if run else None,
        "sinks": outcome,
        "request": {"id": req.request_id, "letters": req.letters, "now": now} if req else None,
        # A preview every sink of which would commit: its request may now be redriven.
        "redrive_ready": bool(
            dry_run and state == "success" and outcome and all(s["ok"] for s in outcome) and req
        ),
    }


@app.get("/dlq/runs/{pipeline}/{dag_run_id}")
def run_page(request: Request, pipeline: str, dag_run_id: str, caller: CallerDep) -> Response:
    out = _redrive_run(request, caller, pipeline, dag_run_id)
    return _html(
        request,
        "run.html",
        r=out,
        can_act=out["redrive_ready"] and _may(caller, "PUT", pipeline),
        refresh=None if out["final"] or out["airflow_error"] else REFRESH_SECONDS,
        back=f"{_links(request)['prefix']}/dlq/?{urlencode({'pipeline': pipeline})}",
    )


@app.get("/dlq/api/runs/{pipeline}/{dag_run_id}")
def api_run(request: Request, pipeline: str, dag_run_id: str, caller: CallerDep) -> Response:
    """A redrive DAG run's state and outcome (poll it until ``final``)."""
    return JSONResponse(_redrive_run(request, caller, pipeline, dag_run_id))
