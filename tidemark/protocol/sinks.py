"""Driver side of the sinks: resolve them, check their servers, create or check tables."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import psycopg
from psycopg import sql

from tidemark.config import Pipeline, Sink
from tidemark.core.db import connect, qualified, require_prepared_transactions, scalar
from tidemark.core.errors import TidemarkError
from tidemark.ledger import markers

META_COLUMNS = [("_tm_partition", "integer"), ("_tm_offset", "bigint"), ("_tm_run_id", "bigint")]


@dataclass
class ResolvedSink:
    config: Sink
    dsn: str

    @property
    def name(self) -> str:
        return self.config.name


def resolve(pipeline: Pipeline, names: list[str] | None = None) -> list[ResolvedSink]:
    chosen = [pipeline.sink(n) for n in names] if names else pipeline.sinks
    return [ResolvedSink(s, pipeline.sink_dsn(s)) for s in chosen]


def prepare_database(conn: psycopg.Connection, what: str) -> None:
    """A database we will PREPARE on: prepared transactions on, marker table present."""
    require_prepared_transactions(conn, what)
    markers.ensure(conn)


def table_exists(sink: ResolvedSink) -> bool:
    with connect(sink.dsn, autocommit=True, what=f"sink {sink.name}") as conn:
        return (
            scalar(conn.execute("SELECT to_regclass(%s)", (qualified(sink.config.table),)))
            is not None
        )


def ensure_table(
    sink: ResolvedSink, columns: list[tuple[str, str]], what: str, tombstones: bool = False
) -> None:
    """The sink's table, created or checked; with ``tombstones`` (the sink deletes keys) also
    its tombstone table."""
    cfg = sink.config
    with connect(sink.dsn, autocommit=True, what=what) as conn:
        prepare_database(conn, what)
        exists = scalar(conn.execute("SELECT to_regclass(%s)", (qualified(cfg.table),)))
        if exists is None:
            if not cfg.create_table:
                raise TidemarkError(
                    f"{what}: table {cfg.table} does not exist "
                    f"(create it, or set create_table: true)"
                )
            _create(conn, cfg, columns)
        else:
            _check(conn, cfg, columns, what)
        if tombstones:
            _create_tombstones(conn, cfg)


def tombstone_name(table: str) -> str:
    """Where a sink that deletes keys keeps its tombstones (schema tidemark): the key, the
    version and the position of the newest tombstone of each deleted key. A re-delivery of an
    older version must not bring the key back, and the key has no row left to say it is
    newer."""
    return "tomb_" + hashlib.sha1(qualified(table).encode()).hexdigest()[:20]


def tombstone_table(table: str) -> sql.Composed:
    return sql.SQL("tidemark.{}").format(sql.Identifier(tombstone_name(table)))


def _create_tombstones(conn: psycopg.Connection, cfg: Sink) -> None:
    name = tombstone_name(cfg.table)
    if scalar(conn.execute("SELECT to_regclass(%s)", (f"tidemark.{name}",))):
        return
    tomb = tombstone_table(cfg.table)
    cols = [*cfg.key, *([cfg.version] if cfg.version else []), "_tm_partition", "_tm_offset"]
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (name,))
        # The key's and version's types are the table's: CREATE TABLE AS copies them.
        conn.execute(
            sql.SQL("CREATE TABLE IF NOT EXISTS {} AS SELECT {} FROM {} WITH NO DATA").format(
                tomb,
                sql.SQL(", ").join(sql.Identifier(c) for c in cols),
                sql.SQL(qualified(cfg.table)),
            )
        )
        conn.execute(
            sql.SQL("CREATE UNIQUE INDEX IF NOT EXISTS {} ON {} ({})").format(
                sql.Identifier(f"{name}_key"),
                tomb,
                sql.SQL(", ").join(sql.Identifier(k) for k in cfg.key),
            )
        )


def _create(conn: psycopg.Connection, cfg: Sink, columns: list[tuple[str, str]]) -> None:
    defs = [sql.SQL("{} {}").format(sql.Identifier(n), sql.SQL(t)) for n, t in columns]
    defs += [
        sql.SQL("{} {} NOT NULL").format(sql.Identifier(n), sql.SQL(t)) for n, t in META_COLUMNS
    ]
    defs.append(
        sql.SQL("PRIMARY KEY ({})").format(sql.SQL(", ").join(sql.Identifier(k) for k in cfg.key))
    )
    with conn.transaction():
        if "." in cfg.table:
            conn.execute(
                sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(
                    sql.Identifier(cfg.table.split(".", 1)[0])
                )
            )
        conn.execute(
            sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
                sql.SQL(qualified(cfg.table)), sql.SQL(", ").join(defs)
            )
        )


def _check(conn: psycopg.Connection, cfg: Sink, columns: list[tuple[str, str]], what: str) -> None:
    have: dict[str, bool] = dict(
        conn.execute(
            """SELECT attname, attnotnull FROM pg_attribute WHERE attrelid = %s::regclass
           AND attnum > 0 AND NOT attisdropped""",
            (qualified(cfg.table),),
        ).fetchall()
    )
    missing = [n for n, _ in [*columns, *META_COLUMNS] if n not in have]
    if missing:
        raise TidemarkError(f"{what}: table {cfg.table} lacks columns {', '.join(missing)}")
    # A NULL key is distinct from every other NULL: the row would duplicate on every
    # re-delivery (and vanish in the merge's DISTINCT ON). Refuse such a table.
    nullable = [k for k in cfg.key if not have[k]]
    if nullable:
        raise TidemarkError(
            f"{what}: table {cfg.table} allows NULL in key column(s) "
            f"{', '.join(nullable)}; make them NOT NULL (ALTER TABLE "
            f"{cfg.table} ALTER COLUMN {nullable[0]} SET NOT NULL)"
        )
    unique = conn.execute(
        """SELECT 1 FROM pg_index i WHERE i.indrelid = %s::regclass AND i.indisunique
           AND i.indpred IS NULL AND (SELECT array_agg(a.attname::text ORDER BY a.attname)
               FROM pg_attribute a WHERE a.attrelid = i.indrelid
               AND a.attnum = ANY(i.indkey)) = %s""",
        (qualified(cfg.table), sorted(cfg.key)),
    ).fetchone()
    if unique is None:
        raise TidemarkError(
            f"{what}: table {cfg.table} needs a unique index on exactly "
            f"({', '.join(cfg.key)}) for keyed upserts"
        )
