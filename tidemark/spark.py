"""The SparkSession every Tidemark job uses."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Hide credentials inside DSNs wherever Spark prints options or plans.
LOG4J = Path(__file__).with_name("log4j2.properties")
REDACT = r"(?i)(password|secret|token)|(://[^:/@\s]+:[^@\s]*@)"


def session(master: str | None, app_name: str):
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    log4j = f"-Dlog4j2.configurationFile=file:{LOG4J}"
    builder = (builder
               .config("spark.driver.extraJavaOptions", log4j)
               .config("spark.executor.extraJavaOptions", log4j)
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.speculation", "false")  # one attempt per task at a time
               .config("spark.task.maxFailures", "4")
               .config("spark.sql.ansi.enabled", "false")
               .config("spark.sql.shuffle.partitions", "8")
               # A gated run caches its batch once; compressing that cache cost more CPU
               # than it saved (bench/replay_bench.py, 2 cores).
               .config("spark.sql.inMemoryColumnarStorage.compressed", "false")
               .config("spark.sql.execution.arrow.maxRecordsPerBatch", "20000")
               .config("spark.sql.redaction.string.regex", REDACT)
               .config("spark.redaction.regex", REDACT)
               .config("spark.driver.memory", os.environ.get("TIDEMARK_DRIVER_MEMORY", "3g")))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("TIDEMARK_SPARK_LOG_LEVEL", "ERROR"))
    return spark
