"""A decided participant someone else rolled back (issue 45, case 3; docs/design.md, "Commit
protocol" step 4): an operator, a failover or a cleanup script runs ``ROLLBACK PREPARED`` on
a chosen gid between the decision and the finish. The finish checks every chosen gid before
it commits any: lost before any commit, the sink's run is rolled back whole (``aborted``);
lost part way, the sink's run ends ``lost`` with its checkpoints moved, and `tidemark settle
RUN` re-delivers exactly its ranges. The ledger's participant (dead letters, a redrive's
status changes) commits last. Never a sink left ``committing``, never a letter without its
row. Real PostgreSQL and Spark (the local engine where no re-delivery is asked); the
interleaving is made at the driver's fault points."""

from __future__ import annotations

import psycopg
import pytest

from tests.invariants import assert_exactly_once
from tests.test_cli import tm
from tidemark.core import faults
from tidemark.core.errors import Halted, Inconsistency

TWO_SINKS = {"main": "sink_dsn", "second": "sink2_dsn"}


def _world(env) -> dict[str, str]:
    """300 orders and two records that are not JSON, for two sinks (a dead letter each)."""
    env.append_orders(range(300))
    env.append([(0, b"poison", b"{not json", None, None), (1, b"poison2", b"\xff", None, None)])
    sinks = {name: getattr(env, attr) for name, attr in TWO_SINKS.items()}
    env.pipeline(
        sinks=[
            {"name": n, "dsn": d, "table": "public.orders", "key": ["id"]} for n, d in sinks.items()
        ]
    )
    return sinks


def _dsn(env, target: str) -> str:
    if target == "ledger":
        return env.ledger_dsn
    return {"sink:main": env.sink_dsn, "sink:second": env.sink2_dsn}[target]


def _roll_back_at(monkeypatch, env, point: str, where: str, n: int = 1) -> list[str]:
    """At the ``n``-th time the driver reaches ``point``, ROLLBACK PREPARED (as an operator
    would, from a session of its own) the first chosen gid matching ``where`` that is still
    prepared. Returns the gid rolled back (once it is)."""
    real = faults.point
    rolled: list[str] = []
    seen = [0]

    def hook(name: str, attempt: int | None = None) -> None:
        if name == point and not rolled:
            seen[0] += 1
            if seen[0] == n:
                for gid, target in env.ledger(
                    "SELECT p.gid, p.target FROM tidemark.participants p "
                    f"JOIN pg_prepared_xacts x USING (gid) WHERE {where} ORDER BY p.gid LIMIT 1"
                ):
                    with psycopg.connect(_dsn(env, target), autocommit=True) as c:
                        c.execute(f"ROLLBACK PREPARED '{gid}'")
                    rolled.append(gid)
        real(name, attempt)

    monkeypatch.setattr(faults, "point", hook)
    return rolled


def _states(env, run_id: int) -> dict[str, str]:
    return dict(
        env.ledger("SELECT sink, state::text FROM tidemark.run_sinks WHERE run_id = %s", (run_id,))
    )


def _last_run(env) -> int:
    return env.ledger("SELECT max(run_id) FROM tidemark.runs")[0][0]


def test_a_gid_rolled_back_before_the_finish_rolls_that_sink_back_whole(env, engine, monkeypatch):
    sinks = _world(env)
    rolled = _roll_back_at(monkeypatch, env, "after_decide", "p.target = 'sink:second'")
    with pytest.raises(Inconsistency) as exc:
        env.run(engine)
    monkeypatch.undo()
    run_id = _last_run(env)
    # Nothing of sink second was committed: it is rolled back whole, never left committing;
    # main, whose participants are all there, commits.
    assert _states(env, run_id) == {"main": "committed", "second": "aborted"}
    assert rolled and rolled[0] in str(exc.value)
    assert f"tidemark settle {run_id}" in str(exc.value)
    assert env.prepared() == []
    assert env.checkpoints(sink="main") == {0: 151, 1: 151}
    assert env.checkpoints(sink="second") == {0: 0, 1: 0}
    # No letter of second's (its ledger participant was rolled back with it).
    assert env.ledger("SELECT sink, count(*) FROM tidemark.dlq GROUP BY 1") == [("main", 2)]
    assert_exactly_once(env, sinks=sinks)
    outcomes = dict(env.ledger("SELECT gid, outcome FROM tidemark.participants"))
    assert outcomes[rolled[0]] == "lost"
    # Halted until an operator settles it; the maintenance check alerts it, naming how.
    with pytest.raises(Halted, match=f"tidemark settle {run_id}"):
        env.run(engine)
    from tidemark import config
    from tidemark.airflow.health import check_health

    halts = [
        p.what
        for p in check_health(config.load_all(env.dir)[0], env.ledger_dsn).problems
        if p.what.startswith("halted: ")
    ]
    assert len(halts) == 1 and f"`tidemark settle {run_id}`" in halts[0], halts

    code, out, err = tm(env.cli_env(), "settle", str(run_id))
    assert code == 0, err
    assert f"run {run_id} sink second: rolled back whole" in out, out
    assert "orders: resumed" in out, out
    report = env.run(engine)
    assert report.ok, report.summary()
    assert report.sinks.keys() == {"second"}
    for sink in sinks:
        assert env.checkpoints(sink=sink) == {0: 151, 1: 151}
    assert env.ledger("SELECT sink, count(*) FROM tidemark.dlq GROUP BY 1 ORDER BY 1") == [
        ("main", 2),
        ("second", 2),
    ]
    assert_exactly_once(env, sinks=sinks)
    # Settled: again, the command changes nothing.
    code, out, err = tm(env.cli_env(), "settle", str(run_id))
    assert code == 0 and "orders: was not halted" in out, (out, err)
    assert _states(env, run_id) == {"main": "committed", "second": "aborted"}
    # A run the ledger does not have: one clear line, nothing done.
    code, out, err = tm(env.cli_env(), "settle", "999")
    assert code == 2 and err.strip().splitlines() == [
        "tidemark: error: run 999: no such run in the ledger (`tidemark status PIPELINE`)"
    ], err


def test_a_gid_rolled_back_part_way_is_settled_by_a_backfill_of_its_ranges(env, spark, monkeypatch):
    """The first COMMIT PREPARED of sink main done, then someone rolls back another of its
    chosen gids (a race: the finish checked them all a moment before)."""
    sinks = _world(env)
    rolled = _roll_back_at(monkeypatch, env, "mid_finish", "p.sink = 'main' AND p.outcome IS NULL")
    with pytest.raises(Inconsistency):
        env.run(spark)
    monkeypatch.undo()
    run_id = _last_run(env)
    assert _states(env, run_id) == {"main": "lost", "second": "committed"}
    assert rolled
    assert env.prepared() == []
    # The run's ranges count as delivered; the settle re-delivers them.
    assert env.checkpoints(sink="main") == {0: 151, 1: 151}
    with pytest.raises(Halted, match=f"tidemark settle {run_id}"):
        env.run(spark)
    code, _, err = tm(env.cli_env(), "resume", "orders")
    assert code != 0 and f"tidemark settle {run_id}" in err, err

    from tidemark import config
    from tidemark.driver.settle import settle

    said: list[str] = []
    all_p, _ = config.load_all(env.dir)
    done = settle(all_p, env.settings(), env.ledger_dsn, run_id, spark=spark, log=said.append)
    assert done.resumed, said
    assert any("re-delivered by backfill run" in m for m in said), said
    assert _states(env, run_id) == {"main": "committed", "second": "committed"}
    assert env.ledger("SELECT sink, count(*) FROM tidemark.dlq GROUP BY 1 ORDER BY 1") == [
        ("main", 2),
        ("second", 2),
    ]
    assert_exactly_once(env, sinks=sinks)
    report = env.run(spark)
    assert report.run_id is None, report.summary()


def _redrive_world(env, spark) -> list[int]:
    """100 orders, ids >= 81 fail a row check (amount over 100): 19 dead letters; the check
    then allows 1000, so a redrive places them."""
    rows = {"expect_column_values_to_be_between": {"column": "amount", "max_value": 100}}
    env.append_orders(range(100))
    env.pipeline(quality={"rows": [rows]})
    assert env.run(spark).ok
    env.pipeline()
    return [i for (i,) in env.ledger("SELECT id FROM tidemark.dlq ORDER BY id")]


def test_a_redrive_whose_sink_gid_is_rolled_back_never_marks_letters_redriven(
    env, spark, monkeypatch
):
    ids = _redrive_world(env, spark)
    assert len(ids) == 19
    rolled = _roll_back_at(monkeypatch, env, "after_decide", "p.target = 'sink:main'")
    with pytest.raises(Inconsistency):
        env.redrive(spark, ids=ids, by="alice")
    monkeypatch.undo()
    run_id = _last_run(env)
    assert rolled
    assert _states(env, run_id) == {"main": "aborted"}
    # No row went in, so no letter is resolved: each is still the live one placing its record.
    assert env.ledger("SELECT status::text, count(*) FROM tidemark.dlq GROUP BY 1") == [
        ("quarantined", 19)
    ]
    assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(81,)]
    assert env.prepared() == []
    assert_exactly_once(env)

    code, out, err = tm(env.cli_env(), "settle", str(run_id))
    assert code == 0, err
    report = env.redrive(spark, ids=ids, by="alice")
    assert report.ok and report.redrive["redriven"] == 19, report.summary()
    assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(100,)]
    assert_exactly_once(env)


def test_a_redrive_whose_ledger_gid_is_lost_after_its_rows_is_settled(env, spark, monkeypatch):
    """The rows committed, then the ledger's participant (the status changes) is rolled back:
    records in the sink and still in a live letter, until `settle` re-delivers them."""
    ids = _redrive_world(env, spark)
    rolled = _roll_back_at(monkeypatch, env, "mid_finish", "p.target = 'ledger'")
    with pytest.raises(Inconsistency):
        env.redrive(spark, ids=ids, by="alice")
    monkeypatch.undo()
    run_id = _last_run(env)
    assert rolled
    assert _states(env, run_id) == {"main": "lost"}
    from tidemark import config
    from tidemark.driver.settle import settle

    all_p, _ = config.load_all(env.dir)
    said: list[str] = []
    done = settle(all_p, env.settings(), env.ledger_dsn, run_id, spark=spark, log=said.append)
    assert done.resumed, said
    assert env.ledger("SELECT status::text, count(*) FROM tidemark.dlq GROUP BY 1") == [
        ("redriven", 19)
    ]
    assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(100,)]
    assert_exactly_once(env)


def test_a_rebuild_whose_swap_is_rolled_back_keeps_the_old_table(env, spark, monkeypatch):
    from tidemark.driver.modes import Rebuild
    from tidemark.driver.run import Run

    ids = _redrive_world(env, spark)
    before = env.q(env.sink_dsn, "SELECT * FROM orders ORDER BY id")
    rolled = _roll_back_at(monkeypatch, env, "after_decide", "p.target = 'sink:main'")
    with pytest.raises(Inconsistency):
        env._execute(Run, spark, "orders", mode=Rebuild("main"), sink_names=["main"])
    monkeypatch.undo()
    run_id = _last_run(env)
    assert rolled
    assert _states(env, run_id) == {"main": "aborted"}
    assert env.q(env.sink_dsn, "SELECT * FROM orders ORDER BY id") == before
    assert env.ledger("SELECT status::text, count(*) FROM tidemark.dlq GROUP BY 1") == [
        ("quarantined", len(ids))
    ]
    assert env.prepared() == []
    assert_exactly_once(env)


def test_recovery_finishes_a_decision_whose_gid_was_rolled_back(env, engine, monkeypatch):
    """The driver dies after its decision; someone rolls back a chosen gid of sink second;
    recovery, not the driver, finishes: main rolls forward, second is rolled back whole, the
    pipeline halts, and recovery's error (what the DAGs' recover tasks fail with and the
    maintenance alert sends) names the pipeline, the gid and the command."""
    sinks = _world(env)
    rolled = _roll_back_at(monkeypatch, env, "after_decide", "p.target = 'sink:second'")
    real = faults.point

    def crash_after(name: str, attempt: int | None = None) -> None:
        real(name, attempt)
        if name == "after_decide":
            raise faults.InjectedFailure("the driver dies after its decision")

    monkeypatch.setattr(faults, "point", crash_after)
    with pytest.raises(faults.InjectedFailure):
        env.run(engine)
    monkeypatch.undo()
    run_id = _last_run(env)
    assert _states(env, run_id) == {"main": "committing", "second": "committing"}

    # The maintenance DAG's recover task: it fails, naming the command, and hands the error
    # to the check task (XCom), which alerts through the pipeline's channels.
    from tidemark.airflow import tasks
    from tidemark.core.errors import TidemarkError
    from tidemark.core.settings import get_settings

    class TaskInstance:
        pushed: dict = {}

        def xcom_push(self, key, value):
            self.pushed[key] = value

    ti = TaskInstance()
    monkeypatch.delenv("AIRFLOW_CONN_TIDEMARK_LEDGER", raising=False)
    monkeypatch.setenv("TIDEMARK_LEDGER_DSN", env.ledger_dsn)
    get_settings.cache_clear()
    try:
        with pytest.raises(TidemarkError, match=f"`tidemark settle {run_id}`"):
            tasks.recover(str(env.dir), ti=ti)
    finally:
        get_settings.cache_clear()
    assert _states(env, run_id) == {"main": "committed", "second": "aborted"}
    (error,) = ti.pushed[tasks.RECOVERY_ERRORS]["orders"]
    assert error.startswith(f"pipeline orders: run {run_id} sink second: ")
    assert rolled[0] in error and f"`tidemark settle {run_id}`" in error
    assert env.prepared() == []
    assert_exactly_once(env, sinks=sinks)
    # Settled once: the next recovery finds nothing to do.
    rep = env.recover()
    assert rep.ok and rep.lost == [], rep.errors
    code, out, err = tm(env.cli_env(), "settle", str(run_id))
    assert code == 0 and "orders: resumed" in out, (out, err)
    assert env.run(engine).ok
    assert_exactly_once(env, sinks=sinks)
    for sink in sinks:
        assert env.checkpoints(sink=sink) == {0: 151, 1: 151}


def test_a_sink_gid_lost_after_another_of_the_sink_committed(env, spark, monkeypatch):
    """One partition written by two tasks (split by key), so sink main has two chosen gids of
    its own: the first commits, then someone rolls back the second. The ledger's participant,
    last, is rolled back rather than committed; `settle` re-delivers the range."""
    from tests.conftest import order_record

    env.append([order_record(0, i % 400, f"v{i}", 1.0) for i in range(2000)])
    env.append([(0, b"poison", b"{not json", None, None)])
    env.pipeline(
        limits={"max_records_per_partition": 5000, "split_min_records": 1000},
    )
    rolled = _roll_back_at(monkeypatch, env, "mid_finish", "p.target = 'sink:main'")
    with pytest.raises(Inconsistency):
        env.run(spark)
    monkeypatch.undo()
    run_id = _last_run(env)
    assert rolled
    assert _states(env, run_id) == {"main": "lost"}
    outcomes = sorted(
        env.ledger(
            "SELECT target, outcome, count(*) FROM tidemark.participants GROUP BY 1, 2 ORDER BY 1"
        )
    )
    # Nothing of the ledger's committed after the sink's loss: no letter stands for rows.
    assert {o[1] for o in outcomes if o[0] == "ledger"} == {"rolled_back"}, outcomes
    assert ("sink:main", "committed", 1) in outcomes and ("sink:main", "lost", 1) in outcomes
    assert env.ledger("SELECT count(*) FROM tidemark.dlq") == [(0,)]
    assert env.prepared() == []
    assert env.checkpoints() == {0: 2001}

    from tidemark import config
    from tidemark.driver.settle import settle

    all_p, _ = config.load_all(env.dir)
    done = settle(all_p, env.settings(), env.ledger_dsn, run_id, spark=spark, log=lambda m: None)
    assert done.resumed and list(done.backfills) == ["main"]
    assert env.q(
        env.sink_dsn, "SELECT count(*), min(name), max(name) FILTER (WHERE id = 399) FROM orders"
    ) == [(400, "v1600", "v1999")]
    assert env.ledger("SELECT count(*) FROM tidemark.dlq WHERE status = 'quarantined'") == [(1,)]
    assert_exactly_once(env)
