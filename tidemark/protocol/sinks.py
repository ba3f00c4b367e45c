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
from tidemark.protocol import sink_schema
from tidemark.protocol.sink_schema import META_COLUMNS


@dataclass
class ResolvedSink:
    config: Sink
    dsn: str
    pipeline: str = "<pipeline>"  # names it in the commands a fix gives

    @property
    def name(self) -> str:
        return self.config.name


def resolve(pipeline: Pipeline, names: list[str] | None = None) -> list[ResolvedSink]:
    chosen = [pipeline.sink(n) for n in names] if names else pipeline.sinks
    return [ResolvedSink(s, pipeline.sink_dsn(s), pipeline.name) for s in chosen]


def prepare_database(conn: psycopg.Connection, what: str) -> None:
    """A database we will PREPARE on: prepared transactions on, marker table present and
    usable by this user. A user who may not is told here, in one line, before any task
    writes (else the first task fails on the marker's INSERT)."""
    require_prepared_transactions(conn, what)
    where = f"{what}: user {conn.info.user} in database {conn.info.dbname}"
    try:
        markers.ensure(conn)
    except psycopg.errors.InsufficientPrivilege as exc:
        reason = exc.diag.message_primary or "permission denied"
        raise TidemarkError(
            f"{where} cannot keep Tidemark's schema tidemark ({reason}): {markers.NEEDED}"
        ) from None
    missing = markers.missing_privileges(conn)
    if missing:
        raise TidemarkError(
            f"{where} lacks {'; '.join(missing)} (Tidemark's schema tidemark, "
            f"made by another user): {markers.NEEDED}"
        )


def table_exists(sink: ResolvedSink) -> bool:
    with connect(sink.dsn, autocommit=True, what=f"sink {sink.name}") as conn:
        return (
            scalar(conn.execute("SELECT to_regclass(%s)", (qualified(sink.config.table),)))
            is not None
        )


def table_problems(
    sink: ResolvedSink, columns: list[tuple[str, str | None]] | None, what: str
) -> list[str]:
    """What keeps the run from writing ``columns`` (None: not knowable before Spark runs the
    transform; the key and Tidemark's columns are checked still) to the sink's table, each
    with its fix; a missing table the run may create is none."""
    with connect(sink.dsn, autocommit=True, what=what) as conn:
        require_prepared_transactions(conn, what)
        have = sink_schema.table_columns(conn, sink.config.table)
        if have is None:
            return [] if sink.config.create_table else [_no_table(sink.config, what)]
        keys = sink_schema.unique_keys(conn, sink.config.table)
        return sink_schema.plan(sink.config, have, keys, columns, sink.pipeline).problems


def _no_table(cfg: Sink, what: str) -> str:
    return f"{what}: table {cfg.table} does not exist (create it, or set create_table: true)"


def ensure_table(
    sink: ResolvedSink, columns: list[tuple[str, str]], what: str, tombstones: bool = False
) -> list[str]:
    """The sink's table, created, or checked and evolved as its ``schema`` allows; with
    ``tombstones`` (the sink deletes keys) also its tombstone table. Returns what changed
    in the table ("added column x text")."""
    cfg = sink.config
    with connect(sink.dsn, autocommit=True, what=what) as conn:
        prepare_database(conn, what)
        changes: list[str] = []
        plan = _checked(conn, cfg, columns, what, sink.pipeline)
        if plan is None:
            _create(conn, cfg, columns)
        else:
            # Before the write: a column added now is NULL in every row already there, and a
            # write that then fails leaves only that (the next run adds nothing again).
            sink_schema.evolve(conn, cfg, plan.adds)
            changes = plan.changes()
        if tombstones:
            _create_tombstones(conn, cfg)
        return changes


def plan_table(
    sink: ResolvedSink, columns: list[tuple[str, str]], what: str, tombstones: bool = False
) -> sink_schema.Plan:
    """What :func:`ensure_table` would change in the sink's table, changing nothing in it
    (a dry run): refused where it refuses, and where the table does not exist (a dry run
    writes to the table as it is). Tidemark's own tombstone table is made as ensure_table
    makes it: it is not the sink's, and the write needs it."""
    cfg = sink.config
    with connect(sink.dsn, autocommit=True, what=what) as conn:
        prepare_database(conn, what)
        plan = _checked(conn, cfg, columns, what, sink.pipeline)
        if plan is None:
            raise TidemarkError(
                f"{what}: table {cfg.table} does not exist; the run would create it, a dry "
                f"run writes only to a table that exists"
            )
        if tombstones:
            _create_tombstones(conn, cfg)
        return plan


def _checked(
    conn: psycopg.Connection,
    cfg: Sink,
    columns: list[tuple[str, str]],
    what: str,
    pipeline: str,
) -> sink_schema.Plan | None:
    """How the table stands against ``columns`` (refused with every problem), or None when
    it does not exist and the sink may create it."""
    have = sink_schema.table_columns(conn, cfg.table)
    if have is None:
        if not cfg.create_table:
            raise TidemarkError(_no_table(cfg, what))
        return None
    keys = sink_schema.unique_keys(conn, cfg.table)
    plan = sink_schema.plan(cfg, have, keys, list(columns), pipeline)
    if not plan.ok:
        raise TidemarkError("; ".join(plan.problems))  # each names its sink
    return plan


def tombstone_name(table: str) -> str:
    """Where a sink that deletes keys keeps its tombstones (schema tidemark): the key, the
    version and the position of the newest tombstone of each deleted key. A re-delivery of an
    older version must not bring the key back, and the key has no row left to say it is
    newer."""
    return "tomb_" + hashlib.sha1(qualified(table).encode()).hexdigest()[:20]


def tombstone_table(table: str) -> sql.Composed:
    return sql.SQL("tidemark.{}").format(sql.Identifier(tombstone_name(table)))


def tombstones_ddl(table: str, key: list[str], version: str | None) -> list[sql.Composed]:
    """The statements that make ``table``'s tombstone table (idempotent): the key's and
    version's types are the table's, as CREATE TABLE AS copies them."""
    tomb = tombstone_table(table)
    cols = [*key, *([version] if version else []), "_tm_partition", "_tm_offset"]
    return [
        sql.SQL("CREATE TABLE IF NOT EXISTS {} AS SELECT {} FROM {} WITH NO DATA").format(
            tomb, sql.SQL(", ").join(sql.Identifier(c) for c in cols), sql.SQL(qualified(table))
        ),
        sql.SQL("CREATE UNIQUE INDEX IF NOT EXISTS {} ON {} ({})").format(
            sql.Identifier(f"{tombstone_name(table)}_key"),
            tomb,
            sql.SQL(", ").join(sql.Identifier(k) for k in key),
        ),
    ]


def column_defs(columns: list[tuple[str, str]], key: list[str]) -> sql.Composed:
    """A sink table's columns: the pipeline's output, Tidemark's, the key as primary key."""
    defs = [sql.SQL("{} {}").format(sql.Identifier(n), sql.SQL(t)) for n, t in columns]
    defs += [
        sql.SQL("{} {} NOT NULL").format(sql.Identifier(n), sql.SQL(t)) for n, t in META_COLUMNS
    ]
    defs.append(
        sql.SQL("PRIMARY KEY ({})").format(sql.SQL(", ").join(sql.Identifier(k) for k in key))
    )
    return sql.SQL(", ").join(defs)


def _create_tombstones(conn: psycopg.Connection, cfg: Sink) -> None:
    name = tombstone_name(cfg.table)
    if scalar(conn.execute("SELECT to_regclass(%s)", (f"tidemark.{name}",))):
        return
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (name,))
        for statement in tombstones_ddl(cfg.table, cfg.key, cfg.version):
            conn.execute(statement)


def _create(conn: psycopg.Connection, cfg: Sink, columns: list[tuple[str, str]]) -> None:
    with conn.transaction():
        if "." in cfg.table:
            conn.execute(
                sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(
                    sql.Identifier(cfg.table.split(".", 1)[0])
                )
            )
        conn.execute(
            sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
                sql.SQL(qualified(cfg.table)), column_defs(columns, cfg.key)
            )
        )
