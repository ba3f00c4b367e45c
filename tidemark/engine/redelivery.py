"""Executor side of re-delivery (backfill, redrive): docs/design.md, "Re-delivery", for one
sink in one task, on the sink's and the ledger's transactions of that task.

The rule: the sink ends as if every record of the re-delivered range had been delivered once
with the current pipeline, and every record outside it as it was. Replace by position:

1. :meth:`Redelivery.remove` (before any row is written): every row whose
   ``(partition, offset)`` lies in the range goes; their keys are kept in a scratch table.
2. the records of the range that pass now are placed by the writer's merge, as in a first
   delivery (newest version of a key wins; never over a newer row outside the range);
3. those that fail now are quarantined for this sink (``_Sink.place``);
4. :meth:`Redelivery.finish`: a key that lost its row in 1 and has none now falls back to its
   newest remaining version that passes now (the driver read the candidates:
   tidemark/driver/fallback.py); newer ones that fail now are quarantined in turn. So does
   the key a removed row's record maps to now, where it fails now and that key has no row
   (``SinkTarget.moved``): after a transform change, the versions that row placed are its;
5. a live letter is resolved when its record ends placed by a row: the range's records that
   passed now, and the version a key fell back to.

A redrive's "range" is its letters' positions; their records have no rows, so no key loses
one (if one does, the sink fails and says to backfill instead).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import psycopg
import pyarrow as pa
from psycopg import sql

from tidemark.engine.records import ERR_CLASS, ERR_REASON, TOMBSTONE, TOMBSTONE_KEPT
from tidemark.ledger import markers

if TYPE_CHECKING:
    from tidemark.engine.writer import DeadLetters, SinkWriter
    from tidemark.protocol.taskspec import SinkTarget, TaskSpec

PARTITION, OFFSET = "_tm_partition", "_tm_offset"


class Unordered(Exception):
    """Versions of one key from two partitions and no version column to order them."""


class Redelivery:
    def __init__(self, spec: TaskSpec, target: SinkTarget, writer: SinkWriter, dead: DeadLetters):
        self.spec, self.t, self.w, self.dead = spec, target, writer, dead
        self.removed = False
        self.keys = [sql.Identifier(k) for k in target.key]

    @property
    def _conn(self) -> psycopg.Connection:
        """The sink's connection of the task: :meth:`remove` opened it (it runs first)."""
        conn = self.w.conn
        if conn is None:
            raise RuntimeError("re-delivery on a sink writer that has no connection open")
        return conn

    # -- step 1 ------------------------------------------------------------------------------
    def positions(self) -> list[tuple[int, sql.Composable, list[Any]]]:
        """(partition, condition on _tm_offset, its arguments) of the re-delivered range."""
        if self.spec.mode == "redrive":
            return [
                (p, sql.SQL("_tm_offset = ANY(%s)"), [offs.to_pylist()])
                for p, offs in self.dead.held_offsets.items()
            ]
        return [
            (p, sql.SQL("_tm_offset >= %s AND _tm_offset < %s"), [a, b])
            for p, (a, b) in self.t.ranges.items()
        ]

    def remove(self) -> None:
        """Step 1, once, before the task's first row reaches the sink."""
        if self.removed:
            return
        self.removed = True
        conn = self.w._open()
        self.lost_table = markers.stage_table("lost", self.w.gid)
        keys = sql.SQL(", ").join(self.keys)
        conn.execute(
            sql.SQL("CREATE UNLOGGED TABLE {} AS SELECT {} FROM {} WITH NO DATA").format(
                self.lost_table, keys, self.w.table
            )
        )
        for part, cond, args in self.positions():
            self.w.out["removed"] += conn.execute(
                sql.SQL(
                    "WITH gone AS (DELETE FROM {t} WHERE _tm_partition = %s AND {cond} "
                    "RETURNING {keys}) INSERT INTO {lost} SELECT {keys} FROM gone"
                ).format(t=self.w.table, cond=cond, keys=keys, lost=self.lost_table),
                [part, *args],
            ).rowcount
            if self.w.tombs is not None:  # a tombstone is a version too: it goes likewise
                self.w.out["removed"] += self.w.tombs.remove_at(part, cond, args, self.lost_table)

    # -- steps 4 and 5 ------------------------------------------------------------------------
    def finish(self, candidates: list[pa.RecordBatch]) -> None:
        """After the range is placed: fall back (4), then resolve letters (5)."""
        self.w.flush()
        if self.w.failed:
            return
        try:
            self.remove()  # a range with no row to write still removes its rows
            self._moved()
            lost = self._lost()
            self._drop()
        except psycopg.Error as exc:
            self.w._fail(exc)
            return
        refused = lost & self.w.write_failed_keys
        if refused:
            self.w._fail(
                RuntimeError(
                    f"key ({', '.join(self.t.key)})={_show(next(iter(refused)))} lost its row: "
                    f"its record in the range passes the checks but PostgreSQL refused its row "
                    f"(see its dead letter), and its older versions were not read; fix the table "
                    f"or the transform, then backfill again"
                )
            )
            return
        if self.spec.mode == "redrive":
            if lost:
                self.w._fail(
                    RuntimeError(
                        f"key ({', '.join(self.t.key)})={_show(next(iter(lost)))} had its row at "
                        f"the position of a live dead letter (placed twice); backfill that range "
                        f"instead of redriving it"
                    )
                )
                return
            self.dead.resolve_held()
            return
        placed = self._fall_back(lost, candidates)
        if self.w.failed:
            return
        by = self.spec.by or "tidemark"
        for part, (a, b) in self.t.ranges.items():
            self.dead.resolve(part, a, b)
        for part, offs in placed.items():
            self.dead.resolve_offsets(
                part, offs, by, f"fallen back to by {self.spec.mode} run {self.spec.run_id}"
            )

    def _moved(self) -> None:
        """The keys the range's failing records map to now where their rows went (the
        driver found them): the versions those rows placed are theirs now, so they fall
        back like the keys that lost their rows."""
        if not self.t.moved:
            return
        with self._conn.cursor() as cur:
            cur.executemany(
                sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
                    self.lost_table,
                    sql.SQL(", ").join(self.keys),
                    sql.SQL(", ").join([sql.Placeholder()] * len(self.keys)),
                ),
                self.t.moved,
            )

    def _lost(self) -> set[tuple[Any, ...]]:
        """Keys whose row step 1 removed and that have none now."""
        match = sql.SQL(" AND ").join(sql.SQL("t.{k} = l.{k}").format(k=k) for k in self.keys)
        return {
            tuple(r)
            for r in self._conn.execute(
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

    def _drop(self) -> None:
        self._conn.execute(sql.SQL("DROP TABLE {}").format(self.lost_table))

    def _fall_back(
        self, lost: set[tuple[Any, ...]], candidates: list[pa.RecordBatch]
    ) -> dict[int, list[int]]:
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
        ours = {(r[PARTITION], r[OFFSET]) for r in self.w.tomb_rows}
        own: set[tuple[int, int]] = set()
        lettered: set[tuple[int, int]] = set()
        applied: set[tuple[int, int]] = set()  # tombstones the sink's table holds
        by_part: dict[int, list[int]] = {}
        for r in rows:
            by_part.setdefault(r[PARTITION], []).append(r[OFFSET])
        try:
            for part, offs in by_part.items():
                own |= {(part, o) for o in self.w.own_rows(part, offs)}
                lettered |= {(part, o) for o in self.dead.live(part, offs)}
                if self.w.tombs is not None:
                    applied |= {(part, o) for o in self.w.tombs.held(part, offs)}
        except psycopg.Error as exc:
            self.w._fail(exc)
            return placed
        versions: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
        for r in rows:
            if (r[PARTITION], r[OFFSET]) not in own:
                versions.setdefault(tuple(r[k] for k in self.t.key), []).append(r)
        good, bad, tombs = [], [], []
        for chain in versions.values():
            try:
                chain.sort(key=functools.cmp_to_key(self._order), reverse=True)
            except Unordered as exc:
                self.w._fail(exc)
                return placed
            for r in chain:
                pos = (r[PARTITION], r[OFFSET])
                if r[ERR_CLASS] == TOMBSTONE and (pos in ours or pos in applied):
                    break  # placed already (by the range, or as it was): the key stays deleted
                if r[ERR_CLASS] == TOMBSTONE and self.t.tombstones == "delete":
                    # The key stays deleted, this tombstone its newest version now; a letter
                    # that held it is resolved like a fallen-back row's (step 5).
                    self.w.out["fallback"] += 1
                    tombs.append(r)
                    placed.setdefault(pos[0], []).append(pos[1])
                    break
                why = self._fails(r)
                if why is not None and (r[PARTITION], r[OFFSET]) in lettered:
                    continue  # placed by its letter as it was (an operator's discard stands)
                self.w.out["fallback"] += 1
                if why is None:
                    good.append(r)
                    placed.setdefault(r[PARTITION], []).append(r[OFFSET])
                    break
                r[ERR_CLASS], r[ERR_REASON] = why
                bad.append(r)
        self.w.add_tombstones(tombs)
        if good:
            # Only candidates pass: the range's own tombstones stop the walk (ours), so
            # ``read`` holds every row in ``good``.
            assert read is not None
            self.w.add(pa.Table.from_pylist(good, schema=read.schema).to_batches()[0])
        self.w.flush()
        self.dead.add(bad)
        return placed

    def _order(self, a: dict[str, Any], b: dict[str, Any]) -> int:
        """Version order (docs/design.md): the version column, ties by (partition, offset);
        where one has no version (a tombstone the transform gave none, or a version that
        fails), by offset within a partition, and below every versioned one across them."""
        v = self.t.version
        x: tuple[Any, ...]
        y: tuple[Any, ...]
        if v and a[v] is not None and b[v] is not None:
            x, y = (a[v], a[PARTITION], a[OFFSET]), (b[v], b[PARTITION], b[OFFSET])
        elif a[PARTITION] == b[PARTITION]:
            x, y = (a[OFFSET],), (b[OFFSET],)
        elif v:
            x, y = (a[v] is not None, a[PARTITION]), (b[v] is not None, b[PARTITION])
        else:  # as the writer's merge refuses them (writer.py, _check_partitions)
            raise Unordered(
                f"key ({', '.join(self.t.key)})={_show(tuple(a[k] for k in self.t.key))} has "
                f"versions from several partitions, which offsets do not order; declare a "
                f"version column for this sink (sinks[].version)"
            )
        return (x > y) - (x < y)

    def _fails(self, r: dict[str, Any]) -> tuple[str, str] | None:
        """Why candidate ``r`` fails with the current pipeline (None: it passes)."""
        if r[ERR_CLASS] == TOMBSTONE:  # where the sink keeps tombstones as letters
            return "decode", TOMBSTONE_KEPT
        if r[ERR_CLASS] is not None:
            return r[ERR_CLASS], r[ERR_REASON]
        why = (self.t.fallback_failed.get(r[PARTITION]) or {}).get(r[OFFSET])
        if why is not None:
            return "validation", why
        if self.t.version and r[self.t.version] is None:
            return "transform", f"version column {self.t.version} is NULL"
        return None


def _show(key: tuple[Any, ...]) -> str:
    return "(" + ", ".join(str(k) for k in key) + ")"
