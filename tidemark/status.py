"""What `tidemark status` shows: checkpoints, recent runs, dead letters, halts."""

from __future__ import annotations

import psycopg
from psycopg.rows import dict_row


def pipeline_status(conn: psycopg.Connection, pipeline: str, runs: int = 10) -> dict:
    cur = conn.cursor(row_factory=dict_row)
    row = cur.execute("SELECT halted_reason, halted_at FROM tidemark.pipelines WHERE name = %s",
                      (pipeline,)).fetchone()
    checkpoints = cur.execute(
        """SELECT sink, partition, next_offset, updated_at FROM tidemark.checkpoints
           WHERE pipeline = %s ORDER BY sink, partition""", (pipeline,)).fetchall()
    recent = cur.execute(
        """SELECT r.run_id, r.mode, r.created_at, r.finished_at, rs.sink, rs.state::text AS state,
                  rs.counts, rs.error
           FROM tidemark.runs r JOIN tidemark.run_sinks rs USING (run_id)
           WHERE r.pipeline = %s AND r.run_id IN (
               SELECT run_id FROM tidemark.runs WHERE pipeline = %s
               ORDER BY run_id DESC LIMIT %s)
           ORDER BY r.run_id DESC, rs.sink""", (pipeline, pipeline, runs)).fetchall()
    dlq = cur.execute(
        """SELECT coalesce(sink, '-') AS sink, error_class::text AS error_class,
                  status::text AS status, count(*) AS records
           FROM tidemark.dlq WHERE pipeline = %s GROUP BY 1, 2, 3 ORDER BY 1, 2, 3""",
        (pipeline,)).fetchall()
    leases = cur.execute(
        """SELECT sink, epoch, run_id, owner, expires_at FROM tidemark.leases
           WHERE pipeline = %s ORDER BY sink""", (pipeline,)).fetchall()
    return {"pipeline": pipeline, "known": row is not None,
            "halted": row["halted_reason"] if row else None,
            "checkpoints": checkpoints, "runs": recent, "dead_letters": dlq, "leases": leases}


def render(st: dict) -> str:
    out = [f"pipeline {st['pipeline']}"]
    if not st["known"]:
        return out[0] + ": never run"
    if st["halted"]:
        out.append(f"  HALTED: {st['halted']}")
    out.append("  checkpoints (next offset to deliver):")
    for c in st["checkpoints"]:
        out.append(f"    {c['sink']:<16} partition {c['partition']:<4} {c['next_offset']:>12,}")
    out.append("  recent runs:")
    for r in st["runs"]:
        counts = r["counts"] or {}
        rows = counts.get("rows", 0)
        dead = counts.get("sink_dead", 0) + counts.get("source_dead", 0)
        err = f"  {r['error'][:100]}" if r["error"] else ""
        out.append(f"    {r['run_id']:>6} {r['mode']:<8} {r['sink']:<16} {r['state']:<10} "
                   f"{rows:>10,} rows {dead:>7,} dlq  {r['created_at']:%Y-%m-%d %H:%M:%S}{err}")
    out.append("  dead letters:")
    if not st["dead_letters"]:
        out.append("    none")
    for d in st["dead_letters"]:
        out.append(f"    {d['sink']:<16} {d['error_class']:<11} {d['status']:<12} "
                   f"{d['records']:>8,}")
    return "\n".join(out)
