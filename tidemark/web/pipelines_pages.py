"""The Pipelines pages (docs/dlq.md, "Pipelines"): every pipeline at a glance, as small
multiples (lag, records per second, dead letters created), and one pipeline in detail, per
sink: checkpoint lag per partition over time, records per second and duration per run, dead
letters created per error class, and its state now (halted, in doubt, last run, where each
sink began); and, to those who may edit its DAG, a Rebuild action per sink, previewed first
(rebuild.py).

A router of the app Airflow mounts at /tidemark (app.py includes it): the app's guard, error
pages and security headers apply. Who may see a pipeline is decided as for its dead letters
(auth.py: read access to its DAG, teams included); one the caller may not read is not found.
The charts are drawn in the browser by uPlot, shipped in static/ (no CDN: Airflow often runs
where nothing outside is reachable); their data travel in the page, escaped, as
``data-chart`` attributes, so the page's CSP (own scripts only) holds.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import fields, is_dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

import psycopg
from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, StrictUndefined

from tidemark.config import IDENT, dag_id
from tidemark.core.db import connect
from tidemark.core.dsn import mask
from tidemark.core.errors import BadInput, NotFound, TidemarkError
from tidemark.core.settings import get_settings
from tidemark.core.text import shown
from tidemark.ledger import history
from tidemark.ledger.run_state import RunState
from tidemark.web import auth as web_auth
from tidemark.web import rebuild
from tidemark.web.auth import Caller, Forbidden, guard
from tidemark.web.context import WebDep, static_file
from tidemark.web.runs import REFRESH_SECONDS

HERE = Path(__file__).resolve().parent
TEMPLATES = HERE / "templates" / "pipelines"
STATIC_DIR = HERE / "static"
STATIC = {
    "uPlot.iife.min.js": "text/javascript",
    "uPlot.min.css": "text/css",
    "uPlot.LICENSE": "text/plain",
    "pipelines.js": "text/javascript",
    "pipelines.css": "text/css",
    "pipelines.svg": "image/svg+xml",
}
WINDOWS = (1, 7, 30, 90)  # days a page can show
DEFAULT_DAYS = 7
NO_LAG = "no lag measured in this window: the maintenance DAG measures it every 5 minutes"
UNAVAILABLE = "the ledger database is unavailable; try again later"
log = logging.getLogger(__name__)

jinja = Environment(
    loader=FileSystemLoader(TEMPLATES),
    autoescape=True,
    undefined=StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
jinja.filters["when"] = lambda v: f"{v.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC" if v else "-"
jinja.filters["num"] = lambda v: "-" if v is None else f"{v:,}"

router = APIRouter()


class LedgerUnavailable(TidemarkError):
    """503, without the ledger's host or user (the log has them)."""


async def _caller(request: Request, caller: Annotated[Caller, Depends(guard)]) -> Caller:
    request.state.tm_caller = caller
    return caller


CallerDep = Annotated[Caller, Depends(_caller)]


def _ledger() -> psycopg.Connection:
    try:
        return connect(
            get_settings().airflow_ledger("Airflow's API server"),
            autocommit=True,
            what="ledger",
            options="-c statement_timeout=30000",
        )
    except TidemarkError as exc:
        log.warning("tidemark pipelines: %s", mask(str(exc)))
        raise LedgerUnavailable(UNAVAILABLE) from None


def _days(request: Request) -> int:
    raw = request.query_params.get("days", "").strip()
    if not raw:
        return DEFAULT_DAYS
    if not raw.isdigit() or int(raw) not in WINDOWS:
        raise BadInput(f"days {shown(raw, 20)}: expected one of {', '.join(map(str, WINDOWS))}")
    return int(raw)


def _html(request: Request, template: str, **ctx: Any) -> HTMLResponse:
    caller: Caller | None = getattr(request.state, "tm_caller", None)
    body = jinja.get_template(template).render(
        prefix=request.scope.get("root_path", ""),
        airflow=request.base_url.path.rstrip("/"),
        user=caller.name if caller else "",
        csrf=web_auth.csrf_token(caller) if caller and caller.via_cookie else "",
        **ctx,
    )
    return HTMLResponse(body)


def _visible(caller: Caller, names: list[str]) -> list[str]:
    return names if web_auth.may_read_all(caller) else web_auth.readable(caller, names)


def _epoch(t: datetime) -> int:
    return int(t.timestamp())


# -- chart data: what pipelines.js draws --------------------------------------------------------
def _chart(
    title: str,
    unit: str,
    rows: list[tuple[datetime, str, float | None]],
    *,
    kind: str = "line",
    order: list[str] | None = None,
    empty: str | None = None,
    add: bool = False,
) -> str:
    """One chart's JSON: (time, series label, value) rows aligned on the times of them all
    (a series without a value at a time has null there: a gap, not a zero); ``add``: the
    values are counts."""
    xs = sorted({_epoch(t) for t, _, _ in rows})
    at = {x: i for i, x in enumerate(xs)}
    labels = order or sorted({s for _, s, _ in rows})
    values: dict[str, list[float | None]] = {s: [None] * len(xs) for s in labels}
    for t, s, v in rows:
        if s not in values:
            continue
        # Two rows in one second (the axis' unit): counts add up, anything else keeps the
        # larger (the most behind, the slower run).
        i = at[_epoch(t)]
        old = values[s][i]
        if old is not None and v is not None:
            v = old + v if add else max(old, v)
        values[s][i] = v
    return json.dumps(
        {
            "title": title,
            "unit": unit,
            "empty": empty or f"no {title.split(':')[0]} in this window",
            "kind": kind,
            "x": xs,
            "series": [{"label": s, "values": values[s]} for s in labels],
        },
        separators=(",", ":"),
    )


def _badges(st: history.State | None) -> list[tuple[str, str]]:
    """(css class, text) of what a person must know first."""
    if st is None:
        return [("muted", "never run")]
    out = []
    if st.halted_reason:
        out.append(("bad", "halted"))
    if st.in_doubt:
        out.append(("warn", f"{len(st.in_doubt)} in doubt"))
    last = st.last_run
    if last and last.finished_at is None and not st.in_doubt:
        out.append(("info", "running"))
    if last and any(s.state != RunState.COMMITTED for s in last.sinks):
        failed = [s.sink for s in last.sinks if s.state in (RunState.ABORTED, RunState.DQ_FAILED)]
        if failed:
            out.append(("bad", "last run failed: " + ", ".join(failed)))
        elif any(s.state == RunState.PREVIEWED for s in last.sinks):
            out.append(("info", "last run a preview"))
    return out or [("ok", "ok")]


# -- pages --------------------------------------------------------------------------------------
@router.get("/pipelines/")
def overview(request: Request, caller: CallerDep) -> Response:
    days = _days(request)
    w = history.Window.of(days)
    with _ledger() as conn:
        names = _visible(caller, history.known(conn))
        states = history.states(conn, names)
        lag = history.lag_totals(conn, names, w)
        rates = history.run_rates(conn, names, w)
        letters = history.letters_created(conn, names, w)
    cards = []
    for name in names:
        per_class: dict[datetime, int] = {}
        for t, _, n in letters.get(name, []):
            per_class[t] = per_class.get(t, 0) + n
        cards.append(
            {
                "name": name,
                "href": f"{quote(name)}?days={days}",
                "state": states.get(name),
                "badges": _badges(states.get(name)),
                "lag": _chart(
                    "records behind",
                    "records",
                    [(t, "lag", v) for t, v in lag.get(name, [])],
                    empty=NO_LAG,
                ),
                "rate": _chart(
                    "records / s",
                    "records/s",
                    [(t, "records/s", r) for t, r, _ in rates.get(name, [])],
                ),
                "letters": _chart(
                    "dead letters created",
                    "letters",
                    [(t, "letters", n) for t, n in sorted(per_class.items())],
                    kind="bars",
                    add=True,
                ),
            }
        )
    return _html(request, "overview.html", cards=cards, days=days, windows=WINDOWS)


def _readable_pipeline(caller: Caller, pipeline: str) -> str:
    missing = NotFound(f"no pipeline {shown(pipeline, 40)}")
    if not re.fullmatch(IDENT, pipeline):
        raise missing
    try:
        web_auth.require(caller, "GET", [pipeline])
    except Forbidden:
        raise missing from None  # whether it exists is not for this caller to learn
    return pipeline


def _detail(caller: Caller, pipeline: str, days: int) -> dict[str, Any]:
    pipeline = _readable_pipeline(caller, pipeline)
    w = history.Window.of(days)
    with _ledger() as conn:
        st = history.states(conn, [pipeline]).get(pipeline)
        if st is None:
            raise NotFound(f"no pipeline {shown(pipeline, 40)}")
        lag = history.lag_by_partition(conn, pipeline, w)
        runs = history.runs(conn, pipeline, w)
        letters = history.letters_created(conn, [pipeline], w).get(pipeline, [])
    sinks = []
    names = [s.sink for s in st.sinks]
    names += sorted({r.sink for r in runs} - set(names))
    for sink in names:
        mine = [r for r in runs if r.sink == sink]
        timed = [r for r in mine if r.seconds is not None]
        sinks.append(
            {
                "name": sink,
                "partitions": next((s.partitions for s in st.sinks if s.sink == sink), []),
                "lag": _chart(
                    f"records behind, per partition: {sink}",
                    "records",
                    [(t, f"partition {p}", v) for s, p, t, v in lag if s == sink],
                    order=[
                        f"partition {p}" for p in sorted({p for s, p, _, _ in lag if s == sink})
                    ],
                    empty=NO_LAG,
                ),
                "rate": _chart(
                    f"records per second, per run: {sink}",
                    "records/s",
                    [
                        (r.created_at, "records/s", r.records / max(r.seconds, 1e-3))
                        for r in timed
                        if r.records is not None and r.seconds is not None
                    ],
                    kind="points",
                ),
                "duration": _chart(
                    f"duration per run: {sink}",
                    "s",
                    [(r.created_at, "seconds", r.seconds) for r in timed],
                    kind="points",
                ),
                "runs": len(mine),
            }
        )
    return {
        "pipeline": pipeline,
        "state": st,
        "badges": _badges(st),
        "sinks": sinks,
        "letters": _chart(
            "dead letters created, per error class",
            "letters",
            [(t, cls, n) for t, cls, n in letters],
            kind="bars",
            add=True,
        ),
        "letters_total": sum(n for _, _, n in letters),
        "recent": list(reversed(runs[-20:])),
    }


@router.get("/pipelines/{pipeline}")
def pipeline_page(request: Request, pipeline: str, caller: CallerDep) -> Response:
    days = _days(request)
    d = _detail(caller, pipeline, days)
    can_edit = _may_edit(caller, d["pipeline"])
    return _html(
        request,
        "pipeline.html",
        **d,
        days=days,
        windows=WINDOWS,
        dag=dag_id(d["pipeline"]),
        can_edit=can_edit,
        # The Rebuild action, to those who may trigger the pipeline's DAGs only.
        rebuild=rebuild.offer(caller, d["pipeline"]) if can_edit else None,
    )


@router.post("/pipelines/{pipeline}/rebuild")
async def rebuild_post(request: Request, pipeline: str, caller: CallerDep, web: WebDep) -> Response:
    """Preview a rebuild of a sink (always, from the page's form), or rebuild what a finished
    preview showed (``preview``: its run id); then the run's page (303, so a reload does not
    trigger again)."""
    body = await rebuild.rebuild_body(request)
    out = await run_in_threadpool(rebuild.trigger, web, request, caller, pipeline, body)
    return RedirectResponse(out["page"], status_code=303)


@router.get("/pipelines/{pipeline}/rebuild/{dag_run_id}")
def rebuild_page(
    request: Request, pipeline: str, dag_run_id: str, caller: CallerDep, web: WebDep
) -> Response:
    """A rebuild DAG run as it goes: reloads until it ends; a preview that ended well offers
    the rebuild for real, to those who may trigger it."""
    r = rebuild.rebuild_run(web, request, caller, pipeline, dag_run_id)
    return _html(
        request,
        "rebuild.html",
        r=r,
        can_act=r["ready"] and _may_edit(caller, r["pipeline"]),
        refresh=None if r["final"] or r["airflow_error"] else REFRESH_SECONDS,
    )


def _may_edit(caller: Caller, pipeline: str) -> bool:
    try:
        web_auth.require(caller, "PUT", [pipeline])
    except Forbidden:
        return False
    return True


@router.get("/pipelines/api/{pipeline}")
def pipeline_api(request: Request, pipeline: str, caller: CallerDep) -> Response:
    """The detail page's data as JSON: state and every chart's series."""
    d = _detail(caller, pipeline, _days(request))
    st: history.State = d["state"]

    def plain(v: Any) -> Any:
        if isinstance(v, datetime):
            return v.astimezone(UTC).isoformat()
        if is_dataclass(v) and not isinstance(v, type):
            return {f.name: plain(getattr(v, f.name)) for f in fields(v)}
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list):
            return [plain(x) for x in v]
        return v

    return JSONResponse(
        {
            "pipeline": d["pipeline"],
            "halted": st.halted_reason,
            "halted_at": plain(st.halted_at),
            "in_doubt": plain(st.in_doubt),
            "last_run": plain(st.last_run),
            "lag_at": plain(st.lag_at),
            "sinks": [
                {
                    "name": s["name"],
                    "partitions": plain(s["partitions"]),
                    "lag": json.loads(s["lag"]),
                    "rate": json.loads(s["rate"]),
                    "duration": json.loads(s["duration"]),
                }
                for s in d["sinks"]
            ],
            "letters": json.loads(d["letters"]),
        }
    )


@router.get("/pipelines/static/{name}")
def static(name: str, caller: CallerDep) -> Response:
    return static_file(STATIC_DIR, STATIC, name)
