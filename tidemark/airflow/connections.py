"""The connections a pipeline names, resolved by Airflow for the job it starts.

spark-submit starts the job as a child process that cannot ask Airflow for connections. So the
task resolves every ``conn_id`` the pipeline names (Airflow's connections, environment and
secrets backends alike; Airflow masks their passwords in the task log) and hands each to the
job as the ``AIRFLOW_CONN_<ID>`` variable Airflow itself reads (tidemark/core/dsn.py), the
way the ledger's connection already reaches it.
"""

from __future__ import annotations

from tidemark import config
from tidemark.core.dsn import CONN_VAR, connection_if_defined
from tidemark.core.errors import BadInput


def job_env(p: config.Pipeline) -> dict[str, str]:
    """``AIRFLOW_CONN_<ID>`` for each connection of ``p``; a missing one is bad input (one
    line naming it and where the pipeline uses it: retrying cannot create it)."""
    env: dict[str, str] = {}
    for where, conn_id in p.conn_ids():
        uri = connection_if_defined(conn_id)
        if uri is None:
            raise BadInput(
                f"pipeline {p.name}: {where}: Airflow connection {conn_id!r} does "
                f"not exist; create it (Admin > Connections, `airflow connections "
                f"add`, or a secrets backend)"
            )
        env[CONN_VAR.format(conn_id.upper())] = uri
    return env
