"""Versioned SQL migrations from ``sql/V<NNN>__<name>.sql``, applied once each, in order."""

from __future__ import annotations

import re
from pathlib import Path

import psycopg

from tidemark.core.db import connect, require_prepared_transactions, scalar
from tidemark.core.errors import TidemarkError
from tidemark.core.settings import get_settings

SHIPPED_SQL = Path(__file__).resolve().parent / "sql"  # the migrations in the wheel
_NAME = re.compile(r"^V(\d{3})__(\w+)\.sql$")
LOCK_KEY = 0x74646D6B  # 'tdmk': one upgrade at a time


def sql_dir() -> Path:
    """The migrations' folder: TIDEMARK_SQL_DIR, else the package's own."""
    return get_settings().sql_dir or SHIPPED_SQL


def available() -> list[tuple[int, str, Path]]:
    found = []
    folder = sql_dir()
    for path in sorted(folder.glob("V*.sql")):
        m = _NAME.match(path.name)
        if m:
            found.append((int(m[1]), m[2], path))
    if not found:
        raise TidemarkError(f"no migrations found in {folder}")
    return found


def current_version(conn: psycopg.Connection) -> int:
    exists = scalar(conn.execute("SELECT to_regclass('tidemark.schema_version')"))
    if exists is None:
        return 0
    return int(
        scalar(conn.execute("SELECT coalesce(max(version), 0) FROM tidemark.schema_version"))
    )


def upgrade(dsn: str) -> tuple[int, list[str]]:
    """Apply pending migrations; returns (version, names applied). Idempotent."""
    applied: list[str] = []
    with connect(dsn, what="ledger") as conn:
        require_prepared_transactions(conn, "ledger")
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
            conn.execute("CREATE SCHEMA IF NOT EXISTS tidemark")
            conn.execute("""CREATE TABLE IF NOT EXISTS tidemark.schema_version (
                version int PRIMARY KEY, name text NOT NULL,
                applied_at timestamptz NOT NULL DEFAULT now())""")
            version = current_version(conn)
            for number, name, path in available():
                if number <= version:
                    continue
                try:
                    conn.execute(path.read_text())
                except psycopg.Error as exc:
                    raise TidemarkError(f"migration {path.name} failed: {exc}") from None
                conn.execute(
                    "INSERT INTO tidemark.schema_version (version, name) VALUES (%s, %s)",
                    (number, name),
                )
                applied.append(path.name)
                version = number
    return version, applied


def require_current(conn: psycopg.Connection) -> None:
    latest = available()[-1][0]
    have = current_version(conn)
    if have < latest:
        raise TidemarkError(
            f"ledger schema is at version {have}, this Tidemark needs {latest}: "
            f"run `tidemark db upgrade`"
        )
