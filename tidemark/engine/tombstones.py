"""Tombstones that delete their key (``tombstones: delete``; docs/design.md, "Re-delivery").

A tombstone is a version of its key that places no row. In the task's sink transaction it
removes the key's row if that row is an older version, and is kept in the sink's tombstone
table (tidemark/protocol/sinks.py, one row per deleted key: its version and position), so that
an older version, re-delivered later by a backfill, a redrive or a fallback, never brings the
key back: the writer's merge skips a row older than its key's tombstone.

Version order is the rows' order: the version column, ties by (partition, offset); a tombstone
whose version the transform leaves NULL orders by offset within its partition only, and
against another partition's version fails the sink, naming the key (as two partitions' rows
without a version column do).
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from tidemark.core.columns import OFFSET, PARTITION
from tidemark.core.db import scalar
from tidemark.ledger import markers
from tidemark.protocol.sinks import tombstone_name, tombstone_table


def newer(a: str, b: str, key: list[str], version: str | None) -> sql.Composed:
    """SQL: the version aliased ``a`` is at least as new as ``b`` (same key), for the merge's
    guard and the tombstones' alike: the version column, equal versions broken by (partition,
    offset) as the merge's DISTINCT ON breaks them within a batch, so every replay converges
    on the same row; without one (or where a tombstone has none), by offset within a
    partition. Versions of one key from two partitions that nothing orders fail the sink,
    naming the key, instead of picking one."""
    same = sql.SQL("{a}._tm_partition = {b}._tm_partition").format(a=sql.SQL(a), b=sql.SQL(b))
    by_offset = sql.SQL("{a}._tm_offset >= {b}._tm_offset").format(a=sql.SQL(a), b=sql.SQL(b))
    label = sql.SQL("{} || concat_ws(', ', {}) || ')'").format(
        sql.Literal(f"({', '.join(key)})=("),
        sql.SQL(", ").join(
            sql.SQL("{}.{}::text").format(sql.SQL(a), sql.Identifier(k)) for k in key
        ),
    )
    conflict = markers.version_conflict(
        label, sql.SQL(f"{b}._tm_partition"), sql.SQL(f"{a}._tm_partition")
    )
    if version is None:
        return sql.SQL("CASE WHEN {same} THEN {by_offset} ELSE {conflict} END").format(
            same=same, by_offset=by_offset, conflict=conflict
        )
    v = sql.Identifier(version)
    return sql.SQL("""CASE WHEN {a}.{v} IS NOT NULL AND {b}.{v} IS NOT NULL
                           THEN ({a}.{v}, {a}._tm_partition, {a}._tm_offset)
                                >= ({b}.{v}, {b}._tm_partition, {b}._tm_offset)
                           WHEN {same} THEN {by_offset} ELSE {conflict} END""").format(
        a=sql.SQL(a), b=sql.SQL(b), v=v, same=same, by_offset=by_offset, conflict=conflict
    )


def exists(conn: psycopg.Connection, table: str) -> bool:
    """Whether the sink ever deleted keys (its tombstone table exists)."""
    return (
        scalar(conn.execute("SELECT to_regclass(%s)", (f"tidemark.{tombstone_name(table)}",)))
        is not None
    )


class Tombstones:
    """One sink's tombstones in one task's transaction on it."""

    def __init__(
        self,
        conn: psycopg.Connection,
        gid: str,
        target_table: sql.Composable,
        table: str,
        key: list[str],
        version: str | None,
    ):
        self.conn, self.target, self.key, self.version = conn, target_table, key, version
        self.table = tombstone_table(table)
        self.stage = markers.stage_table("tombstage", gid)
        self.cols = [*key, *([version] if version else []), PARTITION, OFFSET]
        self.pending: list[dict[str, Any]] = []
        self.staged = False

    def not_older(self, alias: str) -> sql.Composed:
        """SQL condition for the merge: row ``alias`` is not older than its key's tombstone."""
        match = sql.SQL(" AND ").join(
            sql.SQL("x.{k} = {a}.{k}").format(k=sql.Identifier(k), a=sql.SQL(alias))
            for k in self.key
        )
        return sql.SQL("NOT EXISTS (SELECT 1 FROM {tomb} x WHERE {match} AND {newer})").format(
            tomb=self.table, match=match, newer=newer("x", alias, self.key, self.version)
        )

    def add(self, rows: list[dict[str, Any]]) -> None:
        self.pending += rows

    def apply(self) -> None:
        """The pending tombstones: each key's newest removes an older row of its key and is
        kept in the tombstone table (replacing an older tombstone of the key)."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        cols = sql.SQL(", ").join(sql.Identifier(c) for c in self.cols)
        self._stage(pending, cols)
        keys = sql.SQL(", ").join(sql.Identifier(k) for k in self.key)
        order = (
            [sql.SQL("{} DESC NULLS LAST").format(sql.Identifier(self.version))]
            if self.version
            else []
        )
        newest = sql.SQL(
            "SELECT DISTINCT ON ({keys}) {cols} FROM {stage} "
            "ORDER BY {keys}, {order} _tm_partition DESC, _tm_offset DESC"
        ).format(
            keys=keys,
            cols=cols,
            stage=self.stage,
            order=sql.SQL("").join(sql.SQL("{}, ").format(o) for o in order),
        )
        match = sql.SQL(" AND ").join(
            sql.SQL("t.{k} = s.{k}").format(k=sql.Identifier(k)) for k in self.key
        )
        self.conn.execute(
            sql.SQL("DELETE FROM {target} t USING ({newest}) s WHERE {match} AND {newer}").format(
                target=self.target,
                newest=newest,
                match=match,
                newer=newer("s", "t", self.key, self.version),
            )
        )
        updates = sql.SQL(", ").join(
            sql.SQL("{c} = EXCLUDED.{c}").format(c=sql.Identifier(c))
            for c in self.cols
            if c not in self.key
        )
        self.conn.execute(
            sql.SQL(
                "INSERT INTO {tomb} AS t ({cols}) {newest} "
                "ON CONFLICT ({keys}) DO UPDATE SET {updates} "
                "WHERE {newer}"
            ).format(
                tomb=self.table,
                cols=cols,
                newest=newest,
                keys=keys,
                updates=updates,
                newer=newer("EXCLUDED", "t", self.key, self.version),
            )
        )
        self.conn.execute(sql.SQL("TRUNCATE {}").format(self.stage))

    def _stage(self, pending: list[dict[str, Any]], cols: sql.Composable) -> None:
        """COPY the pending tombstones into this task's staging table."""
        if not self.staged:
            self.conn.execute(
                sql.SQL("CREATE UNLOGGED TABLE {} AS SELECT {} FROM {} WITH NO DATA").format(
                    self.stage, cols, self.table
                )
            )
            self.staged = True
        with self.conn.cursor().copy(
            sql.SQL("COPY {} ({}) FROM STDIN").format(self.stage, cols)
        ) as copy:
            for r in pending:
                copy.write_row([r[c] for c in self.cols])

    def held(self, partition: int, offsets: list[int]) -> set[int]:
        """Which of ``offsets`` of ``partition`` are a key's tombstone in the table."""
        return {
            o
            for (o,) in self.conn.execute(
                sql.SQL(
                    "SELECT _tm_offset FROM {} WHERE _tm_partition = %s AND _tm_offset = ANY(%s)"
                ).format(self.table),
                (partition, offsets),
            )
        }

    def remove_at(
        self, partition: int, cond: sql.Composable, args: list[Any], lost: sql.Composable
    ) -> int:
        """Re-delivery, step 1: the tombstones at the range's positions go like its rows,
        their keys into ``lost``. Returns how many."""
        keys = sql.SQL(", ").join(sql.Identifier(k) for k in self.key)
        return self.conn.execute(
            sql.SQL(
                "WITH gone AS (DELETE FROM {t} WHERE _tm_partition = %s AND {cond} "
                "RETURNING {keys}) INSERT INTO {lost} SELECT {keys} FROM gone"
            ).format(t=self.table, cond=cond, keys=keys, lost=lost),
            [partition, *args],
        ).rowcount

    def drop(self) -> None:
        if self.staged:
            self.conn.execute(sql.SQL("DROP TABLE {}").format(self.stage))
            self.staged = False
