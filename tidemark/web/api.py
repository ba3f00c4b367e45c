"""The JSON API under /dlq/api/ (the pages' forms post to its actions too, and get a result
page back): list and read letters, download a payload, counts for alerting, export, discard,
redrive (or preview one), and follow a redrive DAG run."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tidemark.core.errors import BadInput
from tidemark.ledger import dlq
from tidemark.web import auth as web_auth
from tidemark.web import views
from tidemark.web.access import owned, readable, seen, visible
from tidemark.web.auth import Caller
from tidemark.web.context import CallerDep, Web, WebDep, wants_html
from tidemark.web.runs import redrive_run
from tidemark.web.selection import ActionBody, action_body, filters, number
from tidemark.web.trigger import redrive_ids, redrive_matching, redrive_request

router = APIRouter()


@router.get("/dlq/api/records")
def api_records(request: Request, caller: CallerDep, web: WebDep) -> Response:
    q = request.query_params
    f = filters(request, None)
    limit, before = number(q.get("limit"), "limit", 50), number(q.get("before"), "before")
    with web.ledger(options="-c statement_timeout=30000") as conn:
        pg = dlq.page(conn, visible(conn, caller, f), limit, before)
    return JSONResponse(
        {"records": [views.summary(r) for r in pg.rows], "next_before": pg.next_before}
    )


@router.get("/dlq/api/records/{record_id}")
def api_record(request: Request, record_id: str, caller: CallerDep, web: WebDep) -> Response:
    rec = readable(web, caller, record_id)
    fmt = request.query_params.get("format", "auto")
    return JSONResponse(views.record(web, request, rec, fmt))


@router.get("/dlq/api/records/{record_id}/payload")
def api_payload(record_id: str, caller: CallerDep, web: WebDep) -> Response:
    """Every byte of a letter's payload, streamed in slices (the pages show 256 KiB)."""
    with web.ledger() as conn:
        rid = seen(conn, caller, record_id)

    def chunks() -> Iterator[bytes]:
        with web.ledger() as conn:
            yield from dlq.payload_chunks(conn, rid)

    return StreamingResponse(
        chunks(),
        media_type="application/octet-stream",
        headers={"Content-Disposition": f'attachment; filename="dead-letter-{rid}.bin"'},
    )


@router.get("/dlq/api/counts")
def api_counts(caller: CallerDep, web: WebDep) -> Response:
    """Quarantined records per pipeline and error class: poll it for alerting."""
    with web.ledger(options="-c statement_timeout=30000") as conn:
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


def _download(web: Web, f: dlq.Filters) -> StreamingResponse:
    def lines() -> Iterator[str]:
        with web.ledger() as conn:
            yield from dlq.export(conn, f)

    name = f"dead-letters-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.jsonl"
    return StreamingResponse(
        lines(),
        media_type="application/x-ndjson",
        headers={"Content-Disposition": f'attachment; filename="{name}"'},
    )


@router.get("/dlq/api/export")
def api_export(request: Request, caller: CallerDep, web: WebDep) -> Response:
    f = filters(request, None)
    with web.ledger() as conn:  # ids of pipelines the caller may not read are left out
        f = visible(conn, caller, f)
    return _download(web, f)


@router.post("/dlq/api/export")
async def api_export_selected(request: Request, caller: CallerDep, web: WebDep) -> Response:
    ids = (await action_body(request)).chosen()

    def check() -> list[int]:
        with web.ledger() as conn:
            return sorted(owned(conn, caller, ids, "GET"))

    return _download(web, dlq.Filters(ids=await run_in_threadpool(check)))


@router.post("/dlq/api/discard")
async def api_discard(request: Request, caller: CallerDep, web: WebDep) -> Response:
    body = await action_body(request)
    if body.dry:  # refused, not ignored: it would discard for real
        raise BadInput("dry_run: a discard has no preview; list or export the letters to see them")
    if body.all_matching_on:
        sel = body.matching("discard")

        def everything() -> dlq.Discarded:
            web_auth.require(caller, "PUT", [sel.pipeline])
            with web.ledger() as conn:
                return dlq.discard_matching(conn, sel.filters, body.note, caller.name, sel.expected)

        res = await run_in_threadpool(everything)
        done = [
            f"Discarded {len(res.changed):,} dead letter(s) matching "
            f"{sel.filters.without('status').described()}"
        ]
        return _discarded(web, request, body, caller, res, done, skipped=[])
    ids = body.chosen()

    def work() -> dlq.Discarded:
        with web.ledger() as conn:
            owners = owned(conn, caller, ids, "PUT")
            res = (
                dlq.discard(conn, sorted(owners), body.note, caller.name)
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
    return _discarded(web, request, body, caller, res, done, skipped=res.to_dict()["skipped"])


def _discarded(
    web: Web,
    request: Request,
    body: ActionBody,
    caller: Caller,
    res: dlq.Discarded,
    done: list[str],
    skipped: list[Any],
) -> Response:
    """The answer to a discard: a result page saying what was ``done`` and ``skipped``, or
    the JSON of ``res``."""
    if wants_html(request):
        return web.html(
            request,
            "result.html",
            title="Discard",
            back=body.back_link(request),
            done=done,
            runs=[],
            skipped=skipped,
            errors=[],
        )
    return JSONResponse({**res.to_dict(), "by": caller.name})


@router.post("/dlq/api/redrive")
async def api_redrive(request: Request, caller: CallerDep, web: WebDep) -> Response:
    """Redrive the selected ``ids``, or (``all_matching``) every quarantined letter of one
    pipeline that the filters (pipeline, sink, error_class, since, until, reason) match, or
    the letters of an existing redrive ``request`` (one a preview made). With ``dry_run``: a
    preview, the same DAG run up to PREPARE and rolled back."""
    body = await action_body(request)
    dry_run = body.dry
    rid = None
    if body.request not in (None, ""):
        if body.all_matching_on or body.has_ids:
            raise BadInput("request: runs a redrive request as it is; no ids or filters with it")
        rid = body.request_id()
    if rid is not None:
        out = await run_in_threadpool(redrive_request, web, request, caller, rid, dry_run)
    elif body.all_matching_on:
        sel = body.matching("redrive")
        out = await run_in_threadpool(redrive_matching, web, request, caller, sel, dry_run)
    else:
        out = await run_in_threadpool(redrive_ids, web, request, caller, body.chosen(), dry_run)
    status = 502 if out["errors"] and not out["runs"] else 200
    if wants_html(request):
        return web.html(
            request,
            "result.html",
            status,
            title="Preview" if dry_run else "Redrive",
            back=body.back_link(request),
            done=[],
            **out,
        )
    return JSONResponse(out, status_code=status)


@router.get("/dlq/api/runs/{pipeline}/{dag_run_id}")
def api_run(
    request: Request, pipeline: str, dag_run_id: str, caller: CallerDep, web: WebDep
) -> Response:
    """A redrive DAG run's state and outcome (poll it until ``final``)."""
    return JSONResponse(redrive_run(web, request, caller, pipeline, dag_run_id))
