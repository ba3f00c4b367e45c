"""Pipelines change (issue 36): a sink's table evolves with the transform or refuses it
before Spark starts, and a run that would quarantine more than its ceiling halts with
nothing committed. Real PostgreSQL, Spark and Great Expectations."""

from __future__ import annotations

import json

import psycopg
import pytest

from tests.invariants import assert_exactly_once
from tests.test_cli import assert_one_clear_line, tm
from tidemark.core.errors import Halted, OverCeiling
from tidemark.ledger import state

SELECT = {"id": "id", "name": "name", "amount": "amount", "version": "version"}


def _ddl(dsn: str, statement: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(statement)


def test_a_new_output_column_is_added_to_the_table_and_said_in_the_report(env, spark):
    env.append_orders(range(4))
    env.pipeline()
    assert env.run(spark).ok
    env.append_orders(range(4, 8))
    env.pipeline(transform={"select": {**SELECT, "domain": "concat(name, '.example')"}})
    report = env.run(spark)
    assert report.ok, report.summary()
    assert report.sinks["main"].schema_changes == ["added column domain text"]
    assert "table: added column domain text" in report.summary()
    rows = env.q(env.sink_dsn, "SELECT id, domain FROM orders ORDER BY id")
    assert rows == [(i, None) for i in range(4)] + [(i, f"order-{i}.example") for i in range(4, 8)]
    # The transform no longer writes amount: it stays, NULL in new rows.
    env.append_orders(range(8, 10))
    env.pipeline(transform={"select": {"id": "id", "name": "name", "version": "version"}})
    report = env.run(spark)
    assert report.ok and report.sinks["main"].schema_changes == []
    assert env.q(env.sink_dsn, "SELECT amount FROM orders WHERE id IN (7, 8) ORDER BY id") == [
        (8.75,),
        (None,),
    ]
    assert_exactly_once(env)


def test_a_table_the_run_cannot_write_is_refused_before_spark_starts(env, spark):
    env.append_orders(range(4))
    env.pipeline(sinks=[{"name": "main", "dsn": env.sink_dsn, "table": "public.orders",
                         "key": ["id"], "schema": "strict"}])  # fmt: skip
    assert env.run(spark).ok
    env.append_orders(range(4, 8))
    env.pipeline(
        transform={"select": {**SELECT, "domain": "CAST(name AS string)"}},
        sinks=[{"name": "main", "dsn": env.sink_dsn, "table": "public.orders", "key": ["id"],
                "schema": "strict"}],
    )  # fmt: skip
    report = env.run(spark)
    assert not report.ok
    error = report.sinks["main"].error
    assert "lacks column domain (schema: strict)" in error, error
    assert "ALTER TABLE public.orders ADD COLUMN domain text" in error
    assert report.layout == "" and report.records == 0  # no Spark job ran
    assert env.checkpoints() == {0: 2, 1: 2}
    assert_exactly_once(env)


def test_a_key_change_is_refused_before_anything_is_read_not_sent_to_the_dlq(env, spark):
    """The issue's case: key [id] -> [id, version] over a table whose primary key is (id) used
    to commit with every second version in the DLQ."""
    env.append_orders(range(6))
    env.pipeline()
    assert env.run(spark).ok
    env.append_orders(range(6), version=2)
    _ddl(env.sink_dsn, "ALTER TABLE orders ALTER COLUMN version SET NOT NULL")
    _ddl(env.sink_dsn, "CREATE UNIQUE INDEX ON orders (id, version)")
    env.pipeline(sinks=[{"name": "main", "dsn": env.sink_dsn, "table": "public.orders",
                         "key": ["id", "version"]}])  # fmt: skip
    report = env.run(spark)
    assert not report.ok
    error = report.sinks["main"].error
    assert "orders_pkey on (id) is narrower than the key (id, version)" in error, error
    assert "ALTER TABLE public.orders DROP CONSTRAINT orders_pkey" in error
    assert "fix: `tidemark sink rebuild orders main` makes the table again" in error
    assert env.ledger("SELECT count(*) FROM tidemark.dlq") == [(0,)]
    assert report.layout == ""


def _bad(i: int) -> tuple:
    return (i % 2, str(i).encode(), b"{not json" if i % 4 else json.dumps(
        {"id": i, "name": "x", "amount": 1.0, "version": 1}).encode(), None, None)  # fmt: skip


def test_a_run_past_the_quarantine_ceiling_halts_with_nothing_committed(env, spark):
    env.append([_bad(i) for i in range(8)])  # 6 of 8 records do not decode: 75%
    env.pipeline(quality={"max_quarantined": 0.5, "max_quarantined_min": 1})
    with pytest.raises(OverCeiling) as e:
        env.run(spark)
    msg = str(e.value)
    assert "sink main: 6 of 8 records (75%) would go to the dead-letter queue" in msg, msg
    assert "over quality.max_quarantined (50%); nothing was committed" in msg
    assert "6 x decode:" in msg and "\n" not in msg, msg
    assert env.checkpoints() == {0: 0, 1: 0}
    assert env.ledger("SELECT count(*) FROM tidemark.dlq") == [(0,)]
    assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(0,)]
    assert env.prepared() == []
    assert env.ledger("SELECT state::text FROM tidemark.run_sinks") == [("aborted",)]
    # Raised, and the halt resumed, the same records go: 2 rows, 6 letters, exactly once.
    env.pipeline(quality={"max_quarantined": 0.8, "max_quarantined_min": 1})
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        assert state.resume(c, "orders")
    report = env.run(spark)
    assert (
        report.ok
        and report.sinks["main"].counts.rows == 2
        and report.sinks["main"].counts.dead == 6
    )
    assert_exactly_once(env)


def test_a_ceiling_halt_halts_the_pipeline_until_it_is_resumed(env, spark, monkeypatch):
    """Issue 45 case 9: exit 5 past the ceiling marked nothing, so the next scheduled run
    tried again. Now the pipeline is halted with the reason, as after any other halt: runs
    (and Airflow's) refuse it until `tidemark resume`, and `tidemark status` shows it."""
    from tidemark.airflow import tasks
    from tidemark.core.settings import get_settings
    from tidemark.ledger.state import AirflowRun

    env.append([_bad(i) for i in range(8)])  # 75% do not decode
    env.pipeline(quality={"max_quarantined": 0.5, "max_quarantined_min": 1})
    code, out, err = tm(env.cli_env(), "run", "orders", cwd=env.tmp, timeout=300)
    assert code == 5, out + err
    assert "over quality.max_quarantined (50%)" in err, err
    assert "pipeline orders halted" in err and "`tidemark resume orders`" in err, err
    (why,) = env.ledger("SELECT halted_reason FROM tidemark.pipelines WHERE name = 'orders'")
    assert why[0] is not None and "over quality.max_quarantined (50%)" in why[0], why
    code, out, err = tm(env.cli_env(), "status", "orders", cwd=env.tmp)
    assert code == 0 and "HALTED: " in out and "max_quarantined" in out, out + err
    # The next run refuses, saying why and what resumes it; it claims nothing.
    code, out, err = tm(env.cli_env(), "run", "orders", cwd=env.tmp)
    assert code == 5, out + err
    assert_one_clear_line(err, "pipeline orders is halted: ", "`tidemark resume orders`")
    assert env.ledger("SELECT count(*) FROM tidemark.runs") == [(1,)]
    # Airflow's scheduled DAG does not skip it: its replay fails (exit 5: not retried).
    monkeypatch.delenv("AIRFLOW_CONN_TIDEMARK_LEDGER", raising=False)
    monkeypatch.setenv("TIDEMARK_LEDGER_DSN", env.ledger_dsn)
    get_settings.cache_clear()
    try:
        assert tasks.pending(str(env.dir), "orders") is not None
    finally:
        get_settings.cache_clear()
    # Resumed, the run proceeds, and halts again while the records are still over it; as
    # Airflow's replay, whose failure says the pipeline is halted.
    code, out, err = tm(env.cli_env(), "resume", "orders", cwd=env.tmp)
    assert (code, out.strip()) == (0, "orders: resumed"), err
    who = AirflowRun(dag_id="tidemark_orders", run_id="scheduled__2", task_id="replay")
    with pytest.raises(OverCeiling):
        env.run(spark, airflow=who)
    assert env.ledger("SELECT count(*) FROM tidemark.runs") == [(2,)]
    get_settings.cache_clear()
    try:
        why = tasks.failure("orders", "tidemark_orders", "scheduled__2")
    finally:
        get_settings.cache_clear()
    assert why is not None and "over quality.max_quarantined" in why, why
    assert why.endswith("; pipeline orders halted: `tidemark resume orders` once fixed"), why
    with pytest.raises(Halted, match="tidemark resume orders"):
        env.run(spark)
    assert env.checkpoints() == {0: 0, 1: 0}
    assert env.ledger("SELECT count(*) FROM tidemark.dlq") == [(0,)]
    assert env.prepared() == []


def test_a_few_quarantined_records_never_halt_a_run_whatever_their_share(env, spark):
    env.append([_bad(i) for i in range(8)])  # 75%, but 6 records: under the default minimum
    env.pipeline()
    report = env.run(spark)
    assert report.ok and report.sinks["main"].counts.dead == 6
    assert_exactly_once(env)


def test_airflows_report_task_says_what_a_run_changed_in_its_tables(env, spark, monkeypatch):
    """The ledger keeps each sink's schema changes with its counts: the report task (what a
    user reads in Airflow) says them, as the run's own summary does."""
    from tidemark.airflow import tasks
    from tidemark.core.settings import get_settings
    from tidemark.ledger.state import AirflowRun

    env.append_orders(range(4))
    env.pipeline()
    assert env.run(spark).ok
    env.append_orders(range(4, 6))
    env.pipeline(transform={"select": {**SELECT, "domain": "concat(name, '.example')"}})
    who = AirflowRun(dag_id="tidemark_orders", run_id="manual__1", task_id="replay")
    assert env.run(spark, airflow=who).ok
    monkeypatch.delenv("AIRFLOW_CONN_TIDEMARK_LEDGER", raising=False)
    monkeypatch.setenv("TIDEMARK_LEDGER_DSN", env.ledger_dsn)
    get_settings.cache_clear()
    try:
        out = tasks.report("orders", "tidemark_orders", "manual__1")
    finally:
        get_settings.cache_clear()
    assert out["sinks"]["main"]["schema_changes"] == ["added column domain text"]
    assert out["summary"].endswith("main committed 2 rows 0 dead, added column domain text")
