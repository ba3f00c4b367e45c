"""Sources against real writers: the postgres_log watermark, and a file archive through Spark."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import psycopg
import pyarrow as pa
import pytest

from tidemark.config import PostgresLogSource
from tidemark.core.errors import TidemarkError
from tidemark.ledger.state import Range
from tidemark.sources import BATCH_ROWS, SCHEMA
from tidemark.sources.file_archive import write_segment
from tidemark.sources.postgres_log import PostgresLogPlanner, read_range


def _planner(env) -> PostgresLogPlanner:
    src = PostgresLogSource(type="postgres_log", dsn=env.ledger_dsn, table="src.log")
    return PostgresLogPlanner(src, env.ledger_dsn)


def _insert(conn, offset: int, partition: int = 0) -> None:
    conn.execute('INSERT INTO src.log ("partition", "offset", payload) VALUES (%s, %s, %s)',
                 (partition, offset, b"{}"))


def test_the_reader_stops_below_a_writer_that_has_not_committed(env):
    env.append_orders(range(0, 10, 2), partitions=1)  # offsets 0..4, committed
    planner = _planner(env)
    with psycopg.connect(env.ledger_dsn) as slow, psycopg.connect(env.ledger_dsn) as fast:
        _insert(slow, 5)          # takes offset 5, still running
        _insert(fast, 6)
        fast.commit()             # offset 6 is visible before 5
        assert planner.safe_end(0, 0, 100) == 5
        assert planner.safe_end(0, 5, 100) == 5   # never steps over the gap
        slow.commit()
    assert planner.safe_end(0, 0, 100) == 7
    assert planner.safe_end(0, 0, 3) == 3        # the batch limit caps it
    planner.close()


def test_rows_of_transactions_newer_than_the_oldest_running_one_wait(env):
    env.append_orders(range(3), partitions=1)    # offsets 0..2
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
    source = PostgresLogSource(type="postgres_log", dsn=env.ledger_dsn,
                               **{"table": "src.log", **src})
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
    assert (first[0]["_tm_key"], first[0]["_tm_payload"], first[0]["_tm_headers"]) == \
        (None, bad, None)
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
    cols = {"partition": "p", "offset": "o", "key": "k", "payload": "body", "headers": "h",
            "ts": "at", "xid": "x"}
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
        recs = [{"partition": part, "offset": o, "key": f"{part}-{o}".encode(),
                 "payload": json.dumps({"id": part * 100 + o, "name": f"n{o}", "amount": 1.0,
                                        "version": 1}).encode(),
                 "headers": None, "ts": ts} for o in offs]
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
