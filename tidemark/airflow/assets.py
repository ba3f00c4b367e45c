"""Sink tables as Airflow Assets, named the way the postgres provider names a table.

Each sink table is the asset ``postgres://host:port/database/schema/table`` (the provider's
URI scheme, ``airflow.providers.postgres.assets.postgres``: port 5432 when the DSN has none, an
unqualified table in ``public``). The report task of every Tidemark DAG emits an event for
each sink its run committed, through the pipeline's asset alias; a downstream DAG schedules on
the URI (``schedule=[Asset("postgres://...")]``) and reads the run in the event's extra.
Resolved when the task runs, never at DAG parse time: a sink's DSN may be an Airflow
connection.
"""

from __future__ import annotations

from tidemark import config
from tidemark.core.db import conninfo
from tidemark.core.errors import TidemarkError


def alias_name(pipeline: str) -> str:
    """The asset alias a pipeline's DAGs emit their sink events through."""
    return f"{config.dag_id(pipeline)}_sinks"


def table_uri(dsn: str, table: str) -> str:
    """``postgres://host:port/database/schema/table`` of ``table`` in ``dsn``'s database."""
    try:
        parts = conninfo(dsn, "the table's database")
    except TidemarkError as exc:  # says what is wrong, and nothing of the DSN
        raise ValueError(f"not a PostgreSQL DSN: {exc}") from None
    host = str(parts.get("host") or parts.get("hostaddr") or "").split(",")[0]
    if not host or host.startswith("/"):  # a Unix socket: the server is this machine
        host = "localhost"
    port = str(parts.get("port") or "5432").split(",")[0] or "5432"
    database = parts.get("dbname") or parts.get("user") or "postgres"
    schema, _, name = table.rpartition(".")
    return f"postgres://{host}:{port}/{database}/{schema or 'public'}/{name}"


def sink_uri(pipeline: config.Pipeline, sink: config.Sink) -> str:
    return table_uri(pipeline.sink_dsn(sink), sink.table)
