"""Connection references: a DSN (with ${ENV} references) or an Airflow connection id.

Resolved lazily, at the moment a connection is opened, so a pipeline file can be validated
on a machine that cannot reach (or has no secrets for) its databases.
"""

from __future__ import annotations

import os
import re
from urllib.parse import quote, unquote

from tidemark.core.errors import ConfigError, TidemarkError

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
# URI userinfo. libpq ends it at the first '@' or '/', so an encoded password holds neither;
# a raw one may hold both (a ${VAR} holding a password, an AIRFLOW_CONN_<ID> set by hand), so
# the password runs to the last '@' of the token. Without any '@' after it the rest of the
# token may be a password too (a DSN cut short, or one libpq could not parse): hide it all.
_PASSWORD = re.compile(r"(?P<pre>://[^:/@\s]*:)(?P<pw>\S*)(?P<post>@)(?=[^@\s]*(?:\s|$))")
_NO_AT = re.compile(r"(?P<pre>\b(?:postgres(?:ql)?)://[^:/@\s]*:)(?P<rest>[^@\s]*)(?=\s|$)")
# host:port/path is no userinfo (http://127.0.0.1:8080/x@y)
_PORT = re.compile(r"\d*(?:/|$)")
# A URI's query parameter (postgresql://u@h/db?password=pw&sslmode=require): up to the next '&'.
_QUERY_PASSWORD = re.compile(r"(?P<pre>[?&](?:ssl)?password=)[^&#\s]*", re.IGNORECASE)
# key=value form, and PGPASSWORD=... in a shell line; a quoted value may hold spaces and \'.
_KV_PASSWORD = re.compile(
    r"(?<![?&])(\b(?:PG)?(?:ssl)?password\s*=\s*)('(?:[^'\\]|\\.)*'?|\S+)", re.IGNORECASE
)
# Passwords of the DSNs this process resolved (remember()): a message may quote one without
# the DSN around it (libpq's "invalid percent-encoded token: ..."), or a raw password may hold
# a space, which no pattern can see the end of (so a resolved DSN itself is replaced, whole,
# by its masked form wherever it stands). Shorter passwords are left to the patterns.
_SECRETS: set[str] = set()
_DSNS: dict[str, str] = {}
_MIN_SECRET = 4


# libpq quotes what it could not read ('Secret9@host', "Ab%zzSecret9"): there, and only there,
# a resolved password is hidden, so a password that is also a word (a user's name, "tidemark")
# does not garble every message that names it.
_QUOTED = re.compile(r"(\"[^\"\n]*\"|'[^'\n]*')")


def _unquoted_secrets(m: re.Match[str]) -> str:
    text = m[0]
    for secret in sorted(_SECRETS, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def _password_span(dsn: str) -> tuple[int, int] | None:
    """Where the password stands in a DSN, read as leniently as a reader of the text would:
    a URI's userinfo up to its last '@' (raw or URL-encoded), a query's or key=value
    ``password`` (a quoted value without its quotes)."""
    m = re.search(r"://[^:/@\s]*:(.*)@", dsn)
    if m:
        return m.span(1)
    m = re.search(r"[?&]password=([^&#]*)", dsn, re.IGNORECASE) or _KV_PASSWORD.search(dsn)
    if not m:
        return None
    a, b = m.span(m.lastindex or 1)
    quoted = b - a >= 2 and dsn[a] == dsn[b - 1] == "'"
    return (a + 1, b - 1) if quoted else (a, b)


def password_of(dsn: str) -> str | None:
    span = _password_span(dsn)
    return dsn[span[0] : span[1]] if span else None


def remember(dsn: str) -> str:
    """Keep the DSN (with its password masked in place: a user or database of the same name
    stays readable) and its password (as written, decoded and encoded) for mask(); returns
    ``dsn``."""
    span = _password_span(dsn)
    if span and span[1] > span[0]:
        pw = dsn[span[0] : span[1]]
        _DSNS[dsn] = dsn[: span[0]] + "***" + dsn[span[1] :]
        for form in {pw, unquote(pw), quote(pw, safe=""), quote(unquote(pw), safe="")}:
            if len(form) >= _MIN_SECRET:
                _SECRETS.add(form)
    return dsn


def mask(text: str) -> str:
    """Hide passwords in anything that may hold a DSN (URI, raw or URL-encoded, its query,
    key=value form), a PGPASSWORD assignment, or a password this process resolved."""
    for dsn, masked in _DSNS.items():
        text = text.replace(dsn, masked)
    if _SECRETS:
        text = _QUOTED.sub(_unquoted_secrets, text)
    text = _PASSWORD.sub(lambda m: m[0] if _PORT.match(m["pw"]) else f"{m['pre']}***@", text)
    text = _NO_AT.sub(lambda m: m[0] if _PORT.match(m["rest"]) else f"{m['pre']}***", text)
    text = _QUERY_PASSWORD.sub(lambda m: f"{m['pre']}***", text)
    return _KV_PASSWORD.sub(lambda m: f"{m[1]}***", text)


def expand_env(value: str, where: str = "DSN") -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in os.environ:
            raise ConfigError(where, f"environment variable {name} is not set")
        return os.environ[name]

    return _ENV_REF.sub(sub, value)


def airflow_connection_uri(conn_id: str, where: str) -> str:
    """The URI of an Airflow connection: the AIRFLOW_CONN_<ID> environment variable Airflow
    would read, else Airflow's own lookup when Airflow is installed: inside a task its SDK,
    and where Airflow is configured (the CLI beside a scheduler, `airflow` working) its
    metadata database and secrets backends, so a connection made in the UI or with
    `airflow connections add` needs no duplicate variable. ``where`` names the part of the
    pipeline that uses it in the error."""
    var = f"AIRFLOW_CONN_{conn_id.upper()}"
    env = os.environ.get(var)
    if env and not env.lstrip().startswith("{"):
        return remember(_normalize_scheme(env))
    try:
        from airflow.sdk import BaseHook
    except Exception:  # noqa: BLE001 - Airflow absent or not configured
        raise ConfigError(
            where, f"connection {conn_id!r}: set {var} or run where Airflow is installed"
        ) from None
    try:
        conn = BaseHook.get_connection(conn_id)
    except Exception as exc:  # noqa: BLE001 - whatever Airflow raises: one masked line
        # Outside a task the SDK sees environment variables and secrets backends only, not
        # the connections kept in Airflow's metadata database: ask it there.
        uri, why = airflow_metadata_connection(conn_id)
        if uri is not None:
            return uri
        raise ConfigError(
            where,
            f"Airflow connection {conn_id!r} not found ({mask(str(exc))}; {why}); outside "
            f"Airflow, set {var} to its URI (postgresql://user:password@host:port/database)",
        ) from None
    return remember(_normalize_scheme(conn.get_uri()))


def airflow_metadata_connection(conn_id: str) -> tuple[str | None, str]:
    """(URI, "") of ``conn_id`` from Airflow's metadata database and secrets backends, as
    `airflow connections get` finds it, or (None, why not) where it is not there or Airflow
    is not configured here (no metadata database: a SQLite file that does not exist is never
    created by asking)."""
    try:
        from airflow.configuration import conf

        db = conf.get("database", "sql_alchemy_conn")
    except Exception as exc:  # noqa: BLE001 - Airflow's configuration could not load
        return None, f"Airflow is not configured here: {mask(_first_line(exc))}"
    if db.startswith("sqlite:"):
        path = db.split("sqlite:///", 1)[-1].split("?", 1)[0]
        if not path or path == ":memory:" or not os.path.exists(path):
            return None, (
                f"Airflow is not configured here: no metadata database ({db}; set AIRFLOW_HOME "
                "or AIRFLOW__DATABASE__SQL_ALCHEMY_CONN as Airflow's own processes have them)"
            )
    try:
        from airflow.models.connection import Connection

        conn = Connection.get_connection_from_secrets(conn_id)
    except Exception as exc:  # noqa: BLE001 - its types are Airflow's and SQLAlchemy's
        if type(exc).__name__ == "AirflowNotFoundException":
            return None, f"nor in Airflow's metadata database {mask(db)}"
        return None, f"cannot read Airflow's metadata database {mask(db)}: " + mask(
            _first_line(exc)
        )
    return remember(_normalize_scheme(conn.get_uri())), ""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def airflow_connection_if_defined(conn_id: str) -> str | None:
    """The URI of the Airflow connection ``conn_id``, or None when Airflow is not installed or
    has no such connection (any other failure raises, masked). Always through Airflow's
    ``BaseHook``, so that inside a task Airflow masks the password in the logs."""
    try:
        from airflow.sdk import BaseHook
    except Exception:  # noqa: BLE001 - Airflow absent or not configured
        return None
    try:
        conn = BaseHook.get_connection(conn_id)
    except Exception as exc:  # noqa: BLE001 - its type is Airflow's (core cannot import it)
        if type(exc).__name__ == "AirflowNotFoundException":
            return None
        raise TidemarkError(f"Airflow connection {conn_id!r}: {mask(str(exc))}") from None
    return remember(_normalize_scheme(conn.get_uri()))


def _normalize_scheme(uri: str) -> str:
    # Airflow spells it postgres://; libpq accepts both, psycopg too, but keep one spelling.
    return re.sub(r"^postgres(ql)?(\+\w+)?://", "postgresql://", uri)


def resolve(dsn: str | None, conn_id: str | None, where: str) -> str:
    if dsn:
        return remember(expand_env(dsn, where))
    if conn_id:
        return airflow_connection_uri(conn_id, where)
    raise ConfigError(where, "needs a dsn or a conn_id")
