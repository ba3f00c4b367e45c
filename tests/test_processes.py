"""Real job processes against each other and against signals. The job processes run on the
local engine (no JVM) but for the first test's, which keeps a SIGTERM to a process holding a
Spark driver on Spark."""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.invariants import assert_exactly_once
from tests.proc import run_orders
from tidemark.core.errors import Terminated

pytestmark = pytest.mark.slow


def test_sigterm_before_the_decision_rolls_back_and_releases_the_lease(env):
    env.append_orders(range(100))
    env.pipeline()
    job = run_orders(env, pause_at="after_prepare")
    assert env.prepared(), "the tasks prepared before the pause"
    job.signal(signal.SIGTERM)
    code = job.wait()
    out = job.output()
    assert code == Terminated.exit_code, out
    assert "Traceback" not in out
    assert env.prepared() == []
    assert env.ledger("SELECT state::text, error FROM tidemark.run_sinks") == [
        ("aborted", "terminated (SIGTERM) before the decision")
    ]
    assert env.ledger("SELECT run_id FROM tidemark.leases") == [(None,)]
    assert set(env.checkpoints().values()) <= {0}
    assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(0,)]


@pytest.mark.usefixtures("engine")
def test_sigterm_after_the_decision_finishes_the_commit_first(env):
    env.append_orders(range(100))
    env.pipeline()
    job = run_orders(env, pause_at="after_decide")
    job.signal(signal.SIGTERM)
    job.resume()
    code = job.wait()
    assert code == 0, job.output()
    assert env.ledger("SELECT state::text FROM tidemark.run_sinks") == [("committed",)]
    assert env.checkpoints() == {0: 50, 1: 50}
    assert_exactly_once(env)


@pytest.mark.usefixtures("engine")
def test_a_second_run_started_while_the_first_holds_the_lease_delivers_nothing(env):
    env.append_orders(range(100))
    env.pipeline()
    first = run_orders(env, pause_at="after_claim")
    second = run_orders(env)
    assert second.wait() == 3, second.output()
    assert "lease held by run" in second.output()
    first.resume()
    assert first.wait() == 0, first.output()
    assert env.ledger("SELECT count(*) FROM tidemark.runs") == [(1,)]
    assert_exactly_once(env)


@pytest.mark.usefixtures("engine")
def test_two_runs_started_at_once_never_deliver_twice(env):
    env.append_orders(range(200))
    env.pipeline()
    jobs = [run_orders(env) for _ in range(2)]
    codes = sorted(j.wait() for j in jobs)
    # Either the loser found the lease held (3), or it came second and found nothing to do.
    assert codes in ([0, 0], [0, 3]), [j.output() for j in jobs]
    assert env.q(env.sink_dsn, "SELECT count(*), count(DISTINCT _tm_run_id) FROM orders") == [
        (200, 1)
    ]
    assert_exactly_once(env)


def test_a_paused_run_whose_lease_was_taken_over_is_fenced(env, engine):
    env.append_orders(range(100))
    env.pipeline()
    old = run_orders(env, "--json", pause_at="after_prepare")
    os.kill(old.proc.pid, signal.SIGSTOP)  # a stalled driver: alive, holding its session
    try:
        env.ledger(
            "UPDATE tidemark.leases SET expires_at = now() - interval '1 second' RETURNING 1"
        )
        new = env.run(engine)  # recovery aborts the stalled run; this one takes over
        assert new.ok, new.summary()
        assert env.ledger("SELECT epoch FROM tidemark.leases") == [(2,)]
    finally:
        os.kill(old.proc.pid, signal.SIGCONT)
    old.resume()
    code = old.wait()
    out = old.output()
    assert code != 0, out
    # Its report (the one JSON line among the log lines) says why its sink was aborted.
    (report,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    main = report["sinks"]["main"]
    assert main["state"] == "aborted" and "lost the lease of sink main" in main["error"], main
    states = dict(env.ledger("SELECT run_id, state::text FROM tidemark.run_sinks"))
    assert sorted(states.values()) == ["aborted", "committed"]
    assert env.q(env.sink_dsn, "SELECT count(DISTINCT _tm_run_id) FROM orders") == [(1,)]
    assert_exactly_once(env)
