"""`tidemark source prune` on a real PostgreSQL (issue 48 point 2): a postgres_log source's
rows are deleted per partition below the lowest offset anything may read again: every sink's
checkpoint (of every pipeline reading the table, with a file or only in the ledger), a
quarantined dead letter, an open gap, an unsettled run, the keep-days horizon. It says what
it deleted and what kept the rest; --dry-run deletes nothing; the maintenance task prunes
the sources whose pipelines opt in."""

from __future__ import annotations

import json

import psycopg

from tests.test_cli import assert_one_clear_line, tm
from tidemark import config


def _sql(env, text: str) -> None:
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        c.execute(text)


def _offsets(env) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for p, o in env.ledger('SELECT "partition", "offset" FROM src.log ORDER BY 1, 2'):
        out.setdefault(p, []).append(o)
    return out


def _world(env) -> None:
    """Partitions 0 and 1 hold offsets 0-9; offsets below 7 are 30 days old. Pipelines
    orders (sink main) and mirror (sink copy) read the log."""
    env.append_orders(range(20))
    _sql(env, "UPDATE src.log SET ts = now() - interval '30 days' WHERE \"offset\" < 7")
    env.pipeline("orders")
    env.pipeline("mirror", sinks=[{**env.orders_sink(), "name": "copy"}])
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        c.execute(
            "INSERT INTO tidemark.pipelines (name, config) VALUES "
            '(\'orders\', \'{"source": {"table": "src.log"}}\'), '
            '(\'mirror\', \'{"source": {"table": "src.log"}}\')'
        )
        for pipeline, sink, p, at in (
            ("orders", "main", 0, 8),
            ("orders", "main", 1, 6),
            ("mirror", "copy", 0, 5),
            ("mirror", "copy", 1, 10),
        ):
            c.execute(
                "INSERT INTO tidemark.checkpoints (pipeline, sink, partition, next_offset, "
                "start_offset) VALUES (%s, %s, %s, %s, 0)",
                (pipeline, sink, p, at),
            )
        run_id = c.execute(
            "INSERT INTO tidemark.runs (pipeline, mode, owner) VALUES ('orders', 'run', 'h:1') "
            "RETURNING run_id"
        ).fetchone()[0]
        c.execute(
            "INSERT INTO tidemark.dlq (pipeline, sink, run_id, source_partition, source_offset, "
            "payload, error_class, reason) VALUES ('orders', 'main', %s, 1, 3, 'x', 'decode', "
            "'not JSON')",
            (run_id,),
        )


def test_source_prune_deletes_below_what_anything_may_read_and_says_why(env):
    _world(env)
    environ = env.cli_env()
    before = _offsets(env)
    code, out, err = tm(environ, "source", "prune", "orders", "--keep-days", "7", "--dry-run")
    assert code == 0, err
    assert _offsets(env) == before
    assert out.splitlines() == [
        "source src.log of orders (read by mirror, orders); records of the last 7 days kept "
        "for rebuilds and backfills; dry run, nothing deleted",
        "  partition 0: would delete 5 rows below offset 5; kept from there: sink "
        "mirror/copy checkpoint 5",
        "  partition 1: would delete 3 rows below offset 3; kept from there: 1 quarantined "
        "dead letter(s) from offset 3",
    ], out

    code, out, err = tm(environ, "source", "prune", "orders", "--keep-days", "7", "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got["rows"] == 8 and not got["dry_run"]
    assert got["partitions"][1]["kept_by"] == [
        "1 quarantined dead letter(s) from offset 3",
        "sink orders/main checkpoint 6",
        "records since " + got["partitions"][1]["kept_by"][2].split("since ")[1],
        "sink mirror/copy checkpoint 10",
    ]
    assert _offsets(env) == {0: list(range(5, 10)), 1: list(range(3, 10))}

    # The letter is resolved: partition 1 goes to the next constraint. A longer horizon
    # (40 days) keeps everything the 30-day-old records are.
    _sql(env, "UPDATE tidemark.dlq SET status = 'redriven', resolved_at = now()")
    code, out, err = tm(environ, "source", "prune", "orders", "--keep-days", "40")
    assert code == 0, err
    assert "partition 1: nothing deleted: records since" in out, out
    code, out, err = tm(environ, "source", "prune", "orders", "--keep-days", "7")
    assert code == 0, err
    assert (
        "  partition 1: deleted 3 rows below offset 6; kept from there: sink orders/main "
        "checkpoint 6" in out.splitlines()
    ), out

    # A pipeline only the ledger knows (its file gone) reading a table of that name: its
    # checkpoints count too. A partition a sink has no checkpoint in keeps every row.
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        c.execute(
            "INSERT INTO tidemark.pipelines (name, config) VALUES "
            '(\'ghost\', \'{"source": {"table": "src.log"}}\')'
        )
        c.execute(
            "INSERT INTO tidemark.checkpoints (pipeline, sink, partition, next_offset) "
            "VALUES ('ghost', 'x', 0, 2)"
        )
    env.append([(2, b"k", b"{}", None, None)])
    code, out, err = tm(environ, "source", "prune", "orders", "--keep-days", "0")
    assert code == 0, err
    assert "(read by ghost, mirror, orders)" in out
    assert "  partition 0: nothing deleted: sink ghost/x checkpoint 2" in out.splitlines(), out
    assert (
        "  partition 2: nothing deleted: sink ghost/x has no checkpoint in it yet (it may "
        "start at its first record)" in out.splitlines()
    ), out
    assert _offsets(env)[2] == [0]


def test_source_prune_needs_a_horizon_and_a_postgres_log(env, tmp_path):
    env.pipeline()
    code, _, err = tm(env.cli_env(), "source", "prune", "orders")
    assert code == 2
    assert_one_clear_line(err, "--keep-days N, or retention.source_keep_days")
    env.pipeline(retention={"source_prune": True})
    code, _, err = tm(env.cli_env(), "source", "prune", "orders")
    assert code == 2 and "Traceback" not in err
    assert (
        err.strip()
        .splitlines()[-1]
        .endswith(
            "orders.yaml: retention.source_keep_days: source_prune needs source_keep_days (how "
            "many days of records rebuilds and backfills may still read)"
        )
    ), err


def test_the_maintenance_task_prunes_the_sources_that_opt_in(env, monkeypatch):
    from tidemark.airflow import tasks
    from tidemark.core.settings import get_settings

    _world(env)
    env.pipeline("orders", retention={"source_prune": True, "source_keep_days": 7})
    monkeypatch.delenv("AIRFLOW_CONN_TIDEMARK_LEDGER", raising=False)
    monkeypatch.setenv("TIDEMARK_LEDGER_DSN", env.ledger_dsn)
    monkeypatch.setenv("TIDEMARK_DATA_DOCS_DIR", str(env.tmp / "docs"))
    get_settings.cache_clear()
    try:
        tasks.prune(str(env.dir))
    finally:
        get_settings.cache_clear()
    assert _offsets(env) == {0: list(range(5, 10)), 1: list(range(3, 10))}
    # mirror did not opt in: its own prune pass deleted nothing more; orders' did.
    assert config.load(env.dir / "mirror.yaml").retention.source_prune is False
