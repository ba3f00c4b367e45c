"""Rebuild a sink (issue 36 point 3; docs/operations.md, "Rebuild a sink"): every record the
sink has received is re-delivered into a new table made from the current pipeline, which is
swapped in for the old one inside the rebuild's two-phase commit. The old table is kept
under a dated name; the checkpoints stay; nothing is visible before the decision, and a
crash on either side of it ends, after recovery, in the old world or the rebuilt one.
Real PostgreSQL and Spark; the crashes SIGKILL a real `tidemark sink rebuild` process."""

from __future__ import annotations

import json
import signal
import subprocess
from datetime import UTC, datetime

import psycopg
import pytest

from tests.conftest import order_record
from tests.invariants import assert_exactly_once
from tests.proc import JobProcess
from tidemark.core.errors import BadInput
from tidemark.driver.modes import Rebuild
from tidemark.driver.run import Run

ROWS = "expect_column_values_to_be_between"


def _tables(env) -> list[str]:
    return [
        t
        for (t,) in env.q(
            env.sink_dsn,
            "SELECT schemaname || '.' || tablename FROM pg_tables "
            "WHERE schemaname IN ('public', 'tidemark') ORDER BY 1",
        )
    ]


def _retired(run_id: int) -> str:
    return f"orders_{datetime.now(UTC):%Y%m%d}_run{run_id}"


def _rebuild(env, spark, **kw):
    return env._execute(Run, spark, "orders", mode=Rebuild("main"), sink_names=["main"], **kw)


def _key_change_world(env, spark) -> None:
    """Orders delivered under key (id), with a check that quarantines amounts over 3 and a
    poison record; then every order gets a second version, which key (id) keeps only the
    newest of. The pipeline then keys the sink by (id, version) and drops the check."""
    env.append_orders(range(6))
    env.append([(0, b"poison", b"{not json", None, None)])
    env.pipeline(quality={"rows": [{ROWS: {"column": "amount", "max_value": 3}}]})
    assert env.run(spark).ok
    env.append_orders(range(6), version=2)
    assert env.run(spark).ok
    env.pipeline(sinks=[env.orders_sink(key=["id", "version"])])


@pytest.mark.engines("spark", "connect")
def test_a_rebuild_gives_the_sink_its_new_key_and_keeps_the_old_table(env, engine):
    _key_change_world(env, engine)
    before = env.q(env.sink_dsn, "SELECT * FROM orders ORDER BY id")
    cps = env.checkpoints()
    assert env.ledger("SELECT count(*) FROM tidemark.dlq WHERE status = 'quarantined'") == [(7,)]

    said: list[str] = []
    report = _rebuild(env, engine, log=said.append)
    assert report.ok, report.summary()
    assert report.mode == "rebuild" and report.layout == "together"
    # Why one task: no sink here orders versions by a column (the log once said so).
    assert any(m.endswith("a rebuild writes its new table in one task") for m in said), said
    out = report.sinks["main"]
    # Both versions of each order have a row now; the poison record stays a dead letter and
    # the six letters of the dropped check are resolved (their records have rows).
    assert (out.counts.rows, out.counts.dead, out.counts.resolved, out.counts.removed) == (
        12,
        1,
        6,
        0,
    ), report.summary()
    assert out.schema_changes == [
        "public.orders rebuilt from the pipeline: key (id, version), 4 columns",
        f"the old table kept as public.{_retired(report.run_id)} (drop it when you no longer "
        f"need it)",
    ]
    assert env.q(env.sink_dsn, "SELECT id, version FROM orders ORDER BY 1, 2") == [
        (i, v) for i in range(6) for v in (1, 2)
    ]
    assert env.q(
        env.sink_dsn,
        "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
        "WHERE conrelid = 'public.orders'::regclass AND contype = 'p'",
    ) == [("orders_pkey", "PRIMARY KEY (id, version)")]
    retired = _retired(report.run_id)
    assert env.q(env.sink_dsn, f"SELECT * FROM {retired} ORDER BY id") == before
    assert _tables(env) == sorted(["public.orders", f"public.{retired}", "tidemark.commits"]), (
        _tables(env)
    )
    assert env.checkpoints() == cps
    assert env.ledger("SELECT status::text, count(*) FROM tidemark.dlq GROUP BY 1 ORDER BY 1") == [
        ("quarantined", 1),
        ("redriven", 6),
    ]
    assert_exactly_once(env)
    # Deliveries go on under the new key.
    env.append_orders([6], version=3)
    assert env.run(engine).ok
    assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(13,)]
    assert_exactly_once(env)


def test_a_rebuild_preview_changes_nothing(env, spark):
    _key_change_world(env, spark)
    world = lambda: (  # noqa: E731
        _tables(env),
        env.q(env.sink_dsn, "SELECT * FROM orders ORDER BY id"),
        env.ledger("SELECT * FROM tidemark.dlq ORDER BY id"),
        env.ledger("SELECT * FROM tidemark.checkpoints ORDER BY 1, 2, 3"),
    )
    before = world()
    preview = _rebuild(env, spark, dry_run=True)
    assert preview.ok and preview.dry_run, preview.summary()
    out = preview.sinks["main"]
    assert out.previewed and (out.counts.rows, out.counts.dead, out.counts.resolved) == (12, 1, 6)
    assert out.schema_changes[1].startswith("the old table would be kept as public.orders_")
    assert "public.orders would be rebuilt from the pipeline: key (id, version)" in (
        preview.summary()
    )
    assert world() == before
    assert env.prepared() == [] and env.q(env.sink_dsn, "SELECT gid FROM pg_prepared_xacts") == []


def test_a_rebuild_refuses_to_leave_out_rows_the_source_no_longer_holds(env, spark):
    env.append_orders(range(8))
    env.pipeline()
    assert env.run(spark).ok
    # The source's own retention drops the first two records of partition 0.
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        c.execute('DELETE FROM src.log WHERE "partition" = 0 AND "offset" < 2')
    report = _rebuild(env, spark)
    assert not report.ok
    error = report.sinks["main"].error
    assert error == (
        "sink main: the source no longer holds the records of 2 rows of public.orders "
        "(partition 0: 2 rows at offsets 0 to 1; retention pruned them); a rebuild would "
        "leave them out of the new table. Rebuild from what the source holds with "
        "--accept-pruned (the old table keeps them; deleted keys stay deleted)"
    ), error
    assert report.records == 0 and _tables(env) == ["public.orders", "tidemark.commits"]

    report = env._execute(
        Run, spark, "orders", mode=Rebuild("main", accept_pruned=True), sink_names=["main"]
    )
    assert report.ok, report.summary()
    assert report.sinks["main"].schema_changes[0] == (
        "left out 2 rows whose records the source no longer holds (the old table keeps them)"
    )
    kept = [(i,) for i in range(8) if i not in (0, 2)]
    assert env.q(env.sink_dsn, "SELECT id FROM orders ORDER BY id") == kept
    assert env.q(env.sink_dsn, f"SELECT count(*) FROM {_retired(report.run_id)}") == [(8,)]


def test_a_rebuild_keeps_deleted_keys_deleted(env, spark):
    keyed = {"select": {"id": "cast(cast(_tm_key as string) as int)", "name": "name",
                        "amount": "amount", "version": "version"}}  # fmt: skip
    env.append([order_record(0, i, f"o{i}", 1.0) for i in (1, 2, 3)])
    env.append([(0, b"2", None, None, None)])  # deletes order 2
    env.pipeline(transform=keyed, tombstones="delete")
    assert env.run(spark).ok
    report = _rebuild(env, spark)
    assert report.ok, report.summary()
    assert env.q(env.sink_dsn, "SELECT id FROM orders ORDER BY id") == [(1,), (3,)]
    # The tombstone table follows its table: a backfill of the old order 2 brings nothing back.
    from tidemark.core.ranges import Range
    from tidemark.driver.run import Backfill

    assert env.run(spark, mode=Backfill([Range(0, 1, 2)])).ok
    assert env.q(env.sink_dsn, "SELECT id FROM orders ORDER BY id") == [(1,), (3,)]
    assert_exactly_once(env, tombstones=True)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["after_prepare", "after_decide"])
def test_a_crash_on_either_side_of_the_decision_ends_in_one_world_after_recovery(env, spark, point):
    """SIGKILL before the decision: recovery rolls the rebuild back, the old table is the
    sink as it was and no new table exists; after it: recovery commits the swap. Either way
    a rebuild run then (again) ends rebuilt, exactly once."""
    _key_change_world(env, spark)
    before = env.q(env.sink_dsn, "SELECT * FROM orders ORDER BY id")
    job = JobProcess(
        env.cli_argv("sink", "rebuild", "orders", "main"), env.cli_env(), crash_at=point
    )
    assert job.wait() == -signal.SIGKILL, job.output()
    assert env.q(env.sink_dsn, "SELECT count(*) FROM pg_prepared_xacts") != [(0,)]
    rep = env.recover()
    assert rep.ok, rep.errors
    assert env.q(env.sink_dsn, "SELECT gid FROM pg_prepared_xacts") == []
    run_id = env.ledger("SELECT max(run_id) FROM tidemark.runs WHERE mode = 'rebuild'")[0][0]
    if point == "after_prepare":
        assert env.q(env.sink_dsn, "SELECT * FROM orders ORDER BY id") == before
        assert _tables(env) == ["public.orders", "tidemark.commits"]
        assert env.ledger("SELECT count(*) FROM tidemark.dlq WHERE status = 'redriven'") == [(0,)]
        proc = subprocess.run(
            env.cli_argv("sink", "rebuild", "orders", "main", "--json"),
            env=env.cli_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        run_id = json.loads(proc.stdout)["run_id"]
    else:
        assert env.ledger(
            "SELECT state::text FROM tidemark.run_sinks WHERE run_id = %s", (run_id,)
        ) == [("committed",)]
    assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(12,)]
    assert env.q(env.sink_dsn, f"SELECT * FROM {_retired(run_id)} ORDER BY id") == before
    assert env.ledger("SELECT status::text, count(*) FROM tidemark.dlq GROUP BY 1 ORDER BY 1") == [
        ("quarantined", 1),
        ("redriven", 6),
    ]
    assert_exactly_once(env)


def test_rebuild_of_a_sink_the_pipeline_does_not_have_is_one_clear_line(env):
    env.pipeline()
    proc = subprocess.run(
        env.cli_argv("sink", "rebuild", "orders", "nope"),
        env=env.cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        "tidemark: error: pipeline orders has no sink 'nope' (its sinks: main)"
    ), proc.stderr
    assert "Traceback" not in proc.stderr
    with psycopg.connect(env.sink_dsn) as c:
        assert c.execute("SELECT to_regclass('public.orders')").fetchone() == (None,)


def test_a_rebuild_needs_exactly_once(env):
    env.pipeline(delivery="at_least_once")
    with pytest.raises(BadInput, match="a rebuild needs delivery: exactly_once"):
        Run(env.load(), env.settings(), ledger_dsn=env.ledger_dsn, mode=Rebuild("main"))
