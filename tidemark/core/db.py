"""PostgreSQL connections: clear errors, masked DSNs, and the classes of failure we retry."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import errors as pgerr
from psycopg.conninfo import conninfo_to_dict

from tidemark.core.dsn import mask, remember
from tidemark.core.errors import TidemarkError

APP_NAME = "tidemark"


def connect(
    dsn: str,
    *,
    autocommit: bool = False,
    what: str = "database",
    application: str = APP_NAME,
    **kwargs: Any,
) -> psycopg.Connection:
    conninfo(dsn, what)
    try:
        return psycopg.connect(
            dsn, autocommit=autocommit, application_name=application, connect_timeout=10, **kwargs
        )
    except psycopg.Error as exc:
        raise TidemarkError(f"cannot connect to {what} {mask(dsn)}: {one_line(exc)}") from None


def conninfo(dsn: str, what: str = "database") -> dict[str, Any]:
    """The DSN's parts, as libpq reads them; a DSN that does not parse (or parses as a host or
    port no one meant: a raw '@' or '/' in a URI's password) is one line that shows no part
    of it, as libpq's own message quotes what it could not read, often the password."""
    remember(dsn)
    try:
        parts = conninfo_to_dict(dsn)
    except psycopg.Error:
        parts = None
    if (
        parts is None
        or any(c in str(parts.get("host", "")) for c in "@ ")
        or not all(p.isdigit() for p in str(parts.get("port", "5432")).split(",") if p)
    ):
        raise TidemarkError(
            f"cannot connect to {what}: its connection string does not parse (in a "
            "postgresql:// URI, URL-encode a password holding %, /, @, : or a space)"
        )
    return parts


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    return mask(first)


def is_data_error(exc: BaseException) -> bool:
    """The rows are at fault (bad value, constraint): quarantine them, do not retry."""
    state = getattr(exc, "sqlstate", None) or ""
    return state.startswith(("22", "23")) or isinstance(exc, pgerr.DatatypeMismatch)


def one(cur: psycopg.Cursor[tuple[Any, ...]]) -> tuple[Any, ...]:
    """The one row a query always returns (an aggregate, SHOW, a function call, ``RETURNING``
    of a row just written). No row is a bug: raised as one, not as a TypeError on None."""
    row = cur.fetchone()
    if row is None:
        raise LookupError("no row from a query that always returns one")
    return row


def scalar(cur: psycopg.Cursor[tuple[Any, ...]]) -> Any:
    """The first value of :func:`one`'s row."""
    return one(cur)[0]


def require_prepared_transactions(conn: psycopg.Connection, what: str) -> None:
    value = int(scalar(conn.execute("SHOW max_prepared_transactions")))
    if value <= 0:
        raise TidemarkError(
            f"{what}: max_prepared_transactions is 0 on this server; Tidemark's two-phase commit "
            f"needs it > 0 (set it in postgresql.conf to at least 2 x tasks x sinks + 10 and "
            f"restart PostgreSQL)"
        )


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def qualified(table: str) -> str:
    """'schema.table' -> '"schema"."table"' (a bare name is left in the search_path)."""
    return ".".join(quote_ident(p) for p in table.split(".", 1))
