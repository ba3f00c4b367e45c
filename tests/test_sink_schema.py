"""A sink table against what the pipeline writes (tidemark/protocol/sink_schema.py): which
types a column takes, what ``schema: evolve`` adds, what ``strict`` refuses, and the DDL each
problem names. Pure rules, then real PostgreSQL tables (no Spark)."""

from __future__ import annotations

import psycopg
import pytest

from tidemark.config import Sink
from tidemark.core.errors import TidemarkError
from tidemark.protocol import sink_schema, sinks
from tidemark.protocol.sink_schema import accepts, static_output

OUT = [("id", "integer"), ("name", "text"), ("amount", "double precision")]


@pytest.mark.parametrize(
    "table,output",
    [
        ("bigint", "integer"),
        ("numeric(12,2)", "integer"),
        ("numeric", "numeric(10,2)"),
        ("numeric(12,3)", "numeric(10,2)"),
        ("double precision", "real"),
        ("double precision", "integer"),
        ("numeric", "double precision"),
        ("text", "bigint"),
        ("jsonb", "text"),
        ("uuid", "text"),
        ("timestamp with time zone", "timestamptz"),
        ("timestamp with time zone", "date"),
    ],
)
def test_a_column_takes_its_own_type_or_a_wider_one(table, output):
    assert accepts(table, output)


@pytest.mark.parametrize(
    "table,output",
    [
        ("integer", "bigint"),
        ("numeric(10,2)", "bigint"),
        ("numeric(10,1)", "numeric(10,2)"),
        ("real", "double precision"),
        ("numeric(12,2)", "double precision"),
        ("double precision", "bigint"),
        ("integer", "text"),
        ("character varying(8)", "text"),
        ("date", "timestamptz"),
        ("boolean", "integer"),
    ],
)
def test_a_narrowing_or_another_type_is_refused(table, output):
    assert not accepts(table, output)


def test_the_file_says_the_types_of_fields_passed_through_and_of_casts(env):
    env.pipeline(
        transform={
            "select": {
                "id": "id",
                "big": "CAST(id AS bigint)",
                "sum": "cast(id as int) + cast(version as int)",
                "upper": "upper(name)",
            }
        },
        sinks=[{"name": "main", "dsn": env.sink_dsn, "table": "public.orders", "key": ["id"]}],
    )
    assert static_output(env.load()) == [
        ("id", "integer"),
        ("big", "bigint"),
        ("sum", None),  # a CAST inside a larger expression: only Spark knows
        ("upper", None),
    ]


def _sink(env, **kw) -> sinks.ResolvedSink:
    cfg = {"name": "main", "dsn": env.sink_dsn, "table": "public.orders", "key": ["id"], **kw}
    return sinks.ResolvedSink(Sink.model_validate(cfg), env.sink_dsn)


def _do(env, statement: str) -> None:
    with psycopg.connect(env.sink_dsn, autocommit=True) as c:
        c.execute(statement)


def _columns(env) -> list[tuple[str, str, bool]]:
    return env.q(
        env.sink_dsn,
        "SELECT column_name::text, data_type::text, is_nullable = 'YES' "
        "FROM information_schema.columns WHERE table_name = 'orders' ORDER BY ordinal_position",
    )


def test_evolve_adds_a_new_output_column_nullable_and_keeps_one_no_longer_written(env):
    sink = _sink(env)
    assert sinks.ensure_table(sink, OUT, "sink main") == []
    _do(env, "INSERT INTO orders VALUES (1, 'a', 1.5, 0, 0, 1)")
    later = [("id", "integer"), ("amount", "double precision"), ("domain", "text")]
    assert sinks.ensure_table(sink, later, "sink main") == ["added column domain text"]
    cols = _columns(env)
    assert ("domain", "text", True) in cols and ("name", "text", True) in cols
    assert env.q(env.sink_dsn, "SELECT name, domain FROM orders") == [("a", None)]
    # Idempotent: the next run (or one after a crash) finds nothing to add.
    assert sinks.ensure_table(sink, later, "sink main") == []


def test_a_narrowing_is_refused_in_one_line_naming_sink_column_types_and_fix(env):
    sink = _sink(env)
    sinks.ensure_table(sink, OUT, "sink main")
    [msg] = sinks.table_problems(sink, [("id", "bigint"), ("name", "text")], "sink main")
    assert "\n" not in msg
    assert "sink main" in msg and "column id is integer" in msg and "writes bigint" in msg
    assert "ALTER TABLE public.orders ALTER COLUMN id TYPE bigint" in msg
    # Nothing was changed by the refusal.
    assert [c[:2] for c in _columns(env)][0] == ("id", "integer")


def test_strict_refuses_any_difference_and_names_each(env):
    sinks.ensure_table(_sink(env), OUT, "sink main")
    strict = _sink(env, schema="strict")
    assert sinks.table_problems(strict, OUT, "sink main") == []  # the same columns
    with pytest.raises(TidemarkError) as e:
        sinks.ensure_table(strict, [("id", "integer"), ("domain", "text")], "sink main")
    msg = str(e.value)
    assert "lacks column domain (schema: strict)" in msg
    assert "ALTER TABLE public.orders ADD COLUMN domain text" in msg
    assert "has column name, which the transform does not produce" in msg
    assert "domain" not in [c[0] for c in _columns(env)]


def test_a_key_narrower_than_the_tables_unique_constraint_names_the_constraint(env):
    sinks.ensure_table(_sink(env), OUT, "sink main")
    wider = _sink(env, key=["id", "name"])
    _do(env, "ALTER TABLE orders ALTER COLUMN name SET NOT NULL")
    msg = " | ".join(sinks.table_problems(wider, OUT, "sink main"))
    assert "needs a unique index on exactly (id, name)" in msg
    assert "orders_pkey on (id) is narrower than the key (id, name)" in msg
    assert "ALTER TABLE public.orders DROP CONSTRAINT orders_pkey" in msg


def test_a_not_null_column_the_transform_no_longer_writes_is_refused_with_its_fix(env):
    _do(
        env,
        "CREATE TABLE orders (id int PRIMARY KEY, name text, region text NOT NULL, "
        "_tm_partition int NOT NULL, _tm_offset bigint NOT NULL, _tm_run_id bigint NOT NULL)",
    )
    with psycopg.connect(env.sink_dsn) as c:
        have = sink_schema.table_columns(c, "public.orders")
    assert have is not None
    plan = sink_schema.plan(_sink(env).config, have, [("orders_pkey", ["id"])], OUT[:2])
    assert plan.problems == [
        "sink main: table public.orders: column region is NOT NULL without a default and the "
        "transform does not produce it, so no new row could be written; fix: ALTER TABLE "
        "public.orders ALTER COLUMN region DROP NOT NULL"
    ]
