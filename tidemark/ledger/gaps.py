"""The gaps a sink stepped over (docs/design.md, invariant 2; migration V013).

A run that reads a range of a source with gaps (a file archive: offsets between one
segment's last record and the next segment's base) records them for each sink before it
reads (:func:`record`): what it cannot have read. They count once the run commits for that
sink (:func:`settle`, in the advance transaction, which recovery's roll-forward runs too);
a run that aborts leaves them unstepped. A re-delivery (backfill, rebuild) that commits reads
its ranges again: the gaps inside them are resolved, the parts of a gap outside them stay
open, and what it stepped over itself is recorded as new gaps.

A record that appears later inside an open gap lies below the checkpoint and was placed
nowhere: the driver asks the source (tidemark/driver/gaps.py) and reports it.

May import: config, quality, core.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg


@dataclass(frozen=True)
class Gap:
    pipeline: str
    sink: str
    partition: int
    lo: int
    hi: int


def record(
    conn: psycopg.Connection,
    pipeline: str,
    run_id: int,
    gaps: dict[str, dict[int, list[tuple[int, int]]]],
) -> None:
    """Before the read: ``gaps`` (sink -> partition -> [lo, hi) spans) of run ``run_id``."""
    rows = [
        (pipeline, sink, p, lo, hi, run_id)
        for sink, parts in gaps.items()
        for p, spans in parts.items()
        for lo, hi in spans
    ]
    if not rows:
        return
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO tidemark.source_gaps (pipeline, sink, partition, lo, hi, run_id) "
            "VALUES (%s, %s, %s, %s, %s, %s)",
            rows,
        )


def settle(conn: psycopg.Connection, pipeline: str, run_id: int, sink: str) -> None:
    """Inside the advance of ``run_id`` for ``sink``: a re-delivery's ranges resolve the
    open gaps they cover (what of a gap lies outside them stays open), then the run's own
    gaps count."""
    conn.execute(
        """WITH hit AS (
               UPDATE tidemark.source_gaps g SET resolved_by = %(r)s, resolved_at = now()
               FROM tidemark.run_ranges rr JOIN tidemark.runs r USING (run_id)
               WHERE rr.run_id = %(r)s AND rr.sink = %(s)s AND r.mode IN ('backfill', 'rebuild')
                 AND g.pipeline = %(p)s AND g.sink = %(s)s AND g.partition = rr.partition
                 AND g.stepped AND g.resolved_by IS NULL
                 AND g.lo < rr.to_offset AND g.hi > rr.from_offset
               RETURNING g.partition, g.lo, g.hi, g.run_id, rr.from_offset, rr.to_offset)
           INSERT INTO tidemark.source_gaps (pipeline, sink, partition, lo, hi, run_id,
                                             stepped)
           SELECT %(p)s, %(s)s, partition, lo, least(hi, from_offset), run_id, true
             FROM hit WHERE lo < from_offset
           UNION ALL
           SELECT %(p)s, %(s)s, partition, greatest(lo, to_offset), hi, run_id, true
             FROM hit WHERE hi > to_offset""",
        {"p": pipeline, "r": run_id, "s": sink},
    )
    conn.execute(
        "UPDATE tidemark.source_gaps SET stepped = true WHERE run_id = %s AND sink = %s",
        (run_id, sink),
    )


def open_gaps(conn: psycopg.Connection, pipeline: str | None = None) -> list[Gap]:
    """The gaps sinks stepped over that no re-delivery has read again (of one pipeline)."""
    rows = conn.execute(
        "SELECT pipeline, sink, partition, lo, hi FROM tidemark.source_gaps "
        "WHERE stepped AND resolved_by IS NULL AND (%(p)s::text IS NULL OR pipeline = %(p)s) "
        "ORDER BY pipeline, sink, partition, lo",
        {"p": pipeline},
    ).fetchall()
    return [Gap(*r) for r in rows]
