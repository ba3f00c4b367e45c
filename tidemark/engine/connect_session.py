"""A Spark Connect session for a run (tidemark/driver/runners.py: ConnectRunner).

The server is long-lived and shared: what Tidemark's own SparkSession sets at start
(tidemark/engine/session.py) is set here on the run's session where Spark lets a session
set it (SQL settings), and the tidemark package goes to the server's Python workers as a
session artifact (``addArtifacts(pyfile=True)``), never ``addPyFile``. What only the server
decides (its master, task retries, speculation, the workers' Python) is the server's
configuration (docs/production.md, "Spark Connect").
"""

from __future__ import annotations

import atexit
import re
import uuid
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

_NAMESPACE = uuid.UUID("0f1c6a4e-8d53-4c44-9a55-4d8e2b7c1a90")  # Tidemark's sessions
# A Connect URL's parameters may carry a token (Databricks: sc://host:443/;token=...).
_PARAMS = re.compile(r"/;.*$")


def masked(url: str) -> str:
    """``url`` without its parameters (a token among them), for messages."""
    return _PARAMS.sub("/;...", url)


def is_connect(spark: object) -> bool:
    """Whether ``spark`` is a Spark Connect session (it has no SparkContext)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def session_url(url: str, conf: Mapping[str, str]) -> str:
    """``url`` naming the session every run of this tidemark package with these settings
    shares (unless ``url`` names one): the server keeps a session's artifacts and its Python
    workers, which imported tidemark already, between runs, so a run on a warm server starts
    no worker (seconds each) and ships nothing new. The session idles out on the server
    (spark.connect.session.manager.defaultSessionTimeout) when no run uses it."""
    if ";session_id=" in url:
        return url
    from tidemark.engine.session import package_zip

    settings = sorted((k, v) for k, v in {**SQL_CONF, **conf}.items() if k != REMOTE)
    sid = uuid.uuid5(_NAMESPACE, f"{package_zip().name}|{settings!r}")
    sep = ";" if "/;" in url else ("" if url.endswith("/") else "/") + ";"
    return f"{url}{sep}session_id={sid}"


def remote_session(url: str, app: str, conf: Mapping[str, str] | None = None) -> SparkSession:
    """The session on the Connect server at ``url`` shared by the runs of this package with
    these settings (:func:`session_url`), with Tidemark's settings, the user's ``conf`` (the
    pipeline's spark: block, ``spark.remote`` aside) and the tidemark package. Never stopped
    by a run (that would end it for every run sharing it).

    A session a run set up already (a warm server) costs one round trip: the session's own
    setting :data:`READY` says the package is there and the server's parallelism; a new one
    (a cold or restarted server) gets the settings, the artifact, then READY."""
    from pyspark.sql import SparkSession
    from pyspark.sql.connect.client.retries import DefaultPolicy

    conf = {k: v for k, v in (conf or {}).items() if k != REMOTE}
    try:
        spark = SparkSession.builder.remote(session_url(url, conf)).create()
        # Closed at exit, before PySpark's own exit hook (registered first, so run later),
        # which then skips its call to clean the server's ML cache (Tidemark keeps none):
        # retried against a server that is unreachable or lost mid-run, it kept the process
        # 35 s after "cannot reach", 5 s after a lost server failed the run.
        atexit.register(spark.client.close)
        # The first round trip: an unreachable server fails here, after some 4 s of retries
        # (a server restarting is up by then), not the client's default 10 minutes. A server
        # lost mid-run is retried alike, then the run fails and rolls back (its process also
        # waits on the client's release calls, retried alike, before it can exit).
        spark.client.set_retry_policies([DefaultPolicy(max_retries=REACH_TRIES)])
        ready = spark.conf.get(READY, None)
        spark.client.set_retry_policies([DefaultPolicy(max_retries=RUN_TRIES)])
    # Blind on purpose: an unreachable server shows as gRPC's, PySpark's or the OS's error.
    except Exception as exc:  # noqa: BLE001
        raise BadInput(
            f"cannot reach the Spark Connect server at {masked(url)}: {_one_line(exc)}"
        ) from None
    from tidemark.engine.session import package_zip

    shipped = package_zip().name
    sid = str(getattr(spark, "session_id", id(spark)))
    if ready and ready.split("|")[0] == shipped:
        _PARALLELISM[sid] = int(ready.split("|")[1])
        return spark
    try:
        _set_up(spark, url, conf)
        _PARALLELISM[sid] = parallelism(spark)
        spark.conf.set(READY, f"{shipped}|{_PARALLELISM[sid]}")
    except BaseException:
        spark.client.close()  # the channel, not the session: other runs may share it
        raise
    return spark


REACH_TRIES = 4  # 50 ms, then each wait 4 times the last: about 4 s in all
RUN_TRIES = 4  # about 4 s: a rerun is safe, a run stuck on a lost server holds its leases
READY = "spark.tidemark.ready"  # "<package zip>|<parallelism>" once a session is set up
_PARALLELISM: dict[str, int] = {}  # session id -> the server's parallelism


def _set_up(spark: SparkSession, url: str, conf: Mapping[str, str]) -> None:
    from pyspark.errors import PySparkException

    spark.conf._set_all(configs=dict(SQL_CONF), silent=False)  # type: ignore[attr-defined]
    for key, value in conf.items():
        try:
            spark.conf.set(key, value)
        except PySparkException as exc:
            raise BadInput(
                f"the Spark Connect server at {masked(url)} does not let a session set "
                f"{key} ({_one_line(exc)}): set it in the server's configuration "
                '(docs/production.md, "Spark Connect")'
            ) from None
    from tidemark.engine.session import package_zip

    # Added once per session; the server accepts the same file again (concurrent set-ups).
    spark.addArtifacts(str(package_zip()), pyfile=True)


def parallelism(spark: SparkSession) -> int:
    """How many tasks the server runs side by side for this session: as recorded when the
    session was set up, else its ``spark.default.parallelism`` if set, else as many as it
    splits a range into (its default parallelism: a Connect session has no SparkContext)."""
    from pyspark.sql import functions as F

    sid = str(getattr(spark, "session_id", id(spark)))
    if sid in _PARALLELISM:
        return _PARALLELISM[sid]
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
