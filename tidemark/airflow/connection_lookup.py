"""Airflow's connections, as the lookup core/dsn.py resolves a ``conn_id`` through.

Inside a task Airflow's SDK (which masks the password in the task log); where Airflow is
configured (the CLI beside a scheduler, `airflow` working) its metadata database and secrets
backends, so a connection made in the UI or with `airflow connections add` needs no duplicate
variable. Airflow is imported only when a connection is looked up: a process without it gets
the one-line reason.
"""

from __future__ import annotations

import os

from tidemark.core import dsn
from tidemark.core.errors import ConfigError, TidemarkError


class AirflowConnections:
    """core.dsn.ConnectionLookup through Airflow."""

    def uri(self, conn_id: str, where: str) -> str:
        var = dsn.CONN_VAR.format(conn_id.upper())
        try:
            from airflow.sdk import BaseHook
        except Exception:  # noqa: BLE001 - Airflow absent or not configured
            raise ConfigError(
                where, f"connection {conn_id!r}: set {var} or run where Airflow is installed"
            ) from None
        try:
            conn = BaseHook.get_connection(conn_id)
        except Exception as exc:  # noqa: BLE001 - whatever Airflow raises: one masked line
            # Outside a task the SDK sees environment variables and secrets backends only,
            # not the connections kept in Airflow's metadata database: ask it there.
            uri, why = metadata_connection(conn_id)
            if uri is not None:
                return uri
            raise ConfigError(
                where,
                f"Airflow connection {conn_id!r} not found ({dsn.mask(str(exc))}; {why}); "
                f"outside Airflow, set {var} to its URI "
                "(postgresql://user:password@host:port/database)",
            ) from None
        return str(conn.get_uri())

    def uri_if_defined(self, conn_id: str) -> str | None:
        """Always through Airflow's ``BaseHook``, so that inside a task Airflow masks the
        password in the logs."""
        try:
            from airflow.exceptions import AirflowNotFoundException
            from airflow.sdk import BaseHook
        except Exception:  # noqa: BLE001 - Airflow absent or not configured
            return None
        try:
            conn = BaseHook.get_connection(conn_id)
        except AirflowNotFoundException:
            return None
        except Exception as exc:  # noqa: BLE001 - whatever else Airflow raises: one masked line
            raise TidemarkError(f"Airflow connection {conn_id!r}: {dsn.mask(str(exc))}") from None
        return str(conn.get_uri())


def metadata_connection(conn_id: str) -> tuple[str | None, str]:
    """(URI, "") of ``conn_id`` from Airflow's metadata database and secrets backends, as
    `airflow connections get` finds it, or (None, why not) where it is not there or Airflow
    is not configured here (no metadata database: a SQLite file that does not exist is never
    created by asking)."""
    try:
        from airflow.configuration import conf

        db = conf.get("database", "sql_alchemy_conn")
    except Exception as exc:  # noqa: BLE001 - Airflow's configuration could not load
        return None, f"Airflow is not configured here: {dsn.mask(_first_line(exc))}"
    if db.startswith("sqlite:"):
        path = db.split("sqlite:///", 1)[-1].split("?", 1)[0]
        if not path or path == ":memory:" or not os.path.exists(path):
            return None, (
                f"Airflow is not configured here: no metadata database ({db}; set AIRFLOW_HOME "
                "or AIRFLOW__DATABASE__SQL_ALCHEMY_CONN as Airflow's own processes have them)"
            )
    try:
        from airflow.exceptions import AirflowNotFoundException
        from airflow.models.connection import Connection

        conn = Connection.get_connection_from_secrets(conn_id)
    except AirflowNotFoundException:
        return None, f"nor in Airflow's metadata database {dsn.mask(db)}"
    except Exception as exc:  # noqa: BLE001 - its types are Airflow's and SQLAlchemy's
        return None, f"cannot read Airflow's metadata database {dsn.mask(db)}: " + dsn.mask(
            _first_line(exc)
        )
    return dsn.remember(dsn.normalize_scheme(conn.get_uri())), ""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def register() -> None:
    """Resolve connection ids through Airflow in this process (core.dsn.use_connections)."""
    dsn.use_connections(AirflowConnections())
