"""Redrive without Spark here: each pipeline's selection becomes a redrive request in the
ledger, and the pipeline's ``tidemark_<pipeline>_redrive`` DAG is triggered with only the
request's id (and ``dry_run`` for a preview), through Airflow's REST API at Airflow's
configured address, as the caller (airflow_api.py)."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import psycopg
from fastapi import Request

from tidemark.config import dag_id
from tidemark.core.errors import NotFound
from tidemark.ledger import redrives
from tidemark.web import auth as web_auth
from tidemark.web.access import may, owned
from tidemark.web.airflow_api import AirflowApi, TriggerFailed
from tidemark.web.auth import Caller
from tidemark.web.context import Web, links
from tidemark.web.selection import ByIds, Matching, OfRequest, Selection


def dag_run_url(request: Request, dag: str, run_id: str) -> str:
    """The DAG run's page in Airflow's UI."""
    return f"{links(request)['airflow']}/dags/{quote(dag, safe='')}/runs/{quote(run_id, safe='')}"


def redrive_ids(
    web: Web, request: Request, caller: Caller, ids: list[int], dry_run: bool = False
) -> dict[str, Any]:
    """The quarantined ``ids``, one redrive request per pipeline."""
    with web.ledger() as conn:
        owners = owned(conn, caller, ids, "PUT")
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
    chosen: dict[str, Selection] = {p: ByIds(ids=g) for p, g in groups.items()}
    return {**trigger(web, request, caller, chosen, dry_run), "skipped": skipped}


def redrive_matching(
    web: Web, request: Request, caller: Caller, sel: Matching, dry_run: bool = False
) -> dict[str, Any]:
    """Every quarantined letter of the pipeline that the filters match now, as one request;
    none if more match now than the caller confirmed."""
    web_auth.require(caller, "PUT", [sel.pipeline])
    return {**trigger(web, request, caller, {sel.pipeline: sel}, dry_run), "skipped": []}


def redrive_request(
    web: Web, request: Request, caller: Caller, rid: int, dry_run: bool
) -> dict[str, Any]:
    """The letters of redrive request ``rid`` as it holds them (what a preview of it saw;
    those resolved or discarded since are skipped by the redrive). A request of a pipeline
    the caller may not read is not found, like one that does not exist."""
    with web.ledger() as conn:
        req = redrives.get(conn, rid)
    if req is None or not may(caller, "GET", req.pipeline):
        raise NotFound(f"no redrive request {rid}")
    web_auth.require(caller, "PUT", [req.pipeline])
    out = trigger(web, request, caller, {req.pipeline: OfRequest(request=req)}, dry_run)
    return {**out, "skipped": []}


def _request_for(
    conn: psycopg.Connection, caller: Caller, pipeline: str, sel: Selection
) -> tuple[redrives.Request | None, str | None]:
    """The request to run for one pipeline's selection: the one given or one made now (from
    ids or filters); or why there is none (then none is kept)."""
    if isinstance(sel, OfRequest):
        return sel.request, None
    if isinstance(sel, ByIds):
        req = redrives.create(conn, pipeline, caller.name, ids=sel.ids)
    else:
        req = redrives.create(conn, pipeline, caller.name, filters=sel.filters)
    if req is None:
        return None, "no quarantined dead letters match"
    expected = sel.expected if isinstance(sel, Matching) else None
    if expected is not None and req.letters > expected:
        redrives.delete(conn, req.request_id)
        return req, (
            f"{req.letters:,} dead letter(s) match now, not the {expected:,} confirmed; "
            f"nothing was redriven, look again"
        )
    return req, None


def trigger(
    web: Web,
    request: Request,
    caller: Caller,
    selections: dict[str, Selection],
    dry_run: bool = False,
) -> dict[str, Any]:
    """Per pipeline: a redrive request in the ledger, then tidemark_<pipeline>_redrive
    triggered with only its id in the conf (and ``dry_run``), as the caller (their JWT:
    Airflow authorizes the trigger too). A request made here whose trigger fails is deleted;
    an existing one stays."""
    runs, errors = [], []
    prefix = links(request)["prefix"]
    with AirflowApi(caller.token) as airflow, web.ledger() as conn:
        for pipeline, sel in selections.items():
            dag = dag_id(pipeline, "redrive")
            req, error = _request_for(conn, caller, pipeline, sel)
            what: dict[str, Any] = {
                "pipeline": pipeline,
                "dag_id": dag,
                "ids": sel.ids if isinstance(sel, ByIds) else [],
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
                if not isinstance(sel, OfRequest):  # made here, for this run only
                    redrives.delete(conn, req.request_id)
                errors.append({**what, "error": str(exc)})
                continue
            runs.append(
                {
                    **what,
                    "dry_run": dry_run,
                    "dag_run_id": run_id,
                    "url": dag_run_url(request, dag, run_id),
                    "outcome": f"{prefix}/dlq/runs/{quote(pipeline)}/{quote(run_id, safe='')}",
                    "paused": airflow.paused(dag),
                }
            )
    return {"runs": runs, "errors": errors}
