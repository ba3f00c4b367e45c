"""The protocol under faults that meet each other: zombie task attempts, a decision that may
have committed, a lease that expired, a recovery racing a decision, a dropped heartbeat
connection, two sessions committing the same gid, the first read of a partition. Real
PostgreSQL and real job processes."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import psycopg
import pytest

from tests.conftest import claim_orders
from tests.invariants import assert_exactly_once
from tests.proc import run_orders
from tidemark.core.dsn import mask
from tidemark.core.errors import Fenced
from tidemark.core.sink_counts import SinkCounts
from tidemark.engine.transactions import rollback_earlier_attempts
from tidemark.ledger import markers, state
from tidemark.protocol import twopc


def _prepare(dsn: str, gid: str) -> None:
    with psycopg.connect(dsn) as c:
        markers.ensure(c)
        c.commit()
        c.execute("INSERT INTO tidemark.commits (gid, run_id) VALUES (%s, 7)", (gid,))
        c.execute(psycopg.sql.SQL("PREPARE TRANSACTION {}").format(psycopg.sql.Literal(gid)))


def test_a_retry_rolls_back_only_earlier_attempts_of_its_task(env):
    for attempt in (0, 2):
        _prepare(env.ledger_dsn, f"tm:7:d.main:3:{attempt}")
    _prepare(env.ledger_dsn, "tm:7:d.main:4:0")  # another task
    done = rollback_earlier_attempts(env.ledger_dsn, "tm", 7, "%", 3, 1)
    assert done == ["tm:7:d.main:3:0"]
    assert env.prepared() == ["tm:7:d.main:3:2", "tm:7:d.main:4:0"]  # the zombie's is kept


def test_recovery_sweeps_a_second_writes_gids_and_those_of_a_release_before_write_numbers(env):
    """A second write's gid carries its write number as a last field; a release before write
    numbers gave that write attempts from 100 instead. Recovery reads both as its run's and
    rolls them back once the run is gone."""
    with psycopg.connect(env.ledger_dsn, autocommit=True) as conn:
        rid = _claimed(conn)  # its owner's session ends here: the run is orphaned
    mine = [f"tm:{rid}:d.main:0:0:1", f"tm:{rid}:d.main:1:100", f"tm:{rid}:d.main:2:0"]
    for gid in mine:
        _prepare(env.ledger_dsn, gid)
    rep = env.recover()
    assert rep.ok, rep.errors
    assert sorted(rep.rolled_back) == sorted(mine)
    assert env.prepared() == []


def test_recovery_reports_a_gid_with_its_prefix_it_cannot_read_and_leaves_it_prepared(env):
    """A prepared transaction with Tidemark's prefix whose gid does not parse names no run,
    stage or task: recovery never guesses (commit or roll back), it leaves it prepared and
    says so, naming the database and the gid, and `tidemark recover` exits 1. A gid without
    the prefix is someone else's and stays out of it."""
    env.pipeline()
    odd = ["tm:7:s.main:3:0:0", "tm:7:s.main:x:0"]  # write 0 spelled out; a task no number
    for gid in [*odd, "theirs:7:s.main:3:0"]:
        _prepare(env.sink_dsn, gid)
    try:
        rep = env.recover()
        assert not rep.ok and rep.rolled_back == []
        assert rep.unparsed == [(mask(env.sink_dsn), gid) for gid in odd]
        assert len(rep.errors) == 2
        for gid, line in zip(odd, rep.errors, strict=True):
            assert mask(env.sink_dsn) in line and gid in line and "left prepared" in line
        code = subprocess.run(
            env.cli_argv("recover"), env=env.cli_env(), capture_output=True, text=True
        )
        assert code.returncode == 1
        assert f"error: {rep.errors[0]}" in code.stdout, code.stdout
        still = env.q(env.sink_dsn, "SELECT gid FROM pg_prepared_xacts ORDER BY gid")
        assert [g for (g,) in still] == sorted([*odd, "theirs:7:s.main:3:0"])
    finally:
        with psycopg.connect(env.sink_dsn, autocommit=True) as c:
            for gid in [*odd, "theirs:7:s.main:3:0"]:
                twopc.rollback(c, gid)


def _claimed(conn, ttl: int = 60):
    claim = claim_orders(conn, ttl_seconds=ttl)
    state.start_writing(conn, "orders", claim.run_id, "main")
    state.mark_prepared(conn, "orders", claim.run_id, "main", SinkCounts())
    return claim.run_id


def test_an_expired_lease_is_fenced_at_the_decision_even_if_nobody_took_over(env):
    with psycopg.connect(env.ledger_dsn, autocommit=True) as conn:
        rid = _claimed(conn)
        conn.execute("UPDATE tidemark.leases SET expires_at = now() - interval '1 second'")
        with pytest.raises(Fenced, match="expired"):
            state.decide(conn, "orders", rid, "main", [])
        assert state.state_of(conn, rid, "main") == state.RunState.PREPARED


def test_a_recovery_aborting_while_a_decision_holds_the_lease_never_deadlocks(env):
    """Both lock the lease row first: the abort waits, then finds the run decided."""
    with (
        psycopg.connect(env.ledger_dsn, autocommit=True) as driver,
        psycopg.connect(env.ledger_dsn, autocommit=True) as recovery,
    ):
        rid = _claimed(driver)
        outcome: list = []
        with driver.transaction():
            state._check_lease(driver, "orders", rid, "main")  # the decision's first step
            t = threading.Thread(
                target=lambda: outcome.append(
                    state.abort(recovery, "orders", rid, "main", "recovery: test")
                )
            )
            t.start()
            _wait_for_lock_wait(env, "abort")
            state._transition(
                driver, rid, "main", state.RunState.COMMITTING, [state.RunState.PREPARED]
            )
        t.join(30)
        assert outcome == [False]  # decided: not abortable, and no deadlock error
        assert state.state_of(driver, rid, "main") == state.RunState.COMMITTING


def _wait_for_lock_wait(env, what: str, timeout: float = 20, application: str = "%") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if env.ledger(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database() AND application_name LIKE %s",
            (application,),
        )[0][0]:
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} never waited on a lock")


def test_the_heartbeat_reconnects_after_its_connection_is_dropped(env):
    from tidemark.driver.watch import Heartbeat

    with psycopg.connect(env.ledger_dsn, autocommit=True) as conn:
        rid = _claimed(conn, ttl=3)
        beat = Heartbeat(env.ledger_dsn, "orders", rid, 3)
        beat.start()
        try:
            _until(lambda: beat.beats >= 1, "a first heartbeat")
            killed = env.ledger(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = 'tidemark-heartbeat'"
            )
            assert killed == [(True,)]
            seen = beat.beats
            _until(lambda: beat.beats > seen + 1, "heartbeats after the reconnect")
            assert conn.execute("SELECT expires_at > now() FROM tidemark.leases").fetchone()[0]
            state.decide(conn, "orders", rid, "main", [])  # still ours: not fenced
        finally:
            beat.stop()


def _until(cond, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_two_sessions_committing_the_same_gids_both_settle_without_error(env):
    gids = [f"tm:9:s.main:{i}:0" for i in range(40)]
    for g in gids:
        _prepare(env.ledger_dsn, g)
    outcomes: dict[str, list] = {"a": [], "b": []}

    def settle(name: str) -> None:
        with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
            for g in gids:
                outcomes[name].append(twopc.commit(c, g))

    threads = [threading.Thread(target=settle, args=(n,)) for n in outcomes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert outcomes["a"] == outcomes["b"] == ["committed"] * len(gids)
    assert env.prepared() == []


def test_the_first_read_of_a_partition_starts_at_its_first_settled_offset(env):
    """A writer that commits out of offset order (a sequence, not `append`): offset 0 is
    still being written when offsets 1 and 2 are visible. Starting at 1 would skip 0."""
    from tidemark.sources.postgres_log import PostgresLogPlanner

    env.pipeline()
    with (
        psycopg.connect(env.ledger_dsn) as slow,
        psycopg.connect(env.ledger_dsn, autocommit=True) as fast,
    ):
        slow.execute("SELECT pg_current_xact_id()")  # an older transaction, still running
        fast.execute("""INSERT INTO src.log ("partition", "offset", payload) VALUES
                        (0, 1, '{}'), (0, 2, '{}')""")
        src = env.load().source
        planner = PostgresLogPlanner(src, env.ledger_dsn)
        try:
            assert planner.partitions() == [0]
            assert planner.earliest(0) is None  # nothing settled yet: do not start
            slow.execute("""INSERT INTO src.log ("partition", "offset", payload)
                            VALUES (0, 0, '{}')""")
            slow.commit()
            assert planner.earliest(0) == 0
            assert planner.latest(0) == 3
        finally:
            planner.close()


def test_start_latest_skips_the_history_once_and_keeps_what_comes_after(env, engine):
    env.append_orders(range(20))
    env.pipeline(start="latest")
    first = env.run(engine)
    assert first.run_id is None  # nothing after the start
    assert env.checkpoints() == {0: 10, 1: 10}  # the start is recorded, not recomputed
    env.append_orders(range(20, 24))
    second = env.run(engine)
    assert second.ok and second.sinks["main"].counts.rows == 4, second.summary()
    assert sorted(i for (i,) in env.q(env.sink_dsn, "SELECT id FROM orders")) == [20, 21, 22, 23]


@pytest.mark.slow
@pytest.mark.usefixtures("engine")  # the job processes: local engine (no JVM)
@pytest.mark.parametrize("fault", ["sigterm", "lost_connection"])
def test_a_decision_that_may_have_committed_is_settled_by_the_ledger(env, fault):
    """The decision waits on the lease row (held here); meanwhile the job is signalled, or
    its ledger connection is killed. A signal during the decision never rolls it back; a lost
    connection is settled by reading the ledger (here: not recorded, so rolled back)."""
    env.append_orders(range(60))
    env.pipeline()
    job = run_orders(env, pause_at="after_prepare")
    with psycopg.connect(env.ledger_dsn) as holder:
        holder.execute("SELECT 1 FROM tidemark.leases FOR UPDATE")
        job.resume()
        _wait_for_lock_wait(env, "the decision")
        if fault == "sigterm":
            job.signal(signal.SIGTERM)
            time.sleep(0.5)  # the handler has run: the signal must not abort the decision
        else:
            killed = env.ledger(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                "wait_event_type = 'Lock' AND application_name = 'tidemark'"
            )
            assert killed == [(True,)]
        holder.rollback()
    code = job.wait()
    out = job.output()
    assert "Traceback" not in out
    st = env.ledger("SELECT state::text FROM tidemark.run_sinks")
    if fault == "sigterm":
        assert code == 0, out
        assert st == [("committed",)]
        assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(60,)]
    else:
        assert code == 1, out
        # Settled by reading the ledger: the decision was not recorded, so rolled back.
        ((state, error),) = env.ledger("SELECT state::text, error FROM tidemark.run_sinks")
        assert state == "aborted" and error.startswith("decision not recorded: "), error
        assert env.prepared() == []
        rerun = run_orders(env)
        assert rerun.wait() == 0, rerun.output()
        assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(60,)]
    assert_exactly_once(env)


def _two_sinks(env) -> dict[str, str]:
    env.pipeline(
        sinks=[
            {"name": "main", "dsn": env.sink_dsn, "table": "public.orders", "key": ["id"]},
            {"name": "second", "dsn": env.sink2_dsn, "table": "public.orders", "key": ["id"]},
        ]
    )
    return {"main": env.sink_dsn, "second": env.sink2_dsn}


# The run's own ledger session (tidemark.core.db.APP_NAME); the heartbeat's, the tasks' and
# the commit's connections name themselves otherwise.
_RUN_SESSION = "application_name = 'tidemark' AND datname = current_database()"


@pytest.mark.slow
@pytest.mark.usefixtures("engine")  # the job processes: local engine (no JVM)
def test_a_sigterm_during_a_decision_that_was_not_recorded_aborts_the_run(env):
    """SIGTERM arrives while the first sink's decision waits on the lease row; then that
    decision's ledger connection dies, and the ledger says it was not recorded. No sink has
    decided, so the SIGTERM still aborts the run: the second sink must not decide."""
    env.append_orders(range(60))
    sinks = _two_sinks(env)
    job = run_orders(env, pause_at="after_prepare")
    with psycopg.connect(env.ledger_dsn) as holder:
        holder.execute("SELECT 1 FROM tidemark.leases FOR UPDATE")
        job.resume()
        _wait_for_lock_wait(env, "the decision", application="tidemark")
        # Delivered at once (it wakes the waiting driver), handled before the decision's
        # error is: the run learns of the SIGTERM while the decision is in flight.
        job.signal(signal.SIGTERM)
        killed = env.ledger(
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE {_RUN_SESSION} "
            "AND wait_event_type = 'Lock'"
        )
        assert killed == [(True,)]
        holder.rollback()
    code = job.wait()
    out = job.output()
    assert code == 143, out
    assert "Traceback" not in out
    assert env.ledger("SELECT sink, state::text FROM tidemark.run_sinks ORDER BY 1") == [
        ("main", "aborted"),
        ("second", "aborted"),
    ]
    for dsn in sinks.values():
        assert env.q(dsn, "SELECT count(*) FROM orders") == [(0,)]
    assert env.prepared() == []
    rerun = run_orders(env)
    assert rerun.wait() == 0, rerun.output()
    assert_exactly_once(env, sinks=sinks)


@pytest.mark.slow
@pytest.mark.usefixtures("engine")  # the job processes: local engine (no JVM)
@pytest.mark.parametrize("fault", ["sigterm_before_decision", "lost_after_decision"])
def test_a_dead_ledger_session_never_hides_the_runs_own_error(env, fault):
    """The run's ledger session is terminated, then the run fails: by SIGTERM before the
    decision, or (after the decision) by the lost session itself. The cleanup on that
    session (aborting the sinks, noting what was read, finishing the run) fails too; the user
    still sees the run's own error and exit code, and recovery settles what it left."""
    env.append_orders(range(60))
    env.pipeline()
    job = run_orders(
        env, pause_at="after_prepare" if fault == "sigterm_before_decision" else "after_decide"
    )
    killed = env.ledger(
        f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE {_RUN_SESSION}"
    )
    assert killed == [(True,)]
    if fault == "sigterm_before_decision":
        job.signal(signal.SIGTERM)
    else:
        job.resume()
    code = job.wait()
    out = job.output()
    assert "database error" not in out and "Traceback" not in out, out
    if fault == "sigterm_before_decision":
        assert code == 143, out
        assert "tidemark: error: SIGTERM before the decision" in out, out
    else:
        assert code == 1, out
        assert "lost a connection while committing" in out, out
    assert env.recover().ok
    assert env.prepared() == []
    (state_,) = env.ledger("SELECT state::text FROM tidemark.run_sinks")
    if fault == "sigterm_before_decision":
        assert state_ == ("aborted",)
        assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(0,)]
        rerun = run_orders(env)
        assert rerun.wait() == 0, rerun.output()
    else:
        assert state_ == ("committed",)  # rolled forward
    assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(60,)]
    assert_exactly_once(env)
