"""Prepared transactions on one database: list, commit, roll back, and settle an unknown.

``COMMIT PREPARED`` and ``ROLLBACK PREPARED`` cannot run inside a transaction block and
must come from a session on the database that prepared them: every function here takes an
autocommit connection to that database.
"""

from __future__ import annotations

import time

import psycopg
from psycopg import errors as pgerr

from tidemark.ledger import markers
from tidemark.ledger.runs import Outcome


def prepared(conn: psycopg.Connection, like: str) -> list[tuple[str, float]]:
    """(gid, age in seconds) of this database's prepared transactions matching ``like``."""
    return conn.execute(
        "SELECT gid, extract(epoch FROM now() - prepared)::float8 FROM pg_prepared_xacts "
        "WHERE database = current_database() AND gid LIKE %s ORDER BY gid",
        (like,),
    ).fetchall()


def is_prepared(conn: psycopg.Connection, gid: str) -> bool:
    return (
        conn.execute(
            "SELECT 1 FROM pg_prepared_xacts WHERE database = current_database() AND gid = %s",
            (gid,),
        ).fetchone()
        is not None
    )


def _finish(conn: psycopg.Connection, verb: str, gid: str, busy_seconds: float) -> bool:
    """COMMIT/ROLLBACK PREPARED; False if the gid is gone. Another session finishing the same
    gid at this moment (a driver and a recovery both settling a decision) makes it "busy":
    wait until that session is done, then report it gone."""
    stmt = psycopg.sql.SQL(verb + " PREPARED {}").format(psycopg.sql.Literal(gid))
    deadline = time.monotonic() + busy_seconds
    while True:
        try:
            conn.execute(stmt)
            return True
        except pgerr.UndefinedObject:
            return False
        except pgerr.ObjectNotInPrerequisiteState:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def rollback(conn: psycopg.Connection, gid: str, busy_seconds: float = 60.0) -> bool:
    """Roll back if still prepared; False if it was already gone."""
    return _finish(conn, "ROLLBACK", gid, busy_seconds)


def commit(conn: psycopg.Connection, gid: str, busy_seconds: float = 60.0) -> Outcome:
    """Commit a chosen gid: committed (now or earlier) or lost.

    A gid that is gone committed earlier if its marker row is here; with no marker it was
    rolled back by someone else, which the caller must treat as an inconsistency. A lost
    connection propagates: the outcome is then unknown and only recovery may settle it.
    """
    if _finish(conn, "COMMIT", gid, busy_seconds):
        return Outcome.COMMITTED
    return Outcome.COMMITTED if markers.has(conn, gid) else Outcome.LOST
