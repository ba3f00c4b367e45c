"""The server-rendered pages (Jinja2, autoescaped, under a Content-Security-Policy that allows
only this app's own script and stylesheet): the list with its filters, the confirm step of an
"all matching" action, a letter, a redrive DAG run, a pipeline's Data Docs, and the pages'
static files."""

from __future__ import annotations

import mimetypes
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tidemark.config import IDENT
from tidemark.core.errors import BadInput, NotFound
from tidemark.core.text import shown
from tidemark.ledger import dlq
from tidemark.web import auth as web_auth
from tidemark.web import views
from tidemark.web.access import may, readable, readable_pipelines, visible
from tidemark.web.auth import Forbidden
from tidemark.web.context import TEMPLATES, CallerDep, WebDep, links, static_file
from tidemark.web.runs import REFRESH_SECONDS, redrive_run
from tidemark.web.selection import MATCHING, ActionBody, filters, number

STATIC = {"dlq.css": "text/css", "dlq.js": "text/javascript", "icon.svg": "image/svg+xml"}
# Data Docs are GX's own HTML, carrying a check's unexpected values unescaped. The pages are
# rendered on the server and read fine without their scripts (which come from CDNs without
# integrity), so none runs: an opaque-origin sandbox without allow-scripts, keeping them away
# from the Airflow session too. Their stylesheets and icon fonts load only from the CDN paths
# GX names (tests/test_dlq_web.py checks them against GX's templates) or, for sites rendered
# offline (tidemark/quality/docs.py vendors them into each site), from here; nothing on the
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
    f"style-src 'self' 'unsafe-inline' {' '.join(DOCS_STYLES)}; "
    f"font-src 'self' {' '.join(DOCS_FONTS)}; "
    "img-src 'self' data:; connect-src 'none'; form-action 'none'; base-uri 'none'; "
    "frame-ancestors 'self'"
)

router = APIRouter()


def _window(hours: int) -> str:
    return (datetime.now(UTC) - timedelta(hours=hours)).strftime("%Y-%m-%dT%H:%M")


@router.get("/dlq/")
def list_page(request: Request, caller: CallerDep, web: WebDep) -> Response:
    q = request.query_params
    f = filters(request, "quarantined")
    limit, before = number(q.get("limit"), "limit", 50), number(q.get("before"), "before")
    with web.ledger(options="-c statement_timeout=30000") as conn:
        scoped = visible(conn, caller, f)
        pg = dlq.page(conn, scoped, limit, before)
        by_class = dlq.counts(conn, scoped.without("error_class"))
        names = readable_pipelines(conn, caller)
    editable = [p for p in names if may(caller, "PUT", p)]
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
    return web.html(
        request,
        "list.html",
        rows=[views.summary(r) for r in pg.rows],
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


@router.get("/dlq/confirm")
def confirm_page(request: Request, caller: CallerDep, web: WebDep) -> Response:
    """The confirm step of an "all matching" action: the count the server finds for these
    filters now, and the form that acts on them with that count (``expected``)."""
    action = request.query_params.get("action", "")
    if action not in ("redrive", "discard"):
        raise BadInput(f"action {shown(action, 40)}: expected redrive or discard")
    sel = ActionBody.checked(dict(request.query_params)).matching(action)
    web_auth.require(caller, "PUT", [sel.pipeline])
    with web.ledger(options="-c statement_timeout=30000") as conn:
        n = dlq.matching(conn, sel.filters)
    keep = sel.filters.query()
    return web.html(
        request,
        "confirm.html",
        action=action,
        n=n,
        f=sel.filters,
        described=sel.filters.without("status").described(),
        keep=keep,
        fields={k: keep[k] for k in MATCHING if keep.get(k)},
        query=urlencode(keep),
    )


@router.get("/dlq/record/{record_id}")
def record_page(request: Request, record_id: str, caller: CallerDep, web: WebDep) -> Response:
    rec = readable(web, caller, record_id)
    fmt = request.query_params.get("format", "auto")
    return web.html(
        request,
        "record.html",
        r=views.record(web, request, rec, fmt),
        fmt=fmt,
        formats=views.formats(rec),
        show_bytes=views.SHOW_BYTES,
        can_act=may(caller, "PUT", rec["pipeline"]),
        headers_text=views.headers_text(rec),
    )


@router.get("/dlq/runs/{pipeline}/{dag_run_id}")
def run_page(
    request: Request, pipeline: str, dag_run_id: str, caller: CallerDep, web: WebDep
) -> Response:
    out = redrive_run(web, request, caller, pipeline, dag_run_id)
    return web.html(
        request,
        "run.html",
        r=out,
        can_act=out["redrive_ready"] and may(caller, "PUT", pipeline),
        refresh=None if out["final"] or out["airflow_error"] else REFRESH_SECONDS,
        back=f"{links(request)['prefix']}/dlq/?{urlencode({'pipeline': pipeline})}",
    )


@router.get("/dlq/docs/{pipeline}/{path:path}")
def data_docs(pipeline: str, path: str, caller: CallerDep, web: WebDep) -> Response:
    """A page of a pipeline's Great Expectations Data Docs site, to those who may read the
    pipeline's DAG; nothing else of the GX project (config, stored results)."""
    missing = NotFound(f"no Data Docs page {path!r} of pipeline {pipeline!r}")
    if not re.fullmatch(IDENT, pipeline):
        raise missing
    try:
        web_auth.require(caller, "GET", [pipeline])
    except Forbidden:
        raise missing from None  # whether it exists is not for this caller to learn
    site = views.docs_site(web, pipeline)
    if not path or path.startswith("/") or ".." in Path(path).parts or "\x00" in path:
        raise missing
    target = (site / path).resolve()
    if not target.is_relative_to(site) or not target.is_file():
        raise missing
    ctype = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
    return Response(
        target.read_bytes(), media_type=ctype, headers={"Content-Security-Policy": DOCS_CSP}
    )


@router.get("/dlq/static/{name}")
def static(name: str, caller: CallerDep) -> Response:
    return static_file(TEMPLATES, STATIC, name)
