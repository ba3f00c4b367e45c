"""Spark Connect as the engine (tidemark/driver/runners.py: ConnectRunner) on a real local
Connect server (tidemark/devstack/connect_server.py): the `tidemark` CLI's runs, a backfill
and its preview through it, and the crashes Connect adds: the client SIGKILLed while its
tasks run on the server (which runs them on), the server SIGKILLed mid-run and restarted.

Each crash test holds the sink table locked so the write tasks wait inside PostgreSQL, awaits
them waiting there (pg_stat_activity), then kills."""

from __future__ import annotations

import signal
import subprocess
import time

import psycopg
import pytest

from tests.invariants import assert_exactly_once
from tests.proc import JobProcess
from tidemark.core.engines import Engine

pytestmark = pytest.mark.spark


def _cli(env, *args: str, **extra) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        env.cli_argv(*args), env=env.cli_env(**extra), capture_output=True, text=True, timeout=600
    )


def _await(what: str, check, timeout: float = 240.0):
    """Until ``check()`` is truthy (a state of PostgreSQL, polled), or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out awaiting {what}")


def _waiting_tasks(env) -> int:
    """Backends on the sink database waiting for a lock: the write tasks, the table held."""
    return env.q(
        env.sink_dsn,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock'",
    )[0][0]


def _connect_env(env, url: str) -> None:
    env.engine, env.spark_remote = Engine.CONNECT, url


@pytest.fixture
def connect_env(env, connect_server):
    _connect_env(env, connect_server.url)
    return env


def test_cli_run_backfill_and_preview_through_connect(connect_env):
    env = connect_env
    env.append_orders(range(300))
    env.append([(0, b"poison", b"{not json", None, None)])
    env.pipeline()
    run = _cli(env, "run", "orders")
    assert run.returncode == 0, run.stderr
    assert f"orders: write tasks on Spark Connect at {env.spark_remote}" in run.stderr
    assert env.checkpoints() == {0: 151, 1: 150}
    assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(300,)]
    # A preview of a backfill: its counts, nothing committed.
    preview = _cli(env, "backfill", "orders", "--partition", "all", "--dry-run")
    assert preview.returncode == 0, preview.stderr
    assert "dry run" in (preview.stdout + preview.stderr).lower()
    assert env.prepared() == []
    backfill = _cli(env, "backfill", "orders", "--partition", "all")
    assert backfill.returncode == 0, backfill.stderr
    assert env.checkpoints() == {0: 151, 1: 150}
    assert env.ledger("SELECT count(*), max(attempts) FROM tidemark.dlq") == [(1, 2)]
    assert_exactly_once(env)


def test_an_unreachable_server_is_one_line(env):
    """Said in seconds: a few seconds of retries, and no more at the process's exit (54 s
    in all before, 35 of them PySpark's exit hook retrying a call to the server)."""
    env.append_orders(range(5))
    env.pipeline()
    began = time.monotonic()
    bad = _cli(env, "run", "orders", TIDEMARK_SPARK_REMOTE="sc://127.0.0.1:9")
    assert time.monotonic() - began < 30, bad.stderr
    assert bad.returncode != 0
    assert "cannot reach the Spark Connect server at sc://127.0.0.1:9" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr
    assert env.ledger("SELECT count(*) FROM tidemark.runs") == [(0,)]


@pytest.mark.parametrize("var", ["SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED"])
def test_a_classic_run_with_pysparks_connect_variables_set_is_one_line(env, var):
    """PySpark takes a classic session to Spark Connect when either is set in the user's
    environment: the run says which, and what to do, before it claims anything."""
    env.engine = Engine.SPARK
    env.append_orders(range(5))
    env.pipeline()
    value = "sc://127.0.0.1:9/;token=s3cret" if var == "SPARK_REMOTE" else "1"
    bad = _cli(env, "run", "orders", **{var: value})
    assert bad.returncode == 2, (bad.returncode, bad.stderr)
    assert f"{var} is set" in bad.stderr and "TIDEMARK_ENGINE=connect" in bad.stderr, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "Traceback" not in bad.stderr and "s3cret" not in bad.stderr
    assert env.ledger("SELECT count(*) FROM tidemark.runs") == [(0,)]


def _locked_run(env):
    """A first run makes the table; then 200 more records and the table locked: a `tidemark
    run` whose write tasks wait in PostgreSQL, on the server. Returns (job, the lock's conn)."""
    env.append_orders(range(100))
    env.pipeline()
    first = _cli(env, "run", "orders")
    assert first.returncode == 0, first.stderr
    env.append_orders(range(100, 300))
    lock = psycopg.connect(env.sink_dsn)
    lock.execute("LOCK TABLE public.orders IN EXCLUSIVE MODE")  # reads pass, writes wait
    job = JobProcess(env.cli_argv("run", "orders"), env.cli_env())
    _await("the write tasks waiting on the table", lambda: _waiting_tasks(env))
    return job, lock


def _rerun_exact(env) -> None:
    rep = env.recover()
    assert rep.ok, rep.errors
    assert env.prepared() == []
    rerun = _cli(env, "run", "orders")
    assert rerun.returncode == 0, rerun.stderr
    assert env.checkpoints() == {0: 150, 1: 150}
    assert env.q(env.sink_dsn, "SELECT count(*), count(DISTINCT id) FROM orders") == [(300, 300)]
    assert env.prepared() == []
    assert_exactly_once(env)


def test_client_killed_mid_run_recovery_fences_the_tasks_the_server_runs_on(connect_env):
    """The client dies; its tasks run on. Recovery aborts the run; the tasks then PREPARE
    (the table freed) for a run that is aborted: nothing of it commits, the next recovery
    rolls them back, and the rerun places every record once."""
    env = connect_env
    job, lock = _locked_run(env)
    job.kill_group()
    assert job.wait() == -signal.SIGKILL
    rep = env.recover()
    assert rep.ok, rep.errors
    assert env.ledger("SELECT state::text FROM tidemark.run_sinks WHERE run_id = 2") == [
        ("aborted",)
    ]
    lock.rollback()  # the tasks left on the server go on
    lock.close()
    # They prepare for the aborted run (or were interrupted first): either way nothing of
    # run 2 is visible, and once they are done no backend of theirs is left.
    _await(
        "the server's tasks done",
        lambda: env.q(
            env.sink_dsn,
            "SELECT count(*) = 0 FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND backend_type = 'client backend' AND state <> 'idle'",
        )[0][0],
    )
    assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(100,)]
    assert env.checkpoints() == {0: 50, 1: 50}
    _rerun_exact(env)


def test_server_killed_mid_run_restarted_recovery_and_rerun_exact(env, tmp_path):
    from tidemark.devstack.connect_server import ConnectServer

    server = ConnectServer(tmp_path / "connect", master="local[2,4]")
    _connect_env(env, server.start())
    try:
        job, lock = _locked_run(env)
        server.kill()  # the JVM, its worker daemon and the tasks' Python workers
        # The client sees its job fail and rolls the run back itself.
        assert job.wait() != 0
        assert "Traceback" not in job.output()
        lock.rollback()
        lock.close()
        assert env.ledger("SELECT state::text FROM tidemark.run_sinks WHERE run_id = 2") == [
            ("aborted",)
        ]
        server.start()
        _rerun_exact(env)
    finally:
        server.stop()


def test_sigterm_mid_job_rolls_back_and_recovery_settles_what_its_tasks_prepare_later(
    connect_env,
):
    """SIGTERM while the tasks wait on the server: the run interrupts its own job (by its
    tag), rolls back and exits 143. A task blocked inside PostgreSQL does not see the
    interrupt until its statement returns: freed, it PREPAREs for the aborted run (measured:
    both did). Nothing of it commits; the next recovery rolls it back (docs/design.md,
    "Recovery": a task may outlive its run)."""
    from tidemark.core.errors import Terminated

    env = connect_env
    job, lock = _locked_run(env)
    job.signal(signal.SIGTERM)
    code = job.wait()
    out = job.output()
    assert code == Terminated.exit_code, out
    assert "Traceback" not in out
    lock.rollback()
    lock.close()
    assert env.ledger("SELECT state::text FROM tidemark.run_sinks WHERE run_id = 2") == [
        ("aborted",)
    ]
    _await(
        "the tasks' backends done",
        lambda: env.q(
            env.sink_dsn,
            "SELECT count(*) = 0 FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND backend_type = 'client backend' AND state <> 'idle'",
        )[0][0],
    )
    assert {g.split(":")[1] for g in env.prepared()} <= {"2"}  # only the aborted run's
    assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(100,)]
    _rerun_exact(env)


def test_a_connect_run_prints_progress_lines_while_its_tasks_run(connect_env):
    """As on the classic engine, a run whose job lasts prints its tasks' progress: from the
    server's progress reports (tidemark/driver/connect_progress.py), not a status tracker."""
    import queue
    import threading

    env = connect_env
    job, lock = _locked_run(env)  # its tasks wait on the table until the lock goes
    lines: queue.Queue[str | None] = queue.Queue()
    said: list[str] = []

    def read() -> None:
        assert job.proc.stdout is not None
        for line in job.proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)  # the job's output ended

    threading.Thread(target=read, daemon=True).start()
    try:
        while True:
            line = lines.get(timeout=120)  # the job's next line, or fail
            assert line is not None, "no progress line before the job ended:\n" + "\n".join(said)
            said.append(line)
            if line.startswith("run 2: writing, ") and "tasks done" in line:
                break
    finally:
        lock.rollback()
        lock.close()
    assert job.wait() == 0, "\n".join(said)
    assert env.checkpoints() == {0: 150, 1: 150}
    assert_exactly_once(env)
