"""A sink rebuilt from its source (``tidemark sink rebuild``; docs/operations.md, "Rebuild a
sink"): the table is made again from the current pipeline and swapped in, inside the one
transaction that the rebuild's write task PREPAREs on the sink's database.

The task creates a new table (the pipeline's columns, its key as the primary key), writes
every record the sink has received into it, then renames the live table to a dated name and
the new table to the live name, and PREPAREs. Nothing of it is visible before the decision
commits that transaction: a rebuild that fails, crashes before its decision or previews
leaves no table behind, and one past its decision is finished by recovery like any run.

May import: core, config, ledger.
"""

from __future__ import annotations

from datetime import datetime

import psycopg
from psycopg import sql

from tidemark.core.db import qualified, scalar
from tidemark.protocol import sinks
from tidemark.protocol.sinks import tombstone_name, tombstone_table

MAX_NAME = 63  # PostgreSQL's identifier length (NAMEDATALEN - 1)


def _split(table: str) -> tuple[str | None, str]:
    schema, _, name = table.rpartition(".")
    return schema or None, name


def _named(table: str, name: str) -> str:
    schema, _ = _split(table)
    return f"{schema}.{name}" if schema else name


def new_table(table: str, run_id: int) -> str:
    """Where the rebuild writes before the swap (only its own transaction ever sees it)."""
    tail = f"__tm_rebuild_{run_id}"
    return _named(table, _split(table)[1][: MAX_NAME - len(tail)] + tail)


def retired_table(table: str, run_id: int, when: datetime) -> str:
    """The dated name the live table is kept under, e.g. ``public.orders_20261126_run42``."""
    tail = f"_{when:%Y%m%d}_run{run_id}"
    return _named(table, _split(table)[1][: MAX_NAME - len(tail)] + tail)


def create(
    conn: psycopg.Connection, table: str, columns: list[tuple[str, str]], key: list[str]
) -> None:
    """The new table, made as a sink table is (protocol/sinks.py)."""
    conn.execute(
        sql.SQL("CREATE TABLE {} ({})").format(
            sql.SQL(qualified(table)), sinks.column_defs(columns, key)
        )
    )


def create_tombstones(
    conn: psycopg.Connection, table: str, key: list[str], version: str | None
) -> None:
    """The new table's tombstone table (a sink that deletes keys)."""
    for statement in sinks.tombstones_ddl(table, key, version):
        conn.execute(statement)


def swap(conn: psycopg.Connection, live: str, new: str, retired: str) -> None:
    """``live`` becomes ``retired``, ``new`` becomes ``live``; so do their primary keys'
    names where the live one has PostgreSQL's default name (``<table>_pkey``), so that the
    rebuilt table's key reads as a table created under that name would, and their tombstone
    tables (named after their tables). Where there is no live table (it was dropped), the
    new one takes its name."""
    for old, to in ((live, retired), (new, live)):
        if scalar(conn.execute("SELECT to_regclass(%s)", (f"tidemark.{tombstone_name(old)}",))):
            conn.execute(
                sql.SQL("ALTER TABLE {} RENAME TO {}").format(
                    tombstone_table(old), sql.Identifier(tombstone_name(to))
                )
            )
            conn.execute(
                sql.SQL("ALTER INDEX IF EXISTS {} RENAME TO {}").format(
                    sql.SQL("tidemark.{}").format(sql.Identifier(f"{tombstone_name(old)}_key")),
                    sql.Identifier(f"{tombstone_name(to)}_key"),
                )
            )
    live_name, retired_name = _split(live)[1], _split(retired)[1]
    pkey = _primary_key(conn, live)
    if scalar(conn.execute("SELECT to_regclass(%s)", (qualified(live),))) is not None:
        _rename(conn, live, retired)
    if pkey == f"{live_name}_pkey":
        conn.execute(
            sql.SQL("ALTER TABLE {} RENAME CONSTRAINT {} TO {}").format(
                sql.SQL(qualified(retired)),
                sql.Identifier(pkey),
                sql.Identifier(f"{retired_name}_pkey"[:MAX_NAME]),
            )
        )
    _rename(conn, new, live)
    new_pkey = _primary_key(conn, live)
    free = scalar(
        conn.execute("SELECT to_regclass(%s)", (qualified(_named(live, f"{live_name}_pkey")),))
    )
    if new_pkey and free is None:
        conn.execute(
            sql.SQL("ALTER TABLE {} RENAME CONSTRAINT {} TO {}").format(
                sql.SQL(qualified(live)),
                sql.Identifier(new_pkey),
                sql.Identifier(f"{live_name}_pkey"),
            )
        )


def _rename(conn: psycopg.Connection, table: str, to: str) -> None:
    conn.execute(
        sql.SQL("ALTER TABLE {} RENAME TO {}").format(
            sql.SQL(qualified(table)), sql.Identifier(_split(to)[1])
        )
    )


def _primary_key(conn: psycopg.Connection, table: str) -> str | None:
    name: str | None = scalar(
        conn.execute(
            "SELECT conname FROM pg_constraint WHERE conrelid = to_regclass(%s) AND contype = 'p'",
            (qualified(table),),
        )
    )
    return name


def placed_below(conn: psycopg.Connection, table: str, floors: dict[int, int]) -> dict[int, int]:
    """Rows of ``table`` below ``floors`` (partition -> offset), per partition; partitions
    not in ``floors`` count none. Below where a sink began, a row was placed by a
    re-delivery from before the ledger kept where sinks began: never delivered to it."""
    rows = conn.execute(
        sql.SQL(
            "SELECT t._tm_partition, count(*) FROM {} t "
            "JOIN unnest(%s::int[], %s::bigint[]) AS s(p, floor) ON s.p = t._tm_partition "
            "WHERE t._tm_offset < s.floor GROUP BY 1 ORDER BY 1"
        ).format(sql.SQL(qualified(table))),
        (list(floors), list(floors.values())),
    ).fetchall()
    return {p: n for p, n in rows}
