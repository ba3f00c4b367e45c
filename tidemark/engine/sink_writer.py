"""One sink's rows in one Spark task: a transaction on the sink's database (stage
``s.<sink>``) that ends in ``PREPARE TRANSACTION`` (docs/design.md, step 2).

Rows go by COPY, binary where every column's type allows (tidemark/engine/pgbinary.py), else
CSV: straight into the target on a first delivery while no key repeats, or into a staging
table merged into the target by a keyed upsert guarded by version (an older version never
replaces a newer one). Bad data in a merge is bisected down to the rows at fault, which are
quarantined (class ``sink_write``). A sink whose connection or statements fail is reported
failed and rolled back; the task's other sinks carry on.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
from psycopg import sql

from tidemark.core.columns import OFFSET, PARTITION
from tidemark.core.db import is_data_error, one_line, qualified
from tidemark.core.participants import Target
from tidemark.engine import pgbinary, tombstones, transactions
from tidemark.engine.dead_letters import DeadLetters, Record
from tidemark.ledger import markers
from tidemark.protocol import gids, pruned, rebuild, twopc
from tidemark.protocol.taskspec import CopyFormat, Prepared, SinkTarget, TaskSpec

FLUSH_ROWS = 50_000


class Removal(Protocol):
    """What runs in the sink's transaction as it begins, before any row is written: a
    re-delivery's removal by position (tidemark/engine/redelivery.py, which knows this
    module, not the other way round)."""

    def remove(
        self, conn: psycopg.Connection, table: sql.Composable, tombs: tombstones.Tombstones | None
    ) -> int:
        """Removes the rows (and tombstones) at the re-delivered positions; returns how many."""
        ...


@dataclass(frozen=True)
class _Open:
    """The sink's transaction, once begun: what it needed the database to know."""

    conn: psycopg.Connection
    tombs: tombstones.Tombstones | None  # the sink ever deleted keys
    pg_types: dict[str, str]  # the target's column types (pgbinary.column_types)
    merge_sql: sql.Composed


@dataclass(frozen=True)
class _Format:
    """How rows go in, chosen at the task's first rows (the schema is the transform's)."""

    copy_format: CopyFormat
    csv_why: str  # CSV: the first column binary COPY cannot carry
    encoder: pgbinary.Encoder | None  # binary COPY's
    copy_sql: sql.Composed  # into the staging table
    direct_sql: sql.Composed  # straight into the target


_Encoded = tuple[memoryview, _Format]  # a batch's rows as COPY takes them, and the format


class SinkWriter:
    """One sink's rows in one transaction on its database (stage ``s.<sink>``)."""

    def __init__(
        self,
        spec: TaskSpec,
        target: SinkTarget,
        gid: str,
        dead: DeadLetters,
        *,
        direct: bool,
        removal: Removal | None = None,
    ) -> None:
        self.spec, self.target, self.gid, self.dead = spec, target, gid, dead
        self.phases = dead.phases
        self.removal = removal  # backfill and redrive: run as the transaction begins
        self.table = sql.SQL(qualified(target.table))
        self.stage_table = markers.stage_table("stage", gid)
        self.columns = [
            *(c for c in spec.columns if c not in target.omit),
            PARTITION,
            OFFSET,
            "_tm_run_id",
        ]
        self.ident = sql.SQL(", ").join(sql.Identifier(c) for c in self.columns)
        self.truncate_sql = sql.SQL("TRUNCATE {}").format(self.stage_table)
        self.open: _Open | None = None  # begun at the first statement (connection())
        self.format: _Format | None = None  # chosen at the first rows
        self.failed: str | None = None
        self.pending: list[pa.RecordBatch] = []
        self.pending_rows = 0
        # A first delivery usually brings keys the target does not have yet: COPY straight
        # into it and let its unique index prove that (see _copy_direct).
        self.direct = direct
        self.staged = False
        self.tomb_rows: list[Record] = []  # this task's tombstones that delete (redelivery)
        self.write_failed_keys: set[tuple[Any, ...]] = set()  # keys of rows PostgreSQL refused
        # What it wrote (SinkCounts, with the task's other counts: sink_task.py)
        self.rows = 0  # inserted or replaced
        self.superseded = 0  # not written: a newer version of the key won
        self.removed = 0  # re-delivery: rows and tombstones at the range's positions
        self.tombstones = 0  # that delete their key

    @property
    def copy_format(self) -> CopyFormat | None:
        """None: no rows went in."""
        return self.format.copy_format if self.format else None

    @property
    def csv_why(self) -> str:
        return self.format.csv_why if self.format else ""

    @property
    def tombs(self) -> tombstones.Tombstones | None:
        return self.open.tombs if self.open else None

    def connection(self) -> psycopg.Connection:
        """The sink's transaction, begun at the first call (and a re-delivery's removal run
        in it, before any row is written)."""
        return self._tx().conn

    def _tx(self) -> _Open:
        if self.open is None:
            self.open = self._begin()
        return self.open

    def _begin(self) -> _Open:
        t = self.target
        conn = transactions.begin(t.dsn, self.spec.lock_timeout_ms, "sink")
        try:
            if t.rebuild is not None:  # its new table, in this transaction (see prepare)
                rebuild.create(conn, t.table, t.rebuild.columns, t.key)
                if t.tombstones == "delete":
                    rebuild.create_tombstones(conn, t.table, t.key, t.version)
                    if t.held is not None:  # --accept-pruned: deletes the source no longer holds
                        cols = [*t.key, *([t.version] if t.version else []), PARTITION, OFFSET]
                        pruned.carry_tombstones(conn, t.rebuild.live, t.table, cols, t.held)
            pg_types = pgbinary.column_types(conn, qualified(t.table))
            tombs = None
            if t.tombstones == "delete" or tombstones.exists(conn, t.table):
                tombs = tombstones.Tombstones(conn, self.gid, self.table, t.table, t.key, t.version)
                self.direct = False  # a direct COPY would skip the tombstones' guard
            if self.removal is not None:
                self.removed += self.removal.remove(conn, self.table, tombs)
        except BaseException:
            conn.close()
            raise
        return _Open(conn, tombs, pg_types, self._merge_sql(tombs))

    def _merge_sql(self, tombs: tombstones.Tombstones | None) -> sql.Composed:
        t = self.target
        keys = [sql.Identifier(k) for k in t.key]
        updates = [
            sql.SQL("{} = EXCLUDED.{}").format(sql.Identifier(c), sql.Identifier(c))
            for c in self.columns
            if c not in t.key
        ]
        order: list[sql.Composable] = [*keys]
        # Within one batch keep the newest version of each key; against the table, replace
        # only an older version (tombstones.newer: one order everywhere).
        if t.version:
            order.append(sql.SQL("{} DESC").format(sql.Identifier(t.version)))
        guard = tombstones.newer("EXCLUDED", "t", t.key, t.version)
        return sql.SQL("""
            INSERT INTO {target} AS t ({cols})
            SELECT DISTINCT ON ({keys}) {cols} FROM {stage} s WHERE {live}
            ORDER BY {order}, _tm_partition DESC, _tm_offset DESC
            ON CONFLICT ({keys}) DO UPDATE SET {updates}
            WHERE {guard}""").format(
            target=self.table,
            cols=self.ident,
            keys=sql.SQL(", ").join(keys),
            order=sql.SQL(", ").join(order),
            stage=self.stage_table,
            updates=sql.SQL(", ").join(updates),
            guard=guard,
            live=tombs.not_older("s") if tombs else sql.SQL("true"),
        )

    def add(self, batch: pa.RecordBatch) -> None:
        if self.failed or batch.num_rows == 0:
            return
        self.pending.append(batch)
        self.pending_rows += batch.num_rows

    def flush_full(self) -> None:
        if self.pending_rows >= FLUSH_ROWS:
            self.flush()

    def add_tombstones(self, rows: list[Record]) -> None:
        """Tombstones that delete their key (tidemark/engine/tombstones.py), applied at the
        next flush, after that flush's rows."""
        if self.failed or not rows:
            return
        try:
            self.connection()
        except psycopg.Error as exc:
            self.fail(exc)
            return
        assert self.tombs is not None  # a sink whose pipeline deletes keys has them
        self.tombs.add(rows)
        self.tomb_rows += rows
        self.tombstones += len(rows)

    def flush(self) -> None:
        tombs = self.tombs
        if self.failed or not (self.pending or (tombs and tombs.pending)):
            return
        table = pa.Table.from_batches(self.pending) if self.pending else None
        self.pending, self.pending_rows = [], 0
        try:
            self.connection()
            if table is not None:
                self._check_partitions(table)
                self._write(table)
            if self.tombs is not None:
                self.tombs.apply()
        except psycopg.Error as exc:
            self.fail(exc)
        except _VersionConflict as exc:
            self.fail(exc)

    def _check_partitions(self, table: pa.Table) -> None:
        """A batch mixing partitions (a redrive's) must not hold one key from two of them
        unless a version column orders them: the merge's DISTINCT ON would pick one."""
        t = self.target
        if t.version or pc.count_distinct(table.column(PARTITION)).as_py() <= 1:
            return
        spread = table.group_by(t.key).aggregate([(PARTITION, "count_distinct")])
        many = spread.filter(pc.greater(spread.column(f"{PARTITION}_count_distinct"), 1))
        if many.num_rows:
            key = ", ".join(str(many.column(k)[0].as_py()) for k in t.key)
            raise _VersionConflict(
                f"key ({', '.join(t.key)})=({key}) has versions from "
                f"several partitions, which offsets do not order; declare "
                f"a version column for this sink (sinks[].version)"
            )

    def _encode(self, table: pa.Table) -> _Encoded:
        with self.phases("encode"):
            run_col = pa.array(np.full(table.num_rows, self.spec.run_id, np.int64))
            out = table.append_column("_tm_run_id", run_col).select(self.columns)
            if self.format is None:
                self.format = self._choose_format(out.schema)
            fmt = self.format
            if fmt.encoder is not None:
                return fmt.encoder.encode(out), fmt
            buf = io.BytesIO()
            pacsv.write_csv(
                _for_csv(out), buf, pacsv.WriteOptions(include_header=False, batch_size=8192)
            )
            return buf.getbuffer(), fmt

    def _choose_format(self, schema: pa.Schema) -> _Format:
        """Binary COPY when every column's type carries over exactly, else CSV (which lets
        PostgreSQL parse and cast); decided once per task, the schema is the transform's."""
        encoder, csv_why = pgbinary.encoder(schema, self._tx().pg_types)
        fmt = CopyFormat.BINARY if encoder is not None else CopyFormat.CSV
        copy = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT {})")
        return _Format(
            copy_format=fmt,
            csv_why=csv_why,
            encoder=encoder,
            copy_sql=copy.format(self.stage_table, self.ident, sql.SQL(fmt.value)),
            direct_sql=copy.format(self.table, self.ident, sql.SQL(fmt.value)),
        )

    def _write(self, table: pa.Table) -> None:
        encoded = self._encode(table)  # encoded once, whichever path takes it
        if self.direct and self._copy_direct(table, encoded):
            return
        self._merge(table, encoded)

    def _copy_direct(self, table: pa.Table, encoded: _Encoded) -> bool:
        """COPY the rows straight into the target. That succeeds only if no key of theirs is
        in the target or twice among them (the unique index on the key, which every sink
        table has, refuses it), and then it writes exactly what the merge would: every row,
        nothing superseded. Any data error rolls the savepoint back and the staging merge
        decides (versions, duplicates, bisecting bad rows); a key already present turns the
        direct path off for the rest of the task."""
        conn = self.connection()
        buf, fmt = encoded
        try:
            with (
                conn.transaction(),
                self.phases("copy"),
                conn.cursor().copy(fmt.direct_sql) as copy,
            ):
                copy.write(buf)
        except psycopg.Error as exc:
            if not is_data_error(exc):
                raise
            if exc.sqlstate == "23505":  # unique_violation: keys repeat, merge from now on
                self.direct = False
            return False
        self.rows += table.num_rows
        return True

    def _merge(self, table: pa.Table, encoded: _Encoded | None = None) -> None:
        """Stage the rows, then upsert them into the target, guarded by version; on bad data
        bisect down to the rows at fault and quarantine them."""
        tx = self._tx()
        conn = tx.conn
        if not self.staged:
            conn.execute(
                sql.SQL("CREATE UNLOGGED TABLE {} (LIKE {})").format(self.stage_table, self.table)
            )
            self.staged = True
        try:
            with conn.transaction():  # a savepoint: bisect on bad data
                buf, fmt = encoded or self._encode(table)
                with self.phases("copy"), conn.cursor().copy(fmt.copy_sql) as copy:
                    copy.write(buf)
                with self.phases("merge"):
                    written = conn.execute(tx.merge_sql).rowcount
                    conn.execute(self.truncate_sql)
            self.rows += written
            self.superseded += table.num_rows - written
        except psycopg.Error as exc:
            if not is_data_error(exc):
                raise
            if table.num_rows == 1:
                self.write_failed_keys.add(
                    tuple(table.column(k)[0].as_py() for k in self.target.key)
                )
                self.dead.add(
                    table.to_pylist(),
                    "sink_write",
                    one_line(exc),
                    f"{exc}\n(sink {self.target.name}, table {self.target.table})",
                )
                return
            half = table.num_rows // 2
            self._merge(table.slice(0, half))
            self._merge(table.slice(half))

    def fail(self, exc: BaseException) -> None:
        """The sink fails in this task (``failed`` says why): its transaction rolls back."""
        self.failed = f"sink {self.target.name}: {one_line(exc)}"
        self.close()
        if getattr(exc, "sqlstate", None) == "55P03":  # lock_not_available
            sibling = self._sibling_prepared()
            if sibling:
                self.failed += (
                    f"; the row it waited for is held by another task of this run ({sibling}, "
                    f"prepared until the decision): a key has versions in two partitions of "
                    f"this run, which offsets do not order; declare a version column for this "
                    f"sink (sinks[].version)"
                )

    def _sibling_prepared(self) -> str | None:
        """A prepared participant of another task of this run on this sink, if any."""
        me = gids.parse(self.gid, self.spec.prefix)
        try:
            with psycopg.connect(self.target.dsn, autocommit=True, connect_timeout=10) as conn:
                for gid, _age in twopc.prepared(
                    conn, gids.like_run(self.spec.prefix, self.spec.run_id)
                ):
                    other = gids.parse(gid, self.spec.prefix)
                    if other and me and other.stage == me.stage and other.task != me.task:
                        return gid
        except psycopg.Error:
            return None  # the lock timeout is still the error; this only explains it
        return None

    def own_rows(self, partition: int, offsets: list[int]) -> set[int]:
        """Which of ``offsets`` of ``partition`` have their own row in this sink."""
        return {
            o
            for (o,) in self.connection().execute(
                sql.SQL(
                    "SELECT _tm_offset FROM {} WHERE _tm_partition = %s AND _tm_offset = ANY(%s)"
                ).format(self.table),
                (partition, offsets),
            )
        }

    def tombstones_at(self, partition: int, offsets: list[int]) -> set[int]:
        """Which of ``offsets`` of ``partition`` are a key's tombstone in this sink (none
        where it never deleted keys)."""
        tombs = self._tx().tombs
        return set() if tombs is None else tombs.held(partition, offsets)

    def prepare(self) -> Prepared | None:
        self.flush()
        r = self.target.rebuild
        if r is not None and not self.failed:
            try:  # a rebuild swaps its table in even when it received no row
                self.connection()
            except psycopg.Error as exc:
                self.fail(exc)
        if self.failed or self.open is None:
            return None  # failed, or nothing to write: no participant
        conn = self.open.conn
        try:
            with self.phases("prepare"):
                if r is not None:
                    rebuild.swap(conn, r.live, self.target.table, r.retired)
                if self.staged:
                    conn.execute(sql.SQL("DROP TABLE {}").format(self.stage_table))
                if self.open.tombs is not None:
                    self.open.tombs.drop()
                transactions.finish(conn, self.gid, self.spec.run_id, self.spec.prepare)
                conn.close()
        except psycopg.Error as exc:
            self.fail(exc)
            return None
        return Prepared(
            gid=self.gid,
            target=Target.sink(self.target.name),
            sink=self.target.name,
            rows=self.rows + self.removed,
        )

    def close(self) -> None:
        if self.open is not None and not self.open.conn.closed:
            self.open.conn.close()


class _VersionConflict(Exception):
    pass


def _for_csv(table: pa.Table) -> pa.Table:
    """PostgreSQL reads bytea in CSV as hex text."""
    for i, f in enumerate(table.schema):
        if pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type):
            hexed = pa.array(
                [None if v is None else "\\x" + v.hex() for v in table.column(i).to_pylist()],
                pa.string(),
            )
            table = table.set_column(i, f.name, hexed)
    return table
