"""Connection references: a DSN (with ${ENV} references) or a connection id, looked up in its
variable or through the lookup a higher layer registers (Airflow's: tidemark/airflow).

Resolved lazily, at the moment a connection is opened, so a pipeline file can be validated
on a machine that cannot reach (or has no secrets for) its databases.
"""

from __future__ import annotations

import os
import re
from typing import Protocol
from urllib.parse import quote, unquote

from tidemark.core.errors import ConfigError

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


# Connections a pipeline names by id travel between processes in these variables (the
# convention Airflow reads, and the one the DAGs hand the Spark job: airflow/connections.py).
CONN_VAR = "AIRFLOW_CONN_{}"


class ConnectionLookup(Protocol):
    """Where a connection named by id is found when no variable holds it. Core knows none:
    the layer that does registers one (:func:`use_connections`; Airflow's is
    tidemark/airflow/connection_lookup.py)."""

    def uri(self, conn_id: str, where: str) -> str:
        """The URI of ``conn_id``, or ConfigError naming why not (``where``: the part of the
        pipeline that uses it)."""
        ...

    def uri_if_defined(self, conn_id: str) -> str | None:
        """The URI of ``conn_id``, None where there is no such connection (or nothing to ask);
        any other failure raises TidemarkError, masked."""
        ...


_lookup: ConnectionLookup | None = None


def use_connections(lookup: ConnectionLookup | None) -> None:
    """Resolve connection ids through ``lookup`` from now on (None: the environment only)."""
    global _lookup
    _lookup = lookup


def connection_uri(conn_id: str, where: str) -> str:
    """The URI of connection ``conn_id``: its variable (CONN_VAR), else the registered lookup.
    ``where`` names the part of the pipeline that uses it in the error."""
    var = CONN_VAR.format(conn_id.upper())
    env = os.environ.get(var)
    if env and not env.lstrip().startswith("{"):
        return remember(normalize_scheme(env))
    if _lookup is None:
        raise ConfigError(
            where, f"connection {conn_id!r}: set {var} or run where Airflow is installed"
        )
    return remember(normalize_scheme(_lookup.uri(conn_id, where)))


def connection_if_defined(conn_id: str) -> str | None:
    """The URI of connection ``conn_id`` from the registered lookup, or None when there is none
    or it has no such connection (any other failure raises, masked)."""
    uri = None if _lookup is None else _lookup.uri_if_defined(conn_id)
    return None if uri is None else remember(normalize_scheme(uri))


def normalize_scheme(uri: str) -> str:
    # Airflow spells it postgres://; libpq accepts both, psycopg too, but keep one spelling.
    return re.sub(r"^postgres(ql)?(\+\w+)?://", "postgresql://", uri)


def resolve(dsn: str | None, conn_id: str | None, where: str) -> str:
    if dsn:
        return remember(expand_env(dsn, where))
    if conn_id:
        return connection_uri(conn_id, where)
    raise ConfigError(where, "needs a dsn or a conn_id")
