"""The ``tidemark`` schema Tidemark keeps in every database it writes (sinks and the ledger):
a marker row per committed participant, the merge guard's conflict function, and the
per-task staging tables.

A marker row commits inside its prepared transaction, so "gid gone, marker here" means
committed and "gid gone, no marker" means rolled back (docs/design.md, "Commit protocol",
steps 2 and 4).
"""

from __future__ import annotations

import hashlib

import psycopg
from psycopg import sql

from tidemark.core.db import scalar

# SQLSTATE of a key whose versions come from different partitions with no declared order.
VERSION_CONFLICT = "TM001"

MARKERS_DDL = (
    """
CREATE SCHEMA IF NOT EXISTS tidemark;
CREATE TABLE IF NOT EXISTS tidemark.commits (
    gid        text PRIMARY KEY,
    run_id     bigint NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
-- Called by a sink merge's guard when a key's stored and incoming versions come from
-- different partitions and the sink declares no version column: offsets do not order them.
CREATE OR REPLACE FUNCTION tidemark.version_conflict(k text, stored int, incoming int)
RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = '"""
    + VERSION_CONFLICT
    + """',
        MESSAGE = format('key %s has versions from partitions %s and %s, which offsets do '
                         'not order; declare a version column for this sink (sinks[].version)',
                         k, stored, incoming);
END $$;
"""
)


def ensure(conn: psycopg.Connection) -> None:
    have = scalar(
        conn.execute(
            "SELECT to_regclass('tidemark.commits') IS NOT NULL AND "
            "to_regprocedure('tidemark.version_conflict(text,int,int)') IS NOT NULL"
        )
    )
    if not have:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(hashtext('tidemark.commits'))")
            conn.execute(MARKERS_DDL)


# What a database user needs for the schema above (docs/production.md, "Database users").
NEEDED = (
    "grant it CREATE on the database (Tidemark creates the schema tidemark), or USAGE and "
    "CREATE on schema tidemark and SELECT, INSERT, DELETE on tidemark.commits "
    '(docs/production.md, "Database users")'
)


def missing_privileges(conn: psycopg.Connection) -> list[str]:
    """What this connection's user lacks to keep markers and staging tables in the schema,
    which may be another user's (the first one to write that database made it). One round
    trip: the table found by the catalog, which needs no privilege on the schema."""
    row = (
        conn.execute(
            "SELECT has_schema_privilege(n.oid, 'USAGE'), has_schema_privilege(n.oid, 'CREATE'), "
            "has_table_privilege(c.oid, 'SELECT'), has_table_privilege(c.oid, 'INSERT'), "
            "has_table_privilege(c.oid, 'DELETE') "
            "FROM pg_namespace n JOIN pg_class c ON c.relnamespace = n.oid "
            "WHERE n.nspname = 'tidemark' AND c.relname = 'commits'"
        ).fetchone()
        or (False,) * 5
    )
    usage, create, *table = row
    out = [f"{p} on schema tidemark" for p, ok in (("USAGE", usage), ("CREATE", create)) if not ok]
    if not usage:  # the table's name cannot even be looked up
        return out
    lacking = [p for p, ok in zip(("SELECT", "INSERT", "DELETE"), table, strict=True) if not ok]
    return out + ([f"{', '.join(lacking)} on tidemark.commits"] if lacking else [])


def has(conn: psycopg.Connection, gid: str) -> bool:
    return (
        conn.execute("SELECT 1 FROM tidemark.commits WHERE gid = %s", (gid,)).fetchone() is not None
    )


def record(conn: psycopg.Connection, gid: str, run_id: int) -> None:
    """The marker of ``gid``, written in the transaction that is about to be prepared."""
    conn.execute("INSERT INTO tidemark.commits (gid, run_id) VALUES (%s, %s)", (gid, run_id))


def prune(conn: psycopg.Connection, settled_below: int) -> None:
    """Markers matter only while a decision may be in doubt: drop day-old ones of runs below
    ``settled_below`` (all settled)."""
    if scalar(conn.execute("SELECT to_regclass('tidemark.commits')")):
        conn.execute(
            """DELETE FROM tidemark.commits WHERE run_id < %s
                        AND created_at < now() - interval '1 day'""",
            (settled_below,),
        )


def stage_table(kind: str, gid: str) -> sql.Composed:
    """A task's unlogged staging table, named for its gid (``kind``: dlqstage, stage)."""
    return sql.SQL("tidemark.{}").format(
        sql.Identifier(f"{kind}_" + hashlib.sha1(gid.encode()).hexdigest()[:20])
    )


def version_conflict(
    label: sql.Composable, stored: sql.Composable, incoming: sql.Composable
) -> sql.Composed:
    """The merge guard's call that fails a key whose versions no offset orders."""
    return sql.SQL("tidemark.version_conflict({}, {}, {})").format(label, stored, incoming)


def forget(conn: psycopg.Connection, prefix: str, run_ids: list[int]) -> int:
    """Drop this installation's (``prefix``) markers of settled runs whose ledger rows are
    being deleted (retiring their pipeline); returns how many."""
    if not scalar(conn.execute("SELECT to_regclass('tidemark.commits')")):
        return 0
    return conn.execute(
        "DELETE FROM tidemark.commits WHERE run_id = ANY(%s) AND gid LIKE %s",
        (run_ids, f"{prefix}:%"),
    ).rowcount
