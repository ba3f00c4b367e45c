"""Dead letters as Spark tasks write them: inside a task's ledger transaction (prepared with
the task's sink writes), one letter per (pipeline, sink, record).

Quarantined again, a letter is live again (a redriven or discarded one goes back to
quarantined) and keeps its history (attempts, who resolved it before). A re-delivery that
now succeeds resolves the letters of what it delivered.
"""

from __future__ import annotations

from contextlib import contextmanager

import psycopg
from psycopg import sql

from tidemark.ledger import markers

COLUMNS = ("pipeline", "sink", "run_id", "source_partition", "source_offset", "key",
           "payload", "headers", "error_class", "reason", "detail")
_COLS = sql.SQL(", ").join(sql.Identifier(c) for c in COLUMNS)


class Stage:
    """A task's letters staged by COPY (rows in ``COLUMNS`` order), merged into tidemark.dlq.
    The staging table exists only once something is staged."""

    def __init__(self, conn: psycopg.Connection, gid: str):
        self.conn = conn
        self.table = markers.stage_table("dlqstage", gid)
        self.created = False

    @contextmanager
    def copy(self):
        if not self.created:
            self.conn.execute(sql.SQL(
                "CREATE UNLOGGED TABLE {} AS SELECT {} FROM tidemark.dlq WITH NO DATA").format(
                self.table, _COLS))
            self.created = True
        with self.conn.cursor().copy(sql.SQL("COPY {} ({}) FROM STDIN").format(
                self.table, _COLS)) as copy:
            yield copy

    def merge(self) -> None:
        self.conn.execute(sql.SQL("""
            INSERT INTO tidemark.dlq AS d ({cols}) SELECT {cols} FROM {stage}
            ON CONFLICT ON CONSTRAINT dlq_one_per_sink DO UPDATE
            SET attempts = d.attempts + 1, last_seen = now(), run_id = EXCLUDED.run_id,
                error_class = EXCLUDED.error_class, reason = EXCLUDED.reason,
                detail = EXCLUDED.detail, status = 'quarantined'""").format(
            cols=_COLS, stage=self.table))
        self.conn.execute(sql.SQL("TRUNCATE {}").format(self.table))

    def drop(self) -> None:
        if self.created:
            self.conn.execute(sql.SQL("DROP TABLE {}").format(self.table))
            self.created = False


_RESOLVE = """UPDATE tidemark.dlq SET status = 'redriven', resolved_by = %(by)s,
                     resolved_at = now(), note = %(note)s
              WHERE status <> 'redriven' AND {where}"""


def resolve_ids(conn: psycopg.Connection, ids: list[int], by: str, note: str) -> int:
    """Redrive: the held letters whose records are delivered now. Returns how many."""
    return conn.execute(_RESOLVE.format(where="id = ANY(%(ids)s)"),
                        {"ids": ids, "by": by, "note": note}).rowcount


def resolve_range(conn: psycopg.Connection, pipeline: str, sink: str, partition: int,
                  start: int, end: int, failed: list[int], by: str, note: str) -> int:
    """Re-delivery: the live letters of ``sink`` for records in ``[start, end)`` of
    ``partition``, except the ``failed`` offsets. Returns how many were resolved."""
    return conn.execute(_RESOLVE.format(where="""pipeline = %(pipeline)s AND sink = %(sink)s
        AND source_partition = %(p)s AND source_offset >= %(a)s AND source_offset < %(b)s
        AND source_offset <> ALL(%(failed)s)"""),
        {"pipeline": pipeline, "sink": sink, "p": partition, "a": start, "b": end,
         "failed": failed, "by": by, "note": note}).rowcount


def resolve_offsets(conn: psycopg.Connection, pipeline: str, sink: str, partition: int,
                    offsets: list[int], by: str, note: str) -> int:
    """Re-delivery: the live letters of ``sink`` for these records of ``partition``, placed
    by a row now (a key fell back to them). Returns how many were resolved."""
    return conn.execute(_RESOLVE.format(where="""pipeline = %(pipeline)s AND sink = %(sink)s
        AND source_partition = %(p)s AND source_offset = ANY(%(offs)s)"""),
        {"pipeline": pipeline, "sink": sink, "p": partition, "offs": offsets, "by": by,
         "note": note}).rowcount
