"""Executor side of the commit protocol: one Spark task writes its range to every sink.

Per task and sink, one transaction on the sink database: COPY rows into a staging table,
merge them into the target with a keyed upsert that never lets an older offset overwrite a
newer one, insert the gid's marker row, ``PREPARE TRANSACTION gid``. Dead letters go the same
way into the ledger (one transaction for the source stage, one per sink for sink-stage
failures). Rows that a sink refuses for their data (SQLSTATE classes 22 and 23) are found by
bisection under savepoints and quarantined as ``sink_write``; the rest of the batch goes on.

A sink whose connection or statements fail is reported failed in the task's result and
rolled back; the other sinks carry on (a failing sink never holds the others back). Ledger
and source errors fail the task, and Spark retries it with a new attempt.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
from psycopg import sql

from tidemark import faults, gids, twopc
from tidemark.db import is_data_error, one_line, qualified
from tidemark.records import ERR_CLASS, ERR_REASON

FLUSH_ROWS = 50_000
REASON_MAX = 200
DETAIL_MAX = 8_000
RESULT_SCHEMA = "task int, attempt int, result string"


def clamp(text: str, limit: int) -> str:
    text = text.replace("\x00", "\\0")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _begin(dsn: str, lock_timeout_ms: int, what: str) -> psycopg.Connection:
    conn = psycopg.connect(dsn, application_name=f"tidemark-{what}", connect_timeout=10)
    conn.execute(sql.SQL("SET lock_timeout = {}").format(sql.Literal(f"{lock_timeout_ms}ms")))
    return conn


def _finish(conn: psycopg.Connection, gid: str, run_id: int, prepare: bool) -> None:
    conn.execute("INSERT INTO tidemark.commits (gid, run_id) VALUES (%s, %s)", (gid, run_id))
    if prepare:
        conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
    else:
        conn.commit()


def rollback_earlier_attempts(dsn: str, prefix: str, run_id: int, stage: str, task: int,
                              attempt: int) -> None:
    """A retried attempt first rolls back what earlier attempts of its task left prepared
    (no decision can exist yet), or it would wait forever on their row locks."""
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        for gid, _age in twopc.prepared(conn, gids.like_task(prefix, run_id, stage, task)):
            parsed = gids.parse(gid, prefix)
            if parsed and parsed.attempt != attempt:
                twopc.rollback(conn, gid)


@dataclass
class DeadLetters:
    """One ledger transaction of dead letters for a stage (source, or one sink)."""

    spec: dict
    stage: str
    sink: str | None
    gid: str
    conn: psycopg.Connection | None = None
    rows: int = 0
    redrive: Redriven | None = None

    _COLS = ("pipeline", "sink", "run_id", "source_partition", "source_offset", "key",
             "payload", "headers", "error_class", "reason", "detail")

    def open(self) -> None:
        if self.conn is None:
            self._open()

    def _open(self) -> None:
        self.conn = _begin(self.spec["ledger_dsn"], self.spec["lock_timeout_ms"], "dlq")
        self.stage_table = sql.SQL("tidemark.{}").format(sql.Identifier(
            "dlqstage_" + hashlib.sha1(self.gid.encode()).hexdigest()[:20]))
        cols = sql.SQL(", ").join(sql.Identifier(c) for c in self._COLS)
        self.conn.execute(sql.SQL(
            "CREATE UNLOGGED TABLE {} AS SELECT {} FROM tidemark.dlq WITH NO DATA").format(
            self.stage_table, cols))
        self.copy_sql = sql.SQL("COPY {} ({}) FROM STDIN").format(self.stage_table, cols)
        # A re-run of a range adds to attempts; it never adds a second row.
        self.merge_sql = sql.SQL("""
            INSERT INTO tidemark.dlq AS d ({cols}) SELECT {cols} FROM {stage}
            ON CONFLICT ON CONSTRAINT dlq_one_per_stage DO UPDATE
            SET attempts = d.attempts + 1, last_seen = now(), run_id = EXCLUDED.run_id,
                reason = EXCLUDED.reason, detail = EXCLUDED.detail""").format(
            cols=cols, stage=self.stage_table)

    def add(self, records: list[dict], error_class: str | None = None,
            reason: str | None = None, detail: str | None = None) -> None:
        if self.redrive is not None:
            # A redriven record that fails again at its own stage keeps its dead letter.
            records = self.redrive.failed_again(records, self.sink, error_class, reason, detail)
        if not records:
            return
        if self.conn is None:
            self._open()
        with self.conn.cursor().copy(self.copy_sql) as copy:
            for r in records:
                copy.write_row((
                    self.spec["pipeline"], self.sink, self.spec["run_id"], r["_tm_partition"],
                    r["_tm_offset"], r["_tm_key"], r["_tm_payload"], r["_tm_headers"],
                    error_class or r[ERR_CLASS], clamp(reason or r[ERR_REASON], REASON_MAX),
                    clamp(detail, DETAIL_MAX) if detail else None))
        self.conn.execute(self.merge_sql)
        self.conn.execute(sql.SQL("TRUNCATE {}").format(self.stage_table))
        self.rows += len(records)

    def prepare(self) -> dict | None:
        if self.conn is None:
            return None
        self.conn.execute(sql.SQL("DROP TABLE {}").format(self.stage_table))
        _finish(self.conn, self.gid, self.spec["run_id"], self.spec["prepare"])
        self.conn.close()
        return {"gid": self.gid, "target": "ledger", "stage": self.stage, "rows": self.rows}

    def close(self) -> None:
        if self.conn is not None and not self.conn.closed:
            self.conn.close()  # an open, unprepared transaction rolls back


class Redriven:
    """The dead letters a redrive task replays, and their fate, in the task's source-stage
    ledger transaction: it locks them first (a concurrent discard waits, a record discarded
    meanwhile is left out), and its PREPARE carries every status change, so they commit with
    the sink writes under the run's one decision.

    A record that fails before the sinks keeps its dead letter (attempts + 1, the new reason);
    so does one that fails again at the sink its dead letter names. Otherwise the dead letter
    is ``redriven``; a record quarantined before the sinks that now fails at one sink gets a
    new dead letter for that sink."""

    def __init__(self, spec: dict, conn: psycopg.Connection):
        self.spec, self.conn = spec, conn
        self.by_record: dict[tuple[int, int], dict] = {}
        ids = [r["id"] for r in spec["redrive"]["records"]]
        locked = {i for (i,) in conn.execute(
            """SELECT id FROM tidemark.dlq WHERE id = ANY(%s) AND status = 'quarantined'
               ORDER BY id FOR UPDATE""", (ids,))}
        for r in spec["redrive"]["records"]:
            if r["id"] in locked:
                self.by_record[(r["partition"], r["offset"])] = r
        self.skipped = sorted(set(ids) - locked)
        self.failed: set[int] = set()

    def keep(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """Only the records whose dead letters this task holds."""
        keys = pc.add(pc.multiply(pc.cast(batch.column("_tm_partition"), pa.int64()), 1 << 40),
                      batch.column("_tm_offset"))
        mine = pa.array([p * (1 << 40) + o for p, o in self.by_record], pa.int64())
        return batch.filter(pc.is_in(keys, value_set=mine))

    def failed_again(self, records: list[dict], stage: str | None, error_class: str | None,
                     reason: str | None, detail: str | None) -> list[dict]:
        """Update the dead letters of records failing at their own stage; return the others."""
        rest = []
        for r in records:
            d = self.by_record[(r["_tm_partition"], r["_tm_offset"])]
            if stage is not None and d["sink"] != stage:
                rest.append(r)  # passed the stage it failed at before: a new dead letter
                continue
            cls = error_class or r[ERR_CLASS]
            why = reason or r[ERR_REASON]
            if cls != d["error_class"]:
                why = f"{cls}: {why}"
            self.conn.execute(
                """UPDATE tidemark.dlq SET attempts = attempts + 1, last_seen = now(),
                          run_id = %s, reason = %s, detail = coalesce(%s, detail)
                   WHERE id = %s""",
                (self.spec["run_id"], clamp(why, REASON_MAX),
                 clamp(detail, DETAIL_MAX) if detail else None, d["id"]))
            self.failed.add(d["id"])
        return rest

    def resolve(self) -> int:
        done = [d["id"] for d in self.by_record.values() if d["id"] not in self.failed]
        self.conn.execute(
            """UPDATE tidemark.dlq SET status = 'redriven', resolved_by = %s,
                      resolved_at = now(), note = %s WHERE id = ANY(%s)""",
            (self.spec["redrive"]["by"], f"redriven by run {self.spec['run_id']}", done))
        return len(done)


@dataclass
class SinkWriter:
    spec: dict       # the whole task spec
    sink: dict       # this sink's part of it
    gid: str
    dead: DeadLetters
    conn: psycopg.Connection | None = None
    rows: int = 0
    failed: str | None = None
    pending: list[pa.RecordBatch] = field(default_factory=list)
    pending_rows: int = 0

    def _open(self) -> None:
        self.conn = _begin(self.sink["dsn"], self.spec["lock_timeout_ms"], "sink")
        self.stage_table = sql.SQL("tidemark.{}").format(sql.Identifier(
            "stage_" + hashlib.sha1(self.gid.encode()).hexdigest()[:20]))
        target = sql.SQL(qualified(self.sink["table"]))
        cols = [*self.spec["columns"], "_tm_partition", "_tm_offset", "_tm_run_id"]
        ident = [sql.Identifier(c) for c in cols]
        keys = [sql.Identifier(k) for k in self.sink["key"]]
        self.conn.execute(sql.SQL("CREATE UNLOGGED TABLE {} (LIKE {})").format(
            self.stage_table, target))
        self.copy_sql = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(
            self.stage_table, sql.SQL(", ").join(ident))
        updates = [sql.SQL("{} = EXCLUDED.{}").format(sql.Identifier(c), sql.Identifier(c))
                   for c in cols if c not in self.sink["key"]]
        # Within one batch keep the newest version of each key; against the table, replace
        # only a version at the same or an older (partition, offset).
        self.merge_sql = sql.SQL("""
            INSERT INTO {target} AS t ({cols})
            SELECT DISTINCT ON ({keys}) {cols} FROM {stage}
            ORDER BY {keys}, _tm_partition DESC, _tm_offset DESC
            ON CONFLICT ({keys}) DO UPDATE SET {updates}
            WHERE (t._tm_partition, t._tm_offset) <= (EXCLUDED._tm_partition,
                                                      EXCLUDED._tm_offset)""").format(
            target=target, cols=sql.SQL(", ").join(ident), keys=sql.SQL(", ").join(keys),
            stage=self.stage_table, updates=sql.SQL(", ").join(updates))
        self.truncate_sql = sql.SQL("TRUNCATE {}").format(self.stage_table)
        self.columns = cols

    def add(self, batch: pa.RecordBatch) -> None:
        if self.failed or batch.num_rows == 0:
            return
        self.pending.append(batch)
        self.pending_rows += batch.num_rows
        if self.pending_rows >= FLUSH_ROWS:
            self.flush()

    def flush(self) -> None:
        if self.failed or not self.pending:
            return
        table = pa.Table.from_batches(self.pending)
        self.pending, self.pending_rows = [], 0
        try:
            if self.conn is None:
                self._open()
            self._write(table)
        except psycopg.Error as exc:
            self._fail(exc)

    def _write(self, table: pa.Table) -> None:
        try:
            with self.conn.transaction():  # a savepoint: bisect on bad data
                buf = io.BytesIO()
                run_col = pa.array([self.spec["run_id"]] * table.num_rows, pa.int64())
                out = table.append_column("_tm_run_id", run_col).select(self.columns)
                pacsv.write_csv(_for_csv(out), buf,
                                pacsv.WriteOptions(include_header=False, batch_size=8192))
                with self.conn.cursor().copy(self.copy_sql) as copy:
                    copy.write(buf.getbuffer())
                self.conn.execute(self.merge_sql)
                self.conn.execute(self.truncate_sql)
            self.rows += table.num_rows
        except psycopg.Error as exc:
            if not is_data_error(exc):
                raise
            if table.num_rows == 1:
                self.dead.add(table.to_pylist(), "sink_write", one_line(exc),
                              f"{exc}\n(sink {self.sink['name']}, table {self.sink['table']})")
                return
            half = table.num_rows // 2
            self._write(table.slice(0, half))
            self._write(table.slice(half))

    def _fail(self, exc: BaseException) -> None:
        self.failed = f"sink {self.sink['name']}: {one_line(exc)}"
        self.close()

    def prepare(self) -> dict | None:
        self.flush()
        if self.failed:
            return None
        if self.conn is None:
            return None  # nothing to write: no participant
        try:
            self.conn.execute(sql.SQL("DROP TABLE {}").format(self.stage_table))
            _finish(self.conn, self.gid, self.spec["run_id"], self.spec["prepare"])
            self.conn.close()
        except psycopg.Error as exc:
            self._fail(exc)
            return None
        return {"gid": self.gid, "target": f"sink:{self.sink['name']}",
                "stage": gids.sink_stage(self.sink["name"]), "rows": self.rows}

    def close(self) -> None:
        if self.conn is not None and not self.conn.closed:
            self.conn.close()


def _for_csv(table: pa.Table) -> pa.Table:
    """PostgreSQL reads bytea in CSV as hex text."""
    for i, f in enumerate(table.schema):
        if pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type):
            hexed = pa.array([None if v is None else "\\x" + v.hex()
                              for v in table.column(i).to_pylist()], pa.string())
            table = table.set_column(i, f.name, hexed)
    return table


def _by_partition(batch: pa.RecordBatch) -> Iterator[pa.RecordBatch]:
    """A source's batches hold one partition; a redrive's may mix them."""
    parts = batch.column("_tm_partition")
    lo, hi = pc.min_max(parts).values()
    if lo == hi:
        yield batch
        return
    for p in pc.unique(parts).to_pylist():
        yield batch.filter(pc.equal(parts, p))


def _in_range(batch: pa.RecordBatch, partition: int, span: list[int] | None,
              offsets: list[int] | None = None) -> pa.RecordBatch:
    if span is None:
        return batch.slice(0, 0)
    if offsets is not None:  # a redrive: exactly these records go to this sink
        return batch.filter(pc.is_in(batch.column("_tm_offset"),
                                     value_set=pa.array(offsets, pa.int64())))
    off = batch.column("_tm_offset")
    mask = pc.and_(pc.greater_equal(off, span[0]), pc.less(off, span[1]))
    return batch.filter(mask)


def _validated(batch: pa.RecordBatch, partition: int, scope: str, validation: dict,
               dead: DeadLetters) -> pa.RecordBatch:
    """Quarantine the rows the data-quality checks of ``scope`` rejected (class validation),
    or the whole batch when its gate failed under quarantine_batch (class dq_gate)."""
    if batch.num_rows == 0 or not validation:
        return batch
    why = validation["quarantine"].get(scope)
    if why is not None:
        rows = batch.to_pylist()
        dead.add(rows, "dq_gate", why)
        return batch.slice(0, 0)
    failed = validation["rows"].get(scope, {}).get(partition)
    if not failed:
        return batch
    hit = pc.is_in(batch.column("_tm_offset"), value_set=pa.array(list(failed), pa.int64()))
    if not pc.any(hit).as_py():
        return batch
    rows = batch.filter(hit).to_pylist()
    for r in rows:
        r[ERR_CLASS], r[ERR_REASON] = "validation", failed[r["_tm_offset"]]
    dead.add(rows)
    return batch.filter(pc.invert(hit))


def make_task(spec: dict):
    """The function Spark runs per partition (mapInArrow): returns one result row."""

    def run_task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        task, attempt = ctx.partitionId(), ctx.attemptNumber()
        prefix, run_id = spec["prefix"], spec["run_id"]

        def gid(stage: str) -> str:
            return str(gids.Gid(prefix, run_id, stage, task, attempt))

        if attempt > 0:
            rollback_earlier_attempts(spec["ledger_dsn"], prefix, run_id, "%", task, attempt)
            for s in spec["sinks"]:
                rollback_earlier_attempts(s["dsn"], prefix, run_id, gids.sink_stage(s["name"]),
                                          task, attempt)
        source_dead = DeadLetters(spec, gids.SOURCE_STAGE, None, gid(gids.SOURCE_STAGE))
        writers = []
        for s in spec["sinks"]:
            dead = DeadLetters(spec, gids.dlq_stage(s["name"]), s["name"],
                               gid(gids.dlq_stage(s["name"])))
            writers.append(SinkWriter(spec, s, gid(gids.sink_stage(s["name"])), dead))
        partition, seen = None, 0
        validation = spec.get("validation") or {}
        redrive, offsets = None, spec.get("offsets", {})
        try:
            if "redrive" in spec:
                source_dead.open()
                redrive = Redriven(spec, source_dead.conn)
                for d in (source_dead, *(w.dead for w in writers)):
                    d.redrive = redrive
            for whole in batches:
                if whole.num_rows == 0:
                    continue
                for batch in _by_partition(redrive.keep(whole) if redrive else whole):
                    seen += batch.num_rows
                    partition = batch.column("_tm_partition")[0].as_py()
                    bad = pc.is_valid(batch.column(ERR_CLASS))
                    if pc.any(bad).as_py():
                        source_dead.add(batch.filter(bad).to_pylist())
                        batch = batch.filter(pc.invert(bad))
                    batch = _validated(batch, partition, "", validation, source_dead)
                    for w in writers:
                        key = str(partition)
                        mine = _in_range(batch, partition, w.sink["ranges"].get(key),
                                         offsets.get(w.sink["name"], {}).get(key))
                        w.add(_validated(mine, partition, w.sink["name"], validation, w.dead))
            if redrive:
                for w in writers:
                    w.flush()  # sink-write failures reach their dead letters before resolve
                redrive.resolve()
            participants, first = [], True
            for w in writers:
                for p in (w.prepare(), w.dead.prepare() if not w.failed else None):
                    if p:
                        participants.append(p)
                        if first:
                            faults.point("task_after_prepare", attempt)
                            first = False
            p = source_dead.prepare()
            if p:
                participants.append(p)
        except BaseException:
            for w in writers:
                w.close()
                w.dead.close()
            source_dead.close()
            raise
        result = {
            "task": task, "attempt": attempt, "partition": partition, "records": seen,
            "participants": participants,
            "sinks": {w.sink["name"]: {"rows": w.rows, "dead": w.dead.rows, "error": w.failed}
                      for w in writers},
            "source_dead": source_dead.rows,
        }
        if redrive:
            result["redrive"] = {"redriven": len(redrive.by_record) - len(redrive.failed),
                                 "failed": sorted(redrive.failed), "skipped": redrive.skipped}
        for w in writers:
            if w.failed:
                w.dead.close()
        yield pa.RecordBatch.from_pydict({"task": [task], "attempt": [attempt],
                                          "result": [json.dumps(result)]},
                                         schema=pa.schema([("task", pa.int32()),
                                                           ("attempt", pa.int32()),
                                                           ("result", pa.string())]))

    return run_task
