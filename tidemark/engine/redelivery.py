"""Executor side of re-delivery (backfill, redrive): docs/design.md, "Re-delivery", for one
sink in one task, on the sink's and the ledger's transactions of that task.

The rule: the sink ends as if every record of the re-delivered range had been delivered once
with the current pipeline, and every record outside it as it was. Replace by position:

1. :meth:`Removal.remove` (the writer runs it as the sink's transaction begins, before any
   row is written): every row whose ``(partition, offset)`` lies in the range goes; their
   keys are kept in a scratch table.
2. the records of the range that pass now are placed by the writer's merge, as in a first
   delivery (newest version of a key wins; never over a newer row outside the range);
3. those that fail now are quarantined for this sink (tidemark/engine/sink_task.py);
4. :meth:`Redelivery.settle` finds the keys that lost their row in 1 and have none now, and
   :meth:`Redelivery.fall_back` places each one's newest remaining version that passes now
   (the driver read the candidates: tidemark/driver/fallback.py); newer ones that fail now
   are quarantined in turn. So does the key a removed row's record maps to now, where it
   fails now and that key has no row (``moved``): after a transform change, the versions
   that row placed are its;
5. a live letter is resolved when its record ends placed by a row: the range's records that
   passed now, and the version a key fell back to (tidemark/engine/placement.py).

A redrive's "range" is its letters' positions; their records have no rows, so no key loses
one (if one does, the sink fails and says to backfill instead).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg
import pyarrow as pa
from psycopg import sql

from tidemark.core.columns import OFFSET, PARTITION
from tidemark.engine.records import ERR_CLASS, ERR_REASON, TOMBSTONE, TOMBSTONE_KEPT
from tidemark.ledger import markers
from tidemark.protocol.taskspec import Failures, SinkTarget

if TYPE_CHECKING:
    from collections.abc import Callable

    from tidemark.engine.dead_letters import DeadLetters, Record
    from tidemark.engine.sink_writer import SinkWriter
    from tidemark.engine.tombstones import Tombstones

Key = tuple[Any, ...]
# (partition, condition on _tm_offset, its arguments): where the re-delivered records sit.
Position = tuple[int, sql.Composable, list[Any]]


def range_positions(target: SinkTarget) -> list[Position]:
    """The positions of the ranges; with --accept-pruned (``held``) only those whose records
    the source still holds: a row or tombstone at another stays as it is (docs/design.md,
    "Re-delivery": it cannot be re-delivered, and a tombstone removed would let an older
    version of its key come back)."""
    if target.held is None:
        return [
            (p, sql.SQL("_tm_offset >= %s AND _tm_offset < %s"), [a, b])
            for p, (a, b) in target.ranges.items()
        ]
    inside = sql.SQL(
        "_tm_offset >= %s AND _tm_offset < %s AND EXISTS (SELECT 1 FROM "
        "unnest(%s::bigint[], %s::bigint[]) AS h(lo, hi) WHERE _tm_offset >= h.lo "
        "AND _tm_offset < h.hi)"
    )
    out: list[Position] = []
    for p, (a, b) in target.ranges.items():
        spans = target.held.get(p, [])
        out.append((p, inside, [a, b, [lo for lo, _ in spans], [hi for _, hi in spans]]))
    return out


def held_positions(dead: DeadLetters) -> list[Position]:
    return [
        (p, sql.SQL("_tm_offset = ANY(%s)"), [offs.to_pylist()])
        for p, offs in dead.held_offsets.items()
    ]


@dataclass
class _Known:
    """What the sink and the ledger already hold of the candidate versions."""

    own: set[tuple[int, int]] = field(default_factory=set)  # a row of their own
    lettered: set[tuple[int, int]] = field(default_factory=set)  # a live letter
    applied: set[tuple[int, int]] = field(default_factory=set)  # tombstones in the table
    ours: set[tuple[int, int]] = field(default_factory=set)  # this task's tombstones


class Unordered(Exception):
    """Versions of one key from two partitions and no version column to order them."""


def lost_table(gid: str) -> sql.Composed:
    """The scratch table of the keys step 1 removed a row of, in the sink's transaction
    ``gid``."""
    return markers.stage_table("lost", gid)


class Removal:
    """Step 1, for the sink's writer to run as its transaction begins (sink_writer.Removal):
    the rows and tombstones at ``positions`` (asked for then: a redrive holds its letters
    first) go, their keys into :func:`lost_table`."""

    def __init__(
        self, target: SinkTarget, gid: str, positions: Callable[[], list[Position]]
    ) -> None:
        self.keys = sql.SQL(", ").join(sql.Identifier(k) for k in target.key)
        self.lost_table = lost_table(gid)
        self.positions = positions

    def remove(
        self, conn: psycopg.Connection, table: sql.Composable, tombs: Tombstones | None
    ) -> int:
        conn.execute(
            sql.SQL("CREATE UNLOGGED TABLE {} AS SELECT {} FROM {} WITH NO DATA").format(
                self.lost_table, self.keys, table
            )
        )
        removed = 0
        for part, cond, args in self.positions():
            removed += conn.execute(
                sql.SQL(
                    "WITH gone AS (DELETE FROM {t} WHERE _tm_partition = %s AND {cond} "
                    "RETURNING {keys}) INSERT INTO {lost} SELECT {keys} FROM gone"
                ).format(t=table, cond=cond, keys=self.keys, lost=self.lost_table),
                [part, *args],
            ).rowcount
            if tombs is not None:  # a tombstone is a version too: it goes likewise
                removed += tombs.remove_at(part, cond, args, self.lost_table)
        return removed


class Redelivery:
    """Steps 4 and 5 for one sink, once its range is placed, through its writer (whose
    transaction ran step 1: :class:`Removal`) and its dead letters."""

    def __init__(
        self,
        target: SinkTarget,
        writer: SinkWriter,
        dead: DeadLetters,
        *,
        moved: list[list[Any]] | None = None,
        fallback_failed: Failures | None = None,
    ) -> None:
        self.t, self.w, self.dead = target, writer, dead
        self.moved = moved or []  # keys the range's failing records map to now
        self.fallback_failed = fallback_failed or {}  # row-level failures of the candidates
        self.keys = [sql.Identifier(k) for k in target.key]
        self.lost_table = lost_table(writer.gid)
        self.fallback = 0  # candidate versions examined (SinkCounts.fallback)

    # -- step 4 ------------------------------------------------------------------------------
    def settle(self) -> set[Key] | None:
        """After the range is placed: the keys that lost their row and have none now, or
        None if the sink failed (it says why)."""
        self.w.flush()
        if self.w.failed:
            return None
        try:
            # A range with no row to write still removes its rows (the transaction's start).
            conn = self.w.connection()
            self._moved(conn)
            lost = self._lost(conn)
            conn.execute(sql.SQL("DROP TABLE {}").format(self.lost_table))
        except psycopg.Error as exc:
            self.w.fail(exc)
            return None
        refused = lost & self.w.write_failed_keys
        if refused:
            self.w.fail(
                RuntimeError(
                    f"key ({', '.join(self.t.key)})={show(next(iter(refused)))} lost its row: "
                    f"its record in the range passes the checks but PostgreSQL refused its row "
                    f"(see its dead letter), and its older versions were not read; fix the table "
                    f"or the transform, then backfill again"
                )
            )
            return None
        return lost

    def _moved(self, conn: psycopg.Connection) -> None:
        """The keys the range's failing records map to now where their rows went (the
        driver found them): the versions those rows placed are theirs now, so they fall
        back like the keys that lost their rows."""
        if not self.moved:
            return
        with conn.cursor() as cur:
            cur.executemany(
                sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
                    self.lost_table,
                    sql.SQL(", ").join(self.keys),
                    sql.SQL(", ").join([sql.Placeholder()] * len(self.keys)),
                ),
                self.moved,
            )

    def _lost(self, conn: psycopg.Connection) -> set[Key]:
        """Keys whose row step 1 removed and that have none now."""
        match = sql.SQL(" AND ").join(sql.SQL("t.{k} = l.{k}").format(k=k) for k in self.keys)
        return {
            tuple(r)
            for r in conn.execute(
                sql.SQL(
                    "SELECT DISTINCT {keys} FROM {lost} l WHERE NOT EXISTS "
                    "(SELECT 1 FROM {t} t WHERE {match})"
                ).format(
                    keys=sql.SQL(", ").join(sql.SQL("l.{}").format(k) for k in self.keys),
                    lost=self.lost_table,
                    t=self.w.table,
                    match=match,
                )
            )
        }

    def fall_back(self, lost: set[Key], candidates: list[pa.RecordBatch]) -> dict[int, list[int]]:
        """Step 4: per lost key, its candidate versions newest first (version column, then
        partition and offset); each that fails now is quarantined (one a live letter holds
        already keeps it as it is), the first that passes is placed. A candidate with a row
        of its own (made under another key by an earlier pipeline) is placed as it was and
        left alone: placing it again would place it twice. Returns the placed positions."""
        placed: dict[int, list[int]] = {}
        if not lost or not (candidates or self.w.tomb_rows):
            return placed
        read = pa.Table.from_batches(candidates) if candidates else None
        # The range's own tombstones (step 2 applied them) are versions of their keys too:
        # the walk stops at one, and no older version comes back.
        rows = [
            r
            for r in (read.to_pylist() if read else []) + self.w.tomb_rows
            if tuple(r[k] for k in self.t.key) in lost
        ]
        try:
            known = self._known(rows)
        except psycopg.Error as exc:
            self.w.fail(exc)
            return placed
        versions: dict[Key, list[Record]] = {}
        for r in rows:
            if (r[PARTITION], r[OFFSET]) not in known.own:
                versions.setdefault(tuple(r[k] for k in self.t.key), []).append(r)
        try:
            good, bad, tombs = self._walk(versions, known, placed)
        except Unordered as exc:
            self.w.fail(exc)
            return placed
        self.w.add_tombstones(tombs)
        if good:
            assert read is not None  # a version that passes is a candidate, not a tombstone
            self.w.add(pa.Table.from_pylist(good, schema=read.schema).to_batches()[0])
        self.w.flush()
        self.dead.add(bad)
        return placed

    def _known(self, rows: list[Record]) -> _Known:
        known = _Known(ours={(r[PARTITION], r[OFFSET]) for r in self.w.tomb_rows})
        by_part: dict[int, list[int]] = {}
        for r in rows:
            by_part.setdefault(r[PARTITION], []).append(r[OFFSET])
        for part, offs in by_part.items():
            known.own |= {(part, o) for o in self.w.own_rows(part, offs)}
            known.lettered |= {(part, o) for o in self.dead.live(part, offs)}
            known.applied |= {(part, o) for o in self.w.tombstones_at(part, offs)}
        return known

    def _walk(
        self, versions: dict[Key, list[Record]], known: _Known, placed: dict[int, list[int]]
    ) -> tuple[list[Record], list[Record], list[Record]]:
        """Each key's versions, newest first, until one places it: (versions that place a
        row, versions quarantined on the way, tombstones that keep it deleted)."""
        good: list[Record] = []
        bad: list[Record] = []
        tombs: list[Record] = []
        for chain in versions.values():
            chain.sort(key=functools.cmp_to_key(self._order), reverse=True)
            for r in chain:
                pos = (r[PARTITION], r[OFFSET])
                if r[ERR_CLASS] == TOMBSTONE and (pos in known.ours or pos in known.applied):
                    break  # placed already (by the range, or as it was): the key stays deleted
                if r[ERR_CLASS] == TOMBSTONE and self.t.tombstones == "delete":
                    # The key stays deleted, this tombstone its newest version now; a letter
                    # that held it is resolved like a fallen-back row's (step 5).
                    self.fallback += 1
                    tombs.append(r)
                    placed.setdefault(pos[0], []).append(pos[1])
                    break
                why = self._fails(r)
                if why is not None and pos in known.lettered:
                    continue  # placed by its letter as it was (an operator's discard stands)
                self.fallback += 1
                if why is None:
                    good.append(r)
                    placed.setdefault(pos[0], []).append(pos[1])
                    break
                r[ERR_CLASS], r[ERR_REASON] = why
                bad.append(r)
        return good, bad, tombs

    def _order(self, a: Record, b: Record) -> int:
        """Version order (docs/design.md): the version column, ties by (partition, offset);
        where one has no version (a tombstone the transform gave none, or a version that
        fails), by offset within a partition, and below every versioned one across them."""
        v = self.t.version
        x: Any
        y: Any
        if v and a[v] is not None and b[v] is not None:
            x, y = (a[v], a[PARTITION], a[OFFSET]), (b[v], b[PARTITION], b[OFFSET])
        elif a[PARTITION] == b[PARTITION]:
            x, y = a[OFFSET], b[OFFSET]
        elif v:
            x, y = (a[v] is not None, a[PARTITION]), (b[v] is not None, b[PARTITION])
        else:  # as the merge refuses them (sink_writer.py)
            raise Unordered(
                f"key ({', '.join(self.t.key)})={show(tuple(a[k] for k in self.t.key))} has "
                f"versions from several partitions, which offsets do not order; declare a "
                f"version column for this sink (sinks[].version)"
            )
        return int((x > y) - (x < y))

    def _fails(self, r: Record) -> tuple[str, str] | None:
        """Why candidate ``r`` fails with the current pipeline (None: it passes)."""
        if r[ERR_CLASS] == TOMBSTONE:  # where the sink keeps tombstones as letters
            return "decode", TOMBSTONE_KEPT
        if r[ERR_CLASS] is not None:
            return r[ERR_CLASS], r[ERR_REASON]
        why = (self.fallback_failed.get(r[PARTITION]) or {}).get(r[OFFSET])
        if why is not None:
            return "validation", why
        if self.t.version and r[self.t.version] is None:
            return "transform", f"version column {self.t.version} is NULL"
        return None


def show(key: Key) -> str:
    return "(" + ", ".join(str(k) for k in key) + ")"
