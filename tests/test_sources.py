"""Sources against real writers: the postgres_log watermark, and a file archive through Spark."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import psycopg
import pyarrow as pa
import pytest

from tidemark.config import PostgresLogSource
from tidemark.core.errors import TidemarkError
from tidemark.core.ranges import Range
from tidemark.devstack.archive_writer import write_segment
from tidemark.sources import BATCH_ROWS, SCHEMA
from tidemark.sources.postgres_log import PostgresLogPlanner, read_range


def _planner(env) -> PostgresLogPlanner:
    src = PostgresLogSource(type="postgres_log", dsn=env.ledger_dsn, table="src.log")
    return PostgresLogPlanner(src, env.ledger_dsn)


def _insert(conn, offset: int, partition: int = 0) -> None:
    conn.execute(
        'INSERT INTO src.log ("partition", "offset", payload) VALUES (%s, %s, %s)',
        (partition, offset, b"{}"),
    )


def test_the_reader_stops_below_a_writer_that_has_not_committed(env):
    env.append_orders(range(0, 10, 2), partitions=1)  # offsets 0..4, committed
    planner = _planner(env)
    with psycopg.connect(env.ledger_dsn) as slow, psycopg.connect(env.ledger_dsn) as fast:
        _insert(slow, 5)  # takes offset 5, still running
        _insert(fast, 6)
        fast.commit()  # offset 6 is visible before 5
        assert planner.safe_end(0, 0, 100) == 5
        assert planner.safe_end(0, 5, 100) == 5  # never steps over the gap
        slow.commit()
    assert planner.safe_end(0, 0, 100) == 7
    assert planner.safe_end(0, 0, 3) == 3  # the batch limit caps it
    planner.close()


def test_rows_of_transactions_newer_than_the_oldest_running_one_wait(env):
    env.append_orders(range(3), partitions=1)  # offsets 0..2
    planner = _planner(env)
    with psycopg.connect(env.ledger_dsn) as old, psycopg.connect(env.ledger_dsn) as writer:
        old.execute("SELECT pg_current_xact_id()")  # an older transaction, still running
        _insert(writer, 3)
        writer.commit()
        # Offset 3 is visible, but its writer is newer than xmin: not settled yet.
        assert planner.safe_end(0, 0, 100) == 3
        old.rollback()
    assert planner.safe_end(0, 0, 100) == 4
    assert planner.partitions() == [0]
    assert planner.earliest(0) == 0
    planner.close()


def _read(env, r: Range, **src) -> pa.Table:
    source = PostgresLogSource(
        type="postgres_log", dsn=env.ledger_dsn, **{"table": "src.log", **src}
    )
    batches = list(read_range(source, r))
    assert all(b.schema == SCHEMA and b.num_rows <= BATCH_ROWS for b in batches)
    return pa.Table.from_batches(batches, SCHEMA)


def test_the_range_reader_gives_every_record_exactly_as_stored(env):
    bad = b"\xff\xfe not utf-8 \x00"
    ts = datetime(1999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)
    env.append([(1, None, bad, None, ts), (1, b"k", b"{}", '{"h": "\u00e9"}', ts)])
    env.append([(1, str(i).encode(), b"{}", None, None) for i in range(BATCH_ROWS + 5)])
    got = _read(env, Range(1, 0, BATCH_ROWS + 7))
    assert got.column("_tm_offset").to_pylist() == list(range(BATCH_ROWS + 7))
    assert set(got.column("_tm_partition").to_pylist()) == {1}
    first = got.slice(0, 2).to_pylist()
    assert (first[0]["_tm_key"], first[0]["_tm_payload"], first[0]["_tm_headers"]) == (
        None,
        bad,
        None,
    )
    assert first[0]["_tm_ts"] == ts and first[1]["_tm_key"] == b"k"
    assert json.loads(first[1]["_tm_headers"]) == {"h": "é"}
    assert _read(env, Range(1, 3, 5)).column("_tm_offset").to_pylist() == [3, 4]


def test_the_range_reader_refuses_a_gap_or_a_short_range(env):
    env.append_orders(range(10), partitions=1)
    env.ledger('DELETE FROM src.log WHERE "offset" = 4 RETURNING 1')
    with pytest.raises(TidemarkError, match="expected offset 4, found 5"):
        _read(env, Range(0, 0, 10))
    with pytest.raises(TidemarkError, match=r"range \[5, 12\) ended at 10: rows missing"):
        _read(env, Range(0, 5, 12))


def test_a_users_log_table_with_a_text_key_and_a_naive_time_reads_as_bytes_and_utc(env):
    with psycopg.connect(env.ledger_dsn) as c:
        c.execute("""CREATE TABLE src.mine (p int, o bigint, k text, body bytea, h jsonb,
        at timestamp, x xid8 DEFAULT pg_current_xact_id(), PRIMARY KEY (p, o));
        INSERT INTO src.mine (p, o, k, body, h, at) VALUES
        (0, 0, 'clé', 'x', NULL, '2013-01-01 10:15:00')""")
    cols = {
        "partition": "p",
        "offset": "o",
        "key": "k",
        "payload": "body",
        "headers": "h",
        "ts": "at",
        "xid": "x",
    }
    row = _read(env, Range(0, 0, 1), table="src.mine", columns=cols).to_pylist()[0]
    assert row["_tm_key"] == "clé".encode() and row["_tm_payload"] == b"x"
    assert row["_tm_ts"] == datetime(2013, 1, 1, 10, 15, tzinfo=UTC)


def test_append_gives_dense_commit_ordered_offsets_per_partition(env):
    spans = env.append_orders(range(7), partitions=3)
    assert spans == {0: (0, 3), 1: (0, 2), 2: (0, 2)}
    assert env.append_orders([9], partitions=3) == {0: (3, 4)}
    assert env.source_offsets() == {0: 4, 1: 2, 2: 2}


def test_a_file_archive_pipeline_delivers_exactly_once(env, spark, tmp_path):
    archive = tmp_path / "archive"
    ts = datetime(2026, 1, 1, tzinfo=UTC)
    offsets = {0: [0, 1, 2, 5, 6], 1: [10, 11, 12]}  # a compaction gap in partition 0
    for part, offs in offsets.items():
        recs = [
            {
                "partition": part,
                "offset": o,
                "key": f"{part}-{o}".encode(),
                "payload": json.dumps(
                    {"id": part * 100 + o, "name": f"n{o}", "amount": 1.0, "version": 1}
                ).encode(),
                "headers": None,
                "ts": ts,
            }
            for o in offs
        ]
        write_segment(str(archive), part, recs[:3], "jsonl")
        if recs[3:]:
            write_segment(str(archive), part, recs[3:], "jsonl")
    env.pipeline(source={"type": "file_archive", "uri": str(archive), "format": "jsonl"})
    report = env.run(spark)
    assert report.ok, report.summary()
    assert report.records == 8
    assert env.checkpoints() == {0: 7, 1: 13}
    ids = [r[0] for r in env.q(env.sink_dsn, "SELECT id FROM orders ORDER BY id")]
    assert ids == [0, 1, 2, 5, 6, 110, 111, 112]
    assert env.run(spark).run_id is None  # up to date
    assert env.prepared() == []


def _archive_records(part: int, offsets) -> list[dict]:
    ts = datetime(2026, 1, 1, tzinfo=UTC)
    return [
        {
            "partition": part,
            "offset": o,
            "key": f"{part}-{o}".encode(),
            "payload": json.dumps(
                {"id": part * 1000 + o, "name": f"n{o}", "amount": 1.0, "version": 1}
            ).encode(),
            "headers": {"seg": o // 50},
            "ts": ts,
        }
        for o in offsets
    ]


def _write_mixed(archive, parts=(0, 1), segments: int = 4, size: int = 50, first: int = 0):
    """``segments`` segments of ``size`` records per partition, Parquet and JSON Lines in
    turn (the reproduction of issue 32)."""
    for part in parts:
        for i in range(segments):
            base = first + i * size
            write_segment(
                str(archive),
                part,
                _archive_records(part, range(base, base + size)),
                ("parquet", "jsonl")[i % 2],
            )


def _placed(env) -> list[tuple[int, int]]:
    """(partition, offset) of every record in the sink or in a live dead letter."""
    rows = env.q(env.sink_dsn, "SELECT _tm_partition, _tm_offset FROM orders")
    dead = env.ledger(
        "SELECT source_partition, source_offset FROM tidemark.dlq WHERE pipeline = 'orders'"
    )
    return sorted(rows + dead)


@pytest.mark.parametrize("declared", [None, "parquet"])
def test_an_archive_mixing_formats_is_delivered_whole(env, spark, tmp_path, declared):
    """Issue 32: with format parquet, the .jsonl segments were skipped as gaps (200 of 400
    records placed, checkpoints past the rest, exit 0)."""
    archive = tmp_path / "archive"
    _write_mixed(archive)
    (archive / "partition=0" / "_SUCCESS").write_bytes(b"")
    (archive / "partition=1" / "README").write_text("segments of orders")
    source = {"type": "file_archive", "uri": str(archive)}
    env.pipeline(source=source if declared is None else {**source, "format": declared})
    report = env.run(spark)
    assert report.ok, report.summary()
    assert report.records == 400
    assert env.checkpoints() == {0: 200, 1: 200}
    assert env.ledger("SELECT count(*) FROM tidemark.dlq") == [(0,)]
    assert _placed(env) == [(p, o) for p in (0, 1) for o in range(200)]  # each exactly once
    assert env.run(spark).run_id is None  # up to date
    assert env.prepared() == []


def test_records_an_earlier_run_stepped_over_are_placed_by_a_backfill(env, spark, tmp_path):
    """The repair for an archive read before issue 32's fix: the .jsonl segments' records lie
    below the checkpoint, placed nowhere; a backfill of the range places them."""
    from tidemark.driver.modes import Backfill

    archive = tmp_path / "archive"
    for base in (0, 100):
        write_segment(str(archive), 0, _archive_records(0, range(base, base + 50)), "parquet")
    env.pipeline(source={"type": "file_archive", "uri": str(archive), "format": "parquet"})
    assert env.run(spark).ok  # [50, 100) read as a gap, as the old reader read it
    for base in (50, 150):  # the .jsonl segments the old reader left out
        write_segment(str(archive), 0, _archive_records(0, range(base, base + 50)), "jsonl")
    assert env.run(spark).ok
    assert env.checkpoints() == {0: 200}
    assert _placed(env) == [(0, o) for o in (*range(50), *range(100, 200))]
    assert env.run(spark, mode=Backfill([Range(0, 0, 200)])).ok
    assert _placed(env) == [(0, o) for o in range(200)]
    assert env.checkpoints() == {0: 200}
    assert env.prepared() == []


def _cut(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# Each leaves partition 1 with a segment the source cannot read below a good one (at 300).
_DAMAGES = {
    "corrupt jsonl": lambda folder: (folder / f"{250:020d}.jsonl").write_bytes(
        b"\x00\xff{not json\n"
    ),
    "truncated parquet": lambda folder: _cut(folder / f"{200:020d}.parquet"),
    "unknown extension": lambda folder: (folder / f"{200:020d}.parquet").rename(
        folder / f"{200:020d}.avro"
    ),
    "base offset not its first record": lambda folder: (folder / f"{200:020d}.parquet").rename(
        folder / f"{190:020d}.parquet"
    ),
}
_PROBLEMS = {
    "corrupt jsonl": f"{250:020d}.jsonl line 1: not JSON",
    "truncated parquet": f"{200:020d}.parquet: cannot read: ",
    "unknown extension": f"{200:020d}.avro: unknown segment format",
    "base offset not its first record": f"{190:020d}.parquet: first record has offset 200, not "
    f"the base offset 190",
}


@pytest.mark.parametrize("damage", list(_DAMAGES))
def test_a_segment_the_source_cannot_read_fails_the_run_and_keeps_the_checkpoint(
    env, spark, tmp_path, damage
):
    archive = tmp_path / "archive"
    _write_mixed(archive)
    env.pipeline(source={"type": "file_archive", "uri": str(archive)})
    assert env.run(spark).ok
    _write_mixed(archive, segments=3, first=200)  # 200.parquet, 250.jsonl, 300.parquet
    _DAMAGES[damage](archive / "partition=1")
    with pytest.raises(TidemarkError) as err:
        env.run(spark)
    message = str(err.value)
    assert f"partition=1/{_PROBLEMS[damage]}" in message, message
    assert "\n" not in message
    assert env.checkpoints() == {0: 200, 1: 200}  # partition 0's good segments wait too
    assert _placed(env) == [(p, o) for p in (0, 1) for o in range(200)]
    assert env.prepared() == []


# Payloads on which Arrow's parser and Spark's from_json could disagree: each must decode
# (values, verdict, reason) exactly as Spark alone decodes it.
_EDGES = [
    b'{"id": 1, "name": "plain", "amount": 1.5, "ok": true, "big": 9007199254740993}',
    b'{"id": 2.0}',
    b'{"id": "3"}',
    b'{"id": 1e2}',
    b'{"id": 3000000000}',
    b'{"id": -0}',
    b'{"name": 5}',
    b'{"name": {"x": 1}}',
    b'{"name": [1]}',
    b'{"name": null}',
    b'{"amount": "1.5"}',
    b'{"amount": NaN}',
    b'{"amount": Infinity}',
    b'{"amount": -Infinity}',
    b'{"amount": 1e400}',
    b'{"amount": 12345678901234567890}',
    b'{"amount": 0.1}',
    b'{"ok": 1}',
    b'{"ok": "true"}',
    b'{"big": 9223372036854775808}',
    b'{"id": 1, "id": 2}',
    b"[1, 2]",
    b"5",
    b"null",
    b'"text"',
    b"{}",
    b"",
    b"   ",
    b'{"id": 1}{"id": 2}',
    b'{"id": 1} {"id": 2}',
    b'{"id": 1} x',
    b'{"id": 1,}',
    b'{"id": 1} null',
    b'{"id": 1} null {"id": 2}',
    b' {"id": 13} ',
    b'{"id": 14} ',
    b'{\n  "id": 7,\n  "name": "pretty"\n}',
    b'{"id": 8}\r',
    b'\xef\xbb\xbf{"id": 9}',
    b'{"name": "caf\xc3\xa9 \\u00e9 \\ud83d\\ude00"}',
    b'{"name": "\\ud800"}',
    b'{"name": "\xff"}',
    b'{"name": "a\\u0000b"}',
    b'{"name": "line\\nbreak"}',
    b'{"name": "\xe2\x80\xa8"}',
    b'{"ID": 10}',
    b'{"extra": {"deep": [1, 2]}, "id": 11}',
    b'{"name": "' + b"x" * 5000 + b'"}',
    b'{"id": 12, "amount": 3}',
    *(
        b'{"at": %s}' % t
        for t in (
            b'"2013-08-25T20:00:00Z"',
            b'"2013-08-25T20:00:00+02:00"',
            b'"2013-08-25T20:00:00-0530"',
            b'"2013-08-25 20:00:00Z"',
            b'"2013-08-25 20:00:00"',
            b'"2013-08-25"',
            b'"2013-08-25Z"',
            b'"2013-08-25T20:00Z"',
            b'"2013-08-25T20Z"',
            b'"2013-08-25T20:00:00.123456Z"',
            b'"2013-08-25T20:00:00.1234567Z"',
            b'"2013-08-25T20:00:00.5Z"',
            b'"2013-08-25T23:59:60Z"',
            b'"0001-01-01T00:00:00Z"',
            b'"9999-12-31T23:59:59Z"',
            b'"+12013-01-01T00:00:00Z"',
            b'"2013-08-25T20:00:00z"',
            b'"2013-02-30T00:00:00Z"',
            b'"2013-08-25T24:00:00Z"',
            b'"20130825T200000Z"',
            b'"2013-08-25T20:00:00 UTC"',
            b"1377460800",
            b"null",
            b"true",
        )
    ),
]


def test_payloads_the_reader_decodes_with_arrow_decode_as_spark_alone_would(env, spark):
    from tidemark.driver.modes import Delivery
    from tidemark.engine import records
    from tidemark.sources import json_arrow

    clean = [
        json.dumps(
            {"id": i, "name": f"n{i}", "amount": i / 3, "ok": i % 2 == 0, "big": i * 10**12}
        ).encode()
        for i in range(2000)
    ]
    payloads = clean[:1000] + _EDGES + clean[1000:]
    env.append([(0, str(i).encode(), p, None, None) for i, p in enumerate(payloads)])
    env.pipeline(
        decode={
            "schema": {
                "id": "int",
                "name": "string",
                "amount": "double",
                "ok": "boolean",
                "big": "bigint",
                "at": "timestamp",
            }
        },
        # Naming the payload keeps every one in the batch: Spark alone decodes it too.
        transform={"select": {"id": "id", "size": "length(_tm_payload)"}},
    )
    p = env.load()
    df = Delivery().source(spark, p, [Range(0, 0, len(payloads))])
    assert json_arrow.OK in df.columns
    pre = df.where(json_arrow.OK).count()
    assert 1000 <= pre < len(payloads), pre  # Arrow took the clean chunks, not every chunk

    from pyspark.sql import functions as F

    # A timestamp as microseconds since the epoch: the instant, in no time zone.
    cols = [
        "_tm_offset",
        "id",
        "name",
        "amount",
        "ok",
        "big",
        F.unix_micros("at").alias("at"),
        records.ERR_CLASS,
        records.ERR_REASON,
    ]
    fast = records.decode(df, p).select(*cols).orderBy("_tm_offset").collect()
    alone = df.drop(json_arrow.OK, *(json_arrow.column(i) for i in range(6)))
    slow = records.decode(alone, p).select(*cols).orderBy("_tm_offset").collect()
    assert len(fast) == len(payloads)
    for a, b in zip(fast, slow, strict=True):
        same = all(x == y or (x != x and y != y) for x, y in zip(a, b, strict=True))  # NaN
        assert same, (payloads[a["_tm_offset"]][:80], a.asDict(), b.asDict())
    # Every record Arrow decoded, Spark alone decodes with no verdict.
    flagged = {r["_tm_offset"] for r in slow if r[records.ERR_CLASS]}
    ok = {r["_tm_offset"] for r in df.where(json_arrow.OK).select("_tm_offset").collect()}
    assert not ok & flagged
    # Each payload on its own, as Arrow reads it: what it accepts, Spark reads the same.
    fields = json_arrow.fields(p.decode.schema_)
    accepted = 0
    for r in slow:
        one = pa.RecordBatch.from_pydict(
            {"_tm_payload": pa.array([payloads[r["_tm_offset"]]], pa.binary())}
        )
        batch = json_arrow.decode(one, fields)
        at = batch.column(json_arrow.column(5))
        got = batch.set_column(
            batch.schema.get_field_index(json_arrow.column(5)),
            json_arrow.column(5),
            at.cast(pa.int64()),
        ).to_pylist()[0]
        if not got[json_arrow.OK]:
            continue
        accepted += 1
        assert r[records.ERR_CLASS] is None, (payloads[r["_tm_offset"]][:80], r.asDict())
        for i, name in enumerate(fields):
            x, y = got[json_arrow.column(i)], r[name]
            assert x == y or (x != x and y != y), (payloads[r["_tm_offset"]][:80], name, x, y)
    assert accepted > 2000, accepted


def test_a_time_window_maps_to_the_smallest_offset_range_holding_each_of_its_records(env):
    t0 = datetime(2026, 3, 1, tzinfo=UTC)
    with psycopg.connect(env.ledger_dsn) as c:
        # Partition 0's times run out of order at offset 3 (a late producer's clock).
        for off, minute in enumerate([0, 5, 10, 2, 15, 20]):
            c.execute(
                'INSERT INTO src.log ("partition", "offset", payload, ts) VALUES (0, %s, %s, %s)',
                (off, b"{}", t0.replace(minute=minute)),
            )
    planner = _planner(env)
    since, until = t0.replace(minute=1), t0.replace(minute=11)
    # Minutes 5 and 10 (offsets 1, 2) and the late 2 (offset 3): [1, 4).
    assert planner.window(0, since, until, end=6) == (1, 4)
    # Only what lies below ``end`` (the committed checkpoint) counts.
    assert planner.window(0, since, until, end=3) == (1, 3)
    assert planner.window(0, t0.replace(minute=21), t0.replace(minute=30), end=6) is None
    assert planner.window(1, since, until, end=6) is None
