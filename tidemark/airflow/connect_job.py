"""The replay task's job on a Spark Connect service: when the task's Spark connection is of
type ``spark_connect`` (the Spark provider's SparkConnectHook), the task runs the job as a
plain ``tidemark`` process here, whose write tasks run on that service, instead of
spark-submitting it (docs/airflow.md, "Spark Connect").

The endpoint (its ``sc://`` URL may carry a token) reaches the job the way its other
connections do: in the job-secrets file (tidemark/core/job_secrets.py), never on its command
line, in its environment or in the task log; the log shows it without its parameters.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from urllib.parse import quote

from tidemark.core import job_secrets
from tidemark.engine.connect_session import masked

CONN_TYPE = "spark_connect"
REMOTE_VAR = "TIDEMARK_SPARK_REMOTE"
_PARAM = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")


class ConnectJobFailed(RuntimeError):
    """The job exited non-zero; the message says its code as the Spark provider's error does
    (tidemark.airflow.dags.job_exit_code reads it)."""


def endpoint(conn_id: str) -> str | None:
    """The ``sc://`` URL of connection ``conn_id`` if it is a ``spark_connect`` one, else
    None (spark-submit). A URL the hook cannot build fails the task without a retry."""
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowFailException

    conn = BaseHook.get_connection(conn_id)
    if conn.conn_type != CONN_TYPE:
        return None
    from airflow.providers.apache.spark.hooks.spark_connect import SparkConnectHook

    where = f"Spark connection {conn_id!r} (spark_connect)"
    try:
        url = SparkConnectHook(conn_id).get_connection_url()
    except (ValueError, TypeError, AttributeError) as exc:
        raise AirflowFailException(
            f"{where}: no Spark Connect URL from its host and port ({type(exc).__name__}); "
            "set host (e.g. sc://host or host) and port (not retried)"
        ) from None
    # The hook knows user_id, token and use_ssl only; a service's own parameters (Databricks:
    # x-databricks-cluster-id) go in the extra's "params", which PySpark sends as headers.
    params = (conn.extra_dejson or {}).get("params") or {}
    if not isinstance(params, dict) or not all(
        isinstance(k, str) and _PARAM.match(k) and isinstance(v, str | int | bool)
        for k, v in params.items()
    ):
        raise AirflowFailException(
            f"{where}: extra params must map names (letters, digits, - and _) to values, "
            'e.g. {"x-databricks-cluster-id": "0123-456789-abc"} (not retried)'
        )
    if params:
        given = ";".join(f"{k}={quote(str(v))}" for k, v in params.items())
        url = f"{url};{given}" if "/;" in url else f"{url.rstrip('/')}/;{given}"
    from airflow.sdk.log import mask_secret

    # The token quoted into it may differ from the password Airflow masks. A URL without
    # parameters holds no secret: masking it would hide the endpoint the task log names.
    if masked(url) != url:
        mask_secret(url)
    return url


def command(argv: list[str]) -> list[str]:
    """The job's process: this interpreter's ``tidemark`` CLI with the job's arguments."""
    return [sys.executable, "-m", "tidemark", *argv]


def run(
    argv: list[str],
    url: str,
    secrets: dict[str, str],
    log: Callable[[str], None],
    started: Callable[[subprocess.Popen[bytes]], None] = lambda p: None,
) -> None:
    """Run the job against ``url`` with ``secrets`` (the ledger and the pipeline's
    connections) in a file only this user reads, its output line by line to ``log``.
    Raises :class:`ConnectJobFailed` when it exits non-zero."""
    env = {k: v for k, v in os.environ.items() if k != REMOTE_VAR}
    # The connection decides: the run's write tasks go to this endpoint whatever the
    # worker's TIDEMARK_ENGINE says (a pipeline's own spark.remote still wins, as in the CLI).
    env["TIDEMARK_ENGINE"] = "connect"
    log(f"running the job on Spark Connect at {masked(url)}: tidemark {' '.join(argv)}")
    with job_secrets.written({**secrets, REMOTE_VAR: url}) as path:
        env[job_secrets.VAR] = path
        proc = subprocess.Popen(
            command(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        started(proc)
        assert proc.stdout is not None
        for line in proc.stdout:
            log(line.decode(errors="replace").rstrip("\n"))
        code = proc.wait()
    if code != 0:
        raise ConnectJobFailed(f"tidemark job on Spark Connect failed. Error code is: {code}.")


def stop(proc: subprocess.Popen[bytes] | None, timeout: float = 60.0) -> None:
    """On the task's kill: SIGTERM the job (it settles its run as on any SIGTERM), then
    SIGKILL if it has not ended within ``timeout``; recovery settles what it left."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
