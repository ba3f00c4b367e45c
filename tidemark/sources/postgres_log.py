"""``postgres_log``: an append-only table ``(partition, offset, key, payload, headers, ts, xid)``.

The watermark rule (docs/design.md, last section). Offsets must be *dense and commit-ordered per
partition*: :func:`append` guarantees it by serializing writers of a partition on a head row,
so offset n+1 never becomes visible before offset n. The reader enforces it rather than trust
it: it plans only over rows whose writer transaction is older than the oldest transaction
still running (``xid < pg_snapshot_xmin(pg_current_snapshot())``, so nothing below can still
appear), and it stops at the first missing offset. A writer that breaks the contract delays
the reader; it never makes it skip a record. Rows below every checkpoint may be deleted
(retention); rows above must not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime

import numpy as np
import psycopg
import pyarrow as pa
from psycopg import conninfo, sql

from tidemark.config import PostgresLogSource
from tidemark.core.db import connect, one_line, qualified, scalar
from tidemark.core.errors import TidemarkError
from tidemark.core.ranges import Range


def _ids(cols) -> dict[str, sql.Identifier]:
    return {k: sql.Identifier(v) for k, v in cols.items()}


def _table(name: str) -> sql.Composable:
    return sql.SQL(qualified(name))


def _dsn(src: PostgresLogSource) -> str:
    """The DSN of a source as the reader gets it: tidemark.sources resolves a conn_id first."""
    if src.dsn is None:
        raise TidemarkError(f"source {src.table}: its conn_id was not resolved to a DSN")
    return src.dsn


# Every session Tidemark opens on a source reads and compares times in UTC. A ``ts timestamp``
# column (no zone) meets a UTC instant cast in the session's TimeZone, which the server, the
# database or the role may set (Europe/Berlin: a window two hours off). A SET, not a startup
# option: PgBouncer keeps a client's TimeZone across transaction pooling, and a proxy may
# refuse the ``options`` startup parameter.
PIN_UTC = "SET TIME ZONE 'UTC'"


def _connect(dsn: str, what: str) -> psycopg.Connection:
    """A source session (autocommit), its TimeZone UTC."""
    conn = connect(dsn, autocommit=True, what=what)
    try:
        conn.execute(PIN_UTC)
    except BaseException:
        conn.close()
        raise
    return conn


def _utc(ts: datetime | None) -> datetime | None:
    """A time read from the table: a ``timestamp`` column's (naive) is UTC."""
    return ts.replace(tzinfo=UTC) if ts is not None and ts.tzinfo is None else ts


def create_log_table(conn: psycopg.Connection, table: str) -> None:
    """The log table and its per-partition head rows (idempotent)."""
    t = _table(table)
    heads = _table(table + "_heads")
    schema = table.split(".", 1)[0] if "." in table else None
    with conn.transaction():
        if schema:
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
        conn.execute(
            sql.SQL("""CREATE TABLE IF NOT EXISTS {} (
            "partition" int NOT NULL, "offset" bigint NOT NULL, key bytea, payload bytea,
            headers jsonb, ts timestamptz NOT NULL DEFAULT now(),
            xid xid8 NOT NULL DEFAULT pg_current_xact_id(),
            PRIMARY KEY ("partition", "offset"))""").format(t)
        )
        conn.execute(
            sql.SQL("""CREATE TABLE IF NOT EXISTS {} (
            "partition" int PRIMARY KEY, next_offset bigint NOT NULL)""").format(heads)
        )


def problems(src: PostgresLogSource, dsn: str) -> list[str]:
    """What keeps a run from reading the log table: it or its columns missing, one line each."""
    with _connect(dsn, "source database") as conn:
        if scalar(conn.execute("SELECT to_regclass(%s)", (qualified(src.table),))) is None:
            return [
                f"source table {src.table} does not exist (docs/pipelines.md, 'Sources', "
                f"names the columns it needs)"
            ]
        have = {
            r[0]
            for r in conn.execute(
                "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
                "AND NOT attisdropped",
                (qualified(src.table),),
            )
        }
    missing = [f"{k} ({v})" for k, v in src.columns.model_dump().items() if v not in have]
    return (
        [
            f"source table {src.table} lacks the column(s) named for {', '.join(missing)} "
            f"(set source.columns to its names)"
        ]
        if missing
        else []
    )


def append(
    conn: psycopg.Connection,
    table: str,
    records: Iterable[tuple[int, bytes | None, bytes | None, str | None, datetime | None]],
) -> dict[int, tuple[int, int]]:
    """Append ``(partition, key, payload, headers_json, ts)`` records in one transaction.

    Takes each touched partition's head row lock (in partition order, so writers never
    deadlock), which makes offsets dense and commit-ordered. Returns {partition: (first, end)}.
    """
    by_part: dict[int, list] = {}
    for rec in records:
        by_part.setdefault(rec[0], []).append(rec)
    t, heads = _table(table), _table(table + "_heads")
    spans: dict[int, tuple[int, int]] = {}
    now = datetime.now(UTC)
    with conn.transaction():
        for part in sorted(by_part):
            conn.execute(
                sql.SQL("INSERT INTO {} VALUES (%s, 0) ON CONFLICT DO NOTHING").format(heads),
                (part,),
            )
            start = scalar(
                conn.execute(
                    sql.SQL('SELECT next_offset FROM {} WHERE "partition" = %s FOR UPDATE').format(
                        heads
                    ),
                    (part,),
                )
            )
            recs = by_part[part]
            with conn.cursor().copy(
                sql.SQL(
                    'COPY {} ("partition", "offset", key, payload, headers, ts) FROM STDIN'
                ).format(t)
            ) as copy:
                for i, (_, key, payload, headers, ts) in enumerate(recs):
                    copy.write_row((part, start + i, key, payload, headers, ts or now))
            end = start + len(recs)
            conn.execute(
                sql.SQL('UPDATE {} SET next_offset = %s WHERE "partition" = %s').format(heads),
                (end, part),
            )
            spans[part] = (start, end)
    return spans


class PostgresLogPlanner:
    def __init__(self, src: PostgresLogSource, dsn: str):
        self.src = src
        self.cols = _ids(src.columns.model_dump())
        self.table = _table(src.table)
        self.conn = _connect(dsn, f"source {src.table} at")

    def close(self) -> None:
        self.conn.close()

    def _q(self, text: str) -> sql.Composed:
        return sql.SQL(text).format(t=self.table, **self.cols)

    def partitions(self) -> list[int]:
        if self.src.partitions is not None:
            return list(self.src.partitions)
        try:
            # Loose index scan over the primary key: one probe per partition.
            rows = self.conn.execute(
                self._q("""
                WITH RECURSIVE p AS (
                    (SELECT {partition} AS v FROM {t} ORDER BY {partition} LIMIT 1)
                    UNION ALL
                    SELECT (SELECT {partition} FROM {t} WHERE {partition} > p.v
                            ORDER BY {partition} LIMIT 1) FROM p WHERE p.v IS NOT NULL)
                SELECT v FROM p WHERE v IS NOT NULL""")
            ).fetchall()
        except psycopg.Error as exc:
            raise TidemarkError(f"source {self.src.table}: {str(exc).splitlines()[0]}") from None
        return [r[0] for r in rows]

    def earliest(self, partition: int) -> int | None:
        """The first *settled* offset: a row a still-running writer may yet commit below the
        first visible one would otherwise be skipped for good."""
        first: int | None = scalar(
            self.conn.execute(
                self._q("""
                SELECT min({offset}) FROM {t} WHERE {partition} = %s
                  AND {xid} < pg_snapshot_xmin(pg_current_snapshot())"""),
                (partition,),
            )
        )
        return first

    def record_time(self, partition: int, offset: int) -> datetime | None:
        row = self.conn.execute(
            self._q("SELECT {ts} FROM {t} WHERE {partition} = %s AND {offset} = %s"),
            (partition, offset),
        ).fetchone()
        return _utc(row[0]) if row else None

    def window(
        self, partition: int, since: datetime, until: datetime, end: int
    ) -> tuple[int, int] | None:
        row = self.conn.execute(
            self._q(
                "SELECT min({offset}), max({offset}) FROM {t} WHERE {partition} = %s "
                "AND {offset} < %s AND {ts} >= %s AND {ts} < %s"
            ),
            (partition, end, since, until),
        ).fetchone()
        return None if row is None or row[0] is None else (row[0], row[1] + 1)

    def held(self, partition: int, start: int, end: int) -> list[tuple[int, int]]:
        """From the first settled offset on: offsets are dense (a row deleted above it stops
        every read of its range, loudly), so only retention's cut below it drops records."""
        first = self.earliest(partition)
        lo = start if first is None else max(start, first)
        return [] if first is None or lo >= end else [(lo, end)]

    def latest(self, partition: int) -> int | None:
        first = self.earliest(partition)
        if first is None:
            return None
        return self.safe_end(partition, first, 2**62)

    def safe_end(self, partition: int, start: int, limit: int) -> int:
        """End (exclusive) of the longest gap-free run of settled rows from ``start``."""
        return self.safe_ends({partition: start}, limit)[partition]

    def safe_ends(self, starts: dict[int, int], limit: int) -> dict[int, int]:
        """:meth:`safe_end` of each partition. The settled rows of every range are counted
        in one pass over the table: counting each partition's range on its own scanned the
        whole table once per partition (a claim of 10M records, 4 partitions: 3.6 s)."""
        if not starts:
            return {}
        ranges = sql.SQL(" OR ").join(
            sql.SQL("({partition} = {p} AND {offset} >= {a} AND {offset} < {b})").format(
                p=sql.Literal(p), a=sql.Literal(a), b=sql.Literal(a + limit), **self.cols
            )
            for p, a in sorted(starts.items())
        )
        rows = self.conn.execute(
            sql.SQL("""
            SELECT {partition}, count(*), min({offset}), max({offset}) FROM {t}
            WHERE ({ranges}) AND {xid} < pg_snapshot_xmin(pg_current_snapshot())
            GROUP BY {partition}""").format(t=self.table, ranges=ranges, **self.cols)
        ).fetchall()
        found = {p: (count, lo, hi) for p, count, lo, hi in rows}
        return {
            p: self._gap_free_end(p, start, limit, *found.get(p, (0, None, None)))
            for p, start in starts.items()
        }

    def _gap_free_end(
        self, partition: int, start: int, limit: int, count: int, lo: int | None, hi: int | None
    ) -> int:
        """The end from a range's settled rows: ``count`` of them, from ``lo`` to ``hi``."""
        stop = start + limit
        if count == 0 or lo != start or hi is None:
            return start
        if count == hi - start + 1:
            return hi + 1
        gap: int = scalar(
            self.conn.execute(
                self._q("""
                SELECT min(o) + 1 FROM (
                    SELECT {offset} AS o, lead({offset}) OVER (ORDER BY {offset}) AS nxt
                    FROM {t}
                    WHERE {partition} = %(p)s AND {offset} >= %(a)s AND {offset} < %(b)s
                      AND {xid} < pg_snapshot_xmin(pg_current_snapshot())) x
                WHERE nxt IS DISTINCT FROM o + 1"""),
                {"p": partition, "a": start, "b": stop},
            )
        )
        return gap


def headers_and_ts(
    src: PostgresLogSource, wanted: dict[int, list[int]]
) -> dict[tuple[int, int], tuple[str | None, datetime | None]]:
    """``{(partition, offset): (headers text, ts)}`` of the ``wanted`` records the table
    still holds (see tidemark.sources.headers_and_ts), cast as :func:`read_range` casts them:
    the headers' text, a timestamp without time zone as UTC."""
    query = sql.SQL(
        "SELECT {offset}, {headers}::text, {ts} FROM {t} "
        "WHERE {partition} = %s AND {offset} = ANY(%s::bigint[])"
    ).format(t=_table(src.table), **_ids(src.columns.model_dump()))
    out: dict[tuple[int, int], tuple[str | None, datetime | None]] = {}
    with _connect(_dsn(src), f"source {src.table} at") as conn:
        for part, offs in wanted.items():
            try:
                rows = conn.execute(query, (part, list(offs))).fetchall()
            except psycopg.Error as exc:
                raise TidemarkError(f"source {src.table}: {one_line(exc)}") from None
            for off, headers, ts in rows:
                out[(part, off)] = (headers, _utc(ts))
    return out


# A read runs in its own transaction with these, so that PostgreSQL walks the primary key
# (partition, offset) in order. Left to its cost model, it scanned the whole table (every
# partition) with parallel workers and sorted the range: twice the server's CPU for a range
# of 2.5M records (bench/replay_bench.py, 10M records). Transaction-scoped (SET LOCAL), so
# nothing outlives the read, behind a transaction-pooling proxy too.
READ_PLAN = (
    "BEGIN READ ONLY",
    "SET LOCAL enable_seqscan = off",
    "SET LOCAL enable_bitmapscan = off",
    "SET LOCAL max_parallel_workers_per_gather = 0",
    "SET LOCAL jit = off",
)


def adbc_error() -> type[Exception]:
    import adbc_driver_manager.dbapi

    return adbc_driver_manager.dbapi.Error


def connect_reader(src: PostgresLogSource):
    """An ADBC connection for :func:`read_range` (the caller closes it)."""
    import adbc_driver_postgresql.dbapi as adbc

    dsn = conninfo.make_conninfo(_dsn(src), application_name="tidemark-reader", connect_timeout=10)
    conn = adbc.connect(dsn, autocommit=True)
    try:
        with conn.cursor() as cur:
            cur.execute(PIN_UTC)
    except BaseException:
        conn.close()
        raise
    return conn


def read_range(
    src: PostgresLogSource, r: Range, conn=None, *, meta: bool = True
) -> Iterator[pa.RecordBatch]:
    """Executor side: one range as Arrow batches, over ``conn`` (:func:`connect_reader`) or
    a connection of its own. ADBC's PostgreSQL driver (Apache Arrow) turns the server's binary
    COPY into Arrow columns in C++, with no Python object per row: it reads a range in about a
    third of the time psycopg's row loop took. Without ``meta`` the headers and time come back
    NULL: turning each row's jsonb headers into text cost the server a fifth of the read."""
    if conn is None:
        with connect_reader(src) as own:
            yield from read_range(src, r, own, meta=meta)
        return
    cols = _ids(src.columns.model_dump())
    headers, ts = (
        (sql.SQL("{}::text").format(cols["headers"]), cols["ts"])
        if meta
        else (sql.SQL("NULL::text"), sql.SQL("NULL::timestamptz"))
    )
    query = (
        sql.SQL("""SELECT {offset}, {key}, {payload}, {h}, {when}
        FROM {t} WHERE {partition} = {p} AND {offset} >= {a} AND {offset} < {b}
        ORDER BY {offset}""")
        .format(
            t=_table(src.table),
            p=sql.Literal(r.partition),
            a=sql.Literal(r.start),
            b=sql.Literal(r.end),
            h=headers,
            when=ts,
            **cols,
        )
        .as_string(None)
    )
    try:
        with conn.cursor() as cur:
            for statement in READ_PLAN:
                cur.execute(statement)
            cur.execute(query)
            yield from _checked(src, r, cur.fetch_record_batch())
    finally:
        with contextlib.suppress(adbc_error()), conn.cursor() as cur:
            cur.execute("ROLLBACK")  # a read changes nothing: this only ends its transaction


def _checked(src: PostgresLogSource, r: Range, wholes) -> Iterator[pa.RecordBatch]:
    """The rows of ``r`` as the reader's batches, every offset checked to be the next one."""
    from tidemark.sources.schema import BATCH_ROWS, SCHEMA

    expected = r.start
    for whole in wholes:
        for at in range(0, whole.num_rows, BATCH_ROWS):
            part = whole.slice(at, BATCH_ROWS)
            n = part.num_rows
            offsets = part.column(0).to_numpy()
            wrong = np.flatnonzero(offsets != np.arange(expected, expected + n))
            if wrong.size:
                raise TidemarkError(
                    f"source {src.table} partition {r.partition}: expected offset "
                    f"{expected + wrong[0]}, found {offsets[wrong[0]]} (rows deleted or "
                    f"rewritten inside a planned range)"
                )
            expected += n
            # A text key or a timestamp without time zone casts as psycopg read them:
            # the text's bytes, the time as UTC.
            yield pa.RecordBatch.from_arrays(
                [pa.array(np.full(n, r.partition, np.int32)), *part.columns], names=SCHEMA.names
            ).cast(SCHEMA)
    if expected != r.end:
        raise TidemarkError(
            f"source {src.table} partition {r.partition}: range "
            f"[{r.start}, {r.end}) ended at {expected}: rows missing"
        )
