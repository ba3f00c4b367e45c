"""A crash (SIGKILL of the whole job: driver, JVM and Python workers) at every step of the
protocol, then recovery and a rerun: every record is in the sink exactly once or in the DLQ
exactly once, checkpoints are at the end, and no prepared transaction is left.

The job processes write on the local runner (no JVM: tidemark/driver/runners.py), the same
task code in the job's own process; the cases marked ``engines("local", "spark")`` run in
Spark too, where the SIGKILL takes the JVM and the Python workers with it."""

from __future__ import annotations

import signal

import pytest

from tests.conftest import order_record
from tests.invariants import assert_exactly_once
from tests.proc import JobProcess
from tidemark.core import faults

# point -> does the decision exist when the job dies (recovery rolls forward, else back)
CRASH_POINTS = {
    "after_claim": False,
    "task_after_prepare": False,
    "after_prepare": False,
    "after_decide": True,
    "before_commit_prepared": True,
    "mid_finish": True,
    "after_finish": True,
    "after_advance": True,
}


def _world(env):
    env.append_orders(range(300))
    env.append([(0, b"poison", b"{not json", None, None), (1, b"poison2", b"\xff", None, None)])
    sinks = [
        {"name": "main", "dsn": env.sink_dsn, "table": "public.orders", "key": ["id"]},
        {"name": "second", "dsn": env.sink2_dsn, "table": "public.orders", "key": ["id"]},
    ]
    env.pipeline(sinks=sinks)
    return {"main": env.sink_dsn, "second": env.sink2_dsn}


def _rows(env, dsn):
    try:
        return env.q(dsn, "SELECT count(*) FROM orders")[0][0]
    except Exception:  # noqa: BLE001 - the table is created by the run; it may not exist yet
        return 0


# Reached only by a run whose checks run in its write job: tests/test_quality_one_pass.py.
ONE_PASS_POINTS = ["before_verdict"]


def test_the_matrix_covers_every_fault_point():
    assert sorted([*CRASH_POINTS, *ONE_PASS_POINTS]) == sorted(faults.POINTS)


@pytest.mark.parametrize("point", list(CRASH_POINTS))
def test_crash_at_every_step_then_recover_and_rerun(env, engine, point):
    sinks = _world(env)
    job = JobProcess(env.cli_argv("run", "orders"), env.cli_env(), crash_at=point)
    code = job.wait()
    assert code == -signal.SIGKILL, f"expected SIGKILL at {point}, got {code}:\n{job.output()}"

    states = {s for (s,) in env.ledger("SELECT state::text FROM tidemark.run_sinks")}
    decided = CRASH_POINTS[point]
    if point == "after_advance":
        assert states == {"committed"}
    elif decided:
        assert states == {"committing"}, states
    else:
        assert states <= {"planned", "writing", "prepared"}, states
    if point in ("task_after_prepare", "after_prepare", "after_decide"):
        assert env.prepared(), f"{point}: expected prepared transactions before recovery"

    rep = env.recover()
    assert rep.ok, rep.errors
    assert env.prepared() == []
    for dsn in sinks.values():
        assert _rows(env, dsn) == (300 if decided else 0), point
    after = {s for (s,) in env.ledger("SELECT state::text FROM tidemark.run_sinks")}
    assert after == ({"committed"} if decided else {"aborted"})

    report = env.run(engine)
    assert report.ok or report.run_id is None, report.summary()
    for sink in sinks:
        assert env.checkpoints(sink=sink) == {0: 151, 1: 151}
    # The two poison records, once per sink (a dead letter names the sink it applies to).
    assert env.ledger("SELECT sink, count(*) FROM tidemark.dlq GROUP BY 1 ORDER BY 1") == [
        ("main", 2),
        ("second", 2),
    ]
    assert env.ledger("SELECT max(attempts) FROM tidemark.dlq") == [(1,)]
    assert_exactly_once(env, sinks=sinks)


def _crash_recover_rerun(env, engine, point: str) -> list[str]:
    """SIGKILL `tidemark run` at ``point``, recover, run again; the Spark tasks that wrote."""
    job = JobProcess(env.cli_argv("run", "orders"), env.cli_env(), crash_at=point)
    assert job.wait() == -signal.SIGKILL, job.output()
    rep = env.recover()
    assert rep.ok, rep.errors
    report = env.run(engine)
    assert report.ok or report.run_id is None, report.summary()
    return [
        t
        for (t,) in env.ledger(
            "SELECT DISTINCT split_part(gid, ':', 4) FROM tidemark.participants ORDER BY 1"
        )
    ]


@pytest.mark.parametrize("point", ["task_after_prepare", "mid_finish"])
@pytest.mark.engines("local", "spark")
def test_crash_in_a_run_written_by_one_task(env, engine, point):
    """Sinks with a version column and keys whose versions sit in both partitions: one task
    writes both ranges (tidemark/driver/modes.py, Layout "together"). A crash before and after the
    decision, recovery, a rerun: each key once, at its newest version."""
    env.append_orders(range(300))  # id i in partition i % 2, version 1
    env.append([order_record((i + 1) % 2, i, f"v2-{i}", 1.0, version=2) for i in range(10)])
    sinks = {"main": env.sink_dsn, "second": env.sink2_dsn}
    env.pipeline(
        sinks=[
            {"name": n, "dsn": d, "table": "public.orders", "key": ["id"], "version": "version"}
            for n, d in sinks.items()
        ]
    )
    assert _crash_recover_rerun(env, engine, point) == ["0"]
    for sink, dsn in sinks.items():
        assert env.checkpoints(sink=sink) == {0: 155, 1: 155}
        assert env.q(dsn, "SELECT count(*), count(*) FILTER (WHERE version = 2) FROM orders") == [
            (300, 10)
        ]
    assert_exactly_once(env, sinks=sinks)


@pytest.mark.parametrize("point", ["task_after_prepare", "mid_finish"])
@pytest.mark.engines("local", "spark")
def test_crash_in_a_run_spread_over_tasks_by_key(env, engine, point):
    """One partition read in sub-ranges, its records spread by key over two write tasks
    (tidemark/driver/modes.py, Layout), each preparing its own transaction per sink. A
    crash before and after the decision, recovery, a rerun: each record placed once."""
    env.append([order_record(0, i % 400, f"v{i}", 1.0) for i in range(2000)])
    sinks = {"main": env.sink_dsn, "second": env.sink2_dsn}
    env.pipeline(
        sinks=[
            {"name": n, "dsn": d, "table": "public.orders", "key": ["id"]} for n, d in sinks.items()
        ],
        limits={"max_records_per_partition": 5000, "split_min_records": 1000},
    )
    assert _crash_recover_rerun(env, engine, point) == ["0", "1"]
    for sink, dsn in sinks.items():
        assert env.checkpoints(sink=sink) == {0: 2000}
        assert env.q(
            dsn, "SELECT count(*), min(name), max(name) FILTER (WHERE id = 399) FROM orders"
        ) == [(400, "v1600", "v1999")]
    assert_exactly_once(env, sinks=sinks)


@pytest.mark.engines("local", "spark")
def test_a_failed_task_attempt_is_rolled_back_by_its_retry(env, engine):
    sinks = _world(env)
    job = JobProcess(
        env.cli_argv("run", "orders"), env.cli_env(TIDEMARK_FAIL_AT="task_after_prepare")
    )
    assert job.wait() == 0, job.output()
    gids = [g for (g,) in env.ledger("SELECT DISTINCT gid FROM tidemark.participants")]
    assert gids and all(g.endswith(":1") for g in gids), gids  # only the retries were chosen
    assert_exactly_once(env, sinks=sinks)
    for sink in sinks:
        assert env.checkpoints(sink=sink) == {0: 151, 1: 151}


@pytest.mark.parametrize("point", ["before_commit_prepared", "mid_finish"])
def test_sink_backend_killed_during_commit_prepared_is_settled_by_recovery(
    env, engine, point, tmp_path
):
    sinks = _world(env)
    job = JobProcess(
        env.cli_argv("run", "orders"), env.cli_env(), pause_dir=tmp_path / "p", pause_at=point
    )
    assert job.wait_reached() == point
    killed = env.q(
        env.ledger_dsn,
        """SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                                      WHERE application_name = 'tidemark-commit'""",
    )
    assert killed and all(ok for (ok,) in killed)
    job.resume()
    code = job.wait()
    out = job.output()
    assert code == 1, out
    assert "settled by `tidemark recover`" in out
    assert "Traceback" not in out
    # The job did not guess: the decision stands, unresolved until recovery reads the truth.
    assert {s for (s,) in env.ledger("SELECT state::text FROM tidemark.run_sinks")} == {
        "committing"
    }
    rec = JobProcess(env.cli_argv("recover"), env.cli_env())
    assert rec.wait() == 0, rec.output()
    assert {s for (s,) in env.ledger("SELECT state::text FROM tidemark.run_sinks")} == {"committed"}
    outcomes = {o for (o,) in env.ledger("SELECT outcome FROM tidemark.participants")}
    assert outcomes == {"committed"}
    assert_exactly_once(env, sinks=sinks)
    for dsn in sinks.values():
        assert _rows(env, dsn) == 300
