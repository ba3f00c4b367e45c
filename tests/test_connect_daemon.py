"""The local Connect server's Python worker daemon (tidemark/devstack/connect_daemon.py): its
workers start with PySpark from the installed package (not Spark's zip, compiled from source
by every process that imports it) and with a task's third-party modules already imported."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.spark


def test_connect_workers_fork_from_a_daemon_with_task_modules_imported(connect_spark):
    def probe(batches):  # local: shipped by value, the server cannot import this module
        import sys

        import pyarrow as pa
        import pyspark

        for _ in batches:
            pass
        yield pa.RecordBatch.from_pydict(
            {
                "zip": [".zip" in (pyspark.__file__ or "")],
                "adbc": ["adbc_driver_postgresql.dbapi" in sys.modules],
                "psycopg": ["psycopg" in sys.modules],
            }
        )

    schema = "zip boolean, adbc boolean, psycopg boolean"
    rows = connect_spark.range(0, 2, 1, 2).mapInArrow(probe, schema).collect()
    assert rows, "no task ran"
    for row in rows:
        assert not row["zip"], "a worker imported PySpark from Spark's zip"
        assert row["adbc"] and row["psycopg"], "a worker started without the task's modules"
