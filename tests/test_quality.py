"""The data-quality gate inside the protocol: real Spark, real PostgreSQL, real GX."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.invariants import assert_exactly_once
from tests.proc import JobProcess
from tidemark.core.errors import TidemarkError
from tidemark.quality.docs import site_dir

MAIN = {"name": "main", "table": "public.orders", "key": ["id"]}
MAX_AMOUNT = {"expect_column_max_to_be_between": {"column": "amount", "max_value": 1000}}


def _sink_rows(env) -> int:
    exists = env.q(env.sink_dsn, "SELECT to_regclass('public.orders')")[0][0]
    return env.q(env.sink_dsn, "SELECT count(*) FROM orders")[0][0] if exists else 0


def test_a_failed_gate_writes_nothing_then_the_fixed_pipeline_delivers_once(env, spark):
    env.append_orders(range(40))
    env.append_orders([41], amount=1e9)  # the mutated record
    sink = {**MAIN, "dsn": env.sink_dsn}
    env.pipeline(sinks=[sink], quality={"batch": [MAX_AMOUNT]})
    report = env.run(spark)
    assert not report.ok
    assert report.sinks["main"].state == "dq_failed"
    # It read the batch, wrote none of it: it says how many it read, and so does the ledger.
    assert report.records == 41 and "41 records read" in report.summary()
    assert env.ledger("SELECT counts FROM tidemark.run_sinks") == [({"records": 41},)]
    assert "expect_column_max_to_be_between" in report.sinks["main"].error
    assert _sink_rows(env) == 0
    assert env.prepared() == []
    assert set(env.checkpoints().values()) <= {0}
    assert env.ledger("SELECT state::text FROM tidemark.run_sinks") == [("dq_failed",)]
    assert env.ledger("SELECT run_id FROM tidemark.leases") == [(None,)]
    ((success, results),) = env.ledger(
        "SELECT success, results FROM tidemark.dq_results WHERE run_id = %s", (report.run_id,)
    )
    assert success is False
    failed = [r for r in results if not r["success"]]
    assert [r["expectation"] for r in failed] == ["expect_column_max_to_be_between"]
    assert failed[0]["observed_value"] == pytest.approx(1e9)
    # Its Data Docs page is in the pipeline's own GX project, inside the site the web serves.
    ((page,),) = env.ledger(
        "SELECT docs_path FROM tidemark.dq_results WHERE run_id = %s", (report.run_id,)
    )
    site = Path(site_dir(str(env.settings().docs_dir("orders")))).resolve()
    assert Path(page).resolve().is_relative_to(site) and Path(page).is_file(), page

    # The pipeline is fixed (the bound was wrong): the same range goes through, once.
    env.pipeline(
        sinks=[sink],
        quality={
            "batch": [{"expect_column_max_to_be_between": {"column": "amount", "max_value": 1e10}}]
        },
    )
    again = env.run(spark)
    assert again.ok, again.summary()
    assert again.records == 41
    assert _sink_rows(env) == 41
    assert_exactly_once(env)


def test_quarantine_batch_sends_the_whole_range_to_the_dlq_once_and_advances(env, spark):
    env.append_orders(range(30))
    env.append_orders([31], amount=1e9)
    env.pipeline(
        sinks=[{**MAIN, "dsn": env.sink_dsn}],
        quality={"batch": [MAX_AMOUNT], "on_gate_failure": "quarantine_batch"},
    )
    report = env.run(spark)
    assert report.ok, report.summary()
    assert _sink_rows(env) == 0
    dlq = env.ledger(
        "SELECT error_class::text, count(*), max(attempts) FROM tidemark.dlq GROUP BY 1"
    )
    assert dlq == [("dq_gate", 31, 1)]
    assert env.checkpoints() == {0: 15, 1: 16}
    assert_exactly_once(env)


def test_a_row_check_gx_cannot_run_aborts_the_run_and_places_nothing(env, spark):
    # A bad regex fails GX's metric, not a row: the run stops with GX's reason, every record
    # stays below no checkpoint, and the fixed pipeline then delivers the range once.
    env.append_orders(range(20))
    sink = {**MAIN, "dsn": env.sink_dsn}
    env.pipeline(
        sinks=[sink],
        quality={
            "rows": [
                {"expect_column_values_to_match_regex": {"column": "name", "regex": "order-("}}
            ]
        },
    )
    with pytest.raises(
        TidemarkError,
        match=r"expect_column_values_to_match_regex\(column=name\)"
        r": GX could not evaluate it: PatternSyntaxException",
    ):
        env.run(spark)
    ((state, error),) = env.ledger("SELECT state::text, error FROM tidemark.run_sinks")
    assert state == "aborted" and "GX could not evaluate it: PatternSyntaxException" in error
    assert _sink_rows(env) == 0
    assert env.ledger("SELECT count(*) FROM tidemark.dlq") == [(0,)]
    assert env.prepared() == []
    assert set(env.checkpoints().values()) <= {0}

    env.pipeline(
        sinks=[sink],
        quality={
            "rows": [
                {"expect_column_values_to_match_regex": {"column": "name", "regex": "order-[0-9]+"}}
            ]
        },
    )
    again = env.run(spark)
    assert again.ok, again.summary()
    assert _sink_rows(env) == 20
    assert_exactly_once(env)


@pytest.mark.slow
def test_row_failures_are_quarantined_exactly_once_across_a_crash(env, spark):
    env.append_orders(range(100))  # amount = id * 1.25: ids >= 81 exceed 100
    row_check = {"expect_column_values_to_be_between": {"column": "amount", "max_value": 100}}
    env.pipeline(sinks=[{**MAIN, "dsn": env.sink_dsn}], quality={"rows": [row_check]})
    job = JobProcess(env.cli_argv("run", "orders"), env.cli_env(), crash_at="after_prepare")
    assert job.wait() == -signal.SIGKILL, job.output()
    assert env.recover().ok
    report = env.run(spark)
    assert report.ok, report.summary()
    rows = env.ledger(
        "SELECT source_offset, source_partition, attempts, reason, sink "
        "FROM tidemark.dlq WHERE error_class = 'validation'"
    )
    assert len(rows) == 19 and {r[2] for r in rows} == {1} and {r[4] for r in rows} == {"main"}
    assert all("expect_column_values_to_be_between" in r[3] for r in rows)
    assert _sink_rows(env) == 81
    assert env.ledger(
        "SELECT rows_failed FROM tidemark.dq_results WHERE run_id = %s", (report.run_id,)
    ) == [(19,)]
    assert_exactly_once(env)


def test_a_stricter_sink_fails_alone_and_its_row_failures_carry_its_name(env, spark):
    env.append_orders(range(40))  # amounts 0 .. 48.75
    strict_rows = {"expect_column_values_to_be_between": {"column": "amount", "max_value": 40}}
    strict_gate = {"expect_table_row_count_to_be_between": {"max_value": 10}}
    main = {**MAIN, "dsn": env.sink_dsn, "quality": {"rows": [strict_rows]}}
    second = {**MAIN, "name": "second", "dsn": env.sink2_dsn, "quality": {"batch": [strict_gate]}}
    env.pipeline(sinks=[main, second])
    report = env.run(spark)
    assert report.sinks["main"].state == "committed"
    assert report.sinks["second"].state == "dq_failed"
    assert "expect_table_row_count_to_be_between" in report.sinks["second"].error
    dlq = env.ledger("SELECT sink, error_class::text, count(*) FROM tidemark.dlq GROUP BY 1, 2")
    assert dlq == [("main", "validation", 7)]  # ids 33..39 exceed 40
    assert _sink_rows(env) == 33
    assert env.checkpoints(sink="main") == {0: 20, 1: 20}
    assert set(env.checkpoints(sink="second").values()) <= {0}
    scopes = dict(env.ledger("SELECT scope, success FROM tidemark.dq_results"))
    assert scopes == {"": True, "main": True, "second": False}
