"""The Pipelines page's ledger reads and the lag samples the maintenance DAG writes
(tidemark/ledger/history.py, ledger V018), on a real PostgreSQL: no Spark, no Airflow."""

from __future__ import annotations

import psycopg

from bench.pipelines_bench import seed
from tidemark.ledger import history
from tidemark.ledger.history import Sample, Window


def _conn(env) -> psycopg.Connection:
    return psycopg.connect(env.ledger_dsn, autocommit=True)


def test_a_measurement_is_kept_every_ten_minutes_and_for_the_runs_retention(env):
    with _conn(env) as c:
        c.execute("INSERT INTO tidemark.pipelines (name) VALUES ('orders')")
        one = [Sample("main", 0, 10, 25), Sample("main", 1, 7, 7)]
        assert history.record_lag(c, "orders", one, keep_days=90) == 2
        # The maintenance DAG measures every 5 minutes: the next one is not kept.
        assert history.record_lag(c, "orders", one, keep_days=90) == 0
        assert history.record_lag(c, "orders", one, keep_days=90, every_seconds=0) == 2
        ats = c.execute("SELECT DISTINCT at FROM tidemark.lag_samples").fetchall()
        assert len(ats) == 2  # one instant per measurement
        # Older than the runs' retention: dropped at the next measurement.
        c.execute(
            "INSERT INTO tidemark.lag_samples (pipeline, sink, partition, at, checkpoint, head) "
            "VALUES ('orders', 'main', 0, now() - interval '91 days', 0, 5), "
            "('other', 'main', 0, now() - interval '91 days', 0, 5)"
        )
        history.record_lag(c, "orders", [], keep_days=90)
        old = "SELECT pipeline FROM tidemark.lag_samples WHERE at < now() - interval '90 days'"
        assert c.execute(old).fetchall() == [("other",)]
        assert history.prune(c, 90) == 1
        st = history.states(c, ["orders"])["orders"]
        assert st.sinks == []  # no checkpoint: nothing to show lag against
        assert st.lag_at is not None


def test_the_page_reads_on_seeded_history(env):
    with _conn(env) as c:
        rows = seed(c, pipelines=3, days=3, letters_per_run=2)
        assert rows["runs"] == 3 * 72
        names = history.known(c)
        assert names == ["p00", "p01", "p02"]
        w = Window.of(7)
        lag = history.lag_totals(c, names, w)
        assert set(lag) == set(names)
        # Per sink, four partitions of up to 300 + 30 records behind each.
        assert 0 < max(v for _, v in lag["p00"]) <= 4 * 330
        rates = history.run_rates(c, names, w)
        assert len(rates["p01"]) == 72  # hourly buckets, one run each
        for _, rate, seconds in rates["p01"]:
            assert 20 <= seconds <= 24 and 1000 / 24 <= rate <= 1600 / 20
        letters = history.letters_created(c, names, w)
        assert sum(n for _, _, n in letters["p02"]) == 72 * 2
        assert {cls for _, cls, _ in letters["p02"]} == {
            "decode",
            "transform",
            "validation",
            "dq_gate",
            "sink_write",
        }
        runs = history.runs(c, "p00", Window.of(1))
        assert {r.sink for r in runs} == {"main", "archive"}
        assert all(r.state == "committed" and (r.records or 0) >= 1000 for r in runs)
        parts = history.lag_by_partition(c, "p00", Window.of(1))
        assert {(s, p) for s, p, _, _ in parts} == {
            (s, p) for s in ("main", "archive") for p in range(4)
        }
        # A window is a window: nothing older than it.
        day = history.run_rates(c, ["p00"], Window.of(1))["p00"]
        assert 23 <= len(day) <= 25


def test_state_now_halted_in_doubt_last_run_and_where_each_sink_began(env):
    with _conn(env) as c:
        seed(c, pipelines=2, days=1)
        c.execute("UPDATE tidemark.pipelines SET halted_reason = 'a test', halted_at = now()")
        c.execute("UPDATE tidemark.checkpoints SET start_offset = 42 WHERE partition = 3")
        run = c.execute(
            "INSERT INTO tidemark.runs (pipeline, mode, owner) VALUES ('p01', 'backfill', "
            "'gone:1') RETURNING run_id"
        ).fetchone()[0]
        c.execute(
            "INSERT INTO tidemark.run_sinks (run_id, sink, state, lease_epoch) VALUES "
            "(%s, 'main', 'committing', 1), (%s, 'archive', 'writing', 1)",
            (run, run),
        )
        history.record_lag(c, "p01", [Sample("main", 0, 7200, 7250)], keep_days=90, every_seconds=0)
        st = history.states(c, ["p00", "p01", "nope"])
        assert set(st) == {"p00", "p01"}
        p1 = st["p01"]
        assert p1.halted_reason == "a test" and p1.halted_at is not None
        # Decided, and open with its driver gone: both in doubt.
        assert [(d.sink, d.state, d.alive) for d in p1.in_doubt] == [
            ("archive", "writing", False),
            ("main", "committing", False),
        ]
        assert p1.last_run is not None
        assert p1.last_run.run_id == run and p1.last_run.mode == "backfill"
        assert {s.sink: s.state for s in p1.last_run.sinks} == {
            "main": "committing",
            "archive": "writing",
        }
        main = next(s for s in p1.sinks if s.sink == "main")
        assert [p.start_offset for p in main.partitions] == [0, 0, 0, 42]
        assert main.partitions[0].lag == 50 and main.partitions[0].head == 7250
        assert main.partitions[1].lag is None  # not in the newest measurement
        assert st["p00"].in_doubt == []


def test_past_a_week_the_measurement_most_behind_of_each_hour_is_kept(env):
    with _conn(env) as c:
        hour = "date_trunc('hour', now() - interval '7 days 12 hours')"
        c.execute(
            "INSERT INTO tidemark.lag_samples (pipeline, sink, partition, at, checkpoint, head) "
            f"SELECT 'orders', s, 0, {hour} + make_interval(mins => m), 0, m "
            "FROM unnest(ARRAY['main', 'archive']) s, unnest(ARRAY[5, 15, 25, 65, 75]) m"
        )
        # younger than a week: all kept
        c.execute(
            "INSERT INTO tidemark.lag_samples (pipeline, sink, partition, at, checkpoint, head) "
            "SELECT 'orders', 'main', 0, now() - make_interval(mins => m), 0, m "
            "FROM unnest(ARRAY[20, 30, 40]) m"
        )
        history.record_lag(c, "orders", [], keep_days=90)
        kept = c.execute(
            "SELECT sink, head FROM tidemark.lag_samples WHERE at < now() - interval '1 day' "
            "ORDER BY 1, 2"
        ).fetchall()
        # The measurement most behind of each hour (head - checkpoint: the minute here).
        assert kept == [("archive", 25), ("archive", 75), ("main", 25), ("main", 75)]
        recent = "SELECT count(*) FROM tidemark.lag_samples WHERE at > now() - interval '1 day'"
        assert c.execute(recent).fetchone()[0] == 3
