"""Corrections (issue 48 point 3; docs/pipelines.md "Corrections", docs/operations.md
"Upstream sent wrong values"): values corrected in a window of records by the pipeline file,
placed by a backfill of the window exactly once and kept by every later re-delivery (a
rebuild, a backfill again), without a change to the transform. Real PostgreSQL and Spark."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from tests.invariants import assert_exactly_once
from tests.test_cli import assert_one_clear_line, tm
from tidemark import sources
from tidemark.core.errors import ConfigError
from tidemark.driver import windows
from tidemark.driver.modes import Backfill, Rebuild
from tidemark.driver.run import Run

T0 = datetime(2026, 11, 3, 13, 0, tzinfo=UTC)
# Upstream sent the amounts of minutes [10, 20) in cents.
SINCE, UNTIL = T0 + timedelta(minutes=10), T0 + timedelta(minutes=20)
CENTS = {"name": "cents", "note": "upstream sent 13:10-13:20 in cents (INC-7)",
         "since": SINCE.isoformat(), "until": UNTIL.isoformat(),
         "set": {"amount": "amount / 100"}}  # fmt: skip


def _record(p: int, i: int, minute: int, version: int = 1) -> tuple:
    ts = T0 + timedelta(minutes=minute)
    amount = i * 1.25 * (100 if SINCE <= ts < UNTIL else 1)
    body = {"id": i, "name": f"order-{i}", "amount": amount, "version": version}
    return (p, str(i).encode(), json.dumps(body).encode(), None, ts)


def _amounts(env) -> dict[int, float]:
    return dict(env.q(env.sink_dsn, "SELECT id, amount FROM orders"))


def test_a_correction_is_placed_once_by_a_backfill_of_its_window_and_kept_by_a_rebuild(env, spark):
    # Partition 0 holds a late record (offset 3, minute 12) after one outside the window
    # (offset 2, minute 20): the window's offset range re-delivers both, corrects one.
    minutes = {0: [0, 10, 20, 12, 40], 1: [5, 15, 25, 35]}
    ids = {(p, o): p * 10 + o for p, ms in minutes.items() for o in range(len(ms))}
    env.append([_record(p, ids[(p, o)], m) for p, ms in minutes.items() for o, m in enumerate(ms)])
    env.pipeline()
    assert env.run(spark).ok
    wrong = {1, 3, 11}  # delivered in cents
    right = {i: i * 1.25 for i in ids.values()}
    assert _amounts(env) == {i: a * 100 if i in wrong else a for i, a in right.items()}

    # The correction alone: the running pipeline goes on (same table, no schema change) and
    # a record of the window that arrives now is corrected on its first delivery.
    env.pipeline(corrections=[CENTS])
    assert sources.payload_source(env.load()) is None  # the reader keeps each record's time
    code, out, err = tm(env.cli_env(), "pipelines", "validate", "--offline")
    assert code == 0, err
    env.append([_record(1, 14, 18), _record(0, 20, 50)])
    report = env.run(spark)
    assert report.ok, report.summary()
    assert report.sinks["main"].counts.rows == 2 and report.sinks["main"].schema_changes == []
    amounts = _amounts(env)
    assert amounts[14] == 14 * 1.25 and amounts[20] == 20 * 1.25
    assert {i: amounts[i] for i in wrong} == {i: right[i] * 100 for i in wrong}  # not yet

    # A backfill of the window places the corrected values, exactly once.
    p = env.load()
    ends = windows.committed(env.ledger_dsn, p, None)
    ranges = windows.by_time(p, ends, SINCE, UNTIL)
    report = env.run(spark, mode=Backfill(ranges))
    assert report.ok, report.summary()
    right.update({14: 14 * 1.25, 20: 20 * 1.25})
    assert _amounts(env) == right
    assert_exactly_once(env)
    # Again, and a rebuild from the whole source: the same table, nothing placed twice.
    assert env.run(spark, mode=Backfill(ranges)).ok
    assert _amounts(env) == right
    rebuilt = env._execute(Run, spark, "orders", mode=Rebuild("main"), sink_names=["main"])
    assert rebuilt.ok, rebuilt.summary()
    assert _amounts(env) == right
    assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(len(right),)]
    assert_exactly_once(env)
    # Without the correction a rebuild would bring the cents back: the file is what holds it.
    env.pipeline()
    assert env._execute(Run, spark, "orders", mode=Rebuild("main"), sink_names=["main"]).ok
    assert {i: a for i, a in _amounts(env).items() if i in wrong} == {
        i: right[i] * 100 for i in wrong
    }


def test_a_correction_by_offsets_that_empties_a_required_column_quarantines_the_row(env, spark):
    """A window by offsets in one partition; a correction that makes a ``required`` column
    NULL quarantines its row as the transform would, naming the correction."""
    env.append([_record(i % 2, i, 0) for i in range(8)])
    env.pipeline(
        transform={"select": {"id": "id", "name": "name", "amount": "amount",
                              "version": "version"}, "required": ["id", "name"]},
        corrections=[{"name": "renamed", "partitions": [0], "offsets": [1, 3],
                      "set": {"name": "upper(name)", "amount": "amount + 1"}},
                     {"name": "lost", "partitions": [1], "offsets": [0, 1],
                      "set": {"name": None}}],
    )  # fmt: skip
    assert sources.payload_source(env.load()) is not None  # offsets need no record time
    report = env.run(spark)
    assert report.ok, report.summary()
    rows = dict(env.q(env.sink_dsn, "SELECT id, (name, amount)::text FROM orders"))
    # Partition 0 holds ids 0, 2, 4, 6 at offsets 0..3: offsets 1 and 2 are ids 2 and 4.
    assert rows[2] == "(ORDER-2,3.5)" and rows[4] == "(ORDER-4,6)"
    assert rows[0] == "(order-0,0)" and rows[6] == "(order-6,7.5)"
    assert 1 not in rows  # partition 1 offset 0
    assert env.ledger("SELECT source_partition, source_offset, error_class, reason "
                      "FROM tidemark.dlq") == [
        (1, 0, "transform", "required column name is NULL (from correction lost)")
    ]  # fmt: skip
    assert_exactly_once(env)


def test_a_bad_correction_is_one_clear_line(env, spark):
    env.append([_record(0, 0, 0)])
    env.pipeline(corrections=[{**CENTS, "set": {"id": "id + 1"}}])
    code, out, err = tm(env.cli_env(), "pipelines", "validate", "--offline")
    assert code == 2
    assert_one_clear_line(out, "orders.yaml: corrections[0].set.id: id is a sink key column")
    env.pipeline(corrections=[{**CENTS, "set": {"amount": "amount /"}}])
    with pytest.raises(ConfigError, match=r"corrections\[0\]\.set\.amount: invalid expression"):
        env.run(spark)
    assert env.checkpoints() in ({}, {0: 0})


def test_a_redrive_of_letters_in_the_window_places_their_corrected_values(env, spark):
    """The wrong values sent records to the dead-letter queue (a row check): with the
    correction in the file, redriving their letters places the corrected values, by the
    record time the letters kept."""
    env.append([_record(i % 2, i, minute) for i, minute in enumerate([0, 12, 14, 30])])
    check = {"expect_column_values_to_be_between": {"column": "amount", "max_value": 100}}
    env.pipeline(quality={"rows": [check]})
    assert env.run(spark).ok
    letters = env.ledger("SELECT id FROM tidemark.dlq WHERE status = 'quarantined' ORDER BY id")
    assert len(letters) == 2  # ids 1 and 2: minutes 12 and 14, in cents
    env.pipeline(quality={"rows": [check]}, corrections=[CENTS])
    report = env.redrive(spark, ids=[i for (i,) in letters], by="fay")
    assert report.ok, report.summary()
    assert _amounts(env) == {i: i * 1.25 for i in range(4)}
    assert env.ledger("SELECT count(*) FROM tidemark.dlq WHERE status = 'redriven'") == [(2,)]
    assert_exactly_once(env)
