"""A redrive DAG run as its page follows it: Airflow's state of it (asked as the caller) and,
from the ledger, what each sink got (or, previewed, would get) and its request's letters."""

from __future__ import annotations

import re
from typing import Any

from fastapi import Request

from tidemark.config import IDENT, dag_id
from tidemark.core.errors import NotFound
from tidemark.core.text import shown
from tidemark.ledger import redrives
from tidemark.ledger import runs as ledger_runs
from tidemark.ledger.run_state import RunState
from tidemark.web.access import may
from tidemark.web.airflow_api import AirflowApi, AirflowFailed
from tidemark.web.auth import Caller
from tidemark.web.context import Web
from tidemark.web.trigger import dag_run_url

FINAL = ("success", "failed")  # Airflow's DAG run states that do not change any more
REFRESH_SECONDS = 3  # how often the page reloads itself while the run is not final


def _sink_outcome(row: ledger_runs.SinkRun, dry_run: bool) -> dict[str, Any]:
    """One sink of the ledger's run: what it got, or, previewed, what it would get."""
    counts = row.counts.to_json()
    would = dry_run and row.state is RunState.PREVIEWED
    return {
        "sink": row.sink,
        "state": "would commit" if would else row.state.value,
        "ok": would or row.state is RunState.COMMITTED,
        "error": None if would else row.error,
        **{k: counts[k] for k in ("records", "rows", "dead", "superseded", "resolved")},
    }


def redrive_run(
    web: Web, request: Request, caller: Caller, pipeline: str, run_id: str
) -> dict[str, Any]:
    """A run of the pipeline's redrive DAG, to those who may read the pipeline: Airflow's
    state and conf (asked as the caller), the ledger's run of it per sink, and its request's
    letters by status now."""
    missing = NotFound(f"no redrive run {shown(run_id, 80)} of pipeline {shown(pipeline, 40)}")
    if not re.fullmatch(IDENT, pipeline) or not may(caller, "GET", pipeline):
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
    with web.ledger() as conn:
        run, sinks = ledger_runs.of_dag_run(conn, pipeline, dag, run_id)
        rid = conf.get("request")
        req = redrives.get(conn, rid) if isinstance(rid, int) and rid > 0 else None
        req = req if req is not None and req.pipeline == pipeline else None
        now = redrives.statuses(conn, req.request_id) if req else {}
    dry_run = conf.get("dry_run") is True or any(s.state is RunState.PREVIEWED for s in sinks)
    outcome = [_sink_outcome(s, dry_run) for s in sinks]
    state = af.get("state")
    return {
        "pipeline": pipeline,
        "dag_id": dag,
        "dag_run_id": run_id,
        "url": dag_run_url(request, dag, run_id),
        "state": state,
        "final": state in FINAL,
        "paused": paused,
        "airflow_error": airflow_error,
        "dry_run": dry_run,
        "run_id": run.run_id if run else None,
        "sinks": outcome,
        "request": {"id": req.request_id, "letters": req.letters, "now": now} if req else None,
        # A preview every sink of which would commit: its request may now be redriven.
        "redrive_ready": bool(
            dry_run and state == "success" and outcome and all(s["ok"] for s in outcome) and req
        ),
    }
