"""Executor side of the commit protocol: one Spark task places its range in every sink.

Per task and sink, two transactions, each ending in ``PREPARE TRANSACTION``: on the sink
database, COPY the rows (binary where every column's type allows, see pgbinary) straight into
the target on a first delivery, or into a staging table merged into the target with a keyed
upsert guarded by version; on the ledger, that sink's dead letters. Every verdict (decode,
transform, row-level expectation, batch gate, NULL key, sink write) binds only the sinks
whose range holds the record (docs/design.md, "Which sinks a verdict applies to"), so each sink
gets its own dead letters and nothing is shared between sinks.

Re-delivery (backfill, redrive) replaces by position, in the same two-phase commit:
tidemark/engine/redelivery.py.

Before it prepares, a task accounts for its whole range (docs/design.md, "Task accounting"): every
offset seen exactly once, and per sink rows written + quarantined + superseded = records.

A sink whose connection or statements fail is reported failed in the task's result and
rolled back; the other sinks carry on. Ledger and source errors fail the task, and Spark
retries it with a new attempt.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator

import numpy as np
import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
from psycopg import sql

from tidemark.core import faults
from tidemark.core.clock import Phases
from tidemark.core.db import is_data_error, one_line, qualified
from tidemark.core.text import clamp
from tidemark.engine import pgbinary, tombstones
from tidemark.engine.json_reasons import decode_reason
from tidemark.engine.records import ERR_CLASS, ERR_REASON, TOMBSTONE, TOMBSTONE_KEPT
from tidemark.engine.redelivery import Redelivery
from tidemark.ledger import letters, markers, redrives
from tidemark.protocol import coverage, gids, twopc
from tidemark.protocol.taskspec import (
    CHECK,
    FALLBACK,
    Prepared,
    SinkResult,
    SinkTarget,
    Span,
    TaskResult,
    TaskSpec,
)
from tidemark.quality import reasons
from tidemark.sources import PayloadReader

FLUSH_ROWS = 50_000
# A task's dead letters wait and go to the ledger together (one payload read, one COPY, one
# merge): row checks find a few records in many batches, and a round trip per batch cost
# more than the letters. Bounded by count and by the payloads they carry.
FLUSH_LETTERS = 10_000
FLUSH_LETTER_BYTES = 64 * 2**20
REASON_MAX = 200
DETAIL_MAX = 8_000
RESULT_SCHEMA = "task int, attempt int, result string"
PARTITION, OFFSET = "_tm_partition", "_tm_offset"


def pg_text(text: str, limit: int) -> str:
    """A reason for a text column: PostgreSQL refuses NUL characters."""
    return clamp(text.replace("\x00", "\\0"), limit)


def storable_headers(headers: str | None) -> str | None:
    """Headers as jsonb will take them. PostgreSQL refuses a ``\\u0000`` escape (and anything
    not JSON): such headers are kept exactly, base64-encoded, so the record still lands in its
    dead letter instead of failing its own quarantine."""
    if headers is None:
        return None
    if "\\u0000" not in headers:
        try:
            json.loads(headers)
            return headers
        except ValueError:
            pass
    return json.dumps(
        {
            "_tm_unstorable_headers_base64": base64.b64encode(
                headers.encode("utf-8", "surrogatepass")
            ).decode()
        }
    )


def _begin(dsn: str, lock_timeout_ms: int, what: str) -> psycopg.Connection:
    conn = psycopg.connect(dsn, application_name=f"tidemark-{what}", connect_timeout=10)
    conn.execute(sql.SQL("SET lock_timeout = {}").format(sql.Literal(f"{lock_timeout_ms}ms")))
    return conn


def _finish(conn: psycopg.Connection, gid: str, run_id: int, prepare: bool) -> None:
    markers.record(conn, gid, run_id)
    if prepare:
        conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
    else:
        conn.commit()


def rollback_earlier_attempts(
    dsn: str, prefix: str, run_id: int, stage: str, task: int, attempt: int, write: int = 0
) -> list[str]:
    """A retried attempt first rolls back what *earlier* attempts of its task left prepared
    (no decision can exist yet), or it would wait forever on their row locks; so does each
    task of a second write (``write``), for what the first left. A later attempt (this one is
    a zombie, say after a lost executor) is never touched."""
    me = gids.Gid(prefix, run_id, stage, task, attempt, write)
    done = []
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        for gid, _age in twopc.prepared(conn, gids.like_task(prefix, run_id, stage, task)):
            parsed = gids.parse(gid, prefix)
            if parsed and parsed.earlier_than(me) and twopc.rollback(conn, gid):
                done.append(gid)
    return done


class DeadLetters:
    """One sink's dead letters in one ledger transaction (stage ``d.<sink>``)."""

    def __init__(self, spec: TaskSpec, sink: str, gid: str, phases: Phases):
        self.spec, self.sink, self.gid, self.phases = spec, sink, gid, phases
        self.conn: psycopg.Connection | None = None
        self.rows = 0
        self.resolved = 0
        self.offsets: dict[int, list[int]] = {}  # partition -> offsets quarantined here
        self.held: dict[tuple[int, int], int] = {}  # redrive: (partition, offset) -> letter id
        self.held_offsets: dict[int, pa.Array] = {}  # redrive: partition -> offsets held
        self.failed_again: list[int] = []
        self.reader: PayloadReader | None = None  # reads left-out payloads (_fill_payloads)
        self.pending: list[tuple[dict, str, str, str | None]] = []  # (record, class, reason,
        self.pending_bytes = 0  #  detail), not yet written

    def _open(self) -> psycopg.Connection:
        if self.conn is not None:
            return self.conn
        self.conn = _begin(self.spec.ledger_dsn, self.spec.lock_timeout_ms, "dlq")
        self.stage = letters.Stage(self.conn, self.gid)
        return self.conn

    def hold(self, request: int) -> list[int]:
        """Redrive: lock this sink's letters of the request (a concurrent discard waits) and
        keep those still quarantined. Returns the ids not held (discarded or resolved since
        the plan)."""
        conn = self._open()
        skipped, by_part = [], {}
        for i, part, off, live in redrives.hold(conn, request, self.spec.pipeline, self.sink):
            if live:
                self.held[(part, off)] = i
                by_part.setdefault(part, []).append(off)
            else:
                skipped.append(i)
        # Built once: every batch is scoped against them (a redrive may be 100,000 letters).
        self.held_offsets = {p: pa.array(offs, pa.int64()) for p, offs in by_part.items()}
        return skipped

    def add(
        self,
        records: list[dict],
        error_class: str | None = None,
        reason: str | None = None,
        detail: str | None = None,
    ) -> None:
        """Quarantine ``records`` for this sink; they reach the ledger at :meth:`flush`."""
        for r in records:
            part, off = r[PARTITION], r[OFFSET]
            self.pending.append((r, error_class or r[ERR_CLASS], reason or r[ERR_REASON], detail))
            self.pending_bytes += len(r["_tm_payload"] or b"")
            self.offsets.setdefault(part, []).append(off)
            if (part, off) in self.held:
                self.failed_again.append(self.held[(part, off)])
        self.rows += len(records)
        if len(self.pending) >= FLUSH_LETTERS or self.pending_bytes >= FLUSH_LETTER_BYTES:
            self.flush()

    def flush(self) -> None:
        """Write the letters added since the last flush into this sink's ledger transaction."""
        if not self.pending:
            return
        pending, self.pending, self.pending_bytes = self.pending, [], 0
        self._fill_payloads(pending)
        self._open()
        with self.stage.copy() as copy:
            for r, error_class, reason, detail in pending:
                if error_class == "decode":  # Spark's word made precise, from the bytes
                    reason = decode_reason(r["_tm_payload"], reason)
                copy.write_row(
                    (
                        self.spec.pipeline,
                        self.sink,
                        self.spec.run_id,
                        r[PARTITION],
                        r[OFFSET],
                        r["_tm_key"],
                        r["_tm_payload"],
                        storable_headers(r["_tm_headers"]),
                        error_class,
                        pg_text(reason, REASON_MAX),
                        pg_text(detail, DETAIL_MAX) if detail else None,
                        # as the source had them: what a redrive hands the transform
                        letters.header_bytes(r["_tm_headers"]),
                        r["_tm_ts"],
                        True,
                    )
                )
        self.stage.merge()

    def _fill_payloads(self, pending: list[tuple[dict, str, str, str | None]]) -> None:
        """The payloads the reader left out (TaskSpec.payloads), read again from the source:
        a letter keeps its record's bytes. Only a record that failed to decode kept its own."""
        if self.spec.payloads is None:
            return
        left_out = [
            r
            for r, error_class, _, _ in pending
            if r["_tm_payload"] is None and error_class != "decode"
        ]
        wanted: dict[int, list[int]] = {}
        for r in left_out:
            wanted.setdefault(r[PARTITION], []).append(r[OFFSET])
        if wanted:
            if self.reader is None:
                self.reader = PayloadReader(self.spec.payloads)
            got = self.reader.payloads(wanted)
            for r in left_out:
                r["_tm_payload"] = got[(r[PARTITION], r[OFFSET])]

    def resolve_held(self) -> None:
        """Redrive: the held letters that passed this time are resolved (one statement)."""
        self.flush()
        failed = set(self.failed_again)
        ids = [i for i in self.held.values() if i not in failed]
        if ids:
            self.resolved += letters.resolve_ids(
                self._open(), ids, self.spec.by or "tidemark", f"redriven by run {self.spec.run_id}"
            )

    def resolve(self, partition: int, start: int, end: int) -> None:
        """Re-delivery: the live letters of this sink for the records of ``[start, end)``
        that passed this time are resolved: the records are in the sink now."""
        self.flush()
        by = self.spec.by or "tidemark"
        self.resolved += letters.resolve_range(
            self._open(),
            self.spec.pipeline,
            self.sink,
            partition,
            start,
            end,
            self.offsets.get(partition, []),
            by,
            f"delivered again by {self.spec.mode} run {self.spec.run_id}",
        )

    def live(self, partition: int, offsets: list[int]) -> set[int]:
        """Which of ``offsets`` a live letter for this sink holds (this task's own too)."""
        self.flush()
        return letters.live_offsets(self._open(), self.spec.pipeline, self.sink, partition, offsets)

    def resolve_offsets(self, partition: int, offsets: list[int], by: str, note: str) -> None:
        """Re-delivery: the live letters of these records, placed by a row now."""
        self.flush()
        self.resolved += letters.resolve_offsets(
            self._open(), self.spec.pipeline, self.sink, partition, offsets, by, note
        )

    def prepare(self) -> Prepared | None:
        with self.phases("quarantine"):
            self.flush()
        if self.conn is None:
            return None
        if not self.rows and not self.resolved:
            self.close()  # nothing to commit: no participant
            return None
        with self.phases("prepare"):
            self.stage.drop()
            _finish(self.conn, self.gid, self.spec.run_id, self.spec.prepare)
            self.conn.close()
        return Prepared(
            gid=self.gid, target="ledger", sink=self.sink, rows=self.rows + self.resolved
        )

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        if self.conn is not None and not self.conn.closed:
            self.conn.close()  # an open, unprepared transaction rolls back


class SinkWriter:
    """One sink's rows in one transaction on its database (stage ``s.<sink>``)."""

    def __init__(self, spec: TaskSpec, target: SinkTarget, gid: str, dead: DeadLetters):
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
        self.direct = spec.mode == "run"
        self.staged = False
        self.tombs: tombstones.Tombstones | None = None  # the sink ever deleted keys
        self.tomb_rows: list[dict] = []  # this task's tombstones that delete (redelivery)
        self.copy_format: str | None = None  # "binary" or "csv: <why>", at the first rows
        self.encoder: pgbinary.Encoder | None = None
        self.redelivery: Redelivery | None = None  # set for backfill and redrive
        self.write_failed_keys: set[tuple] = set()  # keys of rows PostgreSQL refused

    def _open(self) -> psycopg.Connection:
        if self.conn is not None:
            return self.conn
        t = self.target
        self.conn = _begin(t.dsn, self.spec.lock_timeout_ms, "sink")
        self.stage_table = markers.stage_table("stage", self.gid)
        self.table = sql.SQL(qualified(t.table))
        cols = [*self.spec.columns, PARTITION, OFFSET, "_tm_run_id"]
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
        order = [*keys]
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

    def add_tombstones(self, rows: list[dict]) -> None:
        """Tombstones that delete their key (tidemark/engine/tombstones.py), applied at the
        next flush, after that flush's rows."""
        if self.failed or not rows:
            return
        try:
            self._open()
        except psycopg.Error as exc:
            self._fail(exc)
            return
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
        self.encoder, why = pgbinary.encoder(schema, self.pg_types)
        fmt = "binary" if self.encoder is not None else "csv"
        self.copy_format = f"csv: {why}" if why else fmt
        copy = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT {})")
        self.copy_sql = copy.format(self.stage_table, self.ident, sql.SQL(fmt))
        self.direct_sql = copy.format(self.table, self.ident, sql.SQL(fmt))

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
        try:
            with (
                self.conn.transaction(),
                self.phases("copy"),
                self.conn.cursor().copy(self.direct_sql) as copy,
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
        if not self.staged:
            self.conn.execute(
                sql.SQL("CREATE UNLOGGED TABLE {} (LIKE {})").format(self.stage_table, self.table)
            )
            self.staged = True
        try:
            with self.conn.transaction():  # a savepoint: bisect on bad data
                if buf is None:
                    buf = self._encode(table)
                with self.phases("copy"), self.conn.cursor().copy(self.copy_sql) as copy:
                    copy.write(buf)
                with self.phases("merge"):
                    written = self.conn.execute(self.merge_sql).rowcount
                    self.conn.execute(self.truncate_sql)
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
        if self.failed or self.conn is None:
            return None  # failed, or nothing to write: no participant
        try:
            with self.phases("prepare"):
                if self.staged:
                    self.conn.execute(sql.SQL("DROP TABLE {}").format(self.stage_table))
                if self.tombs is not None:
                    self.tombs.drop()
                _finish(self.conn, self.gid, self.spec.run_id, self.spec.prepare)
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


def _by_partition(batch: pa.RecordBatch) -> Iterator[tuple[int, pa.RecordBatch]]:
    """A source's batches hold one partition; a redrive's may mix them."""
    parts = batch.column(PARTITION)
    lo, hi = pc.min_max(parts).values()
    if lo == hi:
        yield lo.as_py(), batch
        return
    for p in pc.unique(parts).to_pylist():
        yield p, batch.filter(pc.equal(parts, p))


def _offsets_in(batch: pa.RecordBatch, offsets) -> pa.Array:
    return pc.is_in(batch.column(OFFSET), value_set=pa.array(offsets, pa.int64()))


class _Accounts:
    """Every offset of the task's ranges seen exactly once (a transform that drops or
    multiplies rows is caught here, before anything is prepared). A spread task sees only
    part of its ranges: it checks copies and strays, and the driver checks what is missing
    from every task's ``seen`` (tidemark/protocol/coverage.py)."""

    def __init__(self, spans: list[Span] | None, spread: bool = False):
        self.spans = {s.partition: s for s in spans} if spans is not None else None
        self.spread = spread
        self.counts = {s.partition: np.zeros(s.size, np.int32) for s in spans or ()}
        self.seen: dict[int, list[np.ndarray]] = {}  # a redrive: offsets seen, per partition
        self.stray = 0

    def add(self, partition: int, batch: pa.RecordBatch) -> None:
        offs = batch.column(OFFSET).to_numpy(zero_copy_only=False)
        if self.spans is None:
            self.seen.setdefault(partition, []).append(offs)
            return
        span = self.spans.get(partition)
        if span is None:
            self.stray += len(offs)
            return
        idx = offs - span.start
        inside = (idx >= 0) & (idx < span.size)
        self.stray += int((~inside).sum())
        idx = idx[inside]
        if not len(idx):
            return
        lo, hi = int(idx.min()), int(idx.max())
        counts = self.counts[partition]
        if hi - lo < 4 * len(idx):  # a source's batch is a run of offsets: count the window
            counts[lo : hi + 1] += np.bincount(idx - lo).astype(np.int32)
        else:  # a spread task's batch is scattered over the range
            np.add.at(counts, idx, 1)

    def bitmaps(self) -> dict[int, str]:
        """Spread: the offsets this task saw, per partition (protocol.coverage)."""
        return {p: coverage.encode(c > 0) for p, c in self.counts.items()}

    def problem(self, held: list[dict[int, pa.Array]] | None = None) -> str | None:
        """``held``: a redrive's letters held per sink (partition -> offsets), every one of
        which must have been seen exactly once."""
        if self.spans is None:
            twice, missing = [], []
            none = np.array([], np.int64)
            parts = set(self.seen) | {p for h in held or () for p in h}
            for p in sorted(parts):
                seen, counts = np.unique(
                    np.concatenate(self.seen.get(p) or [none]), return_counts=True
                )
                want = np.concatenate(
                    [h[p].to_numpy(zero_copy_only=False) for h in held or () if p in h] or [none]
                )
                twice += [(p, int(o)) for o in seen[counts > 1]]
                missing += [(p, int(o)) for o in np.setdiff1d(want, seen)]
            if twice or missing:
                return (
                    f"{len(twice)} record(s) seen more than once, {len(missing)} missing "
                    f"(e.g. partition/offset {(twice or missing)[0]})"
                )
            return None
        for p, s in self.spans.items():
            counts = self.counts[p]
            dropped = int((counts == 0).sum()) if s.dense and not self.spread else 0
            extra = int(counts[counts > 1].sum() - (counts > 1).sum())
            if dropped or extra or self.stray:
                bad = counts > 1 if self.spread else counts != 1
                first = int(np.argmax(bad)) + s.start if (dropped or extra) else None
                return (
                    f"partition {s.partition} [{s.start}, {s.end}): {dropped} record(s) "
                    f"missing, {extra} extra cop(ies), {self.stray} outside the range"
                    + (f" (first at offset {first})" if first is not None else "")
                )
        return None


class _Sink:
    """One sink's part of a task: which of the task's records are its, and their verdicts."""

    def __init__(self, spec: TaskSpec, target: SinkTarget, writer: SinkWriter):
        self.spec, self.t, self.w = spec, target, writer
        self.dead = writer.dead
        self.skipped: list[int] = []  # redrive: letters no longer quarantined
        self.fallback: list[pa.RecordBatch] = []  # backfill: versions to fall back on
        if spec.redelivery:
            writer.redelivery = Redelivery(spec, target, writer, writer.dead)

    def scope(self, partition: int, batch: pa.RecordBatch) -> pa.RecordBatch:
        """The records of ``batch`` this sink must place: its range (run, backfill) or the
        letters this task holds for it (redrive)."""
        if self.spec.mode == "redrive":
            offs = self.dead.held_offsets.get(partition)
            if offs is None:
                return batch.slice(0, 0)
            return batch.filter(pc.is_in(batch.column(OFFSET), value_set=offs))
        span = self.t.ranges.get(partition)
        if span is None:
            return batch.slice(0, 0)
        off = batch.column(OFFSET)
        return batch.filter(pc.and_(pc.greater_equal(off, span[0]), pc.less(off, span[1])))

    def place(self, partition: int, batch: pa.RecordBatch) -> None:
        self.w.out["records"] += batch.num_rows
        why = self.spec.quarantine or self.t.quarantine
        bad = pc.is_valid(batch.column(ERR_CLASS))
        if pc.any(bad).as_py():  # decode and transform failures, and tombstones
            rows = batch.filter(bad).to_pylist()
            batch = batch.filter(pc.invert(bad))
            tombs = [r for r in rows if r[ERR_CLASS] == TOMBSTONE]
            if tombs:
                rows = [r for r in rows if r[ERR_CLASS] != TOMBSTONE] + self._tombstones(tombs, why)
            self.dead.add(rows)
        if why is not None:  # a failed batch gate under quarantine_batch: this sink's range
            self.dead.add(batch.to_pylist(), "dq_gate", why)
            return
        if self.spec.checks and batch.num_rows:  # the write job ran the row checks
            batch = self._checked(batch)
        for failures in (self.spec.failed.get(partition), self.t.failed.get(partition)):
            if failures and batch.num_rows:
                hit = _offsets_in(batch, list(failures))
                if pc.any(hit).as_py():
                    rows = batch.filter(hit).to_pylist()
                    for r in rows:
                        r[ERR_CLASS], r[ERR_REASON] = "validation", failures[r[OFFSET]]
                    self.dead.add(rows)
                    batch = batch.filter(pc.invert(hit))
        for col in (c for c in self.t.key + [self.t.version] if c):
            nulls = pc.is_null(batch.column(col))
            if pc.any(nulls).as_py():  # a NULL key would vanish in DISTINCT ON
                self.dead.add(batch.filter(nulls).to_pylist(), "transform", self._null_reason(col))
                batch = batch.filter(pc.invert(nulls))
        self.w.add(batch)

    def _tombstones(self, tombs: list[dict], why: str | None) -> list[dict]:
        """Hands the writer the tombstones that delete their key; returns those to quarantine:
        every one where the sink keeps tombstones, or its batch gate quarantined the range,
        and one whose key the transform could not derive (from ``_tm_key``)."""
        deletes, kept = [], []
        for r in tombs:
            null = next((k for k in self.t.key if r[k] is None), None)
            if self.t.tombstones != "delete":
                r[ERR_CLASS], r[ERR_REASON] = "decode", TOMBSTONE_KEPT
            elif why is not None:
                r[ERR_CLASS], r[ERR_REASON] = "dq_gate", why
            elif null is not None:
                r[ERR_CLASS], r[ERR_REASON] = (
                    "transform",
                    (
                        f"tombstone: key column {null} is NULL; to delete, the transform must "
                        f"derive the sink key from _tm_key (a tombstone has no payload)"
                    ),
                )
            else:
                deletes.append(r)
                continue
            kept.append(r)
        self.w.add_tombstones(deletes)
        return kept

    def _checked(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """Quarantines the records a row check failed (column CHECK: the first one's index in
        TaskSpec.checks), with the reason the driver would give them; returns the rest."""
        hit = pc.is_valid(batch.column(CHECK))
        if not pc.any(hit).as_py():
            return batch
        rows = batch.filter(hit).to_pylist()
        for r in rows:
            check = self.spec.checks[r[CHECK]]
            seen = {c: r[c] for c in (PARTITION, OFFSET, *reasons.columns_of(check.kwargs))}
            r[ERR_CLASS], r[ERR_REASON] = (
                "validation",
                reasons.reason(check.type, check.kwargs, seen),
            )
        self.dead.add(rows)
        return batch.filter(pc.invert(hit))

    def _null_reason(self, col: str) -> str:
        return f"{'key' if col in self.t.key else 'version'} column {col} is NULL"

    def finish(self) -> None:
        """Flush; a re-delivery then falls back and resolves (tidemark/engine/redelivery.py)."""
        if self.w.redelivery is None:
            self.w.flush()
            return
        self.w.redelivery.finish(self.fallback)
        self.fallback = []

    def result(self) -> SinkResult:
        o = self.w.out
        extra = {}
        if self.spec.mode == "redrive":
            failed = set(self.dead.failed_again)
            extra = {
                "redriven": len(self.dead.held) - len(failed),
                "failed_again": sorted(failed),
                "skipped": self.skipped,
            }
        return SinkResult(
            records=o["records"],
            rows=o["rows"],
            dead=self.dead.rows,
            superseded=o["superseded"],
            removed=o["removed"],
            fallback=o["fallback"],
            tombstones=o["tombstones"],
            resolved=self.dead.resolved,
            error=self.w.failed,
            copy_format=self.w.copy_format or "",
            phases=self.w.phases.rounded(),
            **extra,
        )


def make_task(spec: TaskSpec):
    """The function Spark runs per partition (mapInArrow): returns one result row."""
    shipped = spec.model_dump_json()

    def run_task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        spec = TaskSpec.model_validate_json(shipped)
        ctx = TaskContext.get()
        task, attempt = ctx.partitionId(), ctx.attemptNumber()
        result = _run_task(spec, task, attempt, batches)
        yield pa.RecordBatch.from_pydict(
            {"task": [task], "attempt": [attempt], "result": [result.model_dump_json()]},
            schema=pa.schema(
                [("task", pa.int32()), ("attempt", pa.int32()), ("result", pa.string())]
            ),
        )

    return run_task


def _run_task(
    spec: TaskSpec, task: int, attempt: int, batches: Iterator[pa.RecordBatch]
) -> TaskResult:
    prefix, run_id = spec.prefix, spec.run_id

    write = spec.write

    def gid(stage: str) -> str:
        return str(gids.Gid(prefix, run_id, stage, task, attempt, write))

    if attempt > 0 or write > 0:
        rollback_earlier_attempts(spec.ledger_dsn, prefix, run_id, "%", task, attempt, write)
        for t in spec.sinks:
            stage = gids.sink_stage(t.name)
            rollback_earlier_attempts(t.dsn, prefix, run_id, stage, task, attempt, write)
    phases = Phases()
    sinks = []
    for t in spec.sinks:
        dead = DeadLetters(spec, t.name, gid(gids.dlq_stage(t.name)), Phases())
        sinks.append(_Sink(spec, t, SinkWriter(spec, t, gid(gids.sink_stage(t.name)), dead)))
    if spec.reads is not None and task >= len(spec.reads):
        return TaskResult(
            task=task,
            attempt=attempt,
            records=0,
            error=(
                f"Spark task {task} beyond the {len(spec.reads)} task(s) of the ranges read: the "
                f"transform changed the partitioning (a union, join or repartition)"
            ),
        )
    spans = (
        spec.spread
        if spec.spread is not None
        else (spec.reads[task] if spec.reads is not None else None)
    )
    accounts = _Accounts(spans, spread=spec.spread is not None)
    seen = 0
    try:
        for s in sinks:
            s.skipped = s.dead.hold(spec.request) if spec.mode == "redrive" else []
        # Upstream of this function Spark reads, decodes and transforms: the time spent
        # waiting for each next batch is theirs.
        for whole in phases.waiting("read_transform", batches):
            with phases("checks"):  # scope, accounting, row verdicts, dead letters
                if spec.fallback and whole.num_rows:
                    whole = _set_aside_fallback(whole, sinks)
                for partition, batch in _by_partition(whole) if whole.num_rows else ():
                    seen += batch.num_rows
                    accounts.add(partition, batch)
                    for s in sinks:
                        mine = s.scope(partition, batch)
                        if mine.num_rows:
                            s.place(partition, mine)
            for s in sinks:
                s.w.flush_full()
        problem = accounts.problem([s.dead.held_offsets for s in sinks] if spans is None else None)
        if problem is None:
            for s in sinks:
                s.finish()
                r = s.result()
                placed = r.rows + r.dead + r.superseded + r.tombstones
                if not r.error and r.records + r.fallback != placed:
                    problem = (
                        f"sink {s.t.name}: {r.records} records"
                        + (f" and {r.fallback} fallback versions" if r.fallback else "")
                        + f" but {r.rows} written + {r.dead} quarantined + "
                        f"{r.superseded} superseded + {r.tombstones} tombstones"
                    )
        if problem is not None:  # nothing is prepared: the driver aborts the run
            _close(sinks)
            return TaskResult(task=task, attempt=attempt, records=seen, error=problem)
        participants, first = [], True
        for s in sinks:
            for p in (s.w.prepare(), s.dead.prepare() if not s.w.failed else None):
                if p:
                    participants.append(p)
                    if first:
                        # Only the run's first try fails on purpose (TIDEMARK_FAIL_AT).
                        faults.point("task_after_prepare", attempt if write == 0 else None)
                        first = False
    except BaseException:
        _close(sinks)
        raise
    _close(sinks)  # a failed sink's letters roll back with it
    return TaskResult(
        task=task,
        attempt=attempt,
        records=seen,
        participants=participants,
        sinks={s.t.name: s.result() for s in sinks},
        phases=phases.rounded(),
        seen=accounts.bitmaps() if accounts.spread else {},
    )


def _set_aside_fallback(batch: pa.RecordBatch, sinks: list[_Sink]) -> pa.RecordBatch:
    """A backfill's fallback versions wait for the end of the range (_Sink.fall_back); the
    rest is the range, accounted for as usual."""
    tag = batch.column(FALLBACK)
    extra = pc.is_valid(tag)
    if not pc.any(extra).as_py():
        return batch
    for s in sinks:
        mine = batch.filter(pc.equal(tag, s.t.name))
        if mine.num_rows:
            s.fallback.append(mine)
    return batch.filter(pc.invert(extra))


def _close(sinks: list[_Sink]) -> None:
    for s in sinks:
        s.w.close()
        s.dead.close()
