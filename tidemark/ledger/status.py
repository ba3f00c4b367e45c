"""What `tidemark status` shows: checkpoints, recent runs, dead letters, halts."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import class_row

from tidemark.core.sink_counts import SinkCounts
from tidemark.ledger import staging
from tidemark.ledger.checkpoints import Checkpoint, listing
from tidemark.quality.outcomes import observed


@dataclass(frozen=True)
class RecentRun:
    """One sink of one of the pipeline's recent runs."""

    run_id: int
    mode: str
    created_at: datetime
    finished_at: datetime | None
    sink: str
    state: str
    counts: dict[str, Any]  # SinkCounts as the ledger stores it (--json shows it so)
    error: str | None


@dataclass(frozen=True)
class LetterCount:
    """Dead letters of one sink ('-': the pipeline's), error class and status."""

    sink: str
    error_class: str
    status: str
    records: int


@dataclass(frozen=True)
class Gate:
    """The last gate of one scope ('': the pipeline's, else a sink's)."""

    scope: str
    run_id: int
    success: bool
    rows_failed: int
    results: list[dict[str, Any]]
    docs_path: str | None
    created_at: datetime


@dataclass(frozen=True)
class Lease:
    sink: str
    epoch: int
    run_id: int | None
    owner: str | None
    expires_at: datetime | None


@dataclass(frozen=True)
class PipelineStatus:
    """What `tidemark status` shows of a pipeline (``--json``: :meth:`to_json`)."""

    pipeline: str
    known: bool  # the ledger has a row for it
    halted: str | None
    checkpoints: list[Checkpoint]
    runs: list[RecentRun]
    dead_letters: list[LetterCount]
    leases: list[Lease]
    gates: list[Gate]
    holds: list[staging.Hold]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def pipeline_status(conn: psycopg.Connection, pipeline: str, runs: int = 10) -> PipelineStatus:
    row = conn.execute(
        "SELECT halted_reason FROM tidemark.pipelines WHERE name = %s", (pipeline,)
    ).fetchone()
    recent = (
        conn.cursor(row_factory=class_row(RecentRun))
        .execute(
            """SELECT r.run_id, r.mode, r.created_at, r.finished_at, rs.sink,
                      rs.state::text AS state, rs.counts, rs.error
               FROM tidemark.runs r JOIN tidemark.run_sinks rs USING (run_id)
               WHERE r.pipeline = %s AND r.run_id IN (
                   SELECT run_id FROM tidemark.runs WHERE pipeline = %s
                   ORDER BY run_id DESC LIMIT %s)
               ORDER BY r.run_id DESC, rs.sink""",
            (pipeline, pipeline, runs),
        )
        .fetchall()
    )
    dlq = (
        conn.cursor(row_factory=class_row(LetterCount))
        .execute(
            """SELECT coalesce(sink, '-') AS sink, error_class::text AS error_class,
                      status::text AS status, count(*) AS records
               FROM tidemark.dlq WHERE pipeline = %s GROUP BY 1, 2, 3 ORDER BY 1, 2, 3""",
            (pipeline,),
        )
        .fetchall()
    )
    gates = (
        conn.cursor(row_factory=class_row(Gate))
        .execute(
            """SELECT DISTINCT ON (d.scope) d.scope, d.run_id, d.success, d.rows_failed,
                      d.results, d.docs_path, d.created_at
               FROM tidemark.dq_results d JOIN tidemark.runs r USING (run_id)
               WHERE r.pipeline = %s ORDER BY d.scope, d.run_id DESC""",
            (pipeline,),
        )
        .fetchall()
    )
    leases = (
        conn.cursor(row_factory=class_row(Lease))
        .execute(
            """SELECT sink, epoch, run_id, owner, expires_at FROM tidemark.leases
               WHERE pipeline = %s ORDER BY sink""",
            (pipeline,),
        )
        .fetchall()
    )
    return PipelineStatus(
        pipeline=pipeline,
        known=row is not None,
        halted=row[0] if row else None,
        checkpoints=listing(conn, pipeline),
        runs=recent,
        dead_letters=dlq,
        leases=leases,
        gates=gates,
        holds=list(staging.holds(conn, pipeline).values()),
    )


def render(st: PipelineStatus) -> str:
    out = [f"pipeline {st.pipeline}"]
    if not st.known and not st.holds:
        return out[0] + ": never run"
    if st.halted:
        out.append(f"  HALTED: {st.halted}")
    out.extend(_hold_lines(st.pipeline, st.holds))
    if not st.known:
        return "\n".join(out)
    out.append("  checkpoints (next offset to deliver; where the sink began):")
    for c in st.checkpoints:
        began = (
            "began at the source's first record"
            if c.start_offset is None
            else f"began at {c.start_offset:,}"
        )
        out.append(f"    {c.sink:<16} partition {c.partition:<4} {c.next_offset:>12,}  {began}")
    out.append("  recent runs:")
    for r in st.runs:
        counts = SinkCounts.from_json(r.counts)
        err = f"  {r.error[:100]}" if r.error else ""
        out.append(
            f"    {r.run_id:>6} {r.mode:<8} {r.sink:<16} {r.state:<10} "
            f"{counts.records:>10,} read {counts.rows:>10,} rows {counts.dead:>7,} dlq  "
            f"{r.created_at:%Y-%m-%d %H:%M:%S}{err}"
        )
    if st.gates:
        out.append("  data quality (last gate per scope):")
        for g in st.gates:
            out.append(
                f"    {g.scope or '(pipeline)':<16} run {g.run_id:<6} "
                f"{'passed' if g.success else 'FAILED':<7} "
                f"{g.rows_failed:,} rows quarantined"
            )
            out.extend(f"      failed: {line}" for line in failed_lines(g.results))
    out.append("  dead letters:")
    if not st.dead_letters:
        out.append("    none")
    for d in st.dead_letters:
        out.append(f"    {d.sink:<16} {d.error_class:<11} {d.status:<12} {d.records:>8,}")
    return "\n".join(out)


def _hold_lines(pipeline: str, holds: list[staging.Hold]) -> list[str]:
    """Sinks held for a staged version (docs/operations.md, "Change a key"): the live file's
    runs are refused for them, which reads as a stalled pipeline unless status says why."""
    out = []
    for h in holds:
        if h.promoted_at is None:
            out.append(
                f"  HELD: sink {h.sink} for the staged version {h.fingerprint[:12]} since "
                f"{h.held_at:%Y-%m-%d %H:%M:%S}: runs of the live file are refused for it; "
                f"`tidemark pipelines promote {pipeline}` once its rebuild committed, or "
                f"`tidemark pipelines unstage {pipeline}`"
            )
        else:
            out.append(
                f"  held: sink {h.sink} refuses runs of the version it replaced "
                f"({h.replaces[:12]}), promoted {h.promoted_at:%Y-%m-%d %H:%M:%S}"
            )
    return out


def failed_lines(results: list[dict[str, Any]] | None) -> list[str]:
    lines = []
    for r in results or []:
        if not r.get("success"):
            args = ", ".join(
                f"{k}={v}"
                for k, v in (r.get("kwargs") or {}).items()
                if k not in ("result_format", "catch_exceptions", "meta")
            )
            lines.append(f"{r.get('expectation')}({args}) {observed(r)}")
    return lines


def save_dq_result(
    conn: psycopg.Connection,
    run_id: int,
    scope: str,
    success: bool,
    rows_failed: int,
    results: list[Any],
    raw: object,
    docs_path: str | None,
) -> None:
    """A gate's outcome for one scope of a run (pipeline or sink); a retry replaces it."""
    with conn.transaction():
        conn.execute(
            """INSERT INTO tidemark.dq_results (run_id, scope, success, rows_failed, results,
                                                raw, docs_path)
               VALUES (%s, %s, %s, %s, %s, %s, %s)
               ON CONFLICT (run_id, scope) DO UPDATE SET success = EXCLUDED.success,
                   rows_failed = EXCLUDED.rows_failed, results = EXCLUDED.results,
                   raw = EXCLUDED.raw, docs_path = EXCLUDED.docs_path""",
            (
                run_id,
                scope,
                success,
                rows_failed,
                json.dumps(results, default=str),
                json.dumps(raw, default=str),
                docs_path,
            ),
        )


@dataclass(frozen=True)
class DqResult:
    """A gate's outcome for one scope of a run ('': the pipeline's, else a sink's)."""

    scope: str
    success: bool
    rows_failed: int
    results: list[dict[str, Any]]  # one per expectation (quality/outcomes.py)
    docs_path: str | None
    created_at: datetime


def dq_results(conn: psycopg.Connection, run_id: int) -> list[DqResult]:
    cur = conn.cursor(row_factory=class_row(DqResult))
    return cur.execute(
        """SELECT scope, success, rows_failed, results, docs_path, created_at
                          FROM tidemark.dq_results WHERE run_id = %s ORDER BY scope""",
        (run_id,),
    ).fetchall()


def render_dq(run_id: int, rows: list[DqResult]) -> str:
    if not rows:
        return f"run {run_id}: no data-quality results (no checks, or the run never reached them)"
    out = [f"run {run_id}: data quality"]
    for r in rows:
        out.append(
            f"  {r.scope or '(pipeline)'}: {'passed' if r.success else 'FAILED'}, "
            f"{r.rows_failed:,} rows quarantined"
        )
        for res in r.results or []:
            mark = "ok  " if res.get("success") else "FAIL"
            args = ", ".join(
                f"{k}={v}"
                for k, v in (res.get("kwargs") or {}).items()
                if k not in ("result_format", "catch_exceptions", "meta")
            )
            out.append(f"    {mark} {res.get('expectation')}({args}) {observed(res)}")
        if r.docs_path:
            out.append(f"    Data Docs: {r.docs_path}")
    return "\n".join(out)
