"""What the Airflow tasks of Tidemark's DAGs do (tidemark/airflow/dags.py wires them).

Plain functions over the ledger: the DAG files stay thin and every step is also reachable
from the CLI. Errors a person must act on are raised as one line.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from tidemark import config
from tidemark.airflow.health import LagEpisodes, Problem, check_health, lag_episodes
from tidemark.core.db import connect
from tidemark.core.errors import BadInput, TidemarkError
from tidemark.core.settings import get_settings
from tidemark.ledger import checkpoints, dlq, runs
from tidemark.ledger.state import RunState, halted


def _ledger() -> str:
    return get_settings().airflow_ledger("Airflow's workers")


def ledger_dsn() -> str:
    """The ledger's DSN as Airflow's tasks see it (connection ``tidemark_ledger``, else
    TIDEMARK_LEDGER_DSN): what ReplayOperator hands its spark-submit child."""
    return _ledger()


RECOVERY_ERRORS = "recovery_errors"  # the maintenance recover task's XCom: pipeline -> errors


def recover(pipelines_dir: str, pipeline: str | None = None, ti=None) -> str:
    """Recovery sweep over every pipeline of the folder (docs/design.md: before every run).

    One pipeline's broken database never stops the others' recovery. A pipeline's own DAG
    fails only on what stops its run: a connection Airflow lacks or a lost transaction (a
    sink it cannot reach fails that sink in the run, while its other sinks commit). The
    maintenance DAG's (``pipeline`` None) fails on any error, and hands each pipeline's to the
    check task (XCom ``recovery_errors``), which alerts through that pipeline's channels.
    Broken pipeline files are printed, not raised: they show as DAG import errors and in the
    check.
    """
    from tidemark.protocol.recovery import recover as sweep

    if pipeline is not None:  # its DAG: a connection it names and Airflow lacks stops it here
        connections_exist(config.find(Path(pipelines_dir), pipeline, deep=False))
    s = get_settings()
    pipelines, broken = config.load_all(Path(pipelines_dir), deep=False)
    rep = sweep(_ledger(), pipelines, s.gid_prefix, s.prepared_alert_seconds)
    print(rep.summary())
    for b in broken:
        print(f"  skipped: {b}")
    for e in rep.errors:
        print(f"  error: {e}")
    if pipeline is None and ti is not None:
        ti.xcom_push(key=RECOVERY_ERRORS, value=rep.errors_of)
    errors = (
        rep.errors
        if pipeline is None
        else [e for e in rep.errors_of.get(pipeline, []) if e.startswith(f"pipeline {pipeline}:")]
    )
    if rep.lost or errors:
        raise TidemarkError(f"{rep.summary()}: {(errors or rep.lost)[0]}")
    return rep.summary()


def connections_exist(p: config.Pipeline) -> dict[str, str]:
    """The job's ``AIRFLOW_CONN_<ID>`` variables for ``p`` (tidemark/airflow/connections.py).
    A connection Airflow lacks fails the task at once: no retry can create it."""
    from tidemark.airflow.connections import job_env

    try:
        return job_env(p)
    except BadInput as exc:
        from airflow.sdk.exceptions import AirflowFailException

        raise AirflowFailException(f"{exc} (not retried)") from None


def pending(pipelines_dir: str, pipeline: str, dag_run=None) -> str | None:
    """The scheduled DAG's first task: the recovery sweep, then whether any sink of
    ``pipeline`` has something to replay (the claim's plan, read-only). None when nothing is
    new: the ShortCircuitOperator then skips replay, report and announce, so an idle run
    starts no JVM and imports no Great Expectations.

    A run of Airflow's own Backfill re-delivers its data interval when the pipeline says
    ``airflow.backfill_by_interval`` (replay then runs a backfill by time, ReplayOperator);
    otherwise it is refused: a run reads from the checkpoints, not from its date, so it would
    re-deliver nothing and look as if it had."""
    from tidemark.driver.modes import Delivery

    p = config.find(Path(pipelines_dir), pipeline, deep=False)
    if getattr(dag_run, "run_type", None) == "backfill":
        if not p.airflow.backfill_by_interval:
            from airflow.sdk.exceptions import AirflowFailException

            raise AirflowFailException(
                f"{config.dag_id(pipeline)} reads from its checkpoints, not by date: an Airflow "
                f"backfill of it would re-deliver nothing. Set airflow.backfill_by_interval: "
                f"true in the pipeline to re-deliver each run's data interval, or re-deliver "
                f"with the DAG {config.dag_id(pipeline, 'backfill')} or `tidemark backfill "
                f"{pipeline}` (not retried)"
            )
        return f"{recover(pipelines_dir, pipeline)}; re-delivering the run's data interval"

    swept = recover(pipelines_dir, pipeline)
    with connect(_ledger(), autocommit=True, what="ledger") as c:
        if Delivery().pending(c, p, [s.name for s in p.sinks]):
            return f"{swept}; {p.name} has records to replay"
    print(f"{p.name}: up to date: nothing to replay (replay skipped)")
    return None


def check_backfill(pipeline_file: str, params: dict) -> dict:
    """The backfill form's checks that JSON schema cannot express (``params``: the form), and
    the `tidemark backfill` arguments it means (``args``, which replay passes on): a time
    window (since and until), or offsets of one partition or of all (partition empty)."""
    p = config.load(Path(pipeline_file), deep=False)
    where = f"backfill of {p.name}"
    sinks = list(params.get("sinks") or [])
    known = [s.name for s in p.sinks]
    unknown = [s for s in sinks if s not in known]
    if unknown or not sinks:
        raise BadInput(
            f"{where}: sinks must be some of {', '.join(known)}; got {', '.join(unknown) or 'none'}"
        )
    partition = params.get("partition")
    since, until = params.get("since") or None, params.get("until") or None
    start, end = params.get("from_offset"), params.get("to_offset")
    args = ["--sink", ",".join(sinks)]
    if partition is not None:
        args += ["--partition", str(int(partition))]
    elif since is None:
        args += ["--partition", "all"]
    if since is not None or until is not None:
        args += _window(where, since, until)
    else:
        args += _offsets(where, p.name, partition, start, end, sinks)
    if params.get("accept_pruned"):
        args.append("--accept-pruned")
    return {"pipeline": p.name, "sinks": sinks, "args": args}


def check_rebuild(pipeline_file: str, params: dict) -> dict:
    """The rebuild form, checked (the staged file too: a broken one fails here, not in
    Spark), as the arguments replay adds after the pipeline's name."""
    path = Path(pipeline_file)
    p = config.load(path, deep=False)
    sink = params.get("sink")
    names = [s.name for s in p.sinks]
    if sink not in names:
        raise BadInput(f"rebuild of {p.name}: sink must be one of {', '.join(names)}; got {sink!r}")
    args = [str(sink)]
    if params.get("staged"):
        from tidemark.protocol.staging import changed_sinks

        staged = config.load_staged(path.parent, p.name)
        changed = changed_sinks(p, staged)
        print(
            f"rebuild of {p.name} sink {sink} with the staged version "
            f"{config.staged_file(path.parent, p.name)} (it changes {', '.join(changed) or 'no sink'})"
        )
        args.append("--staged")
    if params.get("accept_pruned"):
        args.append("--accept-pruned")
    return {"pipeline": p.name, "sinks": [sink], "args": args}


def _window(where: str, since: str | None, until: str | None) -> list[str]:
    from datetime import UTC, datetime

    if since is None or until is None:
        raise BadInput(f"{where}: give both since and until for a time window")
    try:
        t0, t1 = (datetime.fromisoformat(t) for t in (since, until))
    except ValueError as exc:
        raise BadInput(f"{where}: since/until: {exc}") from None
    t0, t1 = (t if t.tzinfo else t.replace(tzinfo=UTC) for t in (t0, t1))
    if t1 <= t0:
        raise BadInput(f"{where}: until ({until}) must be after since ({since})")
    return [
        "--since",
        t0.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "--until",
        t1.strftime("%Y-%m-%dT%H:%M:%S%z"),
    ]


def _offsets(
    where: str,
    name: str,
    partition: int | None,
    start: int | None,
    end: int | None,
    sinks: list[str],
) -> list[str]:
    if partition is None:  # every partition: from/to, each cut at what is committed
        if start is None and end is None:
            raise BadInput(
                f"{where}: say what to re-deliver: a time window (since and until), one "
                f"partition's offsets (partition, from_offset, to_offset), or every "
                f"partition's (from_offset 0 for everything committed)"
            )
        return [
            *(["--from", str(start)] if start is not None else []),
            *(["--to", str(end)] if end is not None else []),
        ]
    if start is None or end is None:
        raise BadInput(f"{where}: from_offset and to_offset are needed for one partition")
    if end <= start:
        raise BadInput(f"{where}: to_offset ({end}) must be greater than from_offset ({start})")
    with connect(_ledger(), autocommit=True, what="ledger") as c:
        at = checkpoints.positions(c, name, sinks)
    behind = [
        (s, at[s][partition])
        for s in sinks
        if partition in at.get(s, {}) and at[s][partition] < end
    ]
    if behind:
        lines = ", ".join(f"{s} at {o}" for s, o in behind)
        raise BadInput(
            f"{where}: partition {partition} is committed only up to {lines}; "
            f"backfill re-delivers committed offsets (to_offset <= checkpoint)"
        )
    return ["--from", str(start), "--to", str(end)]


def select_redrive(pipeline_file: str, params: dict, by: str) -> int:
    """The redrive form's selection as a redrive request in the ledger; returns its id (the
    XCom the Spark job gets: never the ids). ``params.request``: one the Dead letters page
    made; else its ids, or every quarantined record of an error class and/or sink, or
    (all_quarantined) all of the pipeline's."""
    from tidemark.ledger import redrives

    p = config.load(Path(pipeline_file), deep=False)
    where = f"redrive of {p.name}"
    request = params.get("request")
    ids = [int(i) for i in params.get("ids") or []]
    error_class, sink = params.get("error_class") or None, params.get("sink") or None
    with connect(_ledger(), autocommit=True, what="ledger") as c:
        if request:
            req = redrives.get(c, int(request))
            if req is None or req.pipeline != p.name:
                raise BadInput(f"{where}: no redrive request {request} for this pipeline")
            redrives.queue(c, req.request_id)  # kept from prune until the replay claims
        elif ids:
            req = redrives.create(c, p.name, by, ids=ids)
        elif error_class or sink or params.get("all_quarantined"):
            req = redrives.create(
                c, p.name, by, filters=dlq.Filters.parse(error_class=error_class, sink=sink)
            )
        else:
            raise BadInput(f"{where}: give ids, an error class or a sink, or set all_quarantined")
    if req is None:
        from airflow.exceptions import AirflowSkipException

        raise AirflowSkipException(f"{where}: nothing quarantined matches")
    print(
        f"{where}: request {req.request_id} by {req.requested_by}, {req.letters:,} dead letter(s)"
    )
    return req.request_id


def _ledger_run(
    pipeline: str, dag_id: str, run_id: str
) -> tuple[runs.StartedRun | None, list[runs.SinkRun]]:
    """The latest ledger run a task of this DAG run started, and its sinks."""
    with connect(_ledger(), autocommit=True, what="ledger") as c:
        return runs.of_dag_run(c, pipeline, dag_id, run_id)


def _halted(pipeline: str) -> bool:
    with connect(_ledger(), autocommit=True, what="ledger") as c:
        return halted(c, pipeline) is not None


def failure(pipeline: str, dag_id: str, run_id: str, try_number: int | None = None) -> str | None:
    """Why this DAG run's replay failed, in one line, from the ledger (None if it has no run).
    Also sends the metrics of the run this try (``try_number``) started: the report task does
    not run after a failed replay."""
    from tidemark.airflow import metrics

    run, sinks = _ledger_run(pipeline, dag_id, run_id)
    if run is not None and try_number is not None and run.try_number == try_number:
        metrics.safely(metrics.emit_run, pipeline, run, sinks)
    bad = [s for s in sinks if s.state not in runs.DECIDED]
    if run is None or not bad:
        return None
    why = f"run {run.run_id}: " + "; ".join(f"sink {s.sink} {s.state}: {s.error}" for s in bad)
    # A run that halted its pipeline (the quarantine ceiling) says so, as the CLI does.
    if _halted(pipeline):
        why += f"; pipeline {pipeline} halted: `tidemark resume {pipeline}` once fixed"
    return why


def announce(
    pipeline: str, dag_id: str, run_id: str, pipeline_file: str, outlet_events=None
) -> list[str]:
    """One asset event per sink the run this DAG run started committed, through the task's
    asset alias (``outlet_events``: Airflow's), its extra the run id, mode, ranges and counts
    (tidemark/airflow/assets.py): a downstream DAG scheduled on a sink table runs after each
    commit, whatever happened to the run's other sinks, and never for a sink that did not
    commit. Returns the URIs announced."""
    run, sinks = _ledger_run(pipeline, dag_id, run_id)
    if run is None or outlet_events is None:
        return []
    return _emit_assets(config.load(Path(pipeline_file), deep=False), run, sinks, outlet_events)


def report(pipeline: str, dag_id: str, run_id: str, pipeline_file: str | None = None) -> dict:
    """The ledger's record of the run this DAG run started: its state and counts per sink."""
    run, sinks = _ledger_run(pipeline, dag_id, run_id)
    if run is None:
        return {
            "pipeline": pipeline,
            "run_id": None,
            "summary": "nothing to replay (no new records, or every sink busy)",
        }
    from tidemark.airflow import metrics
    from tidemark.ledger.run_state import RunState

    # A dry run's sinks that would commit end previewed (only a dry run has them).
    dry = any(s.state is RunState.PREVIEWED for s in sinks)
    parts = [
        f"{s.sink} {'would commit' if s.state is RunState.PREVIEWED else s.state} "
        f"{s.counts.rows:,} rows {s.counts.dead:,} dead"
        + "".join(f", {c}" for c in s.schema_changes)
        for s in sinks
    ]
    if not dry:  # a preview delivered nothing: no metrics of a run
        metrics.safely(metrics.emit_run, pipeline, run, sinks)
    out = {
        "pipeline": pipeline,
        "run_id": run.run_id,
        "mode": run.mode,
        "sinks": {
            s.sink: {
                "state": s.state.value,
                "counts": s.counts.to_json(),
                "error": s.error,
                "schema_changes": s.schema_changes,
            }
            for s in sinks
        },
        "dry_run": dry,
        "summary": ("dry run, nothing committed: " if dry else "")
        + f"run {run.run_id} ({run.mode}): "
        + "; ".join(parts),
    }
    print(out["summary"])
    return out


def _emit_assets(
    p: config.Pipeline, run: runs.StartedRun, sinks: list[runs.SinkRun], outlet_events
) -> list[str]:
    from airflow.sdk import Asset, AssetAlias

    from tidemark.airflow import assets

    alias = outlet_events[AssetAlias(assets.alias_name(p.name))]
    declared = {s.name: s for s in p.sinks}
    out = []
    for s in sinks:
        if s.state is not RunState.COMMITTED or s.sink not in declared:
            continue  # only committed data is announced (a sink since removed: nothing to name)
        uri = assets.sink_uri(p, declared[s.sink])
        alias.add(
            Asset(uri),
            extra={
                "pipeline": p.name,
                "sink": s.sink,
                "table": declared[s.sink].table,
                "run_id": run.run_id,
                "mode": run.mode,
                "ranges": s.ranges,
                "counts": s.counts.to_json(),
            },
        )
        print(f"asset event: {uri} (run {run.run_id}, sink {s.sink})")
        out.append(uri)
    return out


# -- maintenance ---------------------------------------------------------------------------
def prune(pipelines_dir: str | None = None) -> dict:
    """The maintenance DAG's retention: what `tidemark prune` deletes, with the settings of
    the worker's environment (TIDEMARK_RETENTION_*, TIDEMARK_DATA_DOCS_DIR) and each
    pipeline file's own ``retention:``, read now (a change needs no restart)."""
    from tidemark.protocol.prune import Policy
    from tidemark.protocol.prune import prune as delete_expired

    s = get_settings()
    files = config.load_all(Path(pipelines_dir), deep=False)[0] if pipelines_dir else {}
    summary = delete_expired(
        _ledger(), Policy.of(s), s.data_docs_dir, progress=print, pipelines=files
    )
    failed = prune_sources(files)
    for line in summary.lines():
        print(line)
    if failed:
        raise TidemarkError("source prune failed: " + "; ".join(failed))
    return summary.to_dict()


def prune_sources(files: dict[str, config.Pipeline]) -> list[str]:
    """The source prune of every pipeline whose ``retention.source_prune`` is on (its
    ``source_keep_days`` days kept); one pipeline's failure never stops the others'."""
    from tidemark.sources.prune import prune_source

    failed = []
    for name, p in sorted(files.items()):
        days = p.retention.source_keep_days
        if not p.retention.source_prune or days is None:
            continue
        try:
            for line in prune_source(_ledger(), p, files, days).lines():
                print(line)
        except TidemarkError as exc:
            print(f"{name}: source prune failed: {exc}")
            failed.append(f"{name}: {exc}")
    return failed


def maintenance(pipelines_dir: str, episodes: LagEpisodes | None = None, ti=None) -> str:
    """The maintenance DAG's check: alert through each pipeline's channels, fail if unhealthy.
    It runs whatever the recover task did, and reports that task's errors per pipeline. A lag
    breach alerts once per episode (``episodes``: where they are kept)."""
    from tidemark.airflow import alerts, metrics

    pipelines, broken = config.load_all(Path(pipelines_dir), deep=False)
    health = check_health(pipelines, _ledger())
    swept = ti.xcom_pull(task_ids="recover", key=RECOVERY_ERRORS) if ti is not None else None
    for name, errors in sorted((swept or {}).items()):
        health.problems += [Problem(name, f"recovery: {e}") for e in errors]
    metrics.safely(
        metrics.emit_health,
        health.lags,
        health.prepared_oldest_seconds,
        health.dead_letters,
        list(pipelines),
    )
    for b in broken:
        health.problems.append(Problem("-", str(b)))
    store = episodes or LagEpisodes()
    previous = store.load()
    new, state = lag_episodes(previous, health, datetime.now(UTC).isoformat(timespec="seconds"))
    for name, probs in health.by_pipeline().items():
        print(
            f"{name}: "
            + "; ".join(
                pr.what
                + (
                    f" (alerted, since {state[pr.episode]})"
                    if pr.episode and pr.episode not in new
                    else ""
                )
                for pr in probs
            )
        )
        lines = [pr.what for pr in probs if pr.episode is None or pr.episode in new]
        if lines and name in pipelines:
            sent = alerts.send(
                pipelines[name],
                f"[tidemark] {name}: needs attention",
                "\n".join(f"- {line}" for line in lines),
            )
            if not sent and alerts.failure_notifiers(pipelines[name]):
                for pr in probs:  # undelivered: a new episode alerts again next time
                    if pr.episode in new:
                        state.pop(pr.episode, None)
    if state != previous:
        store.save(state)
    if not health.problems:
        return f"healthy: {len(pipelines)} pipeline(s)"
    first = health.problems[0]
    raise TidemarkError(f"{len(health.problems)} problem(s), first: {first.pipeline}: {first.what}")
