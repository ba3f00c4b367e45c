"""Spark settings a user gives a job: the pipeline's ``spark:`` block and, under Airflow, the
``conf`` of the Spark connection's extra (docs/production.md, "Spark settings"). Both reach
the job as Spark conf; the pipeline's win. They travel in the clear (spark-submit's command
line, the Spark UI, the task log), so a secret is refused, never passed on."""

from __future__ import annotations

import re
from collections.abc import Mapping

# Spark's names: dotted lower-camel words (spark.executor.memory, spark.pyspark.python).
KEY = re.compile(r"^spark(\.[A-Za-z0-9_-]+)+$")
# A key naming a secret, or a value holding a URL's password (scheme://user:password@host).
# A key naming a secret's file (spark.authenticate.secret.file, ...oauthTokenFile) holds a
# path, not the secret.
SECRET_KEY = re.compile(r"(?i)password|secret|token|credential")
SECRET_FILE = re.compile(r"(?i)(\.file|File|\.path)$")
SECRET_VALUE = re.compile(r"://[^:/@\s]+:[^@\s]+@")
# A Spark Connect URL's token parameter (spark.remote: sc://host:443/;token=...).
SECRET_PARAM = re.compile(r"(?i);\s*token=")
# Tidemark decides these: the master is the CLI's setting or the Spark connection's host;
# the driver runs where the job reads its connections (client mode); one attempt of a task
# at a time (docs/design.md).
OWNED = {
    "spark.master": "the master is TIDEMARK_SPARK_MASTER (CLI) or the Spark connection's host",
    "spark.submit.deployMode": "Tidemark's driver runs in client mode",
    "spark.speculation": "Tidemark runs one attempt of a task at a time",
}
EXECUTORS_PYTHON = "spark.pyspark.python"
# Comma-separated files Spark ships to the executors. A relative path resolves against the
# driver's working folder: the checkout for `tidemark run` there, the Airflow worker's own
# folder under Airflow, where the job then fails in Spark's start-up (docs/production.md).
FILE_LISTS = (
    "spark.archives",
    "spark.files",
    "spark.jars",
    "spark.submit.pyFiles",
    "spark.yarn.dist.archives",
    "spark.yarn.dist.files",
    "spark.yarn.dist.jars",
)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def checked(conf: Mapping[str, object]) -> dict[str, str]:
    """``conf`` as Spark's strings, or ValueError naming the first key that is not a
    ``spark.*`` setting, is Tidemark's own, or holds a secret."""
    out: dict[str, str] = {}
    for key, value in conf.items():
        if not isinstance(key, str) or not KEY.match(key):
            raise ValueError(f"{key!r} is not a Spark setting (spark.*)")
        if key in OWNED:
            raise ValueError(f"{key} cannot be set here: {OWNED[key]}")
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, int | float | str):
            text = str(value)
        else:
            raise ValueError(f"{key}: expected a string or a number")
        if (
            (SECRET_KEY.search(key) and not SECRET_FILE.search(key))
            or SECRET_VALUE.search(text)
            or SECRET_PARAM.search(text)
        ):
            raise ValueError(
                f"{key}: Spark settings travel in the clear (command line, Spark UI, logs); "
                "give secrets as connections, not Spark conf"
            )
        if key in FILE_LISTS:
            _absolute_paths(key, text)
        out[key] = text
    return out


def _absolute_paths(key: str, text: str) -> None:
    for entry in (e.strip() for e in text.split(",")):
        path = entry.split("#", 1)[0]
        if path and not path.startswith("/") and not SCHEME.match(path):
            raise ValueError(
                f"{key}: {path} is a relative path, which Spark resolves against the "
                "driver's working folder (under Airflow, the worker's): give an absolute "
                "path or a URL (hdfs://, s3a://, local:)"
            )


def is_local(master: str) -> bool:
    """Whether ``master`` runs the executors on this host (``local``, ``local[...]``,
    ``local-cluster[...]``), where they can run the driver's own Python."""
    return master.startswith("local")
