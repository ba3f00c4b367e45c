"""Operations inside Airflow, without an Airflow stack: the ledger as an Airflow connection,
which job exit codes are not retried, lag measured on a real source log and its alert
episodes, and metrics through Airflow's StatsD client to a real UDP listener on loopback
(tests/test_airflow.py runs the same through real DAG runs)."""

from __future__ import annotations

import json
import socket
from datetime import UTC, datetime, timedelta

import pytest

from tests.conftest import claim_orders
from tidemark.core.errors import TidemarkError
from tidemark.core.settings import Settings

# -- the ledger as an Airflow connection -------------------------------------------------------


def test_inside_airflow_the_ledger_connection_wins_over_the_env(monkeypatch):
    monkeypatch.setenv(
        "AIRFLOW_CONN_TIDEMARK_LEDGER",
        json.dumps(
            {
                "conn_type": "postgres",
                "host": "ledger.internal",
                "port": 5433,
                "login": "tm",
                "password": "s3cret-pw",
                "schema": "tidemark",
                "extra": {"sslmode": "require"},
            }
        ),
    )
    s = Settings(ledger_dsn="postgresql://cli@127.0.0.1/other")
    assert s.airflow_ledger("Airflow's workers") == (
        "postgresql://tm:s3cret-pw@ledger.internal:5433/tidemark?sslmode=require"
    )
    assert s.ledger() == "postgresql://cli@127.0.0.1/other"  # the CLI keeps its variable
    other = Settings(ledger_dsn=None, ledger_conn_id="elsewhere")
    with pytest.raises(TidemarkError) as exc:
        other.airflow_ledger("Airflow's workers")
    assert str(exc.value) == (
        "no ledger: define the Airflow connection 'elsewhere' (or set "
        "TIDEMARK_LEDGER_DSN in the environment of Airflow's workers)"
    )


def test_without_the_connection_the_env_dsn_is_used(monkeypatch):
    monkeypatch.delenv("AIRFLOW_CONN_TIDEMARK_LEDGER", raising=False)
    assert Settings(ledger_dsn="postgresql://x@h/db").airflow_ledger("w") == "postgresql://x@h/db"


def test_the_dev_stack_hands_airflow_the_ledger_as_a_connection():
    from airflow.sdk import Connection

    from tidemark.devstack.airflow_stack import ledger_connection

    conn = Connection.from_json(
        ledger_connection("postgresql://tm:pw%40x@127.0.0.1:5999/led?sslmode=disable"),
        conn_id="tidemark_ledger",
    )
    assert (conn.host, conn.port, conn.login, conn.password, conn.schema) == (
        "127.0.0.1",
        5999,
        "tm",
        "pw@x",
        "led",
    )
    assert conn.extra_dejson == {"sslmode": "disable"}


# -- failures that must not retry --------------------------------------------------------------


@pytest.mark.parametrize(
    "code,retried",
    [(2, False), (5, False), (1, True), (3, True), (4, True), (143, True), (70, True)],
)
def test_only_bad_input_and_halted_fail_without_retry(code, retried):
    from tidemark.airflow.dags import NO_RETRY_EXIT_CODES, job_exit_code

    assert (code in NO_RETRY_EXIT_CODES) is not retried
    # what the provider raises (tests/test_dags.py runs it against a stand-in spark-submit)
    msg = f"Cannot execute: spark-submit ... Error code is: {code}.\ntidemark: error: ..."
    assert job_exit_code(RuntimeError(msg)) == code
    assert job_exit_code(RuntimeError("spark-submit not found")) is None


def test_a_run_of_a_halted_pipeline_exits_5(env):
    import psycopg

    from tidemark.core.errors import Halted
    from tidemark.ledger import state

    env.pipeline()
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        state.ensure_pipeline(c, "orders", {})
        c.execute("UPDATE tidemark.pipelines SET halted_reason = 'test' WHERE name = 'orders'")
        with pytest.raises(Halted) as exc:
            claim_orders(c, owner="t", plan=None)
    assert exc.value.exit_code == 5 and "pipeline orders is halted: test" in str(exc.value)


# -- lag ---------------------------------------------------------------------------------------


def test_lag_is_measured_per_sink_and_partition_and_alerts_past_the_threshold(env):
    import psycopg

    from tidemark import config
    from tidemark.airflow.health import lag_problems
    from tidemark.driver import lag

    old = datetime(2026, 1, 1, tzinfo=UTC)
    env.append(
        [
            (0, b"1", b"{}", None, old),
            (0, b"2", b"{}", None, old + timedelta(hours=1)),
            (1, b"3", b"{}", None, None),
        ]
    )
    env.append_orders(range(10, 16))  # 3 more per partition
    p = config.load(env.pipeline(alerts={"lag_max_records": 4, "lag_max_minutes": 60}))
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        c.execute("INSERT INTO tidemark.pipelines (name, config) VALUES ('orders', '{}')")
        c.execute("""INSERT INTO tidemark.checkpoints (pipeline, sink, partition, next_offset)
                     VALUES ('orders', 'main', 1, 3)""")
        lags = {(x.sink, x.partition): x for x in lag.measure(c, p)}
    assert {k: (x.checkpoint, x.head, x.records) for k, x in lags.items()} == {
        ("main", 0): (0, 5, 5),
        ("main", 1): (3, 4, 1),
    }
    assert lags["main", 0].oldest == old
    now = old + timedelta(minutes=90)
    [prob] = lag_problems(p, list(lags.values()), now)
    assert prob.episode == "orders/main/0"
    assert prob.what == (
        "sink main partition 0 lags: 5 records behind the source (checkpoint "
        "0, source at 5; > 4); oldest undelivered record 90 min old (> 60)"
    )


def test_a_lag_episode_alerts_once_then_again_after_it_ended():
    from tidemark.airflow.health import Health, Problem, lag_episodes

    def health(*episodes, unmeasured=()):
        return Health(
            problems=[Problem(e.split("/")[0], "x", episode=e) for e in episodes]
            + [Problem("a", "DLQ")],
            unmeasured=set(unmeasured),
        )

    new, state = lag_episodes({}, health("a/s/0", "a/s/1"), "t1")
    assert new == {"a/s/0", "a/s/1"} and state == {"a/s/0": "t1", "a/s/1": "t1"}
    new, state = lag_episodes(state, health("a/s/0"), "t2")  # 1 ended, 0 goes on
    assert new == set() and state == {"a/s/0": "t1"}
    new, state = lag_episodes(state, health("a/s/0", "a/s/1"), "t3")  # 1 again: a new episode
    assert new == {"a/s/1"} and state == {"a/s/0": "t1", "a/s/1": "t3"}
    new, state = lag_episodes(state, health(unmeasured=["a"]), "t4")  # source down: kept
    assert new == set() and state == {"a/s/0": "t1", "a/s/1": "t3"}


# -- metrics -----------------------------------------------------------------------------------


@pytest.fixture
def statsd(monkeypatch):
    """A UDP StatsD listener on loopback, and Airflow's metrics layer pointed at it the way a
    task process sets it up (``[metrics]`` from the environment)."""
    from airflow.sdk.observability import stats
    from airflow.sdk.observability.metrics.stats_utils import get_stats_factory

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(10)
    for k, v in {
        "STATSD_ON": "True",
        "STATSD_HOST": "127.0.0.1",
        "STATSD_PORT": str(sock.getsockname()[1]),
        "STATSD_PREFIX": "airflow",
    }.items():
        monkeypatch.setenv(f"AIRFLOW__METRICS__{k}", v)
    stats.initialize(factory=get_stats_factory(), export_legacy_names=False)

    def lines(n: int) -> list[str]:
        got: list[str] = []
        while len(got) < n:
            got += sock.recv(65535).decode().splitlines()
        return got

    yield lines
    stats.initialize(factory=get_stats_factory(), export_legacy_names=False)
    sock.close()


def test_a_runs_numbers_go_to_statsd(statsd):
    from tidemark.airflow import metrics

    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    from tidemark.ledger.runs import SinkRun, StartedRun

    run = StartedRun(7, "run", t0, t0 + timedelta(seconds=12.5), None)
    sinks = [
        SinkRun.of(
            sink="main",
            state="committed",
            counts={"rows": 120, "dead": 3},
            timings={"write_seconds": 1.5, "claim_seconds": 0.25},
            error=None,
            schema_changes=[],
            ranges=[],
        ),
        SinkRun.of(
            sink="audit",
            state="dq_failed",
            counts={"rows": 0},
            timings={},
            error="gate",
            schema_changes=[],
            ranges=[],
        ),
    ]
    n = metrics.emit_run("orders", run, sinks)
    assert sorted(statsd(n)) == sorted(
        [
            "airflow.tidemark.sink_runs.orders.main.committed:1|c",
            "airflow.tidemark.records_delivered.orders.main:120|c",
            "airflow.tidemark.records_quarantined.orders.main:3|c",
            "airflow.tidemark.phase.orders.main.claim:250.000000|ms",
            "airflow.tidemark.phase.orders.main.write:1500.000000|ms",
            "airflow.tidemark.sink_runs.orders.audit.dq_failed:1|c",
            "airflow.tidemark.run_duration.orders:12500.000000|ms",
        ]
    )


def test_the_health_gauges_go_to_statsd(statsd):
    from tidemark.airflow import metrics
    from tidemark.driver.lag import Lag
    from tidemark.ledger.dlq import ERROR_CLASSES

    lags = {
        "orders": [
            Lag("main", 0, 10, 70, datetime.now(UTC) - timedelta(minutes=5)),
            Lag("main", 1, 40, 40, None),
        ]
    }
    n = metrics.emit_health(lags, 95.5, {"orders": {"decode": 4}}, ["orders"])
    got = {ln.rsplit(":", 1)[0]: ln.rsplit(":", 1)[1] for ln in statsd(n)}
    assert got["airflow.tidemark.checkpoint_lag.orders.main.0"] == "60|g"
    assert got["airflow.tidemark.checkpoint_lag.orders.main.1"] == "0|g"
    assert 299 < float(got["airflow.tidemark.oldest_undelivered_age.orders.main.0"][:-2]) < 400
    assert got["airflow.tidemark.oldest_undelivered_age.orders.main.1"] == "0.0|g"
    assert got["airflow.tidemark.prepared_oldest_age"] == "95.5|g"
    assert got["airflow.tidemark.dead_letters.orders.decode"] == "4|g"
    assert {k for k in got if ".dead_letters." in k} == {
        f"airflow.tidemark.dead_letters.orders.{c}" for c in ERROR_CLASSES
    }


def test_a_pipeline_config_is_stored_without_its_passwords(env):
    """The ledger keeps each pipeline's config (what ran); an inline DSN's password is not
    part of what it keeps."""
    import psycopg

    from tidemark.ledger import state

    config = {"sinks": [{"dsn": "postgresql://u:Ab/Secret9@h/db"}], "note": "password=Secret9"}
    with psycopg.connect(env.ledger_dsn, autocommit=True) as conn:
        state.ensure_pipeline(conn, "orders", config)
    (stored,) = env.ledger("SELECT config::text FROM tidemark.pipelines WHERE name = 'orders'")[0]
    assert "Secret9" not in stored and "postgresql://u:***@h/db" in stored


@pytest.mark.parametrize("raw", ["Ab%zzSecret9", "Ab Secret9", "Ab/Secret9", "Ab@Secret9"])
def test_the_recover_tasks_log_shows_no_raw_password(env, monkeypatch, capsys, raw):
    """The recover task's log (printed lines and the error the task fails with), which
    Airflow's Viewer role reads through the REST API: a sink DSN whose password is not
    URL-encoded shows none of it."""
    from tidemark.airflow import tasks
    from tidemark.core.errors import TidemarkError
    from tidemark.core.settings import get_settings

    port = env.sink_dsn.split("@", 1)[1].split("/", 1)[0]
    env.pipeline(sinks=[env.orders_sink(dsn="${TM_SINK_DSN}")])
    monkeypatch.setenv("TM_SINK_DSN", f"postgresql://tidemark:{raw}@{port}/warehouse")
    monkeypatch.delenv("AIRFLOW_CONN_TIDEMARK_LEDGER", raising=False)
    monkeypatch.setenv("TIDEMARK_LEDGER_DSN", env.ledger_dsn)
    get_settings.cache_clear()
    try:
        with pytest.raises(TidemarkError) as failed:
            tasks.recover(str(env.dir))
    finally:
        get_settings.cache_clear()
    logged = capsys.readouterr().out + str(failed.value)
    assert "does not parse" in logged and "Secret" not in logged, logged
