"""Binary COPY (tidemark/engine/pgbinary.py): loads exactly what CSV loads, refuses what CSV
refuses, and is chosen only when every column's type carries over."""

from __future__ import annotations

import io
import math
from datetime import UTC, date, datetime

import psycopg
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest

from tests.invariants import assert_exactly_once
from tidemark.core.db import is_data_error
from tidemark.engine import pgbinary
from tidemark.engine.sink_writer import _for_csv
from tidemark.protocol.taskspec import CopyFormat

COLUMNS = """i2 smallint, i4 integer, i8 bigint, wide bigint, f4 real, f8 double precision,
    b boolean, s text, v varchar(8), j jsonb, by bytea, d date, ts timestamptz, tn timestamp"""
TYPES = {
    "i2": "int2",
    "i4": "int4",
    "i8": "int8",
    "wide": "int8",
    "f4": "float4",
    "f8": "float8",
    "b": "bool",
    "s": "text",
    "v": "varchar",
    "j": "jsonb",
    "by": "bytea",
    "d": "date",
    "ts": "timestamptz",
    "tn": "timestamp",
}


def _edge_table() -> pa.Table:
    utc = [
        datetime(2013, 1, 1, 10, 15, tzinfo=UTC),
        datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
        datetime(1900, 1, 1, tzinfo=UTC),
        None,
        datetime(2000, 1, 1, tzinfo=UTC),
    ]
    return pa.table(
        {
            "i2": pa.array([-32768, 32767, 0, None, 1], pa.int16()),
            "i4": pa.array([-(2**31), 2**31 - 1, 0, None, -1], pa.int32()),
            "i8": pa.array([-(2**63), 2**63 - 1, 0, None, 42], pa.int64()),
            "wide": pa.array([-(2**31), 7, None, 0, 2**31 - 1], pa.int32()),  # widens into bigint
            "f4": pa.array([1.5, -0.0, math.inf, None, math.nan], pa.float32()),
            "f8": pa.array([1e-300, -math.inf, math.nan, None, 370.25], pa.float64()),
            "b": pa.array([True, False, None, True, False]),
            "s": pa.array(["日本", 'quote " comma , new\nline', "", None, "\\x41"]),
            "v": pa.array(["abc", "", None, "éèê", "12345678"]),
            "j": pa.array(['{"a": [1, 2]}', "[]", None, '"x"', "null"]),
            "by": pa.array([b"\x00\xff", b"", None, b"plain", b"\\x00"], pa.binary()),
            "d": pa.array(
                [date(2013, 1, 1), date(1999, 12, 31), date(1970, 1, 1), None, date(2100, 2, 28)]
            ),
            "ts": pa.array(utc, pa.timestamp("us", tz="UTC")),
            "tn": pa.array(utc, pa.timestamp("us", tz="UTC")),
        }
    )


def _csv(table: pa.Table) -> memoryview:
    buf = io.BytesIO()
    pacsv.write_csv(_for_csv(table), buf, pacsv.WriteOptions(include_header=False))
    return buf.getbuffer()


def _load(conn: psycopg.Connection, name: str, fmt: str, body) -> None:
    cols = ", ".join(TYPES)
    with conn.cursor().copy(f"COPY {name} ({cols}) FROM STDIN (FORMAT {fmt})") as cp:
        cp.write(body)


def test_binary_loads_exactly_what_csv_loads(env):
    table = _edge_table()
    enc, why = pgbinary.encoder(table.schema, TYPES)
    assert enc is not None, why
    with psycopg.connect(env.sink_dsn, autocommit=True) as c:
        for name in ("by_csv", "by_binary"):
            c.execute(f"CREATE TABLE {name} (n serial, {COLUMNS})")
        _load(c, "by_csv", "csv", _csv(table))
        _load(c, "by_binary", "binary", enc.encode(table))
        for a, b in (("by_csv", "by_binary"), ("by_binary", "by_csv")):
            assert c.execute(f"SELECT * FROM {a} EXCEPT SELECT * FROM {b}").fetchall() == []
        assert c.execute("SELECT count(*) FROM by_binary").fetchone()[0] == 5
        row = c.execute(
            "SELECT i8, wide, s, by, d, ts, tn, j FROM by_binary WHERE n = 2"
        ).fetchone()
        assert row[:5] == (2**63 - 1, 7, 'quote " comma , new\nline', b"", date(1999, 12, 31))
        assert row[5] == datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)
        assert row[6] == datetime(1969, 12, 31, 23, 59, 59, 999999) and row[7] == []
        nulls = c.execute(
            "SELECT num_nulls(i2, i4, i8, f4, f8, ts, tn, d) FROM by_binary WHERE n = 4"
        ).fetchone()[0]
        assert nulls == 8


@pytest.mark.parametrize(
    "value,column", [("nul\x00inside", "text"), ("far too long", "varchar(8)")]
)
def test_binary_refuses_what_csv_refuses(env, value, column):
    """A value the column refuses is a data error either way, so the writer bisects it to a
    dead letter instead of failing the sink."""
    table = pa.table({"s": pa.array(["fine", value])})
    enc, _ = pgbinary.encoder(table.schema, {"s": column.split("(")[0]})
    with psycopg.connect(env.sink_dsn, autocommit=True) as c:
        c.execute(f"CREATE TABLE t (s {column})")
        for fmt, body in (("csv", _csv(table)), ("binary", enc.encode(table))):
            with pytest.raises(psycopg.Error) as err:
                with c.cursor().copy(f"COPY t (s) FROM STDIN (FORMAT {fmt})") as cp:
                    cp.write(body)
            assert is_data_error(err.value), (fmt, err.value)


@pytest.mark.parametrize(
    "arrow,pg",
    [
        (pa.decimal128(10, 2), "numeric"),
        (pa.int64(), "int4"),
        (pa.float64(), "float4"),
        (pa.timestamp("us"), "timestamptz"),
        (pa.timestamp("ns", tz="UTC"), "timestamptz"),
        (pa.string(), "uuid"),
        (pa.string(), "my_domain"),
        (pa.uint32(), "int8"),
        (pa.list_(pa.int32()), "_int4"),
    ],
)
def test_types_binary_cannot_carry_faithfully_keep_csv(arrow, pg):
    enc, why = pgbinary.encoder(pa.schema([("c", arrow)]), {"c": pg})
    assert enc is None and why.startswith("column c (") and pg in why


def test_a_run_says_how_its_rows_went_in(env, spark):
    """The demo-like sink goes binary; a user's table with a numeric column for a double
    keeps CSV (PostgreSQL casts), says so, and still places every record once."""
    env.append_orders(range(40))
    env.pipeline()
    rep = env.run(spark)
    assert rep.ok and rep.sinks["main"].copy_format == CopyFormat.BINARY
    assert rep.to_dict()["sinks"]["main"]["csv_why"] == ""
    with psycopg.connect(env.sink2_dsn, autocommit=True) as c:
        c.execute("""CREATE TABLE public.orders (id integer PRIMARY KEY, name text,
            amount numeric, version bigint, _tm_partition integer NOT NULL,
            _tm_offset bigint NOT NULL, _tm_run_id bigint NOT NULL)""")
    env.pipeline(
        name="typed",
        sinks=[{"name": "main", "dsn": env.sink2_dsn, "table": "public.orders", "key": ["id"]}],
    )
    rep = env.run(spark, name="typed")
    assert rep.ok and rep.sinks["main"].counts.rows == 40
    assert rep.sinks["main"].copy_format == CopyFormat.CSV
    assert rep.sinks["main"].csv_why.startswith("column amount (double into numeric")
    assert env.q(env.sink2_dsn, "SELECT amount FROM public.orders WHERE id = 3") == [
        (pytest.approx(3.75),)
    ]
    assert_exactly_once(env, pipeline="typed", sinks={"main": env.sink2_dsn})
