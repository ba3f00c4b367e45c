"""The run state machine of docs/design.md, per (run, sink).

    planned -> writing -> prepared -> committing -> committed
    planned/writing/prepared -> aborted
    planned/writing -> dq_failed
    prepared -> previewed      a dry run: it would commit; rolled back instead of decided
    committing -> aborted      a chosen participant lost before any committed (abandon)
    committing -> lost         one lost after others committed (lose) -> committed (settled)

One function per transition; each is exactly one ledger transaction and checks the state it
leaves, so a transition that no longer applies (recovery got there first, the lease moved)
fails instead of acting twice.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import psycopg
from psycopg.rows import class_row
from pydantic import BaseModel, ConfigDict

from tidemark.core.claims import Claim, SinkClaim
from tidemark.core.db import scalar
from tidemark.core.dsn import mask
from tidemark.core.errors import Fenced, Halted, LeaseHeld, TidemarkError
from tidemark.core.participants import Participant
from tidemark.core.ranges import Range
from tidemark.core.sink_counts import SinkCounts
from tidemark.core.text import clamp
from tidemark.ledger import gaps
from tidemark.ledger.checkpoints import positions, starts
from tidemark.ledger.run_state import RunState as RunState

ERROR_MAX = 2000  # characters of an error kept in the ledger
OWNER_LOCK_CLASS = 0x746D  # 'tm': session advisory lock (class, run_id) proves the owner lives


ABORTABLE = (RunState.PLANNED, RunState.WRITING, RunState.PREPARED)


class AirflowRun(BaseModel):
    """The Airflow task try that started a run (the DAGs pass it to the job as JSON)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    dag_id: str
    run_id: str
    task_id: str | None = None
    try_number: int | None = None


class IllegalTransition(TidemarkError):
    pass


class Planner(Protocol):
    """Plans a claim: gets ``checkpoints`` {sink: {partition: next offset}} of the sinks it
    may claim and ``began`` {sink: {partition: start offset}}, where each began (known
    starts only: a partition left out began at the source's first record), both read inside
    the claim transaction; returns {sink: [Range]}, an empty list meaning nothing to do."""

    def __call__(
        self, checkpoints: dict[str, dict[int, int]], began: dict[str, dict[int, int]], /
    ) -> dict[str, list[Range]]: ...


def owner_alive_sql(run_col: str) -> str:
    return f"""EXISTS (SELECT 1 FROM pg_locks lk WHERE lk.locktype = 'advisory'
        AND lk.database = (SELECT oid FROM pg_database WHERE datname = current_database())
        AND lk.classid = {OWNER_LOCK_CLASS} AND lk.objid = {run_col} AND lk.objsubid = 2
        AND lk.granted)"""


def hold_owner_lock(conn: psycopg.Connection, run_id: int) -> None:
    """The owner's session lock: while this session lives, recovery leaves the run alone."""
    conn.execute("SELECT pg_advisory_lock(%s, %s)", (OWNER_LOCK_CLASS, run_id))


def _masked(value: Any) -> Any:
    """``value`` with every string masked (core.dsn.mask): a pipeline's inline DSN carries
    its password, and the ledger is read by more people than the pipeline's secrets are."""
    if isinstance(value, str):
        return mask(value)
    if isinstance(value, dict):
        return {k: _masked(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_masked(v) for v in value]
    return value


def ensure_pipeline(conn: psycopg.Connection, name: str, config: dict[str, Any]) -> None:
    config = _masked(config)
    conn.execute(
        """INSERT INTO tidemark.pipelines (name, config) VALUES (%s, %s)
                    ON CONFLICT (name) DO UPDATE SET config = EXCLUDED.config, updated_at = now()
                    WHERE tidemark.pipelines.config IS DISTINCT FROM EXCLUDED.config""",
        (name, json.dumps(config)),
    )


def claim(
    conn: psycopg.Connection,
    *,
    pipeline: str,
    config: dict[str, Any],
    sinks: Iterable[str],
    mode: str,
    owner: str,
    delivery: str,
    ttl_seconds: int,
    plan: Planner,
    external_id: str | None = None,
    airflow: AirflowRun | None = None,
    halted_ok: bool = False,
) -> Claim | None:
    """Take the leases of the free sinks, bump their epochs and insert the run as planned.

    The owner's session advisory lock is taken on ``conn`` and must be held for the run's
    life. Returns None when no claimed sink has anything to do (nothing is written then).
    Raises LeaseHeld when every sink is held by another live run, Halted when the pipeline
    is halted (unless ``halted_ok``: the re-delivery `tidemark settle` makes of a lost run).
    """
    sinks = list(sinks)
    with conn.transaction():
        ensure_pipeline(conn, pipeline, config)
        halted = scalar(
            conn.execute(
                "SELECT halted_reason FROM tidemark.pipelines WHERE name = %s", (pipeline,)
            )
        )
        if halted and not halted_ok:
            # A reason that names its own way back (`tidemark settle RUN`) is not told resume.
            fix = "" if "`tidemark " in halted else f" (inspect, then `tidemark resume {pipeline}`)"
            raise Halted(f"pipeline {pipeline} is halted: {halted}{fix}")
        conn.execute(
            """INSERT INTO tidemark.leases (pipeline, sink)
                        SELECT %s, unnest(%s::text[]) ON CONFLICT DO NOTHING""",
            (pipeline, sinks),
        )
        leases = conn.execute(
            f"""
            SELECT l.sink, l.epoch, l.run_id, l.owner,
                   l.run_id IS NULL OR l.expires_at < now()
                       OR NOT {owner_alive_sql("l.run_id")} AS free,
                   rs.state
            FROM tidemark.leases l
            LEFT JOIN tidemark.run_sinks rs ON rs.run_id = l.run_id AND rs.sink = l.sink
            WHERE l.pipeline = %s AND l.sink = ANY(%s) ORDER BY l.sink FOR UPDATE OF l""",
            (pipeline, sinks),
        ).fetchall()
        free, skipped = [], {}
        for sink, _epoch, holder, holder_owner, is_free, holder_state in leases:
            if holder_state == RunState.COMMITTING:
                skipped[sink] = f"run {holder} is committing; run `tidemark recover` first"
            elif not is_free:
                skipped[sink] = f"lease held by run {holder} ({holder_owner})"
            else:
                free.append(sink)
        # A sink rebuilt for a staged version of the pipeline takes runs of that version only
        # (ledger/staging.py): checked under its lease's row lock.
        from tidemark.config import digest
        from tidemark.ledger import staging

        for sink, why in staging.refused(conn, pipeline, free, digest(config)).items():
            free.remove(sink)
            skipped[sink] = why
        if not free:
            raise LeaseHeld(
                f"pipeline {pipeline}: nothing claimed: "
                + "; ".join(f"{s}: {why}" for s, why in skipped.items())
            )
        checkpoints: dict[str, dict[int, int]] = {s: {} for s in free} | positions(
            conn, pipeline, free
        )
        planned = plan(checkpoints, starts(conn, pipeline, free))
        # Seed the checkpoints of new partitions, even with nothing to read yet: where a sink
        # starts is decided once (`start: latest` must not move on with every run), recorded
        # as where it began (no re-delivery reaches below it), and status shows them before
        # a commit.
        for sink, rs in plan_seeds(checkpoints, planned).items():
            for r in rs:
                conn.execute(
                    """INSERT INTO tidemark.checkpoints (pipeline, sink, partition,
                                next_offset, start_offset) VALUES (%s, %s, %s, %s, %s)
                       ON CONFLICT DO NOTHING""",
                    (pipeline, sink, r.partition, r.start, r.start),
                )
        work = {s: [r for r in rs if r.size > 0] for s, rs in planned.items()}
        work = {s: rs for s, rs in work.items() if rs}
        if not work:
            return None
        run_id: int = scalar(
            conn.execute(
                """INSERT INTO tidemark.runs (pipeline, mode, delivery, owner, external_id,
                   dag_id, dag_run_id, task_id, try_number)
                   VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) RETURNING run_id""",
                (
                    pipeline,
                    mode,
                    delivery,
                    owner,
                    external_id,
                    *(
                        (airflow.dag_id, airflow.run_id, airflow.task_id, airflow.try_number)
                        if airflow
                        else (None,) * 4
                    ),
                ),
            )
        )
        hold_owner_lock(conn, run_id)
        result = Claim(run_id, pipeline, mode, skipped=skipped)
        for sink, rs in work.items():
            epoch = scalar(
                conn.execute(
                    """UPDATE tidemark.leases SET epoch = epoch + 1, run_id = %s, owner = %s,
                              expires_at = now() + make_interval(secs => %s)
                       WHERE pipeline = %s AND sink = %s RETURNING epoch""",
                    (run_id, owner, ttl_seconds, pipeline, sink),
                )
            )
            conn.execute(
                """INSERT INTO tidemark.run_sinks (run_id, sink, state, lease_epoch)
                            VALUES (%s, %s, %s, %s)""",
                (run_id, sink, RunState.PLANNED, epoch),
            )
            with conn.cursor() as cur:
                cur.executemany(
                    """INSERT INTO tidemark.run_ranges (run_id, sink, partition, from_offset,
                       to_offset) VALUES (%s, %s, %s, %s, %s)""",
                    [(run_id, sink, r.partition, r.start, r.end) for r in rs],
                )
            result.sinks[sink] = SinkClaim(sink, epoch, rs)
        return result


def pending(conn: psycopg.Connection, pipeline: str, sinks: Iterable[str], plan: Planner) -> bool:
    """Whether :func:`claim` would find something to do now: read-only (no lease, no run, no
    seed written), so a scheduler can ask it without paying for a job. Leases are not looked
    at: a sink held by another run counts, and the claim then says why it waits. A halted
    pipeline counts too, so that the claim reports the halt."""
    sinks = list(sinks)
    row = conn.execute(
        "SELECT halted_reason FROM tidemark.pipelines WHERE name = %s", (pipeline,)
    ).fetchone()
    if row and row[0]:
        return True
    checkpoints: dict[str, dict[int, int]] = {s: {} for s in sinks} | positions(
        conn, pipeline, sinks
    )
    planned = plan(checkpoints, starts(conn, pipeline, sinks))
    return any(r.size > 0 for rs in planned.values() for r in rs) or any(
        plan_seeds(checkpoints, planned).values()
    )


def plan_seeds(
    checkpoints: dict[str, dict[int, int]], ranges: dict[str, list[Range]]
) -> dict[str, list[Range]]:
    return {
        s: [r for r in rs if r.partition not in checkpoints.get(s, {})] for s, rs in ranges.items()
    }


def _transition(
    conn: psycopg.Connection,
    run_id: int,
    sink: str,
    to: RunState,
    allowed: Iterable[RunState],
    **sets: Any,
) -> None:
    assigns = ", ".join(f"{k} = %({k})s" for k in sets)
    params = {
        "run_id": run_id,
        "sink": sink,
        "to": to.value,
        "allowed": [s.value for s in allowed],
        **sets,
    }
    row = conn.execute(
        f"""UPDATE tidemark.run_sinks SET state = %(to)s, updated_at = now()
            {", " + assigns if assigns else ""}
            WHERE run_id = %(run_id)s AND sink = %(sink)s AND state::text = ANY(%(allowed)s)
            RETURNING state""",
        params,
    ).fetchone()
    if row is None:
        cur = conn.execute(
            "SELECT state FROM tidemark.run_sinks WHERE run_id = %s AND sink = %s", (run_id, sink)
        ).fetchone()
        raise IllegalTransition(
            f"run {run_id} sink {sink}: cannot go to {to.value} from {cur[0] if cur else 'nowhere'}"
        )


def _check_lease(conn: psycopg.Connection, pipeline: str, run_id: int, sink: str) -> None:
    """The run still holds the sink's lease: same run, same epoch, not expired. Locks the
    lease row first, as every transition of a (run, sink) does, so that a driver and a
    recovery never wait on each other in opposite orders."""
    row = conn.execute(
        """SELECT l.epoch, l.run_id, rs.lease_epoch, l.expires_at < now()
           FROM tidemark.run_sinks rs
           JOIN tidemark.leases l ON l.pipeline = %s AND l.sink = rs.sink
           WHERE rs.run_id = %s AND rs.sink = %s FOR UPDATE OF l""",
        (pipeline, run_id, sink),
    ).fetchone()
    if row is None or row[1] != run_id or row[0] != row[2]:
        holder = f"run {row[1]} (epoch {row[0]})" if row else "nobody"
        raise Fenced(f"run {run_id} lost the lease of sink {sink} to {holder}")
    if row[3]:
        raise Fenced(
            f"run {run_id}: its lease of sink {sink} expired (a stalled driver); "
            f"another run may take over"
        )


def _lock_lease(conn: psycopg.Connection, pipeline: str, sink: str) -> None:
    conn.execute(
        "SELECT 1 FROM tidemark.leases WHERE pipeline = %s AND sink = %s FOR UPDATE",
        (pipeline, sink),
    )


def start_writing(conn: psycopg.Connection, pipeline: str, run_id: int, sink: str) -> None:
    with conn.transaction():
        _check_lease(conn, pipeline, run_id, sink)
        _transition(conn, run_id, sink, RunState.WRITING, [RunState.PLANNED])


def mark_prepared(
    conn: psycopg.Connection,
    pipeline: str,
    run_id: int,
    sink: str,
    counts: SinkCounts,
    schema_changes: list[str] | None = None,
) -> None:
    """writing -> prepared, with the counts and what the run changed in the sink's table."""
    with conn.transaction():
        _check_lease(conn, pipeline, run_id, sink)
        _transition(
            conn,
            run_id,
            sink,
            RunState.PREPARED,
            [RunState.WRITING],
            counts=json.dumps(counts.to_json()),
            schema_changes=list(schema_changes or []),
        )


def decide(
    conn: psycopg.Connection, pipeline: str, run_id: int, sink: str, chosen: list[Participant]
) -> None:
    """The commit point: lease still ours (and not expired), chosen gids recorded, state
    committing, in one ledger transaction."""
    with conn.transaction():
        _check_lease(conn, pipeline, run_id, sink)
        _transition(conn, run_id, sink, RunState.COMMITTING, [RunState.PREPARED])
        with conn.cursor() as cur:
            cur.executemany(
                """INSERT INTO tidemark.participants (run_id, sink, gid, target, task, rows)
                   VALUES (%s, %s, %s, %s, %s, %s)""",
                [(run_id, sink, p.gid, str(p.target), p.task, p.rows) for p in chosen],
            )


def state_of(conn: psycopg.Connection, run_id: int, sink: str) -> RunState | None:
    row = conn.execute(
        "SELECT state::text FROM tidemark.run_sinks WHERE run_id = %s AND sink = %s", (run_id, sink)
    ).fetchone()
    return RunState(row[0]) if row else None


def advance(
    conn: psycopg.Connection,
    pipeline: str,
    run_id: int,
    sink: str,
    timings: dict[str, Any] | None = None,
) -> None:
    """committing -> committed: checkpoints to the ranges' ends (never backwards), lease freed,
    counts and timings stored as run metrics, the gaps it stepped over recorded (and those a
    re-delivery read again resolved: ledger/gaps.py)."""
    with conn.transaction():
        _lock_lease(conn, pipeline, sink)
        _transition(
            conn,
            run_id,
            sink,
            RunState.COMMITTED,
            [RunState.COMMITTING],
            timings=json.dumps(timings or {}),
        )
        conn.execute(
            """INSERT INTO tidemark.run_metrics (run_id, sink, name, value)
               SELECT run_id, sink, m.key, m.value::float8 FROM tidemark.run_sinks,
                      jsonb_each_text(counts || timings) m
               WHERE run_id = %s AND sink = %s AND jsonb_typeof(counts || timings) = 'object'
               ON CONFLICT DO NOTHING""",
            (run_id, sink),
        )
        _move_checkpoints(conn, pipeline, run_id, sink)
        _release(conn, pipeline, run_id, sink)


def _move_checkpoints(conn: psycopg.Connection, pipeline: str, run_id: int, sink: str) -> None:
    """A delivery's checkpoints to its ranges' ends, never backwards (re-deliveries: none);
    then the gaps the run stepped over count, and a re-delivery's ranges resolve the open
    gaps they cover (ledger/gaps.py; docs/design.md, invariant 2)."""
    conn.execute(
        """INSERT INTO tidemark.checkpoints AS c (pipeline, sink, partition, next_offset,
                  updated_by, start_offset)
           SELECT %(p)s, rr.sink, rr.partition, rr.to_offset, rr.run_id, rr.from_offset
           FROM tidemark.run_ranges rr JOIN tidemark.runs r USING (run_id)
           WHERE rr.run_id = %(r)s AND rr.sink = %(s)s AND r.mode = 'run'
           ON CONFLICT (pipeline, sink, partition) DO UPDATE
           SET next_offset = greatest(c.next_offset, EXCLUDED.next_offset),
               updated_at = now(), updated_by = EXCLUDED.updated_by""",
        {"p": pipeline, "r": run_id, "s": sink},
    )
    gaps.settle(conn, pipeline, run_id, sink)


def abandon(conn: psycopg.Connection, pipeline: str, run_id: int, sink: str, reason: str) -> None:
    """committing -> aborted: a chosen participant was lost (rolled back by someone else)
    before any of the decision's committed, and the rest are rolled back: nothing of it is
    visible, its checkpoints stay. The pipeline is halted with ``reason`` in the same
    transaction, so no run starts before an operator has seen it (`tidemark settle`)."""
    _end_decided(conn, pipeline, run_id, sink, reason, RunState.ABORTED)


def lose(conn: psycopg.Connection, pipeline: str, run_id: int, sink: str, reason: str) -> None:
    """committing -> lost: a chosen participant was lost after others of the decision had
    committed (a race with whoever rolled it back). What committed cannot be undone, so the
    run's ranges count as delivered (a delivery's checkpoints move, as in :func:`advance`)
    and must be re-delivered: `tidemark settle RUN` backfills exactly them, then
    :func:`settled`. The pipeline is halted with ``reason`` in the same transaction."""
    _end_decided(conn, pipeline, run_id, sink, reason, RunState.LOST)


def _end_decided(
    conn: psycopg.Connection, pipeline: str, run_id: int, sink: str, reason: str, to: RunState
) -> None:
    """committing -> ``to`` with a lost participant: in one transaction, the lease freed and
    the pipeline halted; ``lost`` ranges count as delivered, ``aborted`` ones do not."""
    with conn.transaction():
        _lock_lease(conn, pipeline, sink)
        _transition(conn, run_id, sink, to, [RunState.COMMITTING], error=clamp(reason, ERROR_MAX))
        if to is RunState.LOST:
            _move_checkpoints(conn, pipeline, run_id, sink)
        _release(conn, pipeline, run_id, sink)
        _halt(conn, pipeline, reason)


def settled(conn: psycopg.Connection, run_id: int, sink: str, note: str) -> None:
    """lost -> committed: the run's ranges were re-delivered (``note`` says by which run)."""
    with conn.transaction():
        _transition(
            conn,
            run_id,
            sink,
            RunState.COMMITTED,
            [RunState.LOST],
            error=clamp(note, ERROR_MAX),
        )


@dataclass(frozen=True)
class LostSink:
    """A (run, sink) in ``lost``: its ranges still to re-deliver (`tidemark settle RUN`)."""

    run_id: int
    sink: str


def lost_sinks(conn: psycopg.Connection, pipeline: str) -> list[LostSink]:
    """The pipeline's sinks in ``lost``, by run and sink."""
    return (
        conn.cursor(row_factory=class_row(LostSink))
        .execute(
            """SELECT rs.run_id, rs.sink FROM tidemark.run_sinks rs JOIN tidemark.runs r
               USING (run_id) WHERE r.pipeline = %s AND rs.state = %s ORDER BY 1, 2""",
            (pipeline, RunState.LOST),
        )
        .fetchall()
    )


def abort(conn: psycopg.Connection, pipeline: str, run_id: int, sink: str, error: str) -> bool:
    """planned/writing/prepared -> aborted. False if the run had already left those states."""
    with conn.transaction():
        _lock_lease(conn, pipeline, sink)
        try:
            _transition(
                conn, run_id, sink, RunState.ABORTED, ABORTABLE, error=clamp(error, ERROR_MAX)
            )
        except IllegalTransition:
            return False
        _release(conn, pipeline, run_id, sink)
        return True


def preview(conn: psycopg.Connection, pipeline: str, run_id: int, sink: str) -> None:
    """prepared -> previewed: a dry run's sink that would commit, its lease freed. The run
    then rolls back what it prepared; its counts stay, as the real run's would."""
    with conn.transaction():
        _lock_lease(conn, pipeline, sink)
        _transition(conn, run_id, sink, RunState.PREVIEWED, [RunState.PREPARED])
        _release(conn, pipeline, run_id, sink)


def dq_failed(conn: psycopg.Connection, pipeline: str, run_id: int, sink: str, error: str) -> None:
    with conn.transaction():
        _lock_lease(conn, pipeline, sink)
        _transition(
            conn,
            run_id,
            sink,
            RunState.DQ_FAILED,
            [RunState.PLANNED, RunState.WRITING],
            error=clamp(error, ERROR_MAX),
        )
        _release(conn, pipeline, run_id, sink)


def note_read(conn: psycopg.Connection, run_id: int, records: int) -> None:
    """The records the run read, on its sinks that ended without writing them (aborted,
    dq_failed): their counts say what the run saw, not nothing."""
    conn.execute(
        """UPDATE tidemark.run_sinks SET counts = counts || jsonb_build_object(
                        'records', %s::bigint)
                    WHERE run_id = %s AND state::text = ANY(%s) AND NOT counts ? 'records'""",
        (records, run_id, [RunState.ABORTED.value, RunState.DQ_FAILED.value]),
    )


def _release(conn: psycopg.Connection, pipeline: str, run_id: int, sink: str) -> None:
    conn.execute(
        """UPDATE tidemark.leases SET run_id = NULL, owner = NULL, expires_at = NULL
                    WHERE pipeline = %s AND sink = %s AND run_id = %s""",
        (pipeline, sink, run_id),
    )


def heartbeat(conn: psycopg.Connection, pipeline: str, run_id: int, ttl_seconds: int) -> int:
    """Extend this run's leases; returns how many it still holds."""
    with conn.transaction():
        return conn.execute(
            """UPDATE tidemark.leases SET expires_at = now() + make_interval(secs => %s)
               WHERE pipeline = %s AND run_id = %s""",
            (ttl_seconds, pipeline, run_id),
        ).rowcount


def finish_run(conn: psycopg.Connection, run_id: int) -> None:
    with conn.transaction():
        conn.execute(
            "UPDATE tidemark.runs SET finished_at = now() WHERE run_id = %s "
            "AND finished_at IS NULL",
            (run_id,),
        )


def halt(conn: psycopg.Connection, pipeline: str, reason: str) -> None:
    with conn.transaction():
        _halt(conn, pipeline, reason)


def _halt(conn: psycopg.Connection, pipeline: str, reason: str) -> None:
    conn.execute(
        """UPDATE tidemark.pipelines SET halted_reason = %s, halted_at = now()
                    WHERE name = %s""",
        (clamp(reason, ERROR_MAX), pipeline),
    )


def halted_pipelines(conn: psycopg.Connection) -> dict[str, str]:
    """pipeline -> why, of every halted pipeline."""
    return dict(
        conn.execute(
            "SELECT name, halted_reason FROM tidemark.pipelines WHERE halted_reason IS NOT NULL"
        ).fetchall()
    )


def halted(conn: psycopg.Connection, pipeline: str) -> str | None:
    """Why ``pipeline`` is halted (None: it is not)."""
    row = conn.execute(
        "SELECT halted_reason FROM tidemark.pipelines WHERE name = %s", (pipeline,)
    ).fetchone()
    return row[0] if row else None


def resume(conn: psycopg.Connection, pipeline: str) -> bool:
    """Clear the halt. Refused while a sink of the pipeline is ``lost``: resuming would let
    runs go on past ranges that are not whole, which only `tidemark settle` re-delivers."""
    with conn.transaction():
        lost = lost_sinks(conn, pipeline)
        if lost:
            run_id, sink = lost[0].run_id, lost[0].sink
            raise TidemarkError(
                f"pipeline {pipeline}: run {run_id} sink {sink} lost a participant after "
                f"others had committed, so its ranges are not whole; `tidemark settle "
                f"{run_id}` re-delivers them and resumes the pipeline"
            )
        return (
            conn.execute(
                """UPDATE tidemark.pipelines SET halted_reason = NULL,
                               halted_at = NULL WHERE name = %s AND halted_reason IS NOT NULL""",
                (pipeline,),
            ).rowcount
            > 0
        )
