"""What the source no longer holds, and what it holds only now (issue 45, cases 4 and 5;
docs/design.md, invariant 2 and "Re-delivery").

Case 4: a re-delivery (rebuild, backfill, a backfill's fallback reads) over positions the
source no longer holds (retention dropped a segment or a row, a tombstone among them)
refuses without --accept-pruned; with it, what the source no longer holds stays as it is,
and a dropped tombstone still deletes its key.

Case 5: a record that appears below a checkpoint, inside a gap the sink stepped over (a late
segment), is reported with the backfill that places it; that backfill places it.
Real PostgreSQL, Spark, file archives and the postgres_log source."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime

import psycopg
import pytest

from tests.test_cli import tm
from tidemark.core.errors import TidemarkError
from tidemark.core.ranges import Range
from tidemark.devstack.archive_writer import write_segment
from tidemark.driver.modes import Backfill, Rebuild
from tidemark.driver.run import Run
from tidemark.protocol.sinks import tombstone_name

KEYED = {
    "select": {
        "id": "cast(cast(_tm_key as string) as int)",
        "name": "name",
        "amount": "amount",
        "version": "version",
    }
}


def _rec(o: int, i: int | None, *, tomb: bool = False, p: int = 0, amount: float = 1.0) -> dict:
    """Archive record at offset ``o`` of order ``i`` (a tombstone of key ``i``)."""
    body = {"id": i, "name": f"o{i}", "amount": amount, "version": 1}
    return {
        "partition": p,
        "offset": o,
        "key": str(i).encode(),
        "payload": None if tomb else json.dumps(body).encode(),
        "headers": None,
        "ts": datetime(2026, 1, 1, tzinfo=UTC),
    }


def _archive_world(env, spark, tmp_path):
    """Three segments of partition 0: orders 0-4 at offsets 0-4; orders 5-8 at 5-8 and a
    tombstone of order 1 at 9; orders 10-12 at 10-12. Delivered, then retention (or an
    operator) deletes the middle segment."""
    archive = tmp_path / "archive"
    write_segment(str(archive), 0, [_rec(o, o) for o in range(5)], "parquet")
    middle = write_segment(
        str(archive), 0, [*(_rec(o, o) for o in range(5, 9)), _rec(9, 1, tomb=True)], "jsonl"
    )
    write_segment(str(archive), 0, [_rec(o, o) for o in range(10, 13)], "parquet")
    env.pipeline(
        source={"type": "file_archive", "uri": str(archive)}, transform=KEYED, tombstones="delete"
    )
    assert env.run(spark).ok
    kept = [0, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12]
    assert _ids(env) == kept
    os.remove(middle)
    return kept


def _tombs(env) -> list[tuple]:
    table = tombstone_name("public.orders")
    return env.q(env.sink_dsn, f"SELECT id, _tm_offset FROM tidemark.{table} ORDER BY id")


def _ids(env) -> list[int]:
    return [i for (i,) in env.q(env.sink_dsn, "SELECT id FROM orders ORDER BY id")]


def _rebuild(env, spark, accept: bool = False):
    return env._execute(
        Run, spark, "orders", mode=Rebuild("main", accept_pruned=accept), sink_names=["main"]
    )


def test_a_rebuild_over_a_deleted_middle_segment_refuses_and_keeps_its_tombstone(
    env, spark, tmp_path
):
    kept = _archive_world(env, spark, tmp_path)
    report = _rebuild(env, spark)
    assert not report.ok, "the rebuild left out 4 rows and brought order 1 back"
    error = report.sinks["main"].error
    assert error == (
        "sink main: the source no longer holds the records of 4 rows and 1 tombstone of "
        "public.orders (partition 0: 4 rows and 1 tombstone at offsets 5 to 9; retention "
        "pruned them); a rebuild would leave them out of the new table. Rebuild from what the "
        "source holds with --accept-pruned (the old table keeps them; deleted keys stay "
        "deleted)"
    ), error
    assert _ids(env) == kept

    report = _rebuild(env, spark, accept=True)
    assert report.ok, report.summary()
    # Rows 5-8 are left out (the old table keeps them); order 1 stays deleted: its tombstone
    # is carried into the new table's tombstone table.
    assert _ids(env) == [0, 2, 3, 4, 10, 11, 12]
    assert _tombs(env) == [(1, 9)]


def test_a_backfill_over_a_deleted_middle_segment_refuses_and_keeps_what_is_gone(
    env, spark, tmp_path
):
    kept = _archive_world(env, spark, tmp_path)
    report = env.run(spark, mode=Backfill([Range(0, 0, 13)]))
    assert not report.ok, "the backfill removed rows 5-8 and brought order 1 back"
    error = report.sinks["main"].error
    assert error == (
        "sink main: the source no longer holds the records of 4 rows and 1 tombstone of "
        "public.orders (partition 0: 4 rows and 1 tombstone at offsets 5 to 9; retention "
        "pruned them); a backfill would remove them. Backfill what the source holds with "
        "--accept-pruned (what it no longer holds stays as it is)"
    ), error
    assert _ids(env) == kept

    report = env.run(spark, mode=Backfill([Range(0, 0, 13)], accept_pruned=True))
    assert report.ok, report.summary()
    assert _ids(env) == kept  # rows 5-8 stay, order 1 stays deleted
    assert _tombs(env) == [(1, 9)]


def test_a_backfills_fallback_over_a_deleted_segment_refuses(env, spark, tmp_path):
    """Order 0's newest version (offset 10) fails a new check, so the backfill of [10, 13)
    falls back to an older version of key 0, over offsets where a segment was deleted: the
    version it would fall back to may not be the newest the sink had."""
    archive = tmp_path / "archive"
    write_segment(str(archive), 0, [_rec(o, o) for o in range(5)], "parquet")
    middle = write_segment(str(archive), 0, [_rec(o, o) for o in range(5, 10)], "jsonl")
    write_segment(
        str(archive), 0, [_rec(10, 0, amount=100.0), _rec(11, 11), _rec(12, 12)], "parquet"
    )
    source = {"type": "file_archive", "uri": str(archive)}
    env.pipeline(source=source, transform=KEYED)
    assert env.run(spark).ok
    os.remove(middle)
    rows = "expect_column_values_to_be_between"
    env.pipeline(
        source=source,
        transform=KEYED,
        quality={"rows": [{rows: {"column": "amount", "max_value": 3}}]},
    )
    with pytest.raises(TidemarkError) as err:
        env.run(spark, mode=Backfill([Range(0, 10, 13)]))
    assert str(err.value) == (
        "sink main: keys fall back to older versions, but the source no longer holds the "
        "records of 5 rows of public.orders (partition 0: 5 rows at offsets 5 to 9; "
        "retention pruned them) where those versions lie. Backfill with --accept-pruned to "
        "fall back to what the source holds"
    ), err.value
    assert env.q(env.sink_dsn, "SELECT id, _tm_offset FROM orders WHERE id = 0") == [(0, 10)]
    report = env.run(spark, mode=Backfill([Range(0, 10, 13)], accept_pruned=True))
    assert report.ok, report.summary()
    assert env.q(env.sink_dsn, "SELECT id, _tm_offset FROM orders WHERE id = 0") == [(0, 0)]
    assert _ids(env) == [*range(10), 11, 12]


def test_a_rebuild_refuses_when_the_source_dropped_a_postgres_log_tombstone(env, spark):
    """Order 2 in partition 0; its tombstone (version 9) in partition 1, whose rows
    retention deletes. The rebuild read partition 0 alone and brought order 2 back."""
    transform = {"select": {**KEYED["select"], "version": "coalesce(version, 9)"}}
    env.append([(0, b"1", json.dumps({"name": "a", "amount": 1.0, "version": 1}).encode(),
                 None, None),
                (0, b"2", json.dumps({"name": "b", "amount": 1.0, "version": 1}).encode(),
                 None, None),
                (1, b"2", None, None, None)])  # fmt: skip
    env.pipeline(
        transform=transform, tombstones="delete", sinks=[env.orders_sink(version="version")]
    )
    assert env.run(spark).ok
    assert _ids(env) == [1]
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        c.execute('DELETE FROM src.log WHERE "partition" = 1')
    report = _rebuild(env, spark)
    assert not report.ok, "the rebuild brought order 2 back"
    assert "1 tombstone of public.orders (partition 1: 1 tombstone at offset 0;" in (
        report.sinks["main"].error or ""
    ), report.sinks["main"].error
    assert _ids(env) == [1]
    assert _rebuild(env, spark, accept=True).ok
    assert _ids(env) == [1]
    # And a backfill of order 2's version keeps it deleted.
    assert env.run(spark, mode=Backfill([Range(0, 0, 2)])).ok
    assert _ids(env) == [1]


def test_a_late_segment_in_a_gap_the_sink_stepped_over_is_reported_and_placed(env, spark, tmp_path):
    archive = tmp_path / "archive"
    write_segment(str(archive), 0, [_rec(o, o) for o in range(5)], "parquet")
    write_segment(str(archive), 0, [_rec(o, o) for o in range(10, 15)], "jsonl")
    env.pipeline(source={"type": "file_archive", "uri": str(archive)}, transform=KEYED)
    assert env.run(spark).ok
    assert env.checkpoints() == {0: 15}
    # A replayed upload: offsets 5 and 6 arrive in the gap the sink stepped over.
    write_segment(str(archive), 0, [_rec(o, o) for o in (5, 6)], "parquet")
    assert env.run(spark).run_id is None  # nothing new above the checkpoint
    fix = "tidemark backfill orders --partition 0 --from 5 --to 10 --sink main"
    code, out, err = tm(env.cli_env(), "status", "orders")
    assert code == 0, err
    assert (
        "LATE: sink main partition 0: 2 record(s) at offsets [5, 10) appeared below the "
        f"checkpoint, in a gap the sink stepped over; place them: {fix}"
    ) in out, out
    code, out, err = tm(env.cli_env(), "recover")
    assert code == 1 and f"place them: {fix}" in out, (code, out, err)
    # The maintenance DAG's check alerts through the pipeline's channels.
    from tidemark.airflow.health import check_health

    problems = check_health({"orders": env.load()}, env.ledger_dsn).problems
    assert [pr.what for pr in problems if pr.pipeline == "orders"] == [
        "sink main partition 0: 2 record(s) at offsets [5, 10) appeared below the checkpoint, "
        f"in a gap the sink stepped over; place them: {fix}"
    ], problems

    assert env.run(spark, mode=Backfill([Range(0, 5, 10)])).ok
    assert _ids(env) == [*range(7), *range(10, 15)]
    code, out, err = tm(env.cli_env(), "status", "orders")
    assert code == 0 and "LATE" not in out, out
    code, out, err = tm(env.cli_env(), "recover")
    assert code == 0, (out, err)
    # What the backfill stepped over itself ([7, 10)) is watched in turn.
    write_segment(str(archive), 0, [_rec(8, 8)], "jsonl")
    code, out, err = tm(env.cli_env(), "status", "orders")
    assert "LATE: sink main partition 0: 1 record(s) at offsets [7, 10) appeared" in out, out


def test_an_accepted_backfill_from_below_the_sources_first_record_places_what_it_holds(env, spark):
    """Retention deleted the oldest records; a backfill of everything committed, with
    --accept-pruned, re-delivers what the source still holds and leaves the rest as it is
    (the reader was handed the whole range and failed below the first record left)."""
    env.append_orders(range(1, 9), partitions=1)
    env.pipeline()
    assert env.run(spark).ok
    assert env.checkpoints() == {0: 8}
    with psycopg.connect(env.ledger_dsn, autocommit=True) as c:
        c.execute('DELETE FROM src.log WHERE "partition" = 0 AND "offset" < 3')
    refused = env.run(spark, mode=Backfill([Range(0, 0, 8)]))
    assert not refused.ok and "no longer holds" in (refused.sinks["main"].error or "")
    report = env.run(spark, mode=Backfill([Range(0, 0, 8)], accept_pruned=True))
    assert report.ok, report.sinks["main"].error
    rows = env.q(env.sink_dsn, "SELECT id, _tm_offset FROM orders ORDER BY id")
    assert rows == [(i, i - 1) for i in range(1, 9)]  # every row once, kept or placed again
    assert env.checkpoints() == {0: 8} and env.prepared() == []
