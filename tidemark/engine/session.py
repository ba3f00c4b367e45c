"""The SparkSession every Tidemark job uses."""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from tidemark.core import spark_settings
from tidemark.core.errors import BadInput

if TYPE_CHECKING:  # PySpark loads when a session starts, not with this module
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

# Hide credentials inside DSNs wherever Spark prints options or plans.
LOG4J = Path(__file__).with_name("log4j2.properties")
REDACT = r"(?i)(password|secret|token)|(://[^:/@\s]+:[^@\s]*@)"
PACKAGE = Path(__file__).resolve().parent.parent  # the tidemark package
_SHIPPED: Path | None = None  # this process's zip of the tidemark package


def gc_options() -> list[str]:
    """The driver JVM's collector. On at most 2 cores, Serial: G1 grows the heap under
    allocation pressure, so the driver's peak RSS followed the run's size (a 2M-record run
    40-70% above a 200,000-record one), and G1's concurrent threads take the cores the tasks
    need. Serial keeps the heap at its initial size (within 6% from 200,000 to 10M records;
    bench/replay_bench.py). On more cores the JVM's default (G1) collects in parallel."""
    return ["-XX:+UseSerialGC"] if (os.cpu_count() or 1) <= 2 else []


def jit_options() -> list[str]:
    """When HotSpot's optimizing compiler (C2) takes a method. On at most 2 cores it competed
    with the tasks for the cores: at its default thresholds it compiled for 4.8 CPU-seconds of
    a 200,000-record run, mostly start-up code run a few thousand times. Twenty times the
    thresholds leave that to the quick compiler (C1) and still give C2 every per-record
    method, which runs millions of times: 9% less driver CPU at 2M records, 12% at 200,000
    (bench/replay_bench.py, fresh runs). On more cores C2 compiles beside the tasks."""
    if (os.cpu_count() or 1) > 2:
        return []
    return [
        "-XX:Tier4InvocationThreshold=100000",
        "-XX:Tier4MinInvocationThreshold=20000",
        "-XX:Tier4CompileThreshold=150000",
        "-XX:Tier4BackEdgeThreshold=800000",
    ]


def driver_java_options() -> list[str]:
    """The driver JVM's options: the class archive if built (tidemark/engine/cds.py), the
    collector and the compiler's thresholds. Airflow hands the same to spark-submit
    (tidemark/airflow/dags.py)."""
    from tidemark.engine import cds

    return cds.java_options() + gc_options() + jit_options()


def log4j_option() -> str:
    """Spark's logging for Tidemark's JVMs (log4j2.properties: Spark's errors only; the job
    reports its own progress and errors on stderr)."""
    return f"-Dlog4j2.configurationFile=file:{LOG4J}"


# PySpark reads either as "this process is Spark Connect's" (set, whatever the value): a
# classic session's builder then asks for a remote one.
CONNECT_MODE_VARS = ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED")


def connect_mode_refusal() -> str | None:
    """Why this process cannot start a classic session (None: it can). Named before a run
    claims anything; the variable's value is left out (a URL may carry a token)."""
    for var in CONNECT_MODE_VARS:
        if var in os.environ:
            return (
                f"{var} is set in the environment: PySpark would take this run on the spark "
                f"engine to Spark Connect. To run on Spark Connect, set TIDEMARK_ENGINE=connect "
                f"and TIDEMARK_SPARK_REMOTE=sc://host:port; for the spark engine, unset {var}"
            )
    return None


def session(
    master: str | None,
    app_name: str,
    java_options: list[str] | None = None,
    conf: Mapping[str, str] | None = None,
) -> SparkSession:
    """Tidemark's SparkSession. The driver JVM's options (``java_options``, else
    :func:`driver_java_options`) apply when this process starts the JVM; under spark-submit
    the JVM is up already and spark-submit's own options hold. ``conf``: the user's Spark
    settings (tidemark/core/spark_settings.py), over Tidemark's defaults."""
    refusal = connect_mode_refusal()
    if refusal is not None:
        raise BadInput(refusal)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from tidemark.core.settings import get_settings

    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    log4j = log4j_option()
    if java_options is None:
        java_options = driver_java_options()
    builder = (
        builder.config("spark.driver.extraJavaOptions", " ".join([log4j, *java_options]))
        .config("spark.executor.extraJavaOptions", log4j)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.speculation", "false")  # one attempt per task at a time
        .config("spark.task.maxFailures", "4")
        .config("spark.sql.ansi.enabled", "false")
        # Times in UTC whatever the machine's zone (the JVM's default otherwise): a transform's
        # to_date(_tm_ts) or a string cast to a timestamp must not move with the host.
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.shuffle.partitions", "8")
        # A gated run caches its batch once; compressing that cache cost more CPU
        # than it saved (bench/replay_bench.py, 2 cores).
        .config("spark.sql.inMemoryColumnarStorage.compressed", "false")
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", "20000")
        # Below INT_MAX, Spark measures the Arrow batch it is filling for a Python task after
        # every row, walking every column: a fifth of the driver JVM's CPU in a run
        # (JFR, bench/replay_bench.py). At INT_MAX it skips that; batches stay bounded by
        # maxRecordsPerBatch, as the reader's own batches are (sources.BATCH_ROWS).
        .config("spark.sql.execution.arrow.maxBytesPerBatch", str(2**31 - 1))
        # The decode step's generated code (a JSON parse and a reason per field) is
        # larger than HotSpot compiles (8,000 bytes of bytecode): whole-stage codegen
        # then runs interpreted. Falling back to per-expression code is 35% faster
        # (bench/replay_bench.py, decode and transform alone).
        .config("spark.sql.codegen.hugeMethodLimit", "8000")
        # PySpark 4 sends the Python call site of every Column function to the JVM (five
        # more round trips each) for the query context of ANSI runtime errors; ANSI is off
        # and a run builds some 300 Columns: 0.4 s of every fresh run.
        .config("spark.python.sql.dataFrameDebugging.enabled", "false")
        .config("spark.sql.redaction.string.regex", REDACT)
        .config("spark.redaction.regex", REDACT)
        .config("spark.driver.memory", get_settings().driver_memory)
    )
    if spark_settings.is_local(master or _submitted_master()):
        # Local Spark stays on loopback. On a cluster the executors connect back to the
        # driver: its address is the host's (Spark's default, or SPARK_LOCAL_IP), or
        # spark.driver.host from spark-submit or the user's settings, never loopback.
        # Its Python workers are this machine's, which import tidemark: their daemon
        # imports PySpark from the installed package (tidemark/engine/worker_daemon.py).
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = (
            builder.config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.python.daemon.module", "tidemark.engine.worker_daemon")
        )
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(get_settings().spark_log_level)
    try:
        python = executors_python(
            spark.sparkContext.master or "local[*]",
            spark.sparkContext.getConf().get(spark_settings.EXECUTORS_PYTHON),
            os.environ.get("PYSPARK_PYTHON"),
        )
    except BadInput:
        spark.stop()
        raise
    # PySpark names the executors' Python in every function it ships (SparkContext.pythonExec,
    # read when a UDF or an RDD function is built), from PYSPARK_PYTHON when the context
    # started: spark-submit sets that from spark.pyspark.python, a session started here does
    # not, and spark.executorEnv.PYSPARK_PYTHON is never read.
    spark.sparkContext.pythonExec = python
    os.environ["PYSPARK_PYTHON"] = python
    # The master may come from the argument or from spark-submit: ask the started context.
    if not (spark.sparkContext.master or "").startswith("local"):
        ship_package(spark.sparkContext)
    return spark


def executors_python(master: str, configured: str | None, environ: str | None) -> str:
    """The Python the executors run: Spark's setting ``spark.pyspark.python`` (the pipeline's
    ``spark:`` block, the Spark connection's extra conf, spark-submit's --conf or
    spark-defaults.conf), else PYSPARK_PYTHON, else with a local master this process's own.
    On a cluster this process's path (a venv on the Airflow worker) rarely exists on the
    executors' hosts, and Spark's default ``python3`` rarely has pyarrow, ADBC and psycopg:
    unset, the run stops before it writes, saying where to set it."""
    if configured:
        return configured
    if environ:
        return environ
    if spark_settings.is_local(master):
        return sys.executable
    raise BadInput(
        f"the executors' Python is not set for master {master}: set "
        f"{spark_settings.EXECUTORS_PYTHON} in the pipeline's spark: block or in the Spark "
        "connection's extra conf, or PYSPARK_PYTHON (docs/production.md)"
    )


def _submitted_master() -> str:
    """spark-submit's --master when it started this Python (its JVM is up already)."""
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        return "local[*]"  # what Spark uses without a master
    from pyspark import SparkConf, SparkContext

    SparkContext._ensure_initialized()
    return SparkConf().get("spark.master", "local[*]")


def ship_package(sc: SparkContext) -> Path:
    """Executors on a cluster (spark://, yarn, k8s://) cannot import the driver's tidemark:
    add the package's zip (:func:`package_zip`) to the context's Python path (a no-op if
    already added)."""
    shipped = package_zip()
    if shipped.name not in {f.rsplit("/", 1)[-1] for f in sc.listFiles}:
        sc.addPyFile(str(shipped))
    return shipped


def package_zip() -> Path:
    """The tidemark package as a zip (sources and package data, no __pycache__), built once
    per process and named by its content hash: what a cluster's executors import
    (:func:`ship_package`) and what a Spark Connect session ships as an artifact
    (tidemark/engine/connect_session.py)."""
    global _SHIPPED
    if _SHIPPED is None:
        files = sorted(
            p
            for p in PACKAGE.rglob("*")
            if p.is_file()
            and "__pycache__" not in p.parts
            and p.suffix in {".py", ".properties", ".sql"}
        )
        digest = hashlib.sha256()
        for f in files:
            digest.update(f"{f.relative_to(PACKAGE)}\0".encode() + f.read_bytes() + b"\0")
        folder = Path(tempfile.gettempdir()) / f"tidemark-pyfiles-{os.getuid()}"
        folder.mkdir(exist_ok=True)
        target = folder / f"tidemark-{digest.hexdigest()[:16]}.zip"
        if not target.exists():  # built by another process already: same content
            fd, tmp = tempfile.mkstemp(dir=folder, suffix=".zip.tmp")
            with os.fdopen(fd, "wb") as fh, zipfile.ZipFile(fh, "w", zipfile.ZIP_DEFLATED) as z:
                for f in files:
                    z.write(f, Path("tidemark") / f.relative_to(PACKAGE))
            os.replace(tmp, target)  # atomic: concurrent jobs never see half a zip
        _SHIPPED = target
    return _SHIPPED
