"""The commit protocol end to end in one process: real PostgreSQL, real Spark."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import psycopg
import pytest

from tests.conftest import claim_orders
from tests.invariants import assert_exactly_once
from tidemark.core.errors import TidemarkError
from tidemark.core.ranges import Range
from tidemark.core.sink_counts import SinkCounts
from tidemark.driver.run import Backfill
from tidemark.ledger import state
from tidemark.protocol.taskspec import TASK_PHASES


@pytest.mark.engines("local", "spark", "connect")
def test_run_delivers_once_then_only_what_is_new(env, engine):
    env.append_orders(range(200))
    env.pipeline()
    report = env.run(engine)
    assert report.ok, report.summary()
    assert report.records == 200
    assert report.sinks["main"].counts.rows == 200
    assert env.checkpoints() == {0: 100, 1: 100}
    assert env.q(env.sink_dsn, "SELECT count(*), count(DISTINCT id) FROM orders")[0] == (200, 200)
    assert env.prepared() == []
    st = env.ledger(
        "SELECT state::text FROM tidemark.run_sinks WHERE run_id = %s", (report.run_id,)
    )
    assert st == [("committed",)]
    metrics = dict(
        env.ledger(
            "SELECT name, value FROM tidemark.run_metrics WHERE run_id = %s", (report.run_id,)
        )
    )
    assert metrics["rows"] == 200 and metrics["records"] == 200
    assert metrics["write_seconds"] > 0 and "commit_seconds" in metrics
    # Where the time went, per phase of the tasks (task-seconds), in the run's metrics too.
    for phase in TASK_PHASES:
        assert metrics[f"task_{phase}_seconds"] >= 0, phase
        assert report.phases[f"task_{phase}_seconds"] == metrics[f"task_{phase}_seconds"]
    assert metrics["task_read_transform_seconds"] > 0 and metrics["task_copy_seconds"] > 0
    # The reader's own time, from its Python worker (tidemark/sources/read_clock.py); none
    # through Spark Connect, which has no accumulators (tidemark/driver/runners.py: ConnectRunner).
    if str(engine.engine) != "connect":
        assert metrics["task_read_seconds"] > 0 and metrics["task_decode_seconds"] > 0
    assert report.phases["task_read_seconds"] == metrics["task_read_seconds"]
    # A first delivery of new keys COPYs straight into the target: no staging merge.
    assert metrics["task_merge_seconds"] == 0
    # Every sink row carries partition, offset and run id.
    rows = env.q(
        env.sink_dsn,
        "SELECT id, _tm_partition, _tm_offset, _tm_run_id FROM orders WHERE id IN (0, 1, 7)",
    )
    assert sorted(rows) == [
        (0, 0, 0, report.run_id),
        (1, 1, 0, report.run_id),
        (7, 1, 3, report.run_id),
    ]

    again = env.run(engine)
    assert again.run_id is None and "up to date" in again.message

    env.append_orders(range(200, 230))
    third = env.run(engine)
    assert third.ok and third.records == 30
    assert env.checkpoints() == {0: 115, 1: 115}
    assert_exactly_once(env)


def test_each_sink_advances_on_its_own_and_reads_once_from_the_minimum(env, engine):
    env.append_orders(range(100))
    broken = {
        "name": "second",
        "dsn": env.cluster.dsn("no_such_database"),
        "table": "public.orders",
        "key": ["id"],
    }
    main = {"name": "main", "dsn": env.sink_dsn, "table": "public.orders", "key": ["id"]}
    env.pipeline(sinks=[main, broken])
    first = env.run(engine)
    assert first.sinks["main"].state == "committed"
    assert first.sinks["second"].state == "aborted"
    assert "no_such_database" in first.sinks["second"].error
    assert not first.ok
    # The aborted sink's run read the records too: the ledger and `status` say how many.
    assert first.records == 100
    assert env.ledger("SELECT counts FROM tidemark.run_sinks WHERE sink = 'second'") == [
        ({"records": 100},)
    ]
    from tidemark.ledger import status

    with psycopg.connect(env.ledger_dsn) as c:
        text = status.render(status.pipeline_status(c, "orders"))
    line = next(ln for ln in text.splitlines() if " second " in ln and "aborted" in ln)
    assert line.split()[4:6] == ["100", "read"], line
    assert env.checkpoints(sink="main") == {0: 50, 1: 50}
    assert env.checkpoints(sink="second") == {0: 0, 1: 0}

    # The second sink is repaired; more data arrives. One read from the minimum (0), each
    # sink gets only what it still lacks.
    env.append_orders(range(100, 120))
    env.pipeline(sinks=[main, {**broken, "dsn": env.sink2_dsn}])
    second = env.run(engine)
    assert second.ok, second.summary()
    assert second.records == 120
    assert second.sinks["main"].counts.rows == 20
    assert second.sinks["second"].counts.rows == 120
    assert env.checkpoints(sink="main") == env.checkpoints(sink="second") == {0: 60, 1: 60}
    runs = env.q(env.sink_dsn, "SELECT _tm_run_id, count(*) FROM orders GROUP BY 1 ORDER BY 1")
    assert runs == [(first.run_id, 100), (second.run_id, 20)]
    assert_exactly_once(env, sinks={"main": env.sink_dsn, "second": env.sink2_dsn})


POISON = {
    "invalid JSON": b'{"id": 1, "name": ',
    "invalid UTF-8": b'\xff\xfe{"id": 2}\x80',
    "NUL byte": b'{"id": 3, "name": "a\x00b"}',
    "5 MB": b'{"id": 4, "name": "' + b"x" * (5 * 1024 * 1024) + b'", "amount": "lots"}',
    "wrong type": b'{"id": "five", "name": "n"}',
    "not an object": b"[1, 2, 3]",
    "empty": b"",
}


@pytest.mark.engines("local", "spark", "connect")
def test_poison_records_land_in_the_dlq_byte_for_byte_and_the_run_advances(env, engine):
    env.append_orders(range(10, 20), partitions=1)
    poison = list(POISON.items())
    env.append(
        [(0, name.encode(), payload, json.dumps({"case": name}), None) for name, payload in poison]
    )
    # A NUL inside a JSON string decodes fine but PostgreSQL text refuses it: a sink_write.
    env.append([(0, b"nul-escape", b'{"id": 99, "name": "a\\u0000b"}', None, None)])
    env.pipeline()
    report = env.run(engine)
    assert report.ok, report.summary()
    assert report.sinks["main"].counts.rows == 10
    # Every letter names the sink it applies to: the only sink here.
    assert report.sinks["main"].counts.dead == len(POISON) + 1
    assert env.checkpoints() == {0: 10 + len(POISON) + 1}

    dlq = {
        r[0]: r[1:]
        for r in env.ledger(
            "SELECT convert_from(key, 'UTF8'), payload, error_class::text, reason, sink, attempts, "
            "headers FROM tidemark.dlq"
        )
    }
    assert set(dlq) == {*POISON, "nul-escape"}
    for name, payload in POISON.items():
        stored, cls, reason, sink, attempts, headers = dlq[name]
        assert bytes(stored) == payload, name
        assert cls == "decode" and sink == "main" and attempts == 1
        assert headers == {"case": name}
        assert 0 < len(reason) <= 200
    assert "UTF-8" in dlq["invalid UTF-8"][2]
    assert dlq["wrong type"][2] == "field id: cannot read 'five' as int"
    # Cut short is not "not an object": the reason says which, and where (docs/dlq.md).
    assert dlq["invalid JSON"][2] == "payload is not valid JSON: unexpected end at byte 18"
    assert dlq["not an object"][2] == "payload is not a JSON object (an array)"
    assert dlq["nul-escape"][1:4] == ("sink_write", dlq["nul-escape"][2], "main")
    assert "0x00" in dlq["nul-escape"][2]
    assert_exactly_once(env)


def test_a_decoded_records_bytes_stay_out_of_the_batch_and_its_letter_reads_them_again(env, spark):
    """The reader leaves out the payload, key, headers and time of a record it decoded;
    whatever quarantines that record later (transform, row expectation, sink write, a
    whole-batch gate) reads them again from the source, so the letter holds the record as
    the source had it, byte for byte."""
    from tidemark import sources
    from tidemark.core.ranges import Range

    at = datetime(2026, 3, 1, 12, 30, tzinfo=UTC)
    env.append_orders(range(20))
    env.append(
        [
            (0, b"transform", b'{"id": 100, "name": "drop-me"}', '{"h": "t"}', at),
            (0, b"validation", b'{"id": 101, "name": "v", "amount": 5000.0}', '{"h": 1}', at),
            (0, b"sink_write", b'{"id": 102, "name": "a\\u0000b"}', '{"h": [1]}', at),
            (1, b"decode", b'{"id": "one hundred and three"}', '{"h": "d"}', at),
        ]
    )
    select = {
        "id": "id",
        "name": "nullif(name, 'drop-me')",
        "amount": "amount",
        "version": "version",
    }
    env.pipeline(
        transform={"select": select, "required": ["id", "name"]},
        quality={
            "rows": [
                {"expect_column_values_to_be_between": {"column": "amount", "max_value": 1000}}
            ]
        },
    )
    pipeline = env.load()
    # What the batch carries: partition 0's records Arrow decoded have no bytes there.
    # (Partition 1's bytes stay: Arrow gives up on the chunk of 512 that holds "decode".)
    # Headers and times are not read at all: every letter reads them again.
    ranges = [Range(0, 0, 13), Range(1, 0, 11)]
    for column in sources.LEFT_OUT:
        kept = (
            sources.dataframe(spark, pipeline, ranges)
            .where(f"{column} IS NOT NULL")
            .select("_tm_partition")
            .distinct()
            .collect()
        )
        kept_by = [] if column in ("_tm_headers", "_tm_ts") else [1]
        assert [r[0] for r in kept] == kept_by, column

    report = env.run(spark)
    assert report.ok, report.summary()
    same = (
        "SELECT convert_from(d.key, 'UTF8'), d.error_class::text, d.payload = s.payload, "
        "d.headers = s.headers AND d.source_headers = convert_to(s.headers::text, 'UTF8'), "
        "d.source_ts = s.ts FROM tidemark.dlq d JOIN src.log s ON (s.partition, s.offset) = "
        "(d.source_partition, d.source_offset) ORDER BY 1"
    )
    assert env.ledger(same) == [
        ("decode", "decode", True, True, True),
        ("sink_write", "sink_write", True, True, True),
        ("transform", "transform", True, True, True),
        ("validation", "validation", True, True, True),
    ]

    # A whole batch quarantined by its gate: every letter reads its bytes again.
    env.append_orders(range(200, 230))
    env.pipeline(
        quality={
            "batch": [{"expect_table_row_count_to_be_between": {"max_value": 5}}],
            "on_gate_failure": "quarantine_batch",
        }
    )
    report = env.run(spark)
    assert report.ok and report.sinks["main"].counts.dead == 30, report.summary()
    assert env.ledger(
        "SELECT count(*), count(*) FILTER (WHERE d.payload = s.payload) FROM tidemark.dlq d "
        "JOIN src.log s ON (s.partition, s.offset) = (d.source_partition, d.source_offset) "
        "WHERE d.error_class = 'dq_gate'"
    ) == [(30, 30)]
    assert_exactly_once(env)

    # A record the source does not hold (deleted since): the task fails, loudly.
    source = sources.payload_source(pipeline)
    with (
        sources.PayloadReader(source) as reader,
        pytest.raises(
            TidemarkError, match=r"partition 1: range \[5, 1000\) ended at 26: rows missing"
        ),
    ):
        reader.records({1: [5, 999]})
    stored = env.q(
        env.ledger_dsn,
        'SELECT "partition", "offset", key, payload, headers::text, ts FROM src.log '
        'WHERE ("partition", "offset") IN ((1, 3), (1, 5), (0, 2))',
    )
    with sources.PayloadReader(source) as reader:  # one connection, read twice
        got = reader.records({1: [5, 3]}) | reader.records({0: [2]})
    assert got == {(p, o): dict(zip(sources.LEFT_OUT, rest, strict=True)) for p, o, *rest in stored}

    # Whatever may read them keeps them in the batch: a setting that names one of them.
    for column in sources.LEFT_OUT:
        env.pipeline(transform={"select": {**select, "meta": f"{column} IS NULL"}})
        assert sources.payload_source(env.load()) is None, column


def test_a_transform_naming_the_source_fields_as_spark_resolves_them_gets_their_values(env, engine):
    """Issue 45 case 8: Spark resolves names case-insensitively, but the reader looked for
    ``_tm_ts`` (...) case-sensitively, left them out, and the sink got NULLs, exit 0."""
    from tidemark import sources

    t0 = datetime(2026, 5, 1, 8, 30, tzinfo=UTC)
    docs = [{"id": i, "name": f"o{i}", "amount": 1.5, "version": 1} for i in range(4)]
    env.append(
        [
            (i % 2, f"k{i}".encode(), json.dumps(d).encode(), json.dumps({"h": i}), t0.replace(
                minute=i))
            for i, d in enumerate(docs)
        ]
    )  # fmt: skip
    odd = {"event_time": "_TM_TS", "k": "`_Tm_Key`", "h": "`_tm_HEADERS`"}
    env.pipeline(transform={"select": {"id": "id", "name": "name", **odd}, "required": ["id"]})
    assert sources.payload_source(env.load()) is None
    report = env.run(engine)
    assert report.ok, report.summary()
    rows = env.q(env.sink_dsn, "SELECT id, event_time, k, h FROM orders ORDER BY id")
    assert rows == [(i, t0.replace(minute=i), f"k{i}".encode(), f'{{"h": {i}}}') for i in range(4)]
    assert_exactly_once(env)
    # A star takes every column, these too: it keeps them in the batch (a product does not).
    for expr, kept in [("to_json(struct(*))", True), ("hash(t.*)", True), ("id * 2", False)]:
        env.pipeline(transform={"select": {"id": "id", "x": expr}})
        assert (sources.payload_source(env.load()) is None) is kept, expr


def test_a_python_transform_naming_tidemark_columns_in_another_case_is_read_as_spark_does(
    env, spark, tmp_path, monkeypatch
):
    """`_TM_ERROR` is `_tm_error` to Spark: the rows a Python transform rejects under that
    name go to the DLQ with its reason (they reached the sink, its rejects an output column);
    a decode field `_TM_TS` would shadow `_tm_ts` and is refused."""
    from tidemark import config
    from tidemark.core.errors import ConfigError

    module = tmp_path / "upper_reject.py"
    module.write_text(
        "from pyspark.sql import functions as F\n\n\n"
        "def fn(df):\n"
        "    odd = F.when(F.col('id') % 2 == 1, F.lit('odd id'))\n"
        "    return df.withColumn('_TM_ERROR', odd).withColumnRenamed('_tm_offset', '_TM_OFFSET')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env.append_orders(range(6), partitions=1)
    env.pipeline(transform={"python": "upper_reject:fn"})
    report = env.run(spark)
    assert report.ok, report.summary()
    assert env.q(env.sink_dsn, "SELECT id FROM orders ORDER BY id") == [(0,), (2,), (4,)]
    assert env.ledger(
        "SELECT source_offset, error_class::text, reason FROM tidemark.dlq ORDER BY 1"
    ) == [(o, "transform", "odd id") for o in (1, 3, 5)]
    assert_exactly_once(env)

    text = env.pipeline().read_text().replace("version: int", "version: int\n    _TM_TS: string")
    with pytest.raises(ConfigError, match="bad field name '_TM_TS'"):
        config.parse(text, "orders.yaml")


def test_backfill_is_idempotent_and_never_moves_checkpoints_back(env, spark):
    env.append_orders(range(100))
    env.pipeline()
    first = env.run(spark)
    assert first.ok
    cols = "id, name, amount, version, _tm_partition, _tm_offset"
    before = env.q(env.sink_dsn, f"SELECT {cols} FROM orders ORDER BY id")
    cps = env.checkpoints()

    report = env.run(spark, mode=Backfill([Range(0, 10, 40)]))
    assert report.ok, report.summary()
    assert report.records == 30
    assert env.q(env.sink_dsn, f"SELECT {cols} FROM orders ORDER BY id") == before
    assert env.checkpoints() == cps
    assert env.ledger("SELECT mode FROM tidemark.runs WHERE run_id = %s", (report.run_id,)) == [
        ("backfill",)
    ]
    # Twice is the same as once.
    assert env.run(spark, mode=Backfill([Range(0, 10, 40)])).ok
    assert env.q(env.sink_dsn, f"SELECT {cols} FROM orders ORDER BY id") == before

    with pytest.raises(TidemarkError, match="goes past the checkpoint"):
        env.run(spark, mode=Backfill([Range(0, 40, 60)]))
    assert env.prepared() == []
    assert_exactly_once(env)


def test_an_older_offset_never_overwrites_a_newer_version_of_a_key(env, spark):
    env.append_orders([1, 3, 5], partitions=1, version=1)  # offsets 0..2
    env.append_orders([3], partitions=1, version=2)  # offset 3
    env.append_orders([3], partitions=1, version=3)  # offset 4, same batch
    env.pipeline()
    assert env.run(spark).ok
    assert env.q(env.sink_dsn, "SELECT version, _tm_offset FROM orders WHERE id = 3") == [(3, 4)]

    # Re-delivering the old versions (offsets 0..3) leaves the newest in place.
    assert env.run(spark, mode=Backfill([Range(0, 0, 4)])).ok
    assert env.q(env.sink_dsn, "SELECT version, _tm_offset FROM orders WHERE id = 3") == [(3, 4)]
    assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(3,)]


def test_rerunning_a_range_counts_attempts_on_one_dead_letter(env, spark):
    env.append([(0, b"bad", b"not json", None, None)])
    env.append_orders([2, 4], partitions=1)
    env.pipeline()
    assert env.run(spark).ok
    assert env.run(spark, mode=Backfill([Range(0, 0, 3)])).ok
    rows = env.ledger("SELECT source_offset, attempts, status::text FROM tidemark.dlq")
    assert rows == [(0, 2, "quarantined")]


def test_state_machine_step_by_step(env):
    """Each transition is one ledger transaction and refuses to run from the wrong state."""
    import psycopg

    from tidemark.core.participants import Participant, Target

    env.pipeline()
    with psycopg.connect(env.ledger_dsn, autocommit=True) as conn:
        claim = claim_orders(conn)
        rid = claim.run_id

        def st():
            return conn.execute(
                "SELECT state::text FROM tidemark.run_sinks WHERE run_id = %s", (rid,)
            ).fetchone()[0]

        assert st() == "planned" and claim.sinks["main"].epoch == 1
        with pytest.raises(state.IllegalTransition):
            state.decide(conn, "orders", rid, "main", [])
        state.start_writing(conn, "orders", rid, "main")
        assert st() == "writing"
        state.mark_prepared(conn, "orders", rid, "main", SinkCounts(records=5, rows=5))
        assert st() == "prepared"
        stored = conn.execute("SELECT counts FROM tidemark.run_sinks WHERE run_id = %s", (rid,))
        assert SinkCounts.from_json(stored.fetchone()[0]) == SinkCounts(records=5, rows=5)
        state.decide(conn, "orders", rid, "main", [Participant("tm:x", Target.ledger(), 0, 5)])
        assert st() == "committing"
        assert not state.abort(conn, "orders", rid, "main", "too late")
        assert st() == "committing"
        state.advance(conn, "orders", rid, "main")
        assert st() == "committed"
        cp = conn.execute("SELECT next_offset FROM tidemark.checkpoints").fetchall()
        assert cp == [(5,)]
        lease = conn.execute("SELECT run_id, epoch FROM tidemark.leases").fetchone()
        assert lease == (None, 1)
        with pytest.raises(state.IllegalTransition):
            state.advance(conn, "orders", rid, "main")


def test_a_run_that_lost_its_lease_can_never_reach_the_decision(env):
    import psycopg

    from tidemark.core.errors import Fenced

    with (
        psycopg.connect(env.ledger_dsn, autocommit=True) as a,
        psycopg.connect(env.ledger_dsn, autocommit=True) as b,
    ):
        old = claim_orders(a, owner="a:1")
        state.start_writing(a, "orders", old.run_id, "main")
        state.mark_prepared(a, "orders", old.run_id, "main", SinkCounts())
        with pytest.raises(state.LeaseHeld):
            claim_orders(b, owner="b:2")
        # The lease expires (a paused or partitioned owner): another run takes over.
        a.execute("UPDATE tidemark.leases SET expires_at = now() - interval '1 second'")
        new = claim_orders(b, owner="b:2")
        assert new.sinks["main"].epoch == old.sinks["main"].epoch + 1
        with pytest.raises(Fenced):
            state.decide(a, "orders", old.run_id, "main", [])
        assert (
            a.execute(
                "SELECT state::text FROM tidemark.run_sinks WHERE run_id = %s", (old.run_id,)
            ).fetchone()[0]
            == "prepared"
        )
    # With the old owner's session gone, recovery aborts the fenced run.
    rep = env.recover()
    assert (old.run_id, "main") in rep.aborted


def test_a_failure_before_the_decision_rolls_back_at_once_and_frees_the_lease(env, engine):
    env.append_orders(range(20))
    env.pipeline(transform={"select": {"id": "id", "name": "no_such_column"}})
    with pytest.raises(TidemarkError, match="invalid expression"):
        env.run(engine)
    assert env.ledger("SELECT state::text, error FROM tidemark.run_sinks")[0][0] == "aborted"
    assert env.ledger("SELECT run_id FROM tidemark.leases") == [(None,)]
    assert env.prepared() == []


def test_a_lagging_sink_catches_up_without_the_read_spanning_the_gap(env, engine):
    env.append_orders(range(40), partitions=1)
    main = {"name": "main", "dsn": env.sink_dsn, "table": "public.orders", "key": ["id"]}
    env.pipeline(sinks=[main], limits={"max_records_per_partition": 30})
    assert env.run(engine).ok and env.run(engine).ok
    assert env.checkpoints(sink="main") == {0: 40}
    late = {"name": "late", "dsn": env.sink2_dsn, "table": "public.orders", "key": ["id"]}
    env.pipeline(sinks=[main, late], limits={"max_records_per_partition": 30})
    first = env.run(engine)
    assert first.ok and first.records == 30  # [0, 30): no more than the limit
    assert "main" not in first.sinks  # nothing for it: not even claimed
    assert first.sinks["late"].counts.rows == 30
    second = env.run(engine)
    assert second.records == 10 and second.sinks["late"].counts.rows == 10
    assert env.checkpoints(sink="late") == env.checkpoints(sink="main") == {0: 40}
    assert env.run(engine).run_id is None
