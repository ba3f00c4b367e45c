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
from typing import Any, Protocol

import numpy as np
import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
from psycopg import sql

from tidemark.core.columns import OFFSET, PARTITION
from tidemark.core.db import is_data_error, one_line, qualified
from tidemark.engine import pgbinary, tombstones, transactions
from tidemark.engine.dead_letters import DeadLetters, Record
from tidemark.ledger import markers
from tidemark.protocol import gids, pruned, rebuild, twopc
from tidemark.protocol.taskspec import CopyFormat, Prepared, SinkTarget, TaskSpec

FLUSH_ROWS = 50_000


class BeforeFirstRows(Protocol):
    """What runs in the sink's transaction before its first row is written: a re-delivery's
    removal by position (tidemark/engine/redelivery.py, which knows this module, not the
    other way round)."""

    def remove(self) -> None: ...


class SinkWriter:
    """One sink's rows in one transaction on its database (stage ``s.<sink>``)."""

    def __init__(
        self, spec: TaskSpec, target: SinkTarget, gid: str, dead: DeadLetters, *, direct: bool
    ) -> None:
        self.spec, self.target, self.gid, self.dead = spec, target, gid, dead
        self.phases = dead.phases
        self.conn: psycopg.Connection | None = None
        self.out = {
            "records": 0,
            "rows": 0,
            "superseded": 0,
            "removed": 0,
            "fallback": 0,
            "tombstones": 0,
        }
        self.failed: str | None = None
        self.pending: list[pa.RecordBatch] = []
        self.pending_rows = 0
        # A first delivery usually brings keys the target does not have yet: COPY straight
        # into it and let its unique index prove that (see _copy_direct).
        self.direct = direct
        self.staged = False
        self.tombs: tombstones.Tombstones | None = None  # the sink ever deleted keys
        self.tomb_rows: list[Record] = []  # this task's tombstones that delete (redelivery)
        self.copy_format: CopyFormat | None = None  # chosen at the first rows
        self.csv_why = ""  # CSV: the first column binary COPY cannot carry
        self.encoder: pgbinary.Encoder | None = None
        self.redelivery: BeforeFirstRows | None = None  # set for backfill and redrive
        self.write_failed_keys: set[tuple[Any, ...]] = set()  # keys of rows PostgreSQL refused

    def _open(self) -> psycopg.Connection:
        if self.conn is not None:
            return self.conn
        t = self.target
        self.conn = transactions.begin(t.dsn, self.spec.lock_timeout_ms, "sink")
        if t.rebuild is not None:  # its new table, in this transaction (see prepare)
            rebuild.create(self.conn, t.table, t.rebuild.columns, t.key)
            if t.tombstones == "delete":
                rebuild.create_tombstones(self.conn, t.table, t.key, t.version)
                if t.held is not None:  # --accept-pruned: deletes the source no longer holds
                    cols = [*t.key, *([t.version] if t.version else []), PARTITION, OFFSET]
                    pruned.carry_tombstones(self.conn, t.rebuild.live, t.table, cols, t.held)
        self.stage_table = markers.stage_table("stage", self.gid)
        self.table = sql.SQL(qualified(t.table))
        cols = [*(c for c in self.spec.columns if c not in t.omit), PARTITION, OFFSET, "_tm_run_id"]
        ident = [sql.Identifier(c) for c in cols]
        keys = [sql.Identifier(k) for k in t.key]
        self.ident = sql.SQL(", ").join(ident)
        self.pg_types = pgbinary.column_types(self.conn, qualified(t.table))
        if t.tombstones == "delete" or tombstones.exists(self.conn, t.table):
            self.tombs = tombstones.Tombstones(
                self.conn, self.gid, self.table, t.table, t.key, t.version
            )
            self.direct = False  # a direct COPY would skip the tombstones' guard
        updates = [
            sql.SQL("{} = EXCLUDED.{}").format(sql.Identifier(c), sql.Identifier(c))
            for c in cols
            if c not in t.key
        ]
        order: list[sql.Composable] = [*keys]
        # Within one batch keep the newest version of each key; against the table, replace
        # only an older version (tombstones.newer: one order everywhere).
        if t.version:
            order.append(sql.SQL("{} DESC").format(sql.Identifier(t.version)))
        guard = tombstones.newer("EXCLUDED", "t", t.key, t.version)
        self.merge_sql = sql.SQL("""
            INSERT INTO {target} AS t ({cols})
            SELECT DISTINCT ON ({keys}) {cols} FROM {stage} s WHERE {live}
            ORDER BY {order}, _tm_partition DESC, _tm_offset DESC
            ON CONFLICT ({keys}) DO UPDATE SET {updates}
            WHERE {guard}""").format(
            target=self.table,
            cols=sql.SQL(", ").join(ident),
            keys=sql.SQL(", ").join(keys),
            order=sql.SQL(", ").join(order),
            stage=self.stage_table,
            updates=sql.SQL(", ").join(updates),
            guard=guard,
            live=self.tombs.not_older("s") if self.tombs else sql.SQL("true"),
        )
        self.truncate_sql = sql.SQL("TRUNCATE {}").format(self.stage_table)
        self.columns = cols
        return self.conn

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
            self._open()
        except psycopg.Error as exc:
            self._fail(exc)
            return
        assert self.tombs is not None  # a sink whose pipeline deletes keys has them
        self.tombs.add(rows)
        self.tomb_rows += rows
        self.out["tombstones"] += len(rows)

    def flush(self) -> None:
        if self.failed or not (self.pending or (self.tombs and self.tombs.pending)):
            return
        table = pa.Table.from_batches(self.pending) if self.pending else None
        self.pending, self.pending_rows = [], 0
        try:
            self._open()
            if self.redelivery is not None:
                self.redelivery.remove()  # by position, before the first row is written
            if table is not None:
                self._check_partitions(table)
                self._write(table)
            if self.tombs is not None:
                self.tombs.apply()
        except psycopg.Error as exc:
            self._fail(exc)
        except _VersionConflict as exc:
            self._fail(exc)

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

    def _encode(self, table: pa.Table) -> memoryview:
        with self.phases("encode"):
            run_col = pa.array(np.full(table.num_rows, self.spec.run_id, np.int64))
            out = table.append_column("_tm_run_id", run_col).select(self.columns)
            if self.copy_format is None:
                self._choose_format(out.schema)
            if self.encoder is not None:
                return self.encoder.encode(out)
            buf = io.BytesIO()
            pacsv.write_csv(
                _for_csv(out), buf, pacsv.WriteOptions(include_header=False, batch_size=8192)
            )
            return buf.getbuffer()

    def _choose_format(self, schema: pa.Schema) -> None:
        """Binary COPY when every column's type carries over exactly, else CSV (which lets
        PostgreSQL parse and cast); decided once per task, the schema is the transform's."""
        self.encoder, self.csv_why = pgbinary.encoder(schema, self.pg_types)
        fmt = CopyFormat.BINARY if self.encoder is not None else CopyFormat.CSV
        self.copy_format = fmt
        copy = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT {})")
        self.copy_sql = copy.format(self.stage_table, self.ident, sql.SQL(fmt.value))
        self.direct_sql = copy.format(self.table, self.ident, sql.SQL(fmt.value))

    def _write(self, table: pa.Table) -> None:
        buf = self._encode(table)  # encoded once, whichever path takes it
        if self.direct and self._copy_direct(table, buf):
            return
        self._merge(table, buf)

    def _copy_direct(self, table: pa.Table, buf: memoryview) -> bool:
        """COPY the rows straight into the target. That succeeds only if no key of theirs is
        in the target or twice among them (the unique index on the key, which every sink
        table has, refuses it), and then it writes exactly what the merge would: every row,
        nothing superseded. Any data error rolls the savepoint back and the staging merge
        decides (versions, duplicates, bisecting bad rows); a key already present turns the
        direct path off for the rest of the task."""
        conn = self._open()
        try:
            with (
                conn.transaction(),
                self.phases("copy"),
                conn.cursor().copy(self.direct_sql) as copy,
            ):
                copy.write(buf)
        except psycopg.Error as exc:
            if not is_data_error(exc):
                raise
            if exc.sqlstate == "23505":  # unique_violation: keys repeat, merge from now on
                self.direct = False
            return False
        self.out["rows"] += table.num_rows
        return True

    def _merge(self, table: pa.Table, buf: memoryview | None = None) -> None:
        """Stage the rows, then upsert them into the target, guarded by version; on bad data
        bisect down to the rows at fault and quarantine them."""
        conn = self._open()
        if not self.staged:
            conn.execute(
                sql.SQL("CREATE UNLOGGED TABLE {} (LIKE {})").format(self.stage_table, self.table)
            )
            self.staged = True
        try:
            with conn.transaction():  # a savepoint: bisect on bad data
                if buf is None:
                    buf = self._encode(table)
                with self.phases("copy"), conn.cursor().copy(self.copy_sql) as copy:
                    copy.write(buf)
                with self.phases("merge"):
                    written = conn.execute(self.merge_sql).rowcount
                    conn.execute(self.truncate_sql)
            self.out["rows"] += written
            self.out["superseded"] += table.num_rows - written
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

    def _fail(self, exc: BaseException) -> None:
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
            for (o,) in self._open().execute(
                sql.SQL(
                    "SELECT _tm_offset FROM {} WHERE _tm_partition = %s AND _tm_offset = ANY(%s)"
                ).format(self.table),
                (partition, offsets),
            )
        }

    def prepare(self) -> Prepared | None:
        self.flush()
        r = self.target.rebuild
        if r is not None and not self.failed:
            try:  # a rebuild swaps its table in even when it received no row
                self._open()
            except psycopg.Error as exc:
                self._fail(exc)
        if self.failed or self.conn is None:
            return None  # failed, or nothing to write: no participant
        try:
            with self.phases("prepare"):
                if r is not None:
                    rebuild.swap(self.conn, r.live, self.target.table, r.retired)
                if self.staged:
                    self.conn.execute(sql.SQL("DROP TABLE {}").format(self.stage_table))
                if self.tombs is not None:
                    self.tombs.drop()
                transactions.finish(self.conn, self.gid, self.spec.run_id, self.spec.prepare)
                self.conn.close()
        except psycopg.Error as exc:
            self._fail(exc)
            return None
        return Prepared(
            gid=self.gid,
            target=f"sink:{self.target.name}",
            sink=self.target.name,
            rows=self.out["rows"] + self.out["removed"],
        )

    def close(self) -> None:
        if self.conn is not None and not self.conn.closed:
            self.conn.close()


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
