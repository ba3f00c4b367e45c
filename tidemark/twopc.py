"""Prepared transactions on one database: list, commit, roll back, and settle an unknown.

``COMMIT PREPARED`` and ``ROLLBACK PREPARED`` cannot run inside a transaction block and
must come from a session on the database that prepared them: every function here takes an
autocommit connection to that database.
"""

from __future__ import annotations

import psycopg
from psycopg import errors as pgerr

MARKERS_DDL = """
CREATE SCHEMA IF NOT EXISTS tidemark;
CREATE TABLE IF NOT EXISTS tidemark.commits (
    gid        text PRIMARY KEY,
    run_id     bigint NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
"""


def ensure_markers(conn: psycopg.Connection) -> None:
    exists = conn.execute("SELECT to_regclass('tidemark.commits')").fetchone()[0]
    if exists is None:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(hashtext('tidemark.commits'))")
            conn.execute(MARKERS_DDL)


def prepared(conn: psycopg.Connection, like: str) -> list[tuple[str, float]]:
    """(gid, age in seconds) of this database's prepared transactions matching ``like``."""
    return conn.execute(
        "SELECT gid, extract(epoch FROM now() - prepared)::float8 FROM pg_prepared_xacts "
        "WHERE database = current_database() AND gid LIKE %s ORDER BY gid", (like,)).fetchall()


def is_prepared(conn: psycopg.Connection, gid: str) -> bool:
    return conn.execute("SELECT 1 FROM pg_prepared_xacts WHERE database = current_database() "
                        "AND gid = %s", (gid,)).fetchone() is not None


def has_marker(conn: psycopg.Connection, gid: str) -> bool:
    return conn.execute("SELECT 1 FROM tidemark.commits WHERE gid = %s", (gid,)
                        ).fetchone() is not None


def rollback(conn: psycopg.Connection, gid: str) -> bool:
    """Roll back if still prepared; False if it was already gone."""
    try:
        conn.execute(psycopg.sql.SQL("ROLLBACK PREPARED {}").format(psycopg.sql.Literal(gid)))
        return True
    except pgerr.UndefinedObject:
        return False


def commit(conn: psycopg.Connection, gid: str) -> str:
    """Commit a chosen gid. Returns 'committed' (now or earlier) or 'lost'.

    A gid that is gone committed earlier if its marker row is here; with no marker it was
    rolled back by someone else, which the caller must treat as an inconsistency. A lost
    connection propagates: the outcome is then unknown and only recovery may settle it.
    """
    try:
        conn.execute(psycopg.sql.SQL("COMMIT PREPARED {}").format(psycopg.sql.Literal(gid)))
        return "committed"
    except pgerr.UndefinedObject:
        return "committed" if has_marker(conn, gid) else "lost"
