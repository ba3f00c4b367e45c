"""The Pipelines page's Rebuild action: a sink's table made again from the source by the
pipeline's ``tidemark_<pipeline>_rebuild`` DAG (tidemark/airflow/dags.py ``rebuild_dag``),
triggered through Airflow's REST API as the caller, previewed first as redrive is.

The form's submit always triggers a preview (``dry_run``: true, the DAG's own default). The
rebuild for real is triggered only from a preview's page, with only the preview's run id:
its sink and options are the preview's own conf, read back from Airflow, and only once that
preview ended successfully with every sink's replay rolled back as a dry run. So what is
rebuilt is what was previewed, whatever a form sends.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import parse_qs, quote

from fastapi import Request
from pydantic import BaseModel, ConfigDict, ValidationError

from tidemark.config import IDENT, dag_id
from tidemark.core.errors import BadInput, NotFound
from tidemark.core.text import shown
from tidemark.ledger import runs as ledger_runs
from tidemark.ledger.run_state import RunState
from tidemark.web import auth as web_auth
from tidemark.web.access import may
from tidemark.web.airflow_api import AirflowApi, AirflowFailed
from tidemark.web.auth import CSRF_FIELD, Caller
from tidemark.web.context import FORM, Web, links
from tidemark.web.runs import FINAL
from tidemark.web.trigger import dag_run_url

KIND = "rebuild"
OPTIONS = ("sink", "staged", "accept_pruned")  # what a preview fixes for its rebuild


class RebuildBody(BaseModel):
    """The POST: a preview of ``sink`` with the options, or (``preview``) the rebuild a
    finished preview showed. Anything else (a ``dry_run`` above all) is refused."""

    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)

    sink: str | None = None
    staged: bool = False
    accept_pruned: bool = False
    preview: str | None = None


async def rebuild_body(request: Request) -> RebuildBody:
    """The POST's fields from a form or JSON, checked: one line naming what is wrong."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    raw = await request.body()
    data: Any
    if ctype == FORM:
        form = parse_qs(raw.decode("utf-8", "replace"), keep_blank_values=True)
        for k, v in form.items():
            if len(set(v)) > 1:
                raise BadInput(f"{k}: given {len(v)} times with different values")
        data = {k: v[-1] for k, v in form.items() if k != CSRF_FIELD}
    elif ctype == "application/json":
        try:
            data = json.loads(raw or b"{}")
        except ValueError as exc:
            raise BadInput(f"body is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise BadInput("body: expected a JSON object")
    else:
        raise BadInput(f"content type {ctype or '(none)'!r}: send a form or application/json")
    try:
        body = RebuildBody.model_validate(data)
    except ValidationError as exc:
        e = exc.errors()[0]
        where = ".".join(map(str, e["loc"])) or "body"
        if e["type"] == "extra_forbidden":
            raise BadInput(
                f"{shown(where, 40)}: not a field of a rebuild (the first submit is always a "
                f"preview; rebuild for real from the preview's page)"
            ) from None
        raise BadInput(f"{shown(where, 40)}: {e['msg']}") from None
    if body.preview and (body.sink or body.staged or body.accept_pruned):
        raise BadInput("preview: a rebuild takes its sink and options from its preview alone")
    if not body.preview and not body.sink:
        raise BadInput("sink: say which sink's table to rebuild")
    return body


def _pipeline(caller: Caller, pipeline: str, what: str) -> str:
    """The pipeline, if the caller may read it (else not found, as if it did not exist)."""
    if not re.fullmatch(IDENT, pipeline) or not may(caller, "GET", pipeline):
        raise NotFound(f"no {what} of pipeline {shown(pipeline, 40)}")
    return pipeline


def offer(caller: Caller, pipeline: str) -> dict[str, Any]:
    """What the page's Rebuild forms need, from the rebuild DAG's Params as Airflow parsed
    them (the API server does not read pipeline files): its sinks, and whether a staged
    version (``<pipeline>.next.yaml``) exists (the Staged param's default says so). With
    ``error`` instead when Airflow does not have the DAG or cannot be asked."""
    dag = dag_id(pipeline, KIND)
    try:
        with AirflowApi(caller.token) as airflow:
            params = airflow.dag_params(dag)
    except AirflowFailed as exc:
        return {"dag": dag, "sinks": [], "staged": False, "error": str(exc)}
    if params is None:
        return {
            "dag": dag,
            "sinks": [],
            "staged": False,
            "error": f"DAG {dag} not found in Airflow (is the pipeline deployed?)",
        }
    sink = params.get("sink") or {}
    staged = params.get("staged") or {}
    sinks = (sink.get("schema") or {}).get("enum") or []
    return {"dag": dag, "sinks": list(sinks), "staged": staged.get("value") is True, "error": None}


def _outcome(row: ledger_runs.SinkRun) -> dict[str, Any]:
    counts = row.counts.to_json()
    would = row.state is RunState.PREVIEWED
    return {
        "sink": row.sink,
        "state": "would commit" if would else row.state.value,
        "ok": would or row.state is RunState.COMMITTED,
        "dry": would,
        "error": None if would else row.error,
        **{k: counts[k] for k in ("records", "rows", "dead")},
    }


def rebuild_run(
    web: Web, request: Request, caller: Caller, pipeline: str, run_id: str
) -> dict[str, Any]:
    """A run of the pipeline's rebuild DAG, to those who may read the pipeline: Airflow's
    state and conf (asked as the caller) and the ledger's run of it per sink; ``ready`` when
    it is a preview that ended well, so its rebuild may be triggered."""
    pipeline = _pipeline(caller, pipeline, f"rebuild run {shown(run_id, 80)}")
    missing = NotFound(f"no rebuild run {shown(run_id, 80)} of pipeline {pipeline}")
    dag = dag_id(pipeline, KIND)
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
    outcome = [_outcome(s) for s in sinks]
    # The DAG's default is a preview: a run without dry_run in its conf was one.
    dry_run = conf.get("dry_run", True) is not False
    state = af.get("state")
    options = {k: conf.get(k, False if k != "sink" else None) for k in OPTIONS}
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
        "options": options,
        "run_id": run.run_id if run else None,
        "sinks": outcome,
        "ready": bool(
            dry_run
            and state == "success"
            and outcome
            and all(s["dry"] for s in outcome)
            and isinstance(options["sink"], str)
        ),
    }


def trigger(
    web: Web, request: Request, caller: Caller, pipeline: str, body: RebuildBody
) -> dict[str, Any]:
    """A preview of the body's sink and options; or, given a ``preview`` run that is ready,
    the rebuild it previewed (its own conf, dry_run false). Refused (403) unless the caller
    may edit the pipeline's DAG; Airflow authorizes the trigger too (the caller's JWT)."""
    pipeline = _pipeline(caller, pipeline, "rebuild")
    web_auth.require(caller, "PUT", [pipeline])
    dag = dag_id(pipeline, KIND)
    if body.preview:
        seen = rebuild_run(web, request, caller, pipeline, body.preview)
        if not seen["ready"]:
            raise BadInput(
                f"preview {shown(body.preview, 80)}: not a preview that ended successfully "
                f"(state {seen['state']}); preview again, then rebuild from its page"
            )
        conf: dict[str, Any] = {**seen["options"], "dry_run": False}
    else:
        conf = {
            "sink": body.sink,
            "staged": body.staged,
            "accept_pruned": body.accept_pruned,
            "dry_run": True,
        }
    with AirflowApi(caller.token) as airflow:
        run_id = airflow.trigger(dag, conf)  # TriggerFailed: the error page says why
    prefix = links(request)["prefix"]
    return {
        "pipeline": pipeline,
        "dag_id": dag,
        "dag_run_id": run_id,
        "conf": conf,
        "page": f"{prefix}/pipelines/{quote(pipeline)}/rebuild/{quote(run_id, safe='')}",
    }
