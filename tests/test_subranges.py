"""A range split into sub-ranges, one Spark task each (every core busy whatever the partition
count), kept exactly once together with the other features: several sinks at different
checkpoints, a failing gate, backfill over dead letters. The crash of a split run is in
tests/test_crash.py."""

from __future__ import annotations

import psycopg

from tests.invariants import assert_exactly_once
from tidemark.driver.modes import MIN_PIECE, split
from tidemark.driver.run import Backfill
from tidemark.ledger import dlq
from tidemark.ledger.state import Range

ROWS = "expect_column_values_to_be_between"


def test_split_covers_each_range_exactly_in_even_pieces():
    read = [Range(0, 10, 110), Range(1, 0, 7), Range(2, 5, 5)]
    pieces = split(read, slots=2, most=30)
    assert pieces == [Range(0, 10, 35), Range(0, 35, 60), Range(0, 60, 85),
                      Range(0, 85, 110), Range(1, 0, 7), Range(2, 5, 5)]
    # Automatic: a one-partition range fills two waves of the cluster's task slots...
    one = split([Range(0, 0, 2_000_000)], slots=2)
    assert len(one) == 4 and {r.size for r in one} == {500_000}
    assert split([Range(0, 0, 2_000_000)], slots=8)[0].size == 125_000
    # ... four even partitions are not split further on two cores ...
    four = [Range(p, 0, 500_000) for p in range(4)]
    assert split(four, slots=2) == four
    # ... and small ranges are never cut below MIN_PIECE.
    assert split([Range(0, 0, MIN_PIECE + 1)], slots=64) == [Range(0, 0, MIN_PIECE + 1)]
    for read, slots, most in [([Range(0, 3, 1003)], 3, None), ([Range(1, 0, 997)], 2, 10)]:
        got = split(read, slots, most)
        covered = [o for r in got for o in range(r.start, r.end)]
        assert covered == list(range(read[0].start, read[0].end))


def tasks_of(env, run_id: int, sink: str) -> set[int]:
    return {t for (t,) in env.ledger("SELECT task FROM tidemark.participants WHERE run_id = %s "
                                     "AND target = %s", (run_id, f"sink:{sink}"))}


def test_a_lagging_sink_with_a_failing_gate_over_split_ranges(env, spark):
    """The first-wave bug, with every range cut into pieces of 7 records: sink b catches up
    with a failing gate (quarantine_batch) over pieces that hold records sink a has."""
    env.append_orders(range(80))  # 40 per partition
    sinks = [{"name": "a", "dsn": env.sink_dsn, "table": "public.orders", "key": ["id"]},
             {"name": "b", "dsn": env.sink2_dsn, "table": "public.orders", "key": ["id"]}]
    gate = {"expect_table_row_count_to_be_between": {"max_value": 30}}
    quality = {"batch": [gate], "on_gate_failure": "quarantine_batch"}
    env.pipeline(sinks=sinks, quality=quality,
                 limits={"max_records_per_partition": 10, "max_records_per_task": 7})
    first = env.run(spark, sink_names=["a"])
    assert first.ok and first.sinks["a"].rows == 20, first.summary()
    assert tasks_of(env, first.run_id, "a") == {0, 1, 2, 3}  # 2 partitions x [0,5) [5,10)

    env.pipeline(sinks=sinks, quality=quality,
                 limits={"max_records_per_partition": 40, "max_records_per_task": 7})
    second = env.run(spark, sink_names=["b"])
    assert second.ok and second.sinks["b"].dead == 80, second.summary()
    third = env.run(spark)  # a's own range [10, 40) only, in pieces of [0, 40)
    assert list(third.sinks) == ["a"] and third.sinks["a"].dead == 60, third.summary()
    assert env.ledger("SELECT sink, count(*) FROM tidemark.dlq GROUP BY 1 ORDER BY 1") == \
        [("a", 60), ("b", 80)]
    assert env.checkpoints(sink="a") == env.checkpoints(sink="b") == {0: 40, 1: 40}
    assert_exactly_once(env, sinks={"a": env.sink_dsn, "b": env.sink2_dsn})

    # New records: a delivers them in pieces, one participant per piece.
    env.append_orders(range(80, 120))
    env.pipeline(sinks=sinks, limits={"max_records_per_partition": 40,
                                      "max_records_per_task": 7})
    fourth = env.run(spark)
    assert fourth.ok and fourth.sinks["a"].rows == fourth.sinks["b"].rows == 40
    assert tasks_of(env, fourth.run_id, "a") == set(range(6))  # 20 per partition: 3 x 7
    assert_exactly_once(env, sinks={"a": env.sink_dsn, "b": env.sink2_dsn})


def test_a_backfill_over_split_ranges_resolves_each_letter_once(env, spark):
    """Each piece resolves only the live letters of its own sub-range: the pieces that
    quarantine a record again must not find it resolved (or locked) by another piece."""
    env.append_orders(range(40), partitions=1)  # amount = id * 1.25
    limits = {"max_records_per_partition": 100, "max_records_per_task": 6}
    env.pipeline(quality={"rows": [{ROWS: {"column": "amount", "max_value": 25}}]},
                 limits=limits)
    first = env.run(spark)
    assert first.ok, first.summary()
    # [0, 40) in 7 pieces of 6 (the last of 4): ids 0 .. 20 in the first 4 pieces' sink
    # transactions, the letters of 21 .. 39 in the dead-letter transactions of the last 4.
    assert tasks_of(env, first.run_id, "main") == {0, 1, 2, 3}
    dlq_tasks = {t for (t,) in env.ledger("SELECT task FROM tidemark.participants WHERE "
                                          "run_id = %s AND target = 'ledger'", (first.run_id,))}
    assert dlq_tasks == {3, 4, 5, 6}
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        (last,) = c.execute("SELECT id FROM tidemark.dlq WHERE source_offset = 39").fetchone()
        assert dlq.discard(c, [last], "not worth it", "dora").changed == [last]

    env.pipeline(quality={"rows": [{ROWS: {"column": "amount", "min_value": 5,
                                           "max_value": 40}}]}, limits=limits)
    report = env.run(spark, mode="backfill", backfill=Backfill(0, 0, 40), by="erin")
    assert report.ok, report.summary()
    out = report.sinks["main"]
    assert (out.rows, out.removed, out.resolved, out.dead) == (29, 4, 12, 4 + 7)
    got = [i for (i,) in env.q(env.sink_dsn, "SELECT id FROM orders ORDER BY id")]
    assert got == list(range(4, 33))
    status = dict(env.ledger("SELECT source_offset, status::text FROM tidemark.dlq"))
    assert [o for o, s in sorted(status.items()) if s == "quarantined"] == \
        [0, 1, 2, 3, *range(33, 40)]
    assert {status[o] for o in range(21, 33)} == {"redriven"}
    assert env.checkpoints() == {0: 40}
    assert_exactly_once(env)
