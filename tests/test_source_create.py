"""`tidemark source create` (issue 48 point 4): the postgres_log table a pipeline reads, made
with the column names of its file; idempotent; a table of another shape refused naming what
differs. Real PostgreSQL; the table is then appended to and planned over as a run would."""

from __future__ import annotations

import psycopg

from tests.test_cli import assert_one_clear_line, tm
from tidemark.sources import log_table, postgres_log


def _source(env, **extra) -> dict:
    return {"type": "postgres_log", "dsn": env.sink2_dsn, "table": "shop.events", **extra}


def test_source_create_makes_the_table_the_reader_needs_once(env):
    env.pipeline(source=_source(env))
    code, out, err = tm(env.cli_env(), "source", "create", "orders")
    assert code == 0, err
    assert "created source table shop.events in postgresql://" in out and "_heads" in out
    assert "tidemark@" not in out or ":***@" in out  # the DSN is masked
    code, out, err = tm(env.cli_env(), "source", "create", "orders")
    assert code == 0 and "exists with the columns the reader needs: left as it is" in out, out
    # The table is what the reader and append() expect: records go in and are planned over.
    with psycopg.connect(env.sink2_dsn) as c:
        postgres_log.append(c, "shop.events", [(0, b"k", b'{"id": 1}', None, None)] * 3)
    from tidemark.config import PostgresLogSource

    src = PostgresLogSource(type="postgres_log", dsn=env.sink2_dsn, table="shop.events")
    assert postgres_log.problems(src, env.sink2_dsn) == []
    plan = postgres_log.PostgresLogPlanner(src, env.sink2_dsn)
    try:
        assert plan.partitions() == [0] and plan.earliest(0) == 0
    finally:
        plan.close()


def test_source_create_uses_the_files_column_names_and_prints_its_ddl(env):
    env.pipeline(source=_source(env, columns={"partition": "part", "offset": "pos"}))
    code, out, err = tm(env.cli_env(), "source", "create", "orders", "--print")
    assert code == 0, err
    assert out == log_table.ddl("shop.events", _cols()) + "\n"
    assert '"part" int NOT NULL' in out and 'PRIMARY KEY ("part", "pos")' in out
    code, out, err = tm(env.cli_env(), "source", "create", "orders")
    assert code == 0, err
    cols = env.q(
        env.sink2_dsn,
        "SELECT attname FROM pg_attribute WHERE attrelid = 'shop.events'::regclass "
        "AND attnum > 0 ORDER BY attnum",
    )
    assert [c for (c,) in cols] == ["part", "pos", "key", "payload", "headers", "ts", "xid"]


def _cols():
    from tidemark.config import LogColumns

    return LogColumns(partition="part", offset="pos")


def test_a_table_of_another_shape_is_refused_naming_what_differs(env):
    with psycopg.connect(env.sink2_dsn, autocommit=True) as c:
        c.execute("CREATE SCHEMA shop")
        c.execute(
            'CREATE TABLE shop.events ("partition" int, "offset" bigint, key text, '
            "payload text, headers jsonb, ts timestamp)"
        )
    env.pipeline(source=_source(env))
    code, _, err = tm(env.cli_env(), "source", "create", "orders")
    assert code == 2
    assert_one_clear_line(
        err,
        "source table shop.events in postgresql://",
        "exists with another shape: column payload (payload) is text, not bytea",
        "lacks column xid (xid, xid8)",
        "has no primary key or unique index on (partition, offset)",
        "tidemark source create orders --print",
    )
    assert ":***@" in err or "tidemark@" not in err


def test_a_file_archive_pipeline_has_no_table_to_create(env, tmp_path):
    env.pipeline(source={"type": "file_archive", "uri": str(tmp_path)})
    code, _, err = tm(env.cli_env(), "source", "create", "orders")
    assert code == 2
    assert_one_clear_line(err, "its source is file_archive, not postgres_log")
