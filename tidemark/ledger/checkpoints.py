"""Checkpoints: per (pipeline, sink, partition), the next offset to deliver and where the sink
began (``start_offset``: the first offset it was ever to receive; NULL when a ledger from
before V009 could not tell, read as the source's first record). Written only by the run
state machine (state.py: seeded at a claim, advanced at a commit); read here."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

import psycopg
from psycopg.rows import class_row


@dataclass(frozen=True)
class Checkpoint:
    sink: str
    partition: int
    next_offset: int
    start_offset: int | None  # None: not known (read as the source's first record)
    updated_at: datetime


def listing(
    conn: psycopg.Connection, pipeline: str, sinks: Iterable[str] | None = None
) -> list[Checkpoint]:
    """The pipeline's checkpoints (only ``sinks``', if given), ordered by sink and partition."""
    names = None if sinks is None else list(sinks)
    return (
        conn.cursor(row_factory=class_row(Checkpoint))
        .execute(
            """SELECT sink, partition, next_offset, start_offset, updated_at FROM tidemark.checkpoints
           WHERE pipeline = %s AND (%s::text[] IS NULL OR sink = ANY(%s::text[]))
           ORDER BY sink, partition""",
            (pipeline, names, names),
        )
        .fetchall()
    )


def positions(
    conn: psycopg.Connection, pipeline: str, sinks: Iterable[str] | None = None
) -> dict[str, dict[int, int]]:
    """{sink: {partition: next_offset}} of the pipeline (only ``sinks``, if given)."""
    out: dict[str, dict[int, int]] = {}
    for r in listing(conn, pipeline, sinks):
        out.setdefault(r.sink, {})[r.partition] = r.next_offset
    return out


def starts(
    conn: psycopg.Connection, pipeline: str, sinks: Iterable[str] | None = None
) -> dict[str, dict[int, int]]:
    """{sink: {partition: start_offset}}: where each sink began, where the ledger knows it
    (a partition left out began at the first record the source holds)."""
    out: dict[str, dict[int, int]] = {}
    for r in listing(conn, pipeline, sinks):
        if r.start_offset is not None:
            out.setdefault(r.sink, {})[r.partition] = r.start_offset
    return out
