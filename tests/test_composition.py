"""Features together (docs/design.md: "Which sinks a verdict applies to", "Re-delivery", "Task
accounting"): per-sink runs at different checkpoints, failing gates, backfill over dead
letters, discard and redrive, key versions, NULL keys, transforms that lose records. Real
PostgreSQL, Spark and Great Expectations."""

from __future__ import annotations

import json

import psycopg
import pytest

from tests.conftest import order_record
from tests.invariants import assert_exactly_once
from tidemark.core.errors import TidemarkError
from tidemark.core.ranges import Range
from tidemark.driver.run import Backfill
from tidemark.ledger import dlq

ROWS = "expect_column_values_to_be_between"


def two_sinks(env) -> list[dict]:
    return [
        {"name": "a", "dsn": env.sink_dsn, "table": "public.orders", "key": ["id"]},
        {"name": "b", "dsn": env.sink2_dsn, "table": "public.orders", "key": ["id"]},
    ]


def ddl(dsn: str, statement: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(statement)


def both(env) -> dict[str, str]:
    return {"a": env.sink_dsn, "b": env.sink2_dsn}


def letters(env, where: str = "true", params=()) -> list[tuple]:
    return env.ledger(
        f"SELECT sink, source_partition, source_offset, error_class::text, "
        f"status::text, attempts FROM tidemark.dlq WHERE {where} "
        f"ORDER BY sink, source_partition, source_offset",
        params,
    )


def ids(env, dsn: str) -> list[int]:
    return [i for (i,) in env.q(dsn, "SELECT id FROM orders ORDER BY id")]


def test_a_lagging_sinks_failed_gate_quarantines_only_its_own_range(env, spark):
    """The first-wave bug: sink a delivered alone, then sink b caught up with a failing gate
    under quarantine_batch, and a's records landed in a's DLQ too."""
    env.append_orders(range(80))  # 40 per partition
    gate = {"expect_table_row_count_to_be_between": {"max_value": 30}}
    quality = {"batch": [gate], "on_gate_failure": "quarantine_batch"}
    env.pipeline(sinks=two_sinks(env), quality=quality, limits={"max_records_per_partition": 10})
    first = env.run(spark, sink_names=["a"])
    assert first.ok and first.sinks["a"].counts.rows == 20, first.summary()

    env.pipeline(sinks=two_sinks(env), quality=quality, limits={"max_records_per_partition": 40})
    second = env.run(spark, sink_names=["b"])  # 80 records: the gate fails
    assert second.ok and second.sinks["b"].counts.dead == 80, second.summary()
    assert letters(env, "sink = 'a'") == []
    assert {r[3] for r in letters(env, "sink = 'b'")} == {"dq_gate"}
    assert len(ids(env, env.sink_dsn)) == 20 and ids(env, env.sink2_dsn) == []
    assert_exactly_once(env, sinks=both(env))

    # Sink a catches up over records b has (in its DLQ): its own range [10, 40) only.
    third = env.run(spark)
    assert list(third.sinks) == ["a"] and third.sinks["a"].counts.dead == 60, third.summary()
    assert len(letters(env, "sink = 'a'")) == 60
    assert len(ids(env, env.sink_dsn)) == 20
    assert env.checkpoints(sink="a") == env.checkpoints(sink="b") == {0: 40, 1: 40}
    assert_exactly_once(env, sinks=both(env))


def test_a_decode_verdict_binds_only_the_sinks_whose_range_holds_the_record(env, engine):
    env.append_orders(range(10), partitions=1)
    env.append([(0, b"poison", b"{not json", None, None)])  # offset 10
    env.pipeline(sinks=two_sinks(env))
    assert env.run(engine, sink_names=["a"]).ok
    assert letters(env) == [("a", 0, 10, "decode", "quarantined", 1)]
    env.append_orders(range(10, 15), partitions=1)
    both_run = env.run(engine)  # b from 0 (gets the poison for itself), a from 11
    assert both_run.ok, both_run.summary()
    assert both_run.sinks["a"].counts.rows == 5 and both_run.sinks["b"].counts.rows == 15
    assert letters(env) == [
        ("a", 0, 10, "decode", "quarantined", 1),
        ("b", 0, 10, "decode", "quarantined", 1),
    ]
    assert_exactly_once(env, sinks=both(env))


def test_a_backfill_leaves_the_sink_as_one_delivery_with_the_current_pipeline_would(env, spark):
    """Re-delivery: what now fails leaves the sink for the DLQ, what now passes leaves the DLQ
    for the sink, in one two-phase commit; re-quarantined letters are live again, except a
    discarded one, whose discard stands while its record fails."""
    env.append_orders(range(40), partitions=1)  # amount = id * 1.25
    env.pipeline(quality={"rows": [{ROWS: {"column": "amount", "max_value": 25}}]})
    assert env.run(spark).ok
    assert ids(env, env.sink_dsn) == list(range(21))  # 21 .. 39 quarantined
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        (last,) = c.execute("SELECT id FROM tidemark.dlq WHERE source_offset = 39").fetchone()
        assert dlq.discard(c, [last], "not worth it", "dora").changed == [last]

    # The pipeline changes: ids 0 .. 3 now fail (amount < 5), ids 21 .. 32 now pass.
    env.pipeline(quality={"rows": [{ROWS: {"column": "amount", "min_value": 5, "max_value": 40}}]})
    report = env.run(spark, mode=Backfill([Range(0, 0, 40)]), by="erin")
    assert report.ok, report.summary()
    out = report.sinks["main"]
    # Every row of the range goes first (21: ids 0 .. 20), then the range is placed again.
    assert (out.counts.rows, out.counts.removed, out.counts.resolved, out.counts.dead) == (
        29,
        21,
        12,
        4 + 7,
    )
    assert ids(env, env.sink_dsn) == list(range(4, 33))
    by_offset = {r[2]: r for r in letters(env)}
    assert [o for o, r in by_offset.items() if r[4] == "quarantined"] == [
        0,
        1,
        2,
        3,
        *range(33, 39),
    ]
    assert {by_offset[o][4] for o in range(21, 33)} == {"redriven"}
    # The discarded letter failed again: its discard stands, its history grows.
    status, attempts, who, note = env.ledger(
        "SELECT status::text, attempts, resolved_by, note FROM tidemark.dlq WHERE id = %s", (last,)
    )[0]
    assert (status, attempts, who, note) == ("discarded", 2, "dora", "not worth it")
    resolved = env.ledger(
        "SELECT DISTINCT resolved_by, note FROM tidemark.dlq WHERE status = 'redriven'"
    )
    assert resolved == [("erin", f"delivered again by backfill run {report.run_id}")]
    assert env.checkpoints() == {0: 40}
    assert_exactly_once(env)

    # Back to the first check: the 12 redriven letters are quarantined again, their rows gone.
    env.pipeline(quality={"rows": [{ROWS: {"column": "amount", "max_value": 25}}]})
    again = env.run(spark, mode=Backfill([Range(0, 0, 40)]))
    assert again.ok and again.sinks["main"].counts.removed == 29, again.summary()
    assert again.sinks["main"].counts.resolved == 4  # ids 0 .. 3 pass again
    assert ids(env, env.sink_dsn) == list(range(21))
    status = {r[2]: r[4] for r in letters(env)}
    assert status == {
        **dict.fromkeys(range(4), "redriven"),
        **dict.fromkeys(range(21, 39), "quarantined"),
        39: "discarded",
    }
    assert_exactly_once(env)

    # A redrive takes quarantined letters only: the discarded one is skipped ...
    env.pipeline(quality={"rows": [{ROWS: {"column": "amount", "max_value": 100}}]})
    rep = env.redrive(spark, ids=[last], by="fay")
    assert rep.redrive["skipped"] == [last], rep.summary()
    # ... and a backfill of its range places it, now that it passes: its letter resolved.
    rep = env.run(spark, mode=Backfill([Range(0, 39, 40)]), by="fay")
    assert rep.ok and rep.sinks["main"].counts.resolved == 1, rep.summary()
    assert 39 in ids(env, env.sink_dsn)
    assert letters(env, "id = %s", (last,))[0][4] == "redriven"
    assert_exactly_once(env)


def test_a_backfill_that_removes_a_keys_row_places_its_older_versions_again(env, spark):
    """Re-delivery removes the row of a record that now fails. The versions of its key that
    row superseded, inside the range or outside it, were placed only by that row: the key falls
    back to its newest version that passes now (and a newer one that fails is quarantined), in
    the same two-phase commit. The sink ends as one delivery with the current pipeline would
    leave it."""
    versions = [
        (7, 1),
        (8, 2),
        (8, 60),
        (9, 3),  # 0 .. 3
        (7, 100),
        (8, 100),
        (9, 100),  # 4 .. 6: the backfill's range [3, 7)
        (10, 100),
        (11, 4),
    ]  # 7, 8
    env.append([order_record(0, i, f"o{n}", a, version=n) for n, (i, a) in enumerate(versions)])
    env.pipeline()
    assert env.run(spark).ok
    newest = [(7, 4), (8, 5), (9, 6), (10, 7), (11, 8)]  # (id, offset of its newest version)
    assert env.q(env.sink_dsn, "SELECT id, _tm_offset FROM orders ORDER BY id") == newest

    env.pipeline(quality={"rows": [{ROWS: {"column": "amount", "max_value": 50}}]})
    report = env.run(spark, mode=Backfill([Range(0, 3, 7)]))
    assert report.ok, report.summary()
    out = report.sinks["main"]
    # Range: the rows of 4 .. 6 removed; 3 placed, 4 .. 6 quarantined. Keys 7 and 8 lost
    # their rows: fallen back to offsets 0 and 1, and 2 quarantined on the way (amount 60).
    assert (out.counts.removed, out.counts.fallback, out.counts.rows, out.counts.dead) == (
        3,
        3,
        3,
        4,
    ), report.summary()
    assert env.q(env.sink_dsn, "SELECT id, _tm_offset, amount FROM orders ORDER BY id") == [
        (7, 0, 1.0),
        (8, 1, 2.0),
        (9, 3, 3.0),
        (10, 7, 100.0),
        (11, 8, 4.0),
    ]
    assert [(r[2], r[3]) for r in letters(env)] == [
        (2, "validation"),
        (4, "validation"),
        (5, "validation"),
        (6, "validation"),
    ]
    assert_exactly_once(env)

    # Back to no check: the backfill puts the newest versions back, and resolves the letters
    # of its range; offset 2 stays quarantined (outside the range), superseded by the row.
    env.pipeline()
    again = env.run(spark, mode=Backfill([Range(0, 3, 7)]))
    assert again.ok and again.sinks["main"].counts.resolved == 3, again.summary()
    assert env.q(env.sink_dsn, "SELECT id, _tm_offset FROM orders ORDER BY id") == newest
    assert_exactly_once(env)


def test_a_backfill_falls_back_to_a_version_in_another_partition_by_the_version_column(env, spark):
    def order(i: int, version: int, amount: float) -> bytes:
        return json.dumps(
            {"id": i, "name": f"v{version}", "amount": amount, "version": version}
        ).encode()

    env.append([(1, b"7", order(7, 1, 1.0), None, None), (1, b"8", order(8, 1, 1.0), None, None)])
    env.append([(0, b"7", order(7, 2, 100.0), None, None), (0, b"8", order(8, 3, 1.0), None, None)])
    main = env.orders_sink(version="version")
    source = env.source(0, 1)
    env.pipeline(source=source, sinks=[main])
    assert env.run(spark).ok
    env.pipeline(
        source=source,
        sinks=[main],
        quality={"rows": [{ROWS: {"column": "amount", "max_value": 50}}]},
    )
    report = env.run(spark, mode=Backfill([Range(0, 0, 2)]))
    assert report.ok, report.summary()
    assert (report.sinks["main"].counts.removed, report.sinks["main"].counts.fallback) == (2, 1)
    assert env.q(env.sink_dsn, "SELECT id, version, _tm_partition FROM orders ORDER BY id") == [
        (7, 1, 1),
        (8, 3, 0),
    ]
    assert_exactly_once(env)


def test_a_backfill_whose_batch_gate_fails_changes_nothing_whatever_the_policy(env, spark):
    env.append_orders(range(30), partitions=1)
    env.append([(0, b"poison", b"{not json", None, None)])
    quality = {
        "batch": [{"expect_table_row_count_to_be_between": {"max_value": 100}}],
        "on_gate_failure": "quarantine_batch",
    }
    env.pipeline(quality=quality)
    assert env.run(spark).ok
    before = (env.q(env.sink_dsn, "SELECT * FROM orders ORDER BY id"), letters(env))
    env.pipeline(
        quality={**quality, "batch": [{"expect_table_row_count_to_be_between": {"max_value": 5}}]}
    )
    report = env.run(spark, mode=Backfill([Range(0, 0, 31)]))
    assert report.sinks["main"].state == "dq_failed", report.summary()
    assert (env.q(env.sink_dsn, "SELECT * FROM orders ORDER BY id"), letters(env)) == before
    assert env.checkpoints() == {0: 31}
    assert_exactly_once(env)


def _named(i: int, name: str, version: int) -> bytes:
    """The payload of version ``version`` of order ``i``, named ``name`` (no amount)."""
    return json.dumps({"id": i, "name": name, "version": version}).encode()


def test_versions_of_a_key_from_two_partitions_need_a_declared_order(env, spark):
    env.append(
        [
            (0, b"7", _named(7, "p0", 1), None, None),
            (0, b"1", _named(1, "a", 1), None, None),
            (0, b"1", _named(1, "b", 2), None, None),
        ]
    )
    env.append([(1, b"7", _named(7, "p1", 2), None, None)])
    plain = env.orders_sink()
    env.pipeline(source=env.source(0), sinks=[plain])
    first = env.run(spark)
    assert first.ok, first.summary()
    assert first.sinks["main"].counts.superseded == 1  # id 1's first version, in the same batch
    assert env.q(env.sink_dsn, "SELECT name FROM orders ORDER BY id") == [("b",), ("p0",)]

    # Partition 1 brings another version of id 7: offsets cannot order it against partition 0.
    env.pipeline(source=env.source(0, 1), sinks=[plain])
    refused = env.run(spark)
    assert refused.sinks["main"].state == "aborted"
    assert "key (id)=(7) has versions from partitions 0 and 1" in refused.sinks["main"].error
    assert "declare a version column" in refused.sinks["main"].error
    assert env.checkpoints() == {0: 3, 1: 0} and env.prepared() == []

    env.pipeline(source=env.source(0, 1), sinks=[{**plain, "version": "version"}])
    second = env.run(spark)
    assert second.ok, second.summary()
    assert env.q(env.sink_dsn, "SELECT name, version FROM orders WHERE id = 7") == [("p1", 2)]
    # Re-delivering partition 0 never puts back an older version; what it skips is counted.
    back = env.run(spark, mode=Backfill([Range(0, 0, 3)]))
    assert back.ok and back.sinks["main"].counts.superseded == 2, back.summary()
    assert env.q(env.sink_dsn, "SELECT id, name, version FROM orders ORDER BY id") == [
        (1, "b", 2),
        (7, "p1", 2),
    ]


def _versions_in_two_partitions(env) -> None:
    """Key 7 in both partitions of one run; the newer version (3) in partition 0."""
    env.append(
        [
            (0, b"1", _named(1, "a", 1), None, None),
            (0, b"7", _named(7, "p0", 3), None, None),
            (1, b"2", _named(2, "b", 1), None, None),
            (1, b"7", _named(7, "p1", 2), None, None),
            (1, b"3", _named(3, "c", 1), None, None),
        ]
    )
    env.pipeline(source=env.source(0, 1))


def test_one_run_with_versions_of_a_key_in_two_partitions_commits_the_newest(env, engine):
    # Two tasks writing key 7 would deadlock: the second waits on the first's row, which its
    # prepared transaction holds until the decision. A short lock timeout makes that a quick
    # failure here instead of a hang.
    _versions_in_two_partitions(env)
    main = env.orders_sink(version="version")
    env.pipeline(source=env.source(0, 1), sinks=[main])
    report = env.run(engine, settings=env.settings(lock_timeout_ms=2000))
    assert report.ok, report.summary()
    assert report.sinks["main"].counts.rows == 4 and report.sinks["main"].counts.superseded == 1
    assert env.q(env.sink_dsn, "SELECT id, name, version FROM orders ORDER BY id") == [
        (1, "a", 1),
        (2, "b", 1),
        (3, "c", 1),
        (7, "p0", 3),
    ]
    assert env.checkpoints() == {0: 2, 1: 3}
    assert_exactly_once(env)


def test_a_key_in_two_partitions_of_one_run_without_a_version_column_says_so(env, engine):
    _versions_in_two_partitions(env)
    report = env.run(engine, settings=env.settings(lock_timeout_ms=1000))
    error = report.sinks["main"].error or ""
    assert report.sinks["main"].state == "aborted", report.summary()
    assert "lock timeout" in error and "another task of this run" in error, error
    assert "declare a version column" in error, error
    assert set(env.checkpoints().values()) <= {0} and env.prepared() == []
    assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(0,)]


def test_sink_keys_are_never_null(env, engine):
    env.append_orders(range(5), partitions=1)
    env.append([(0, b"nokey", json.dumps({"name": "no id"}).encode(), None, None)])
    # No `required`: the key column is required all the same.
    env.pipeline(transform={"select": {"id": "id", "name": "name"}})
    report = env.run(engine)
    assert report.ok and report.sinks["main"].counts.rows == 5, report.summary()
    assert env.ledger("SELECT error_class::text, reason FROM tidemark.dlq") == [
        ("transform", "key column id is NULL")
    ]
    assert_exactly_once(env)

    # A table whose key allows NULL (a unique index, no primary key) is refused.
    ddl(
        env.sink2_dsn,
        "CREATE TABLE loose (id int, name text, _tm_partition int NOT NULL, "
        "_tm_offset bigint NOT NULL, _tm_run_id bigint NOT NULL)",
    )
    ddl(env.sink2_dsn, "CREATE UNIQUE INDEX ON loose (id)")
    env.pipeline(
        transform={"select": {"id": "id", "name": "name"}},
        sinks=[{"name": "loose", "dsn": env.sink2_dsn, "table": "public.loose", "key": ["id"]}],
    )
    refused = env.run(engine, sink_names=["loose"])
    assert refused.sinks["loose"].state == "aborted"
    assert "allows NULL in key column(s) id" in refused.sinks["loose"].error


@pytest.mark.parametrize("spread", [False, True], ids=["one-task", "spread"])
@pytest.mark.parametrize("how", ["drops", "duplicates"])
def test_a_transform_that_loses_or_copies_records_fails_before_anything_is_prepared(
    env, spark, how, spread, tmp_path, monkeypatch
):
    # Spread, no task sees the whole range: a dropped record shows only when the driver
    # puts every task's offsets together.
    module = tmp_path / f"lossy_{how}.py"
    body = (
        "df.where('_tm_offset <> 3')"
        if how == "drops"
        else "df.unionByName(df.where('_tm_offset = 3'))"
    )
    module.write_text(f"def fn(df):\n    return {body}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env.append_orders(range(10), partitions=1)
    env.pipeline(
        transform={"python": f"lossy_{how}:fn"},
        limits={"max_records_per_partition": 100, "split_min_records": 1 if spread else 1000},
    )
    with pytest.raises(
        TidemarkError,
        match=rf"transform lossy_{how}:fn.*(partition 0 \[0, 10\)|changed the partitioning)",
    ):
        env.run(spark)
    assert env.ledger("SELECT state::text FROM tidemark.run_sinks") == [("aborted",)]
    assert env.prepared() == []
    assert env.checkpoints() == {0: 0}
    assert env.ledger("SELECT count(*) FROM tidemark.dlq") == [(0,)]


def test_headers_postgresql_refuses_are_kept_and_the_record_quarantined(env, engine):
    """A `\\u0000` in JSON headers: jsonb refuses it, so the dead letter keeps them base64."""
    import base64

    ddl(env.ledger_dsn, "ALTER TABLE src.log ALTER COLUMN headers TYPE json")
    raw = '{"trace": "a\\u0000b"}'
    env.append([(0, b"k", b"{not json", raw, None)])
    env.append_orders([1], partitions=1)
    env.pipeline()
    report = env.run(engine)
    assert report.ok and report.sinks["main"].counts.dead == 1, report.summary()
    (headers,) = env.ledger("SELECT headers FROM tidemark.dlq")[0]
    assert base64.b64decode(headers["_tm_unstorable_headers_base64"]).decode() == raw
    assert_exactly_once(env)


def _tasks(env) -> set[str]:
    return {
        t
        for (t,) in env.ledger("SELECT DISTINCT split_part(gid, ':', 4) FROM tidemark.participants")
    }


@pytest.mark.engines("local", "spark", "connect")
def test_a_one_partition_run_spreads_over_tasks_by_key_and_places_each_record_once(env, engine):
    """One partition, two cores: the range is read in sub-ranges and its records spread by key
    over two write tasks, each its own participant. Versions of a key sit in every
    sub-range; the newest wins, for each sink, and a lagging sink catches up alone."""
    recs = [order_record(0, i % 700, f"v{i}", 1.0) for i in range(3000)]
    recs[1234] = (0, b"bad", b"not json", None, None)
    env.append(recs)
    spread = {"max_records_per_partition": 2000, "split_min_records": 1000}
    env.pipeline(sinks=two_sinks(env)[:1], limits=spread)
    first = env.run(engine)
    assert first.ok, first.summary()
    assert _tasks(env) == {"0", "1"}
    env.pipeline(sinks=two_sinks(env), limits=spread)
    for _ in range(3):  # a: 2000 -> 3000; b: 0 -> 2000 -> 3000
        report = env.run(engine)
        assert report.ok or report.run_id is None, report.summary()
    newest = {i % 700: f"v{i}" for i in range(3000) if i != 1234}
    for dsn in both(env).values():
        assert dict(env.q(dsn, "SELECT id, name FROM orders")) == newest
    assert env.checkpoints(sink="a") == env.checkpoints(sink="b") == {0: 3000}
    assert letters(env) == [
        ("a", 0, 1234, "decode", "quarantined", 1),
        ("b", 0, 1234, "decode", "quarantined", 1),
    ]
    assert_exactly_once(env, sinks=both(env))


def test_versions_of_a_key_in_two_partitions_spread_by_key_commit_the_newest(env, engine):
    """A sink ordering versions by a column: every version of a key goes to one task, so
    several tasks write side by side without waiting on each other's rows."""
    env.append(
        [order_record(p, i, f"p{p}", 1.0, version=p + 1) for i in range(500) for p in (0, 1)]
    )
    env.pipeline(
        sinks=[env.orders_sink(version="version")],
        limits={"max_records_per_partition": 1000, "split_min_records": 10},
    )
    report = env.run(engine, settings=env.settings(lock_timeout_ms=2000))
    assert report.ok, report.summary()
    assert report.sinks["main"].counts.rows + report.sinks["main"].counts.superseded == 1000
    assert _tasks(env) == {"0", "1"}
    assert env.q(env.sink_dsn, "SELECT DISTINCT name FROM orders") == [("p1",)]
    assert_exactly_once(env)
