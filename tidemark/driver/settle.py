"""`tidemark settle RUN`: bring a run with a lost participant (a chosen transaction someone
else rolled back; docs/design.md, "Commit protocol" step 4) to a state from which every
record is placed once, and resume its pipeline (docs/operations.md, "Halts").

1. Recovery first: a sink of the run still ``committing`` is finished there (its lost gid
   makes it aborted or lost). One recovery cannot finish (a database unreachable) stops
   the settle, pipeline still halted.
2. Each sink of the run in ``lost`` (some of its decision committed, some not): a backfill
   of exactly its ranges, under its lease, while the pipeline stays halted; then the sink
   reads committed. A backfill that does not commit stops the settle: run it again.
3. A sink ``aborted`` by its lost gid needs nothing: nothing of it was committed and its
   checkpoints stayed, so the next run delivers its ranges.
4. The pipeline resumes once none of its sinks is ``lost``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg
from pyspark.sql import SparkSession

from tidemark.config import Pipeline
from tidemark.core.db import connect
from tidemark.core.errors import BadInput, TidemarkError
from tidemark.core.settings import Settings
from tidemark.driver.modes import Backfill
from tidemark.driver.run import Run, stderr_log
from tidemark.ledger import runs, state
from tidemark.ledger.state import RunState
from tidemark.protocol import recovery

BY = "tidemark settle"  # who the re-delivery's letters name as resolving them


@dataclass
class Settlement:
    run_id: int
    pipeline: str
    said: list[str] = field(default_factory=list)
    backfills: dict[str, int] = field(default_factory=dict)  # sink -> the backfill's run
    resumed: bool = False


def settle(
    pipelines: dict[str, Pipeline],
    settings: Settings,
    ledger_dsn: str,
    run_id: int,
    *,
    spark: SparkSession | None = None,
    log: Callable[[str], None] = stderr_log,
    say: Callable[[str], None] | None = None,
) -> Settlement:
    """``log``: the runs' progress; ``say``: what the settle did, line by line (``log``)."""
    with connect(ledger_dsn, autocommit=True, what="ledger") as conn:
        run = runs.get(conn, run_id)
    if run is None:
        raise BadInput(f"run {run_id}: no such run in the ledger (`tidemark status PIPELINE`)")
    name = run.pipeline
    pipeline = pipelines.get(name)
    if pipeline is None:
        raise BadInput(
            f"run {run_id} is of pipeline {name}, whose file is not in the pipelines folder "
            f"(or is broken): `tidemark pipelines validate`"
        )
    out = Settlement(run_id, name)

    tell = say or log

    def said(msg: str) -> None:
        out.said.append(msg)
        tell(msg)

    rep = recovery.recover(
        ledger_dsn, pipelines, settings.gid_prefix, settings.prepared_alert_seconds
    )
    with connect(ledger_dsn, autocommit=True, what="ledger") as conn:
        sinks = runs.sinks_of(conn, run_id)
        lost_of = {s.sink: _lost(conn, run_id, s.sink) for s in sinks}
    stuck = [s.sink for s in sinks if s.state is RunState.COMMITTING]
    if stuck:
        why = "; ".join(rep.errors_of.get(name, [])) or "see `tidemark recover`"
        raise TidemarkError(
            f"run {run_id} sink {stuck[0]} is still committing: recovery could not finish it "
            f"({why}); fix that, then `tidemark settle {run_id}` again"
        )
    for s in sinks:
        sink, st = s.sink, s.state
        if not lost_of[sink]:
            continue
        gids = ", ".join(lost_of[sink])
        if st == RunState.ABORTED:
            said(
                f"run {run_id} sink {sink}: rolled back whole ({gids} lost before any of its "
                f"transactions committed); its checkpoints stayed, the next run delivers it"
            )
        elif st == RunState.LOST:
            out.backfills[sink] = _redeliver(
                pipeline, pipelines, settings, ledger_dsn, run_id, sink, spark, log
            )
            said(
                f"run {run_id} sink {sink}: its ranges re-delivered by backfill run "
                f"{out.backfills[sink]} ({gids} lost after others had committed)"
            )
    if not any(lost_of.values()):
        said(f"run {run_id}: no chosen transaction of it was lost; nothing to settle")
    with connect(ledger_dsn, autocommit=True, what="ledger") as conn:
        left = state.lost_sinks(conn, name)
        if left:
            other, sink = left[0].run_id, left[0].sink
            said(f"{name}: still halted: run {other} sink {sink}: `tidemark settle {other}`")
        elif any(lost_of.values()):
            out.resumed = state.resume(conn, name)
            said(f"{name}: resumed" if out.resumed else f"{name}: was not halted")
    return out


def _lost(conn: psycopg.Connection, run_id: int, sink: str) -> list[str]:
    return sorted(g for g, o in runs.outcomes(conn, run_id, sink).items() if o == runs.Outcome.LOST)


def _redeliver(
    pipeline: Pipeline,
    pipelines: dict[str, Pipeline],
    settings: Settings,
    ledger_dsn: str,
    run_id: int,
    sink: str,
    spark: SparkSession | None,
    log: Callable[[str], None],
) -> int:
    """A backfill of exactly the ranges of (run, sink), then the sink reads committed."""
    with connect(ledger_dsn, autocommit=True, what="ledger") as conn:
        ranges = runs.ranges(conn, run_id, sink)
    if sink not in {s.name for s in pipeline.sinks}:
        raise TidemarkError(
            f"run {run_id} sink {sink}: the pipeline {pipeline.name} no longer has this sink; "
            f"its ranges cannot be re-delivered: put it back in the pipeline file, then "
            f"`tidemark settle {run_id}` again"
        )
    report = Run(
        pipeline,
        settings,
        ledger_dsn=ledger_dsn,
        all_pipelines=pipelines,
        mode=Backfill(ranges),
        sink_names=[sink],
        external_id=f"settle run {run_id}",
        spark=spark,
        log=log,
        by=BY,
        halted_ok=True,
    ).execute()
    if not report.ok or report.run_id is None:
        raise TidemarkError(
            f"run {run_id} sink {sink}: the backfill of its ranges did not commit "
            f"({report.summary()}); the pipeline stays halted: fix that, then `tidemark "
            f"settle {run_id}` again"
        )
    with connect(ledger_dsn, autocommit=True, what="ledger") as conn:
        try:
            state.settled(
                conn,
                run_id,
                sink,
                f"lost a participant; re-delivered by backfill run {report.run_id}",
            )
        except state.IllegalTransition:
            # Another settle of the same run got there first (its backfill and this one both
            # re-delivered the ranges: the rule makes the second harmless).
            if state.state_of(conn, run_id, sink) != RunState.COMMITTED:
                raise
    return report.run_id
