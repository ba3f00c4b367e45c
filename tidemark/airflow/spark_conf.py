"""The replay task's Spark conf: Tidemark's own (the driver JVM's options), then the ``conf``
of the Spark connection's extra, then the pipeline's ``spark:`` block; the later wins. The
Spark provider reads only deploy mode, queue, namespace, binary and principal from the
extra: everything else a team sets for its cluster (executor memory and cores, archives,
the executors' Python) goes in ``conf`` (docs/production.md, "Spark settings")."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

from tidemark import config
from tidemark.core import spark_settings

DRIVER_PYTHON = "spark.pyspark.driver.python"


def job_conf(base: Mapping[str, str] | None, conn_id: str, pipeline_file: str) -> dict[str, str]:
    """The conf spark-submit gets (``--conf key=value`` each). A connection whose ``conf`` is
    not a mapping of Spark settings, or holds a secret, fails the task without a retry."""
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowFailException

    conn = BaseHook.get_connection(conn_id)
    if (conn.host or "").startswith("k8s") and not _kubernetes_provider():
        # Else the provider's hook fails with "NameError: name 'kube_client' is not defined".
        raise AirflowFailException(
            f"Spark connection {conn_id!r} has a Kubernetes master: install "
            "apache-airflow-providers-cncf-kubernetes beside Tidemark (the lock does not "
            "include it; docs/production.md)"
        )
    extra = conn.extra_dejson or {}
    try:
        given = extra.get("conf") or {}
        if not isinstance(given, Mapping):
            raise ValueError("expected a mapping of Spark settings")
        from_connection = spark_settings.checked(given)
    except ValueError as exc:
        raise AirflowFailException(
            f"Spark connection {conn_id!r}: extra conf: {exc} (docs/production.md)"
        ) from None
    pipeline = config.load(Path(pipeline_file), deep=False).spark
    # The driver runs here (client mode), as this task's Python: spark-submit would otherwise
    # start it with spark.pyspark.python, the executors' (./env/bin/python of an archive, a
    # path on the executors' hosts), which cannot import tidemark here.
    driver = {DRIVER_PYTHON: sys.executable}
    return {**driver, **(base or {}), **from_connection, **pipeline}


def _kubernetes_provider() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("airflow.providers.cncf.kubernetes") is not None
    except ModuleNotFoundError:
        return False
