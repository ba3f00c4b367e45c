"""Reads of runs, their sinks and participants: for recovery, the Airflow tasks, health
checks and the Dead letters page. The writes are the transitions of state.py."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

import psycopg
from psycopg.rows import args_row, class_row, dict_row, kwargs_row

from tidemark.core.db import scalar
from tidemark.core.participants import Target
from tidemark.core.ranges import Range
from tidemark.core.sink_counts import SinkCounts
from tidemark.ledger.state import ABORTABLE, AirflowRun, RunState, owner_alive_sql

# The states a run's sink is in before it is settled (committed, aborted, dq_failed or
# previewed).
OPEN = (RunState.PLANNED, RunState.WRITING, RunState.PREPARED, RunState.COMMITTING)
DECIDED = (RunState.COMMITTING, RunState.COMMITTED)


class Outcome(StrEnum):
    """What became of a chosen participant (``tidemark.participants.outcome``): committed
    (now or earlier), lost (gone without its marker row: someone else rolled it back), or
    rolled back by the finish itself because another of its decision was lost."""

    COMMITTED = "committed"
    LOST = "lost"
    ROLLED_BACK = "rolled_back"


def newest(conn: psycopg.Connection) -> int:
    return int(scalar(conn.execute("SELECT coalesce(max(run_id), 0) FROM tidemark.runs")))


def newest_of(conn: psycopg.Connection, pipeline: str) -> int | None:
    """The pipeline's newest run (None: it has none)."""
    found = scalar(
        conn.execute("SELECT max(run_id) FROM tidemark.runs WHERE pipeline = %s", (pipeline,))
    )
    return None if found is None else int(found)


def participant_gids(conn: psycopg.Connection, run_id: int) -> set[str]:
    """Every gid the run's decisions chose, of every sink and the ledger."""
    return {
        g
        for (g,) in conn.execute(
            "SELECT gid FROM tidemark.participants WHERE run_id = %s", (run_id,)
        )
    }


@dataclass(frozen=True)
class RunSink:
    """One (run, sink) of a pipeline."""

    run_id: int
    sink: str
    pipeline: str


@dataclass(frozen=True)
class Undecided(RunSink):
    """A (run, sink) before its decision, and whether its run can still reach it."""

    alive: bool  # the owner's session lock is held
    leased: bool  # the lease is still the run's, same epoch, not expired


@dataclass(frozen=True)
class SinkState:
    """Where one sink of a run is: its state, and why it ended there when it failed."""

    sink: str
    state: RunState
    error: str | None

    @classmethod
    def of(cls, sink: str, state: str, error: str | None) -> SinkState:
        return cls(sink, RunState(state), error)


def committing(conn: psycopg.Connection) -> list[RunSink]:
    """Every decided (run, sink) whose commits may not be done."""
    return (
        conn.cursor(row_factory=class_row(RunSink))
        .execute(
            """SELECT rs.run_id, rs.sink, r.pipeline FROM tidemark.run_sinks rs
               JOIN tidemark.runs r USING (run_id)
               WHERE rs.state = %s ORDER BY rs.run_id""",
            (RunState.COMMITTING,),
        )
        .fetchall()
    )


@dataclass(frozen=True)
class Chosen:
    """A chosen participant still to finish: its gid and where it is prepared."""

    gid: str
    target: Target

    @classmethod
    def of(cls, gid: str, target: str) -> Chosen:
        return cls(gid, Target.parse(target))


def chosen(conn: psycopg.Connection, run_id: int, sink: str) -> list[Chosen]:
    """The participants of a decision that are not known to be committed yet, in the order
    they commit: the sink's first, the ledger's last (docs/design.md, step 4)."""
    return (
        conn.cursor(row_factory=args_row(Chosen.of))
        .execute(
            "SELECT gid, target FROM tidemark.participants WHERE run_id = %s AND sink = %s "
            "AND outcome IS DISTINCT FROM %s ORDER BY target = 'ledger', target, gid",
            (run_id, sink, Outcome.COMMITTED),
        )
        .fetchall()
    )


def outcomes(conn: psycopg.Connection, run_id: int, sink: str) -> dict[str, Outcome | None]:
    """gid -> outcome of every participant a decision chose (None: not known yet)."""
    return {
        gid: None if outcome is None else Outcome(outcome)
        for gid, outcome in conn.execute(
            "SELECT gid, outcome FROM tidemark.participants WHERE run_id = %s AND sink = %s",
            (run_id, sink),
        )
    }


def sinks_of(conn: psycopg.Connection, run_id: int) -> list[SinkState]:
    """A run's sinks, by name."""
    return (
        conn.cursor(row_factory=args_row(SinkState.of))
        .execute(
            "SELECT sink, state::text, error FROM tidemark.run_sinks WHERE run_id = %s ORDER BY 1",
            (run_id,),
        )
        .fetchall()
    )


def ranges(conn: psycopg.Connection, run_id: int, sink: str) -> list[Range]:
    """A run's sink's ranges, one per partition (the span of its ranges there)."""
    return (
        conn.cursor(row_factory=args_row(Range))
        .execute(
            "SELECT partition, min(from_offset), max(to_offset) FROM tidemark.run_ranges "
            "WHERE run_id = %s AND sink = %s GROUP BY 1 ORDER BY 1",
            (run_id, sink),
        )
        .fetchall()
    )


def record_outcome(
    conn: psycopg.Connection, run_id: int, sink: str, gid: str, outcome: Outcome
) -> None:
    conn.execute(
        "UPDATE tidemark.participants SET outcome = %s WHERE run_id = %s "
        "AND sink = %s AND gid = %s",
        (outcome, run_id, sink, gid),
    )


def unsettled(conn: psycopg.Connection) -> list[Undecided]:
    """Every undecided (run, sink), with whether its owner lives and still holds the lease."""
    return (
        conn.cursor(row_factory=class_row(Undecided))
        .execute(
            f"""
        SELECT rs.run_id, rs.sink, r.pipeline, {owner_alive_sql("rs.run_id")} AS alive,
               coalesce(l.run_id = rs.run_id AND l.epoch = rs.lease_epoch
                        AND l.expires_at >= now(), false) AS leased
        FROM tidemark.run_sinks rs JOIN tidemark.runs r USING (run_id)
        LEFT JOIN tidemark.leases l ON l.pipeline = r.pipeline AND l.sink = rs.sink
        WHERE rs.state = ANY(%s)""",
            ([str(s) for s in ABORTABLE],),
        )
        .fetchall()
    )


def open_sinks(conn: psycopg.Connection, up_to: int) -> dict[int, dict[str, RunState]]:
    """{run_id: {sink: state}} of runs up to ``up_to`` not settled yet."""
    out: dict[int, dict[str, RunState]] = {}
    for run_id, sink, st in conn.execute(
        "SELECT run_id, sink, state::text FROM tidemark.run_sinks WHERE run_id <= %s "
        "AND state = ANY(%s)",
        (up_to, [str(s) for s in OPEN]),
    ):
        out.setdefault(run_id, {})[sink] = RunState(st)
    return out


def decided_gids(conn: psycopg.Connection) -> set[str]:
    """Every gid a decision chose: never to be rolled back."""
    return {
        r[0]
        for r in conn.execute(
            """SELECT p.gid FROM tidemark.participants p JOIN tidemark.run_sinks rs
           USING (run_id, sink) WHERE rs.state = ANY(%s)""",
            ([str(s) for s in DECIDED],),
        )
    }


def recent_pipelines(conn: psycopg.Connection) -> dict[int, str]:
    """{run_id: pipeline} of runs unfinished or finished within a day."""
    return dict(
        conn.execute(
            "SELECT run_id, pipeline FROM tidemark.runs WHERE finished_at IS "
            "NULL OR finished_at > now() - interval '1 day'"
        ).fetchall()
    )


def long_leases(
    conn: psycopg.Connection, pipeline: str, minutes: int
) -> list[tuple[str, int, float]]:
    """(sink, run_id, minutes) of leases held by a run started more than ``minutes`` ago."""
    return conn.execute(
        """SELECT l.sink, l.run_id, extract(epoch FROM now() - r.created_at) / 60
           FROM tidemark.leases l JOIN tidemark.runs r USING (run_id)
           WHERE l.pipeline = %s AND l.run_id IS NOT NULL
           AND r.created_at < now() - make_interval(mins => %s)""",
        (pipeline, minutes),
    ).fetchall()


@dataclass(frozen=True)
class StartedRun:
    """The ledger run a task of an Airflow DAG run started, and the task's try."""

    run_id: int
    mode: str
    created_at: datetime
    finished_at: datetime | None
    try_number: int | None


@dataclass(frozen=True)
class SinkRun:
    """One sink of a run as its DAG run's tasks report it."""

    sink: str
    state: RunState
    counts: SinkCounts
    timings: dict[str, Any]  # phase -> seconds
    error: str | None
    schema_changes: list[str]  # what the run changed in the sink's table
    ranges: list[dict[str, int]]  # {partition, from_offset, to_offset}, by partition

    @classmethod
    def of(cls, **row: Any) -> SinkRun:
        return cls(
            **{
                **row,
                "state": RunState(row["state"]),
                "counts": SinkCounts.from_json(row["counts"]),
            }
        )


def of_dag_run(
    conn: psycopg.Connection, pipeline: str, dag_id: str, dag_run_id: str
) -> tuple[StartedRun | None, list[SinkRun]]:
    """The latest ledger run a task of this Airflow DAG run started, and its sinks."""
    run = (
        conn.cursor(row_factory=class_row(StartedRun))
        .execute(
            """SELECT run_id, mode, created_at, finished_at, try_number FROM tidemark.runs
           WHERE pipeline = %s AND dag_id = %s
           AND dag_run_id = %s ORDER BY run_id DESC LIMIT 1""",
            (pipeline, dag_id, dag_run_id),
        )
        .fetchone()
    )
    if run is None:
        return None, []
    sinks = (
        conn.cursor(row_factory=kwargs_row(SinkRun.of))
        .execute(
            """SELECT sink, state::text AS state, counts, timings, error, schema_changes,
                  (SELECT coalesce(json_agg(json_build_object(
                              'partition', rr.partition, 'from_offset', rr.from_offset,
                              'to_offset', rr.to_offset) ORDER BY rr.partition), '[]')
                   FROM tidemark.run_ranges rr
                   WHERE rr.run_id = rs.run_id AND rr.sink = rs.sink) AS ranges
           FROM tidemark.run_sinks rs WHERE run_id = %s ORDER BY sink""",
            (run.run_id,),
        )
        .fetchall()
    )
    return run, sinks


@dataclass(frozen=True)
class RunRecord:
    """One run of the ledger, with the Airflow task try that started it (None: not Airflow)."""

    run_id: int
    pipeline: str
    mode: str
    owner: str
    created_at: datetime
    finished_at: datetime | None
    external_id: str | None
    airflow: AirflowRun | None

    def as_dict(self) -> dict[str, Any]:
        """As the dead-letter JSON shows it (``airflow`` a dict)."""
        return {**vars(self), "airflow": self.airflow.model_dump() if self.airflow else None}


def get(conn: psycopg.Connection, run_id: int) -> RunRecord | None:
    """One run of the ledger (None: no such run)."""
    run = (
        conn.cursor(row_factory=dict_row)
        .execute(
            """SELECT run_id, pipeline, mode, owner, created_at, finished_at, external_id, dag_id,
                  dag_run_id, task_id, try_number FROM tidemark.runs WHERE run_id = %s""",
            (run_id,),
        )
        .fetchone()
    )
    if run is None:
        return None
    ids = {k: run.pop(k) for k in ("dag_id", "dag_run_id", "task_id", "try_number")}
    airflow = (
        None
        if ids["dag_id"] is None
        else AirflowRun(
            dag_id=ids["dag_id"],
            run_id=ids["dag_run_id"],
            task_id=ids["task_id"],
            try_number=ids["try_number"],
        )
    )
    return RunRecord(**run, airflow=airflow)
