"""Tombstones (a key and no payload: how a compacted Kafka topic deletes a key), as a pipeline
declares them (docs/pipelines.md, "Tombstones"; docs/design.md, "Re-delivery"). Real
PostgreSQL and Spark."""

from __future__ import annotations

from tests.conftest import order_record
from tests.invariants import assert_exactly_once
from tidemark.core.ranges import Range
from tidemark.driver.run import Backfill

ROWS = "expect_column_values_to_be_between"
KEYED = {
    "select": {
        "id": "cast(cast(_tm_key as string) as int)",
        "name": "name",
        "amount": "amount",
        "version": "version",
    }
}


def order(i: int, amount: float = 1.0) -> tuple:
    return order_record(0, i, f"o{i}", amount)


def tombstone(i: int) -> tuple:
    return (0, str(i).encode(), None, None, None)


def ids(env) -> list[tuple]:
    return env.q(env.sink_dsn, "SELECT id, _tm_offset FROM orders ORDER BY id")


def letters(env) -> list[tuple]:
    return env.ledger(
        "SELECT source_offset, error_class::text, reason, status::text "
        "FROM tidemark.dlq ORDER BY source_offset"
    )


def test_a_tombstone_deletes_its_keys_row_and_no_backfill_brings_it_back(env, spark):
    env.append([order(1), order(2)])
    env.pipeline(transform=KEYED, tombstones="delete")
    assert env.run(spark).ok
    env.append([tombstone(1)])
    report = env.run(spark)
    assert report.ok and report.sinks["main"].counts.tombstones == 1, report.summary()
    assert ids(env) == [(2, 1)] and letters(env) == []
    # Re-delivering the older version of key 1 (offset 0, before the tombstone) places
    # nothing: the tombstone is its key's newest version.
    back = env.run(spark, mode=Backfill([Range(0, 0, 2)]))
    assert back.ok and back.sinks["main"].counts.superseded == 1, back.summary()
    assert ids(env) == [(2, 1)] and letters(env) == []
    # A newer version brings the key back.
    env.append([order(1, 7.0)])
    assert env.run(spark).ok
    assert ids(env) == [(1, 3), (2, 1)]
    assert_exactly_once(env, tombstones=True)


def test_tombstones_are_dead_letters_where_the_pipeline_keeps_them(env, spark):
    env.append([order(1), tombstone(1)])
    env.pipeline(transform=KEYED)  # tombstones: quarantine, the default
    assert env.run(spark).ok
    assert ids(env) == [(1, 0)]
    assert letters(env) == [
        (
            1,
            "decode",
            "tombstone (a key and no payload): this sink keeps "
            "tombstones as dead letters (tombstones: quarantine)",
            "quarantined",
        )
    ]
    assert_exactly_once(env)


def test_a_tombstone_whose_key_the_transform_cannot_derive_is_quarantined(env, spark):
    env.append([order(1), tombstone(1)])
    env.pipeline(tombstones="delete")  # id from the payload: a tombstone has none
    assert env.run(spark).ok
    assert ids(env) == [(1, 0)]
    ((off, cls, reason, status),) = letters(env)
    assert (off, cls, status) == (1, "transform", "quarantined")
    assert "key column id is NULL" in reason and "_tm_key" in reason, reason
    assert_exactly_once(env)


def _delete_and_backfill_the_newest_failing(env, spark) -> None:
    """The pipeline deletes on tombstones and now fails key 1's newest version (offset 2,
    amount 500): a backfill of that offset."""
    env.pipeline(
        transform=KEYED,
        tombstones="delete",
        quality={"rows": [{ROWS: {"column": "amount", "max_value": 100}}]},
    )
    report = env.run(spark, mode=Backfill([Range(0, 2, 3)]))
    assert report.ok, report.summary()


def test_a_fallback_stops_at_a_tombstone(env, spark):
    """Key 1: a version, a tombstone, a newer version. The newest fails now: the key falls
    back, meets the tombstone first, and stays deleted."""
    env.append([order(1, 10.0), tombstone(1), order(1, 500.0), order(2, 10.0)])
    env.pipeline(transform=KEYED, tombstones="delete")
    first = env.run(spark)
    assert first.ok, first.summary()
    assert ids(env) == [(1, 2), (2, 3)]
    _delete_and_backfill_the_newest_failing(env, spark)
    assert ids(env) == [(2, 3)]
    assert [(o, s) for o, _, _, s in letters(env)] == [(2, "quarantined")]
    # Kept as tombstones again: the backfill of the whole log leaves key 1 deleted.
    again = env.run(spark, mode=Backfill([Range(0, 0, 4)]))
    assert again.ok, again.summary()
    assert ids(env) == [(2, 3)]
    assert_exactly_once(env, tombstones=True)


def test_a_tombstone_kept_as_a_letter_deletes_its_key_when_redriven(env, spark):
    env.append([order(1), order(2), tombstone(1)])
    env.pipeline(transform=KEYED)
    assert env.run(spark).ok
    (letter,) = [i for (i,) in env.ledger("SELECT id FROM tidemark.dlq")]
    env.pipeline(transform=KEYED, tombstones="delete")
    rep = env.redrive(spark, ids=[letter], by="fay")
    assert rep.ok and rep.redrive["redriven"] == 1, rep.summary()
    assert rep.sinks["main"].counts.tombstones == 1
    assert ids(env) == [(2, 1)]
    assert [(o, s) for o, _, _, s in letters(env)] == [(2, "redriven")]
    assert_exactly_once(env, tombstones=True)


def test_a_fallback_to_a_tombstone_a_letter_held_applies_it_and_resolves_the_letter(env, spark):
    """Found by `tidemark chaos --seed 38`: a tombstone kept as a dead letter, then the
    pipeline deletes; a fallback that meets it applied it and left its letter live (placed
    twice). Now it is placed once: applied, its letter resolved."""
    env.append([order(1, 10.0), tombstone(1), order(1, 500.0)])
    env.pipeline(transform=KEYED)  # tombstones kept as letters
    assert env.run(spark).ok
    assert ids(env) == [(1, 2)] and [(o, s) for o, _, _, s in letters(env)] == [(1, "quarantined")]
    _delete_and_backfill_the_newest_failing(env, spark)
    assert ids(env) == []
    assert [(o, s) for o, _, _, s in letters(env)] == [(1, "redriven"), (2, "quarantined")]
    assert_exactly_once(env, tombstones=True)


def test_a_tombstone_kept_after_a_key_change_gives_its_older_version_back(env, spark):
    """Chaos seed 27, step 56: a tombstone deleted key 1, superseding offset 0. The pipeline
    then keeps tombstones as letters and maps keys anew: a backfill of the tombstone alone is
    refused (a key change: offset 0's key now, the old transform alone knew). One from the
    first record quarantines the tombstone and places offset 0 as key 101: not lost."""
    env.append([order(1), tombstone(1)])
    env.pipeline(transform=KEYED, tombstones="delete")
    assert env.run(spark).ok
    assert ids(env) == [] and letters(env) == []
    moved = {"select": {**KEYED["select"], "id": "cast(cast(_tm_key as string) as int) + 100"}}
    env.pipeline(transform=moved, tombstones="quarantine")
    refused = env.run(spark, mode=Backfill([Range(0, 1, 2)]))
    error = refused.sinks["main"].error or ""
    assert not refused.ok and "partition 0 offset 1: (1) -> (101)" in error, error
    back = env.run(spark, mode=Backfill([Range(0, 0, 2)]))
    assert back.ok, back.summary()
    assert ids(env) == [(101, 0)]
    assert [(o, s) for o, _c, _r, s in letters(env)] == [(1, "quarantined")]
    assert_exactly_once(env)
