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
