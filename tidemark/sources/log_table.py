"""The ``postgres_log`` table a pipeline reads: its DDL, made from the pipeline's column names,
and a check of an existing table's shape (``tidemark source create``; docs/pipelines.md,
"Sources").

The reader needs: ``partition`` and ``offset`` integers, the primary key (offsets are per
partition); ``key`` bytes or text; ``payload`` bytes; ``headers`` JSON (or text); ``ts`` a
time (``timestamp`` without zone is UTC); ``xid`` the writer's transaction id as ``xid8``, which
the watermark compares with ``pg_snapshot_xmin`` (tidemark/sources/postgres_log.py). The
``<table>_heads`` table holds each partition's next offset for ``postgres_log.append``, whose
head-row lock keeps offsets dense and commit-ordered.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql

from tidemark.config import LogColumns
from tidemark.core.db import qualified, scalar

# column role -> (the type it is created with, the types the reader takes)
TYPES: dict[str, tuple[str, tuple[str, ...]]] = {
    "partition": ("int NOT NULL", ("integer", "smallint", "bigint")),
    "offset": ("bigint NOT NULL", ("bigint", "integer")),
    "key": ("bytea", ("bytea", "text")),
    "payload": ("bytea", ("bytea",)),
    "headers": ("jsonb", ("jsonb", "json", "text")),
    "ts": (
        "timestamptz NOT NULL DEFAULT now()",
        ("timestamp with time zone", "timestamp without time zone"),
    ),
    "xid": ("xid8 NOT NULL DEFAULT pg_current_xact_id()", ("xid8",)),
}


def _q(name: str) -> str:
    return sql.Identifier(name).as_string(None)


def ddl(table: str, columns: LogColumns | None = None) -> str:
    """The statements that create the log table ``table`` and its heads table (idempotent)."""
    cols = (columns or LogColumns()).model_dump()
    t, heads = qualified(table), qualified(table + "_heads")
    lines = [f"    {_q(cols[role])} {created}," for role, (created, _) in TYPES.items()]
    out = []
    if "." in table:
        out.append(f"CREATE SCHEMA IF NOT EXISTS {_q(table.split('.', 1)[0])};")
    out.append(
        f"CREATE TABLE IF NOT EXISTS {t} (\n"
        + "\n".join(lines)
        + f"\n    PRIMARY KEY ({_q(cols['partition'])}, {_q(cols['offset'])})\n);"
    )
    out.append(
        f"CREATE TABLE IF NOT EXISTS {heads} (\n"
        f'    "partition" int PRIMARY KEY,\n    next_offset bigint NOT NULL\n);'
    )
    return "\n".join(out)


@dataclass(frozen=True)
class Shape:
    """What a log table that exists lacks, one line each (empty: the reader can read it)."""

    problems: list[str]


def shape(conn: psycopg.Connection, table: str, columns: LogColumns | None = None) -> Shape | None:
    """The shape of ``table`` as the reader sees it, or None if there is no such table."""
    cols = (columns or LogColumns()).model_dump()
    if scalar(conn.execute("SELECT to_regclass(%s)", (qualified(table),))) is None:
        return None
    have: dict[str, str] = dict(
        conn.execute(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
            "WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped",
            (qualified(table),),
        ).fetchall()
    )
    problems = []
    for role, (_, takes) in TYPES.items():
        name = cols[role]
        if name not in have:
            problems.append(f"lacks column {name} ({role}, {' or '.join(takes)})")
        elif have[name] not in takes:
            problems.append(f"column {name} ({role}) is {have[name]}, not {' or '.join(takes)}")
    unique = conn.execute(
        """SELECT 1 FROM pg_index i WHERE i.indrelid = %s::regclass AND i.indisunique
           AND (SELECT array_agg(a.attname::text ORDER BY a.attname) FROM pg_attribute a
                WHERE a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey))
               = %s::text[]""",
        (qualified(table), sorted([cols["partition"], cols["offset"]])),
    ).fetchone()
    if unique is None:
        problems.append(
            f"has no primary key or unique index on ({cols['partition']}, {cols['offset']})"
        )
    return Shape(problems)


def create(conn: psycopg.Connection, table: str, columns: LogColumns | None = None) -> bool:
    """Create the log table (and its heads table) unless it exists; True if it was created.
    A table that exists is left as it is: check it with :func:`shape`."""
    with conn.transaction():
        # Two creators at once: the second waits here, then finds the table.
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (qualified(table),))
        if shape(conn, table, columns) is not None:
            return False
        conn.execute(ddl(table, columns))
    return True
