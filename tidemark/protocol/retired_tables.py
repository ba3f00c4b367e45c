"""Retired tables (``<table>_<YYYYMMDD>_run<N>``: the tables a rebuild swapped out,
tidemark/protocol/rebuild.py) dropped once older than the pipeline's
``retention.retired_tables_days`` (docs/operations.md, "Retention"), with their tombstone
tables. A table is taken for retired only if its name is exactly the one a rebuild of that
sink's table would give it (rebuild.retired_table); one that other objects depend on (a
view, a foreign key) is kept and said so: never CASCADE.

May import: core, config, ledger.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, date, datetime

import psycopg
from psycopg import sql

from tidemark.config import Pipeline
from tidemark.core.db import connect, one_line, qualified
from tidemark.core.dsn import mask
from tidemark.core.errors import TidemarkError
from tidemark.protocol.prune_summary import Progress, Summary
from tidemark.protocol.rebuild import retired_table
from tidemark.protocol.sinks import tombstone_table

_RETIRED = re.compile(r"_(\d{8})_run(\d+)$")


@dataclass(frozen=True)
class Retired:
    table: str  # as the pipeline names tables: schema.name, or a bare name
    retired_on: date
    run_id: int


def found(conn: psycopg.Connection, table: str) -> list[Retired]:
    """The retired tables of ``table`` in its schema, oldest first."""
    schema, _, _ = table.rpartition(".")
    rows = conn.execute(
        "SELECT tablename FROM pg_tables WHERE schemaname = coalesce(%s, current_schema()) "
        "AND tablename ~ '_[0-9]{8}_run[0-9]+$'",
        (schema or None,),
    ).fetchall()
    out = []
    for (name,) in rows:
        m = _RETIRED.search(name)
        if m is None:
            continue
        try:
            when = datetime.strptime(m[1], "%Y%m%d").replace(tzinfo=UTC)
        except ValueError:
            continue
        named = f"{schema}.{name}" if schema else name
        if retired_table(table, int(m[2]), when) == named:
            out.append(Retired(named, when.date(), int(m[2])))
    return sorted(out, key=lambda r: (r.retired_on, r.run_id))


def drop(conn: psycopg.Connection, r: Retired) -> None:
    """Drop a retired table and its tombstone table, in one transaction."""
    with conn.transaction():
        conn.execute(sql.SQL("DROP TABLE {}").format(sql.SQL(qualified(r.table))))
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(tombstone_table(r.table)))


def expire(pipeline: Pipeline, days: int, summary: Summary, progress: Progress) -> None:
    """Drop (``summary.dry_run``: list) the retired tables of ``pipeline``'s sinks older than
    ``days``, saying each; a sink database that cannot be reached is a note, not an error."""
    today = datetime.now(UTC).date()
    verb = "would drop" if summary.dry_run else "dropped"
    for sink in pipeline.sinks:
        where = f"pipeline {pipeline.name} sink {sink.name}"
        try:
            dsn = pipeline.sink_dsn(sink)
            with connect(dsn, autocommit=True, what=f"sink {sink.name}") as conn:
                for r in found(conn, sink.table):
                    age = (today - r.retired_on).days
                    if age < days:
                        continue
                    why = (
                        f"retired table {r.table} ({where}; rebuild run {r.run_id}, retired "
                        f"{r.retired_on:%Y-%m-%d}, {age} days ago; kept {days} days)"
                    )
                    if not summary.dry_run:
                        try:
                            drop(conn, r)
                        except psycopg.Error as exc:
                            summary.notes.append(f"kept {why}: {one_line(exc)}")
                            continue
                    summary.tables.append(f"{verb} {why}")
                    summary.rows["retired_tables"] = summary.rows.get("retired_tables", 0) + 1
                    progress(f"retired tables: {verb} {r.table}")
        except (psycopg.Error, TidemarkError) as exc:
            summary.notes.append(f"retired tables of {where} not checked: {mask(one_line(exc))}")
