"""A pipeline's history for the Pipelines page (tidemark/web/pipelines_pages.py): lag samples
(written by the maintenance DAG's lag measurement, V018), and reads over time of what the
ledger keeps anyway: runs with their counts and durations, dead letters by error class,
checkpoints and where each sink began, halts and in-doubt runs.

Every series is bucketed on the server (``Window``): a chart of 90 days gets a few hundred
points, not every row.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import class_row

from tidemark.core.db import scalar
from tidemark.ledger.runs import OPEN
from tidemark.ledger.state import RunState, owner_alive_sql

# The maintenance DAG measures lag every 5 minutes; a sample every 10 minutes is kept for a
# week (the 24-hour and 7-day charts), then one an hour (the 30- and 90-day charts, whose
# buckets are 4 and 12 hours): 90 days of 20 pipelines stay about half a million rows.
SAMPLE_EVERY_SECONDS = 600
FINE_DAYS = 7
_ORIGIN = "timestamptz '2000-01-01 00:00:00+00'"


@dataclass(frozen=True)
class Sample:
    """One sink's lag in one partition: its checkpoint and the source's settled end."""

    sink: str
    partition: int
    checkpoint: int
    head: int


@dataclass(frozen=True)
class Window:
    """The last ``days`` days, in buckets of ``bucket_seconds``."""

    days: int
    bucket_seconds: int

    @classmethod
    def of(cls, days: int) -> Window:
        """A day or a week: every sample, run and letter write as it is (0: no buckets; a
        week of 10-minute samples is 1,008 points). Longer: about 180 buckets."""
        if days <= 7:
            return cls(days, 0)
        return cls(days, {30: 4 * 3600, 90: 12 * 3600}.get(days, days * 86400 // 180))


def record_lag(
    conn: psycopg.Connection,
    pipeline: str,
    samples: Iterable[Sample],
    *,
    keep_days: int,
    every_seconds: int | None = None,
) -> int:
    """Store one measurement of the pipeline's lag (one ``at`` for all its rows), unless the
    last one is younger than ``every_seconds`` (default SAMPLE_EVERY_SECONDS); thin its
    samples past FINE_DAYS to one an hour, and drop those older than ``keep_days`` (the
    runs' retention). Returns the rows stored."""
    every = SAMPLE_EVERY_SECONDS if every_seconds is None else every_seconds
    rows = [(pipeline, s.sink, s.partition, s.checkpoint, s.head) for s in samples]
    with conn.transaction():
        conn.execute(
            "DELETE FROM tidemark.lag_samples WHERE pipeline = %s "
            "AND at < now() - make_interval(days => %s)",
            (pipeline, keep_days),
        )
        # Thin the day that just left the fine week to one measurement an hour: the one most
        # behind (the charts show the most behind per bucket; the first of the hour would
        # often be the moment after a run, and hide every backlog). One day only, so each
        # call touches a bounded number of rows (a maintenance DAG stopped for longer leaves
        # that stretch fine: more rows, nothing wrong).
        conn.execute(
            f"""DELETE FROM tidemark.lag_samples s
               WHERE s.pipeline = %(p)s
                 AND s.at >= now() - make_interval(days => {FINE_DAYS + 1})
                 AND s.at < now() - make_interval(days => {FINE_DAYS})
                 AND s.at <> (SELECT m.at FROM tidemark.lag_samples m
                              WHERE m.pipeline = s.pipeline
                                AND m.at >= date_trunc('hour', s.at)
                                AND m.at < date_trunc('hour', s.at) + interval '1 hour'
                              GROUP BY m.at
                              ORDER BY sum(greatest(m.head - m.checkpoint, 0)) DESC, m.at
                              LIMIT 1)""",
            {"p": pipeline},
        )
        if not rows:
            return 0
        recent = scalar(
            conn.execute(
                "SELECT EXISTS (SELECT 1 FROM tidemark.lag_samples WHERE pipeline = %s "
                "AND at > now() - make_interval(secs => %s))",
                (pipeline, every),
            )
        )
        if recent and every > 0:
            return 0
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO tidemark.lag_samples (pipeline, sink, partition, checkpoint, head) "
                "VALUES (%s, %s, %s, %s, %s)",
                rows,
            )
        return len(rows)


def prune(conn: psycopg.Connection, keep_days: int) -> int:
    """Every pipeline's samples older than ``keep_days`` (retired pipelines' too)."""
    return conn.execute(
        "DELETE FROM tidemark.lag_samples WHERE at < now() - make_interval(days => %s)",
        (keep_days,),
    ).rowcount


# -- current state ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Partition:
    """One partition of a sink: its checkpoint, where the sink began, and its lag in the
    newest measurement (None: not measured then)."""

    sink: str
    partition: int
    start_offset: int | None
    next_offset: int
    updated_at: datetime
    lag: int | None = None
    head: int | None = None


@dataclass
class SinkState:
    sink: str
    partitions: list[Partition] = field(default_factory=list)


@dataclass(frozen=True)
class InDoubt:
    """An open run's sink whose owner is gone, or one decided and not yet finished."""

    run_id: int
    sink: str
    state: str
    alive: bool  # its driver still holds the run's owner lock


@dataclass(frozen=True)
class LastRunSink:
    sink: str
    state: str
    error: str | None


@dataclass(frozen=True)
class LastRun:
    run_id: int
    mode: str
    created_at: datetime
    finished_at: datetime | None
    sinks: list[LastRunSink]


@dataclass
class State:
    """What a pipeline is doing now."""

    pipeline: str
    halted_reason: str | None = None
    halted_at: datetime | None = None
    in_doubt: list[InDoubt] = field(default_factory=list)
    last_run: LastRun | None = None
    sinks: list[SinkState] = field(default_factory=list)
    lag_at: datetime | None = None  # when the lag in ``sinks`` was measured


@dataclass(frozen=True)
class _Lag:
    pipeline: str
    sink: str
    partition: int
    at: datetime
    head: int
    lag: int


def states(conn: psycopg.Connection, pipelines: list[str]) -> dict[str, State]:
    """The current state of each of ``pipelines`` the ledger knows."""
    out = {
        name: State(name, reason, at)
        for name, reason, at in conn.execute(
            "SELECT name, halted_reason, halted_at FROM tidemark.pipelines "
            "WHERE name = ANY(%s) ORDER BY name",
            (pipelines,),
        )
    }
    names = list(out)
    for pipeline, run_id, sink, state, alive in conn.execute(
        f"""SELECT r.pipeline, rs.run_id, rs.sink, rs.state::text AS state,
                   {owner_alive_sql("rs.run_id")} AS alive
            FROM tidemark.run_sinks rs JOIN tidemark.runs r USING (run_id)
            WHERE rs.state = ANY(%s) AND r.pipeline = ANY(%s) ORDER BY rs.run_id, rs.sink""",
        ([str(s) for s in (*OPEN, RunState.LOST)], names),
    ):
        # A live owner's open run is running, not in doubt; a decided or lost one always is.
        if state in (RunState.COMMITTING, RunState.LOST) or not alive:
            out[pipeline].in_doubt.append(InDoubt(run_id, sink, state, alive))
    for pipeline, run_id, mode, created_at, finished_at, sinks_json in conn.execute(
        # each pipeline's newest run by an index lookup (runs_by_time), not a sort of all
        """SELECT p.name AS pipeline, r.run_id, r.mode, r.created_at, r.finished_at,
                  (SELECT coalesce(json_agg(json_build_object('sink', rs.sink,
                          'state', rs.state, 'error', rs.error) ORDER BY rs.sink), '[]')
                   FROM tidemark.run_sinks rs WHERE rs.run_id = r.run_id) AS sinks
           FROM unnest(%s::text[]) p(name)
           CROSS JOIN LATERAL (SELECT * FROM tidemark.runs x WHERE x.pipeline = p.name
                               ORDER BY x.created_at DESC, x.run_id DESC LIMIT 1) r""",
        (names,),
    ):
        last_sinks = [LastRunSink(**s) for s in sinks_json]
        out[pipeline].last_run = LastRun(run_id, mode, created_at, finished_at, last_sinks)
    lags: dict[tuple[str, str, int], _Lag] = {}
    for lag in conn.cursor(row_factory=class_row(_Lag)).execute(
        # each pipeline's newest measurement: two index lookups, whatever the history holds
        """SELECT s.pipeline, s.sink, s.partition, s.at, s.head,
                  greatest(s.head - s.checkpoint, 0) AS lag
           FROM unnest(%s::text[]) p(name)
           CROSS JOIN LATERAL (SELECT max(at) AS at FROM tidemark.lag_samples
                               WHERE pipeline = p.name) m
           JOIN tidemark.lag_samples s ON s.pipeline = p.name AND s.at = m.at
           ORDER BY 1, 2, 3""",
        (names,),
    ):
        out[lag.pipeline].lag_at = lag.at
        lags[lag.pipeline, lag.sink, lag.partition] = lag
    sinks: dict[tuple[str, str], SinkState] = {}
    for pipeline, sink, partition, start, next_offset, updated_at in conn.execute(
        """SELECT pipeline, sink, partition, start_offset, next_offset, updated_at
           FROM tidemark.checkpoints WHERE pipeline = ANY(%s)
           ORDER BY pipeline, sink, partition""",
        (names,),
    ):
        if (pipeline, sink) not in sinks:
            sinks[pipeline, sink] = SinkState(sink)
            out[pipeline].sinks.append(sinks[pipeline, sink])
        measured = lags.get((pipeline, sink, partition))
        sinks[pipeline, sink].partitions.append(
            Partition(
                sink,
                partition,
                start,
                next_offset,
                updated_at,
                measured.lag if measured else None,
                measured.head if measured else None,
            )
        )
    return out


# -- series -------------------------------------------------------------------------------------
def _bucket(col: str, w: Window) -> str:
    if not w.bucket_seconds:
        return col
    return f"date_bin(make_interval(secs => %(bucket)s), {col}, {_ORIGIN})"


def _params(pipelines: list[str], w: Window) -> dict[str, Any]:
    return {"pipelines": pipelines, "days": w.days, "bucket": w.bucket_seconds}


_SINCE = "now() - make_interval(days => %(days)s)"


def lag_totals(
    conn: psycopg.Connection, pipelines: list[str], w: Window
) -> dict[str, list[tuple[datetime, int]]]:
    """Per pipeline and bucket (or measurement), the most records any sink was behind (summed over its
    partitions) in a measurement: the overview's lag line."""
    out: dict[str, list[tuple[datetime, int]]] = {}
    for pipeline, t, lag in conn.execute(
        f"""SELECT pipeline, {_bucket("at", w)} AS t, max(lag)::bigint FROM (
                SELECT pipeline, sink, at, sum(greatest(head - checkpoint, 0)) AS lag
                FROM tidemark.lag_samples
                WHERE pipeline = ANY(%(pipelines)s) AND at >= {_SINCE}
                GROUP BY pipeline, sink, at) per_sink
            GROUP BY 1, 2 ORDER BY 1, 2""",
        _params(pipelines, w),
    ):
        out.setdefault(pipeline, []).append((t, int(lag)))
    return out


def lag_by_partition(
    conn: psycopg.Connection, pipeline: str, w: Window
) -> list[tuple[str, int, datetime, int]]:
    """(sink, partition, bucket, most records behind in it), ordered."""
    return [
        (s, p, t, int(lag))
        for s, p, t, lag in conn.execute(
            f"""SELECT sink, partition, {_bucket("at", w)} AS t,
                       max(greatest(head - checkpoint, 0))
                FROM tidemark.lag_samples
                WHERE pipeline = %(pipeline)s AND at >= {_SINCE}
                GROUP BY 1, 2, 3 ORDER BY 1, 2, 3""",
            {**_params([pipeline], w), "pipeline": pipeline},
        )
    ]


def run_rates(
    conn: psycopg.Connection, pipelines: list[str], w: Window
) -> dict[str, list[tuple[datetime, float, float]]]:
    """Per pipeline and bucket: records per second (mean over its finished runs, each run's
    records those of its busiest sink) and the longest run's seconds."""
    out: dict[str, list[tuple[datetime, float, float]]] = {}
    for pipeline, t, rate, seconds in conn.execute(
        f"""SELECT pipeline, {_bucket("created_at", w)} AS t, avg(records / seconds),
                   max(seconds)
            FROM (SELECT r.pipeline, r.created_at,
                         greatest(extract(epoch FROM r.finished_at - r.created_at), 0.001)
                             AS seconds,
                         max((rs.counts ->> 'records')::float8) AS records
                  FROM tidemark.runs r JOIN tidemark.run_sinks rs USING (run_id)
                  WHERE r.pipeline = ANY(%(pipelines)s) AND r.created_at >= {_SINCE}
                    AND r.finished_at IS NOT NULL
                  GROUP BY r.run_id) x
            WHERE records IS NOT NULL
            GROUP BY 1, 2 ORDER BY 1, 2""",
        _params(pipelines, w),
    ):
        out.setdefault(pipeline, []).append((t, float(rate), float(seconds)))
    return out


@dataclass(frozen=True)
class RunRow:
    """One sink of one run of the window."""

    run_id: int
    mode: str
    sink: str
    state: str
    created_at: datetime
    seconds: float | None  # None while unfinished
    records: int | None  # None: the sink has no counts yet
    rows: int | None
    dead: int | None


def runs(conn: psycopg.Connection, pipeline: str, w: Window) -> list[RunRow]:
    """Every run of the window per sink, in order."""
    return (
        conn.cursor(row_factory=class_row(RunRow))
        .execute(
            f"""SELECT r.run_id, r.mode, rs.sink, rs.state::text AS state, r.created_at,
                       extract(epoch FROM r.finished_at - r.created_at)::float8 AS seconds,
                       (rs.counts ->> 'records')::bigint AS records,
                       (rs.counts ->> 'rows')::bigint AS rows,
                       (rs.counts ->> 'dead')::bigint AS dead
                FROM tidemark.runs r JOIN tidemark.run_sinks rs USING (run_id)
                WHERE r.pipeline = %(pipeline)s AND r.created_at >= {_SINCE}
                ORDER BY r.run_id, rs.sink""",
            {**_params([pipeline], w), "pipeline": pipeline},
        )
        .fetchall()
    )


def letters_created(
    conn: psycopg.Connection, pipelines: list[str], w: Window
) -> dict[str, list[tuple[datetime, str, int]]]:
    """Per pipeline: (bucket, error class, dead letters first seen in it), whatever their
    status now. Without buckets, per instant: a run writes its letters in one transaction."""
    out: dict[str, list[tuple[datetime, str, int]]] = {}
    for pipeline, t, cls, n in conn.execute(
        f"""SELECT pipeline, {_bucket("first_seen", w)} AS t, error_class::text, count(*)
            FROM tidemark.dlq
            WHERE pipeline = ANY(%(pipelines)s) AND first_seen >= {_SINCE}
            GROUP BY 1, 2, 3 ORDER BY 1, 2, 3""",
        _params(pipelines, w),
    ):
        out.setdefault(pipeline, []).append((t, cls, int(n)))
    return out


def known(conn: psycopg.Connection) -> list[str]:
    """Every pipeline the ledger has a row for."""
    return [r[0] for r in conn.execute("SELECT name FROM tidemark.pipelines ORDER BY name")]
