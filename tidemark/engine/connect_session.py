"""A Spark Connect session for a run (tidemark/driver/runners.py: ConnectRunner).

The server is long-lived and shared: what Tidemark's own SparkSession sets at start
(tidemark/engine/session.py) is set here on the run's session where Spark lets a session
set it (SQL settings), and the tidemark package goes to the server's Python workers as a
session artifact (``addArtifacts(pyfile=True)``), never ``addPyFile``. What only the server
decides (its master, task retries, speculation, the workers' Python) is the server's
configuration (docs/production.md, "Spark Connect").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from tidemark.core.errors import BadInput

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

REMOTE = "spark.remote"  # a pipeline's spark: block may name its Connect endpoint

# tidemark/engine/session.py's session settings a Connect session can set itself (why each:
# there). The redaction pattern is the server's: a static setting.
SQL_CONF = {
    "spark.sql.ansi.enabled": "false",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.shuffle.partitions": "8",
    "spark.sql.inMemoryColumnarStorage.compressed": "false",
    "spark.sql.execution.arrow.maxRecordsPerBatch": "20000",
    "spark.sql.execution.arrow.maxBytesPerBatch": str(2**31 - 1),
    "spark.sql.codegen.hugeMethodLimit": "8000",
}

# A Connect URL's parameters may carry a token (Databricks: sc://host:443/;token=...).
_PARAMS = re.compile(r"/;.*$")


def masked(url: str) -> str:
    """``url`` without its parameters (a token among them), for messages."""
    return _PARAMS.sub("/;...", url)


def is_connect(spark: object) -> bool:
    """Whether ``spark`` is a Spark Connect session (it has no SparkContext)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def remote_session(url: str, app: str, conf: Mapping[str, str] | None = None) -> SparkSession:
    """A new session on the Connect server at ``url``, with Tidemark's settings, the user's
    ``conf`` (the pipeline's spark: block, ``spark.remote`` aside) and the tidemark package."""
    from pyspark.errors import PySparkException
    from pyspark.sql import SparkSession

    try:
        spark = SparkSession.builder.remote(url).config("spark.app.name", app).create()
        spark.sql("SELECT 1").collect()  # the channel opens lazily: fail here, not mid-run
    # Blind on purpose: an unreachable server shows as gRPC's, PySpark's or the OS's error.
    except Exception as exc:  # noqa: BLE001
        raise BadInput(
            f"cannot reach the Spark Connect server at {masked(url)}: {_one_line(exc)}"
        ) from None
    try:
        for key, value in SQL_CONF.items():
            spark.conf.set(key, value)
        for key, value in (conf or {}).items():
            if key == REMOTE:
                continue
            try:
                spark.conf.set(key, value)
            except PySparkException as exc:
                raise BadInput(
                    f"the Spark Connect server at {masked(url)} does not let a session set "
                    f"{key} ({_one_line(exc)}): set it in the server's configuration "
                    '(docs/production.md, "Spark Connect")'
                ) from None
        ship(spark)
    except BaseException:
        spark.stop()
        raise
    return spark


_SHIPPED: set[tuple[str, str]] = set()  # (session id, zip) already added


def ship(spark: SparkSession) -> None:
    """The tidemark package on the session's Python path, on the server's workers: a zip
    named by its content (tidemark/engine/session.py: package_zip), added once per session."""
    from tidemark.engine.session import package_zip

    shipped = package_zip()
    key = (str(getattr(spark, "session_id", id(spark))), shipped.name)
    if key not in _SHIPPED:
        spark.addArtifacts(str(shipped), pyfile=True)
        _SHIPPED.add(key)


def parallelism(spark: SparkSession) -> int:
    """How many tasks the server runs side by side for this session: its
    ``spark.default.parallelism`` if set, else as many as it splits a range into (its
    default parallelism: a Connect session has no SparkContext to ask)."""
    from pyspark.sql import functions as F

    configured = spark.conf.get("spark.default.parallelism", None)
    if configured:
        return max(int(configured), 1)
    ids = spark.range(0, 1 << 16).select(F.spark_partition_id().alias("p"))
    row = ids.agg(F.max("p").alias("p")).first()
    return int(row["p"]) + 1 if row is not None else 1


def _one_line(exc: BaseException) -> str:
    from tidemark.core.dsn import mask

    text = str(exc).strip().splitlines()
    first = next((line for line in text if line.strip()), type(exc).__name__)
    return mask(masked(first.strip()))[:300]
