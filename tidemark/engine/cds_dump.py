"""The process that dumps the Spark driver's class archive (tidemark/engine/cds.py), run as
``python -m tidemark.engine.cds_dump TMPFILE``: a Spark session started with
``-XX:ArchiveClassesAtExit``, one small job through the classes a replay uses, and a clean JVM
exit, at which the JVM writes the archive. A module of its own, so that the session (which
maps the archive) and the archive (which a session dumps) do not import each other.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tidemark.core.errors import TidemarkError
from tidemark.engine.cds import path_option
from tidemark.engine.session import gc_options, session


def _dump(tmp: Path) -> int:
    """The dumping process: load what a replay loads, then let the JVM exit cleanly."""
    import pyarrow as pa
    from pyspark import SparkContext
    from pyspark.sql import functions as F

    spark = session(
        "local[2]",
        "tidemark-cds",
        java_options=[
            path_option("-XX:ArchiveClassesAtExit", tmp),
            *gc_options(),
            "-Xlog:disable",
            "-Xlog:all=error:stderr",
        ],
    )

    def batches(it: Iterator[Any]) -> Iterator[Any]:  # pyarrow RecordBatches (no stubs)
        for b in it:
            ids = b.column(0).to_pylist()
            yield pa.RecordBatch.from_pydict(
                {
                    "k": [str(i).encode() for i in ids],
                    "v": [f'{{"y": 2013, "m": {i + 1}, "s": "x{i}"}}' for i in ids],
                }
            )

    df = (
        spark.range(0, 2, 1, 2)
        .mapInArrow(batches, "k binary, v string")
        .select("k", F.from_json("v", "y int, m int, s string").alias("j"))
        .select("k", F.make_date("j.y", "j.m", F.lit(1)).alias("d"), "j.s")
    )
    df.where(F.col("d").isNotNull()).mapInArrow(lambda it: it, df.schema).collect()
    spark.stop()
    gateway = SparkContext._gateway
    if gateway is None:
        raise TidemarkError("the Spark session started no JVM to archive")
    proc = gateway.proc  # the JVM exits once its stdin closes
    proc.stdin.close()
    return int(proc.wait(timeout=120))


if __name__ == "__main__":
    sys.exit(_dump(Path(sys.argv[1])))
