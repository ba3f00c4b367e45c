"""What the ledger still needs of a source's records, per partition: the lowest offset that
any sink's checkpoint, quarantined dead letter, open gap or unsettled run points at
(`tidemark source prune`; docs/operations.md, "Pruning a postgres_log source")."""

from __future__ import annotations

from dataclasses import dataclass, field

import psycopg

from tidemark.ledger.runs import OPEN


@dataclass
class Needs:
    # (pipeline, sink) -> partition -> its checkpoint (the next offset it reads)
    checkpoints: dict[tuple[str, str], dict[int, int]] = field(default_factory=dict)
    letters: dict[int, tuple[int, int]] = field(default_factory=dict)  # p -> (lowest, how many)
    gaps: dict[int, int] = field(default_factory=dict)  # p -> lowest offset of an open gap
    runs: dict[int, tuple[int, int]] = field(default_factory=dict)  # p -> (lowest, its run)


def reading(conn: psycopg.Connection, table: str) -> list[str]:
    """Pipelines the ledger knows whose stored settings read a source table named ``table``
    (its file may be gone; its checkpoints still count)."""
    return [
        r[0]
        for r in conn.execute(
            "SELECT name FROM tidemark.pipelines WHERE config->'source'->>'table' = %s "
            "ORDER BY name",
            (table,),
        )
    ]


def needs(conn: psycopg.Connection, pipelines: list[str]) -> Needs:
    out = Needs()
    for pipeline, sink, partition, next_offset in conn.execute(
        "SELECT pipeline, sink, partition, next_offset FROM tidemark.checkpoints "
        "WHERE pipeline = ANY(%s)",
        (pipelines,),
    ):
        out.checkpoints.setdefault((pipeline, sink), {})[partition] = next_offset
    for p, lo, n in conn.execute(
        "SELECT source_partition, min(source_offset), count(*) FROM tidemark.dlq "
        "WHERE pipeline = ANY(%s) AND status = 'quarantined' GROUP BY 1",
        (pipelines,),
    ):
        out.letters[p] = (lo, n)
    for p, lo in conn.execute(
        "SELECT partition, min(lo) FROM tidemark.source_gaps WHERE pipeline = ANY(%s) "
        "AND resolved_by IS NULL GROUP BY 1",
        (pipelines,),
    ):
        out.gaps[p] = lo
    for p, lo, run_id in conn.execute(
        """SELECT DISTINCT ON (g.partition) g.partition, g.from_offset, g.run_id
           FROM tidemark.run_ranges g JOIN tidemark.runs r USING (run_id)
           JOIN tidemark.run_sinks s ON s.run_id = g.run_id AND s.sink = g.sink
           WHERE r.pipeline = ANY(%s) AND s.state::text = ANY(%s)
           ORDER BY g.partition, g.from_offset""",
        (pipelines, [str(s) for s in OPEN]),
    ):
        out.runs[p] = (lo, run_id)
    return out
