"""Re-delivery replaces by position (docs/design.md, "Re-delivery"): the sink ends as if every
record of the range had been delivered once with the current pipeline, and every record
outside it as it was. The cases a review found broken, on real PostgreSQL and Spark."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone

import psycopg
import pytest

from tests.conftest import order_record
from tests.invariants import assert_exactly_once
from tidemark.core.ranges import Range
from tidemark.driver import windows
from tidemark.driver.run import Backfill

ROWS = "expect_column_values_to_be_between"


def rows(env, cols: str = "id, _tm_offset, amount") -> list[tuple]:
    return env.q(env.sink_dsn, f"SELECT {cols} FROM orders ORDER BY 1, 2")


def letters(env) -> dict[int, str]:
    return dict(
        env.ledger("SELECT source_offset, status::text FROM tidemark.dlq ORDER BY source_offset")
    )


def test_a_backfill_whose_check_changes_places_each_records_newest_passing_version(env, spark):
    """Case 1 of the review: the fallback took offset 1 as placed by its live letter, then
    resolved the letter, and id 8 vanished."""
    records = [(7, 200), (7, 500), (7, 50), (8, 500), (8, 50), (9, 150)]
    env.append([order_record(0, i, "x", a) for i, a in records])
    env.pipeline(quality={"rows": [{ROWS: {"column": "amount", "max_value": 300}}]})
    assert env.run(spark).ok
    assert rows(env) == [(7, 2, 50.0), (8, 4, 50.0), (9, 5, 150.0)]
    assert letters(env) == {1: "quarantined", 3: "quarantined"}

    env.pipeline(quality={"rows": [{ROWS: {"column": "amount", "min_value": 100}}]})
    report = env.run(spark, mode=Backfill([Range(0, 1, 5)]))
    assert report.ok, report.summary()
    assert rows(env) == [(7, 1, 500.0), (8, 3, 500.0), (9, 5, 150.0)]
    assert letters(env) == {1: "redriven", 2: "quarantined", 3: "redriven", 4: "quarantined"}
    assert report.sinks["main"].counts.removed == 2 and report.sinks["main"].counts.fallback == 0
    assert_exactly_once(env)


def test_a_backfill_whose_transform_changes_the_key_leaves_no_row_of_the_old_key(env, spark):
    """Case 2: re-delivery upserted by the new key and kept the old pipeline's row."""
    env.append(
        [
            (0, b"1", json.dumps({"id": 1, "code": "A"}).encode(), None, None),
            (0, b"2", json.dumps({"id": 2, "code": "B"}).encode(), None, None),
        ]
    )
    sink = {"name": "main", "dsn": env.sink_dsn, "table": "public.codes", "key": ["code"]}
    decode = {"schema": {"id": "int", "code": "string"}}
    env.pipeline(decode=decode, transform={"select": {"id": "id", "code": "code"}}, sinks=[sink])
    assert env.run(spark).ok
    env.pipeline(
        decode=decode, transform={"select": {"id": "id", "code": "lower(code)"}}, sinks=[sink]
    )
    report = env.run(spark, mode=Backfill([Range(0, 0, 2)]))
    assert report.ok, report.summary()
    assert env.q(env.sink_dsn, "SELECT code, id, _tm_offset FROM codes ORDER BY code") == [
        ("a", 1, 0),
        ("b", 2, 1),
    ]
    assert_exactly_once(env, table="codes")


def test_a_key_split_and_merged_by_a_new_transform_keeps_its_newest_passing_version(env, spark):
    """Keys that merge: a backfill of part of what the sink received is refused (the older
    versions the range's rows stood for cannot be told apart: tests/test_key_split.py); one
    from the first record re-keys them all, and each new key holds its newest version."""
    docs = [{"id": 1, "grp": 1}, {"id": 2, "grp": 1}, {"id": 3, "grp": 2}, {"id": 4, "grp": 2}]
    env.append([(0, str(d["id"]).encode(), json.dumps(d).encode(), None, None) for d in docs])
    sink = {"name": "main", "dsn": env.sink_dsn, "table": "public.g", "key": ["k"]}
    decode = {"schema": {"id": "int", "grp": "int"}}
    env.pipeline(decode=decode, transform={"select": {"k": "id", "id": "id"}}, sinks=[sink])
    assert env.run(spark).ok
    # Now keyed by group: ids 1 and 2 are versions of key 1, ids 3 and 4 of key 2.
    env.pipeline(decode=decode, transform={"select": {"k": "grp", "id": "id"}}, sinks=[sink])
    refused = env.run(spark, mode=Backfill([Range(0, 1, 4)]))
    assert not refused.ok and "a key change" in (refused.sinks["main"].error or "")
    report = env.run(spark, mode=Backfill([Range(0, 0, 4)]))
    assert report.ok, report.summary()
    # Offsets 0 and 1 map to key 1, 2 and 3 to key 2, the newest wins. Keys 3 and 4 lost
    # their rows and no version maps to them now.
    assert env.q(env.sink_dsn, "SELECT k, id, _tm_offset FROM g ORDER BY k") == [
        (1, 2, 1),
        (2, 4, 3),
    ]
    # (tests/invariants.py reads versions by the source key, which this transform no longer
    # follows: offsets 0 and 2 are placed by the newer rows of keys 1 and 2.)
    assert letters(env) == {} and env.prepared() == []


def test_equal_versions_across_partitions_are_broken_by_position_in_and_across_runs(env, spark):
    """Case 4: a tie inside a run kept partition 1's row; across runs it aborted the sink
    with 'declare a version column' (one is declared), on every later run too."""

    def order(i: int, name: str) -> bytes:
        return json.dumps({"id": i, "name": name, "amount": 1, "version": 3}).encode()

    source = env.source(0, 1)
    main = env.orders_sink(version="version")
    env.append([(0, b"5", order(5, "p0"), None, None), (1, b"5", order(5, "p1"), None, None)])
    env.pipeline(source=source, sinks=[main])
    assert env.run(spark).ok
    assert env.q(env.sink_dsn, "SELECT id, name FROM orders") == [(5, "p1")]
    # Across runs: id 6 in partition 1 first, then in partition 0. Same winner: partition 1.
    env.append([(1, b"6", order(6, "p1"), None, None)])
    assert env.run(spark).ok
    env.append([(0, b"6", order(6, "p0"), None, None)])
    second = env.run(spark)
    assert second.ok, second.summary()
    assert env.q(env.sink_dsn, "SELECT id, name FROM orders ORDER BY id") == [(5, "p1"), (6, "p1")]
    env.append([(0, b"7", order(7, "p0"), None, None)])
    assert env.run(spark).ok  # the sink is not stuck
    # A backfill of partition 0 converges on the same rows.
    back = env.run(spark, mode=Backfill([Range(0, 0, 3)]))
    assert back.ok, back.summary()
    assert env.q(env.sink_dsn, "SELECT id, name FROM orders ORDER BY id") == [
        (5, "p1"),
        (6, "p1"),
        (7, "p0"),
    ]
    assert_exactly_once(env)


@pytest.mark.engines("spark", "connect")
def test_a_backfill_whose_every_record_fails_now_removes_their_rows(env, engine):
    """No row to write at all: the task still removes the range's rows, and each key falls
    back to the version before the range that passes now."""
    env.append([order_record(0, 1, "x", a) for a in (1, 200, 300)])
    env.pipeline()
    assert env.run(engine).ok
    env.pipeline(quality={"rows": [{ROWS: {"column": "amount", "max_value": 100}}]})
    report = env.run(engine, mode=Backfill([Range(0, 1, 3)]))
    assert report.ok, report.summary()
    assert rows(env) == [(1, 0, 1.0)]
    assert letters(env) == {1: "quarantined", 2: "quarantined"}
    assert_exactly_once(env)


def test_a_redrive_of_a_letter_whose_newer_version_is_in_the_sink_resolves_it(env, spark):
    """A redrive places a record that passes now under the same rule: superseded by the
    newer row of its key, its letter is resolved and the row stays."""
    env.append([order_record(0, 1, n, a) for n, a in (("old", 500), ("new", 100))])
    env.pipeline(quality={"rows": [{ROWS: {"column": "amount", "max_value": 300}}]})
    assert env.run(spark).ok
    (letter,) = [i for (i,) in env.ledger("SELECT id FROM tidemark.dlq")]
    env.pipeline()
    rep = env.redrive(spark, ids=[letter], by="fay")
    assert rep.ok and rep.redrive["redriven"] == 1, rep.summary()
    assert rep.sinks["main"].counts.superseded == 1
    assert rows(env, "id, _tm_offset, name") == [(1, 1, "new")]
    assert letters(env) == {0: "redriven"}
    assert_exactly_once(env)


def test_two_sinks_at_different_checkpoints_converge_under_a_new_key(env, spark):
    """A key change backfilled over two sinks from the first record, one of them further
    ahead: each ends as one delivery with the current pipeline, and the one ahead keeps what
    lies past the range."""
    docs = [{"id": i, "code": c} for i, c in enumerate("ABCD")]
    env.append([(0, str(d["id"]).encode(), json.dumps(d).encode(), None, None) for d in docs[:3]])
    sinks = [
        {"name": n, "dsn": d, "table": "public.codes", "key": ["code"]}
        for n, d in (("a", env.sink_dsn), ("b", env.sink2_dsn))
    ]
    decode = {"schema": {"id": "int", "code": "string"}}
    env.pipeline(decode=decode, transform={"select": {"id": "id", "code": "code"}}, sinks=sinks)
    assert env.run(spark).ok
    env.append([(0, b"3", json.dumps(docs[3]).encode(), None, None)])
    assert env.run(spark, sink_names=["a"]).ok  # a at 4, b at 3
    env.pipeline(
        decode=decode, transform={"select": {"id": "id", "code": "lower(code)"}}, sinks=sinks
    )
    report = env.run(spark, mode=Backfill([Range(0, 0, 3)]))
    assert report.ok, report.summary()
    for dsn, want in ((env.sink_dsn, ["D", "a", "b", "c"]), (env.sink2_dsn, ["a", "b", "c"])):
        assert [c for (c,) in env.q(dsn, "SELECT code FROM codes ORDER BY code")] == want
    assert letters(env) == {}


def test_older_versions_outside_the_range_follow_their_newer_version_to_its_new_key(env, spark):
    """Chaos seed 27's gap: after a transform change that maps keys anew, the range's newer
    version now fails. Its old key loses its row and no record maps to it any more; the older
    version outside the range, which that row placed, now maps to another key. Which one, the
    old transform alone knew: the backfill is refused (docs/design.md, "Re-delivery", step 4),
    and one from the first record places the older version under its new key."""
    env.append([order_record(0, 7, n, a) for n, a in (("old", 50), ("new", 500))])
    sink = {"name": "main", "dsn": env.sink_dsn, "table": "public.moved", "key": ["k"]}
    decode = {"schema": {"id": "int", "name": "string", "amount": "double"}}
    select = {"k": "id", "id": "id", "name": "name", "amount": "amount"}
    env.pipeline(decode=decode, transform={"select": select}, sinks=[sink])
    assert env.run(spark).ok
    assert env.q(env.sink_dsn, "SELECT k, name FROM moved") == [(7, "new")]

    env.pipeline(
        decode=decode,
        transform={"select": {**select, "k": "id + 100"}},
        sinks=[sink],
        quality={"rows": [{ROWS: {"column": "amount", "max_value": 300}}]},
    )
    refused = env.run(spark, mode=Backfill([Range(0, 1, 2)]))
    error = refused.sinks["main"].error or ""
    assert not refused.ok and "partition 0 offset 1: (7) -> (107)" in error, error
    assert env.q(env.sink_dsn, "SELECT k, name FROM moved") == [(7, "new")]
    report = env.run(spark, mode=Backfill([Range(0, 0, 2)]))
    assert report.ok, report.summary()
    assert env.q(env.sink_dsn, "SELECT k, name, _tm_offset FROM moved") == [(107, "old", 0)]
    assert letters(env) == {1: "quarantined"}
    assert report.sinks["main"].counts.removed == 1 and report.sinks["main"].counts.fallback == 0
    assert_exactly_once(env, table="moved")


def test_the_fallback_fails_the_sink_on_versions_offsets_do_not_order():
    """Without a version column offsets order a key's versions within one partition only: the
    fallback's version order refuses two partitions' versions with the merge's message (it
    raised KeyError: None), and still orders the rest as before. Pure logic, no Spark."""
    from types import SimpleNamespace

    import pytest

    from tidemark.engine.redelivery import Redelivery, Unordered

    def row(partition: int, offset: int, **more) -> dict:
        return {"id": 7, "_tm_partition": partition, "_tm_offset": offset, **more}

    order = Redelivery.__new__(Redelivery)
    order.t = SimpleNamespace(version=None, key=["id"])
    assert order._order(row(0, 5), row(0, 3)) == 1 and order._order(row(1, 3), row(1, 5)) == -1
    with pytest.raises(Unordered, match=r"key \(id\)=\(7\) has versions from several partitions"):
        order._order(row(0, 5), row(1, 3))
    order.t = SimpleNamespace(version="v", key=["id"])
    assert order._order(row(0, 5, v=1), row(1, 3, v=2)) == -1
    assert order._order(row(0, 5, v=None), row(1, 3, v=2)) == -1  # unversioned below versioned
    assert order._order(row(0, 5, v=2), row(1, 3, v=2)) == -1  # a tie: (partition, offset)


def test_a_time_window_backfill_redelivers_each_partitions_records_of_the_window(env, spark):
    """Issue 36 point 4: --since/--until maps to the smallest offset range of each partition
    holding every record of the window, out-of-order times included, cut at the committed
    end; the whole window is one backfill run (one decision)."""
    t0 = datetime(2026, 5, 1, tzinfo=UTC)
    minutes = {0: [0, 10, 20, 12, 40], 1: [5, 15, 25, 35]}  # partition 0: a late record
    env.append(
        [
            (p, str(p * 10 + o).encode(), _order(p * 10 + o), None, t0 + timedelta(minutes=m))
            for p, ms in minutes.items()
            for o, m in enumerate(ms)
        ]
    )
    env.pipeline()
    assert env.run(spark).ok
    before = dict(env.q(env.sink_dsn, "SELECT id, amount FROM orders"))

    env.pipeline(
        transform={
            "select": {"id": "id", "name": "name", "amount": "amount * 2", "version": "version"}
        }
    )
    p = env.load()
    ends = windows.committed(env.ledger_dsn, p, None)
    ranges = windows.by_time(p, ends, t0 + timedelta(minutes=10), t0 + timedelta(minutes=20))
    # Partition 0: minutes 10 and 12 (offsets 1 and 3) and the 20 between them: [1, 4).
    # Partition 1: minute 15 (offset 1): [1, 2).
    assert ranges == [Range(0, 1, 4), Range(1, 1, 2)]
    report = env.run(spark, mode=Backfill(ranges))
    assert report.ok, report.summary()
    after = dict(env.q(env.sink_dsn, "SELECT id, amount FROM orders"))
    doubled = {1, 2, 3, 11}
    assert after == {i: a * 2 if i in doubled else a for i, a in before.items()}
    assert env.ledger("SELECT count(*) FROM tidemark.runs WHERE mode = 'backfill'") == [(1,)]
    assert_exactly_once(env)
    # --partition all re-delivers everything committed, from each partition's first record.
    assert windows.by_offsets(p, ends, None, None) == [Range(0, 0, 5), Range(1, 0, 4)]


@pytest.mark.parametrize("ts_type", ["timestamp", "timestamptz"])
def test_a_time_window_is_utc_whatever_the_source_sessions_time_zone(env, spark, ts_type):
    """Issue 45 case 7: a ``ts timestamp`` column (no zone) was compared with the UTC window
    in the session's TimeZone, which the source database (or role) sets to Europe/Berlin
    here: the window mapped to the records two hours off. Times are UTC, always."""
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        c.execute(f"ALTER DATABASE \"{env.names['ledger']}\" SET TimeZone = 'Europe/Berlin'")
        if ts_type == "timestamp":
            c.execute(
                "ALTER TABLE src.log ALTER COLUMN ts TYPE timestamp USING ts AT TIME ZONE 'UTC'"
            )
    assert env.ledger("SHOW TimeZone") == [("Europe/Berlin",)]
    t0 = datetime(2026, 5, 1, tzinfo=UTC)  # Berlin is UTC+2 then
    stored = t0 if ts_type == "timestamptz" else t0.replace(tzinfo=None)  # naive: UTC
    minutes = {0: [0, 10, 20, 12, 40], 1: [5, 15, 25, 35]}
    env.append(
        [
            (p, str(p * 10 + o).encode(), _order(p * 10 + o), None, stored + timedelta(minutes=m))
            for p, ms in minutes.items()
            for o, m in enumerate(ms)
        ]
    )
    env.pipeline()
    assert env.run(spark).ok
    before = dict(env.q(env.sink_dsn, "SELECT id, amount FROM orders"))
    env.pipeline(
        transform={
            "select": {"id": "id", "name": "name", "amount": "amount * 2", "version": "version"}
        }
    )
    p = env.load()
    ends = windows.committed(env.ledger_dsn, p, None)
    since, until = t0 + timedelta(minutes=10), t0 + timedelta(minutes=20)
    expected = [Range(0, 1, 4), Range(1, 1, 2)]
    assert windows.by_time(p, ends, since, until) == expected
    # The same instants written in another zone, or naive (UTC, as --since/--until read them).
    berlin = timezone(timedelta(hours=2))
    assert windows.by_time(p, ends, since.astimezone(berlin), until.astimezone(berlin)) == expected
    naive = since.replace(tzinfo=None), until.replace(tzinfo=None)
    assert windows.by_time(p, ends, *naive) == expected
    from tidemark.cli.main import _Time

    typed = [_Time().convert(t, None, None) for t in ("2026-05-01T00:10", "2026-05-01T02:20+02")]
    assert typed == [since, until] and all(t.tzinfo == UTC for t in typed)
    from tidemark import sources

    plan = sources.planner(p)
    try:  # the lag's clock: the record's time, as an instant
        assert plan.record_time(0, 1) == t0 + timedelta(minutes=10)
    finally:
        plan.close()
    report = env.run(spark, mode=Backfill(expected))
    assert report.ok, report.summary()
    after = dict(env.q(env.sink_dsn, "SELECT id, amount FROM orders"))
    assert after == {i: a * 2 if i in {1, 2, 3, 11} else a for i, a in before.items()}
    assert_exactly_once(env)


def _order(i: int) -> bytes:
    return json.dumps({"id": i, "name": f"o{i}", "amount": i + 0.5, "version": 1}).encode()
