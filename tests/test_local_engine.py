"""The local task runner (tidemark/driver/runners.py): chosen once from Settings.engine, and
refusing, before it claims anything, what only Spark can run. What it runs is proven by the
protocol, crash and composition tests that take the engine fixture."""

from __future__ import annotations

import pytest

from tidemark.core.engines import Engine
from tidemark.core.errors import BadInput
from tidemark.core.ranges import Range
from tidemark.core.settings import Settings
from tidemark.driver.run import Backfill
from tidemark.driver.runners import LocalRunner, SparkRunner, runner_for


def test_the_engine_is_one_setting_spark_by_default(monkeypatch):
    monkeypatch.delenv("TIDEMARK_ENGINE", raising=False)
    assert Settings().engine is Engine.SPARK
    assert isinstance(runner_for(Settings(), None, "t"), SparkRunner)  # no session yet
    monkeypatch.setenv("TIDEMARK_ENGINE", "local")
    assert isinstance(runner_for(Settings(), None, "t"), LocalRunner)
    monkeypatch.setenv("TIDEMARK_ENGINE", "flink")
    with pytest.raises(ValueError, match="engine"):
        Settings()


@pytest.mark.parametrize(
    "overrides, mode, why",
    [
        ({"transform": {"select": {"id": "id * 2"}}}, None, "is an expression"),
        ({"transform": {"python": "tests.nothing:fn"}}, None, "Python function"),
        (
            {"quality": {"rows": [{"expect_column_values_to_not_be_null": {"column": "id"}}]}},
            None,
            "data-quality checks",
        ),
        ({}, Backfill([Range(0, 0, 5)]), "fallback versions"),
        (
            {
                "corrections": [
                    {"name": "cents", "partitions": [0], "offsets": [0, 5], "set": {"amount": "0"}}
                ]
            },
            None,
            "corrections",
        ),
    ],
    ids=["expression", "python", "checks", "backfill", "corrections"],
)
def test_the_local_engine_refuses_what_needs_spark_before_it_claims(env, overrides, mode, why):
    env.append_orders(range(10))
    env.pipeline(**overrides)
    kw = {"mode": mode} if mode else {}
    with pytest.raises(BadInput, match=f"engine local cannot run this .*{why}.*engine spark"):
        env.run(LocalRunner(), **kw)
    assert env.ledger("SELECT count(*) FROM tidemark.runs") == [(0,)]


def _pipeline():
    from tidemark.config import parse

    return parse(
        """
name: arrow_path
source: {type: postgres_log, dsn: "postgresql://u@h/d", table: s.log}
decode:
  format: json
  schema: {id: int, name: string, at: timestamp, ok: boolean, x: double}
transform:
  select: {id: id, name: name, at: at, ok: ok, x: x}
  required: [id, name]
sinks: [{name: w, dsn: "postgresql://u@h/d", table: s.t, key: [id]}]
""",
        "test",
        deep=False,
    )


def _batch(payloads: list[bytes]):
    import pyarrow as pa

    from tidemark.sources.schema import SCHEMA

    n = len(payloads)
    return pa.RecordBatch.from_arrays(
        [
            pa.array([0] * n, pa.int32()),
            pa.array(range(n), pa.int64()),
            pa.array([b"k"] * n, pa.binary()),
            pa.array(payloads, pa.binary()),
            pa.nulls(n, pa.string()),
            pa.nulls(n, SCHEMA.field("_tm_ts").type),
        ],
        schema=SCHEMA,
    )


def test_a_batch_arrow_decoded_whole_gives_the_rows_the_per_record_parse_gives():
    """A batch whose every record Arrow decoded goes through in Arrow; the rows and verdicts
    are those of the per-record parse (what a batch with a record Arrow cannot read takes),
    required columns that are NULL included."""
    from tidemark.engine import local_records
    from tidemark.sources import json_arrow

    p = _pipeline()
    raw = _batch(
        [
            b'{"id": 1, "name": "a", "at": "2024-01-02T03:04:05Z", "ok": true, "x": 1.5}',
            b'{"id": 2, "at": null, "x": 2}',  # name missing: required, so a transform reject
            b'{"name": "c", "ok": false}',  # id missing
            b'{"id": 4, "name": "d", "extra": [1, 2]}',
        ]
    )
    decoded = json_arrow.decode(raw, json_arrow.fields(p.decode.schema_))
    assert decoded.column(json_arrow.OK).to_pylist() == [True] * 4  # the Arrow path
    fast = local_records.rows(decoded, p)
    slow = local_records.rows(raw, p)  # no Arrow decode: every record parsed in Python
    assert fast.schema == slow.schema
    assert fast.to_pylist() == slow.to_pylist()
    got = fast.to_pylist()
    assert [r["_tm_error_class"] for r in got] == [None, "transform", "transform", None]
    assert got[1]["_tm_reason"] == "required column name is NULL (from name)"
    assert got[2]["_tm_reason"] == "required column id is NULL (from id)"


def _read_ahead_world(env, monkeypatch):
    """600 orders and two poison records over two partitions, read 40 records a batch and
    written 100 rows a COPY: every task reads many batches and COPYs several times while its
    next batches are read (tidemark/core/ahead.py)."""
    from tidemark.engine import sink_writer
    from tidemark.sources import schema

    monkeypatch.setattr(schema, "BATCH_ROWS", 40)
    monkeypatch.setattr(sink_writer, "FLUSH_ROWS", 100)
    env.append_orders(range(600))
    env.append([(0, b"poison", b"{not json", None, None), (1, b"poison2", b"\xff", None, None)])
    env.pipeline()


def _rows_counting(monkeypatch, fail_at: int | None = None) -> list[str]:
    """local_records.rows, recording the thread each batch of records is transformed in;
    the batch numbered ``fail_at`` (from 0) raises, once."""
    import threading

    from tidemark.engine import local_records

    threads: list[str] = []
    real = local_records.rows

    def rows(batch, pipeline):
        if not batch.num_rows:  # the runner's schema, at the start
            return real(batch, pipeline)
        threads.append(threading.current_thread().name)
        if len(threads) - 1 == fail_at:
            raise RuntimeError("source connection lost mid-read")
        return real(batch, pipeline)

    monkeypatch.setattr(local_records, "rows", rows)
    return threads


def test_the_local_engine_reads_ahead_of_the_write_and_the_run_is_exact(env, monkeypatch):
    from tests.invariants import assert_exactly_once

    _read_ahead_world(env, monkeypatch)
    threads = _rows_counting(monkeypatch)
    report = env.run(LocalRunner())
    assert report.ok, report.summary()
    assert report.records == 602
    assert report.sinks["main"].counts.rows == 600
    assert report.sinks["main"].counts.dead == 2
    assert env.checkpoints() == {0: 301, 1: 301}
    assert_exactly_once(env)
    # Decoded and transformed beside the write, in the task's read-ahead thread.
    assert len(threads) >= 2 * 301 // 40
    assert all(t.startswith("tidemark-read-task-") for t in threads), set(threads)


def test_a_read_failing_mid_task_fails_that_attempt_and_the_retry_reads_afresh(env, monkeypatch):
    """An error in the read-ahead is the task's error where the batches stop: never an early
    end the task would take for the end of its records. The attempt fails (what it wrote
    rolls back), the next one reads the range again, and the run is exact."""
    from tests.invariants import assert_exactly_once

    _read_ahead_world(env, monkeypatch)
    # The 5th batch of the first task: after its first COPYs of 100 rows.
    _rows_counting(monkeypatch, fail_at=4)
    lines: list[str] = []
    report = env.run(LocalRunner(), log=lines.append)
    assert report.ok, report.summary()
    failed = [ln for ln in lines if "attempt 0 failed" in ln]
    assert len(failed) == 1 and "source connection lost mid-read" in failed[0], lines
    assert report.records == 602
    assert report.sinks["main"].counts.rows == 600
    assert env.checkpoints() == {0: 301, 1: 301}
    assert_exactly_once(env)
    gids = [g for (g,) in env.ledger("SELECT gid FROM tidemark.participants")]
    assert any(g.endswith(":1") for g in gids), gids  # the retry's were chosen


def test_a_sigterm_while_the_task_reads_ahead_stops_the_run_and_its_thread(env, monkeypatch):
    """SIGTERM raises Terminated in the main thread wherever it is (waiting for the next
    batch, or in a COPY): the run rolls back, and the read-ahead thread is stopped and waited
    for before the runner closes the reader connection it reads over."""
    import os
    import signal
    import threading

    from tidemark.core.errors import Terminated
    from tidemark.engine import local_records

    _read_ahead_world(env, monkeypatch)
    real = local_records.rows
    seen: list[int] = []

    def rows(batch, pipeline):
        if batch.num_rows:
            seen.append(batch.num_rows)
            if len(seen) == 5:
                os.kill(os.getpid(), signal.SIGTERM)
        return real(batch, pipeline)

    monkeypatch.setattr(local_records, "rows", rows)
    with pytest.raises(Terminated):
        env.run(LocalRunner())
    assert not [t for t in threading.enumerate() if t.name.startswith("tidemark-read-task-")]
    assert len(seen) < 2 * 301 // 40  # it stopped reading
    assert env.prepared() == []
    assert env.ledger("SELECT state::text FROM tidemark.run_sinks") == [("aborted",)]
    assert env.checkpoints() in ({}, {0: 0, 1: 0})
