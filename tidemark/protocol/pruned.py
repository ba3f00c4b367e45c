"""What a re-delivery would read over that the source no longer holds (docs/design.md,
"Re-delivery": pruned positions).

A sink holds a position by a row, a tombstone (a deleted key) or a live dead letter for it.
Where the source no longer holds that position's record (retention dropped it, a segment was
deleted), a re-delivery cannot deliver it again: a rebuild would leave it out, a backfill
would remove it, and a dropped tombstone would let an older version of its key come back.
So the driver asks the source which spans of the ranges it holds (``held``, per partition:
sorted ``[lo, hi)``) and this module counts what the sink and the ledger hold outside them.

May import: ledger, config, quality, core.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from tidemark.core.db import qualified, scalar
from tidemark.ledger import letters
from tidemark.ledger.letters import CTES as _CTES
from tidemark.ledger.letters import outside as _outside
from tidemark.ledger.letters import span_args as _args
from tidemark.protocol.sinks import tombstone_name, tombstone_table

Spans = dict[int, list[tuple[int, int]]]  # partition -> [lo, hi) spans
EVERYTHING = 2**62  # the end of a range that covers every offset of a partition


@dataclass
class Found:
    """Per partition: rows, tombstones, letters outside the held spans, and the lowest and
    highest such offset."""

    rows: dict[int, int] = field(default_factory=dict)
    tombstones: dict[int, int] = field(default_factory=dict)
    letters: dict[int, int] = field(default_factory=dict)
    bounds: dict[int, tuple[int, int]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.rows or self.tombstones or self.letters)

    def _add(self, kind: dict[int, int], p: int, n: int, lo: int, hi: int) -> None:
        kind[p] = kind.get(p, 0) + n
        have = self.bounds.get(p)
        self.bounds[p] = (lo, hi) if have is None else (min(have[0], lo), max(have[1], hi))

    @staticmethod
    def _what(rows: int, tombs: int, letters: int) -> str:
        parts = [
            f"{n:,} {word}{'' if n == 1 else 's'}"
            for n, word in ((rows, "row"), (tombs, "tombstone"), (letters, "dead letter"))
            if n
        ]
        return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]

    @property
    def total_rows(self) -> int:
        return sum(self.rows.values())

    @property
    def total_tombstones(self) -> int:
        return sum(self.tombstones.values())

    def describe(self, table: str) -> str:
        """``the source no longer holds the records of 4 rows and 1 tombstone of t
        (partition 0: ... at offsets 5 to 9)``."""
        total = self._what(
            sum(self.rows.values()), sum(self.tombstones.values()), sum(self.letters.values())
        )
        where = []
        for p in sorted(self.bounds):
            lo, hi = self.bounds[p]
            at = f"offset {lo}" if lo == hi else f"offsets {lo} to {hi}"
            what = self._what(
                self.rows.get(p, 0), self.tombstones.get(p, 0), self.letters.get(p, 0)
            )
            where.append(f"partition {p}: {what} at {at}")
        return f"the source no longer holds the records of {total} of {table} ({'; '.join(where)}"


def in_sink(
    conn: psycopg.Connection, table: str, ranges: dict[int, tuple[int, int]], held: Spans
) -> Found:
    """Rows and tombstones of ``table`` in ``ranges`` (partition -> [a, b)) outside ``held``."""
    found = Found()
    tables: list[tuple[dict[int, int], sql.Composable]] = [(found.rows, sql.SQL(qualified(table)))]
    if scalar(conn.execute("SELECT to_regclass(%s)", (f"tidemark.{tombstone_name(table)}",))):
        tables.append((found.tombstones, tombstone_table(table)))
    if scalar(conn.execute("SELECT to_regclass(%s)", (qualified(table),))) is None:
        tables = tables[1:]
    for kind, t in tables:
        query = sql.SQL(_CTES).format() + sql.SQL(
            "SELECT x._tm_partition, count(*), min(x._tm_offset), max(x._tm_offset) "
            "FROM {t} x WHERE {cond} GROUP BY 1"
        ).format(t=t, cond=_outside("x", "_tm_partition", "_tm_offset"))
        for p, n, lo, hi in conn.execute(query, _args(ranges, held)):
            found._add(kind, p, n, lo, hi)
    return found


def in_ledger(
    conn: psycopg.Connection,
    found: Found,
    pipeline: str,
    sink: str,
    ranges: dict[int, tuple[int, int]],
    held: Spans,
) -> Found:
    """``found`` with the live dead letters of ``sink`` in ``ranges`` outside ``held``."""
    for p, n, lo, hi in letters.outside_held(conn, pipeline, sink, ranges, held):
        found._add(found.letters, p, n, lo, hi)
    return found


def carry_tombstones(
    conn: psycopg.Connection, live: str, new: str, cols: list[str], held: Spans
) -> int:
    """A rebuild with --accept-pruned: the tombstones of ``live`` whose records the source
    no longer holds go into ``new``'s tombstone table, so that their keys stay deleted (the
    source can no longer say so). Returns how many."""
    if not scalar(conn.execute("SELECT to_regclass(%s)", (f"tidemark.{tombstone_name(live)}",))):
        return 0
    names = sql.SQL(", ").join(sql.Identifier(c) for c in cols)
    query = sql.SQL(_CTES).format() + sql.SQL(
        "INSERT INTO {new} ({cols}) SELECT {cols} FROM {old} x WHERE {cond}"
    ).format(
        new=tombstone_table(new),
        old=tombstone_table(live),
        cols=names,
        cond=sql.SQL("NOT EXISTS (SELECT 1 FROM h WHERE h.p = x._tm_partition "
                     "AND x._tm_offset >= h.lo AND x._tm_offset < h.hi)"),
    )  # fmt: skip
    return conn.execute(query, _args({}, held)).rowcount
