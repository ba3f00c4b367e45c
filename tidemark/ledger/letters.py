"""Dead letters as Spark tasks write them: inside a task's ledger transaction (prepared with
the task's sink writes), one letter per (pipeline, sink, record).

Quarantined again, a letter is live again (a redriven one goes back to quarantined) and keeps
its history (attempts, who resolved it before); a discarded one stays discarded while its record
fails (the operator's decision stands). A re-delivery that now succeeds resolves the letters
of what it delivered, discarded ones too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime

import psycopg
from psycopg import sql

from tidemark.ledger import markers

# What a letter says of its record and why it failed: the start of every letter's columns,
# those a task writes (COLUMNS) and those a reader gets (dlq.ENVELOPE).
RECORD = (
    "pipeline",
    "sink",
    "run_id",
    "source_partition",
    "source_offset",
    "key",
    "payload",
    "headers",
    "error_class",
    "reason",
    "detail",
)
COLUMNS = (*RECORD, "source_headers", "source_ts", "source_kept")
_COLS = sql.SQL(", ").join(sql.Identifier(c) for c in COLUMNS)
# A letter of dlq alias d whose bytes retention dropped, going live again.
_BACK = sql.SQL("(d.pruned_at IS NOT NULL AND d.status <> 'discarded')")


def header_bytes(headers: str | None) -> bytes | None:
    """A record's headers text as ``source_headers`` keeps it: its exact UTF-8 bytes."""
    return None if headers is None else headers.encode("utf-8", "surrogatepass")


def header_text(stored: bytes | None) -> str | None:
    return None if stored is None else bytes(stored).decode("utf-8", "surrogatepass")


class Stage:
    """A task's letters staged by COPY (rows in ``COLUMNS`` order), merged into tidemark.dlq.
    The staging table exists only once something is staged."""

    def __init__(self, conn: psycopg.Connection, gid: str):
        self.conn = conn
        self.table = markers.stage_table("dlqstage", gid)
        self.created = False

    @contextmanager
    def copy(self) -> Iterator[psycopg.Copy]:
        if not self.created:
            self.conn.execute(
                sql.SQL(
                    "CREATE UNLOGGED TABLE {} AS SELECT {} FROM tidemark.dlq WITH NO DATA"
                ).format(self.table, _COLS)
            )
            self.created = True
        with self.conn.cursor().copy(
            sql.SQL("COPY {} ({}) FROM STDIN").format(self.table, _COLS)
        ) as copy:
            yield copy

    def merge(self) -> None:
        # A source record never changes: a letter that knows its record's headers and
        # timestamp (or knows the source lost them) keeps that. A redrive of a lost one hands
        # back the stored headers, which must not pass for the source's.
        # A discard stands while its record fails (docs/design.md, "DLQ envelope"): the
        # letter stays discarded with who, when and why; only its history grows. Any other
        # letter quarantined again is live again. Retention may have dropped a discarded
        # letter's bytes (pruned_at): they stay dropped while it stays discarded, and a
        # letter live again gets them back from its record, for a redrive to replay.
        self.conn.execute(
            sql.SQL("""
            INSERT INTO tidemark.dlq AS d ({cols}) SELECT {cols} FROM {stage}
            ON CONFLICT ON CONSTRAINT dlq_one_per_sink DO UPDATE
            SET attempts = d.attempts + 1, last_seen = now(), run_id = EXCLUDED.run_id,
                error_class = EXCLUDED.error_class, reason = EXCLUDED.reason,
                status = CASE WHEN d.status = 'discarded' THEN d.status
                              ELSE 'quarantined' END,
                detail = CASE WHEN d.pruned_at IS NOT NULL AND d.status = 'discarded'
                              THEN NULL ELSE EXCLUDED.detail END,
                payload = CASE WHEN {back} THEN EXCLUDED.payload ELSE d.payload END,
                headers = CASE WHEN {back} THEN EXCLUDED.headers ELSE d.headers END,
                pruned_at = CASE WHEN {back} THEN NULL ELSE d.pruned_at END,
                source_headers = CASE WHEN d.source_kept IS NULL OR {back}
                                      THEN EXCLUDED.source_headers ELSE d.source_headers END,
                source_ts = CASE WHEN d.source_kept IS NULL OR {back} THEN EXCLUDED.source_ts
                                 ELSE d.source_ts END,
                source_kept = CASE WHEN {back} THEN EXCLUDED.source_kept
                                   ELSE coalesce(d.source_kept, EXCLUDED.source_kept) END""").format(
                cols=_COLS, stage=self.table, back=_BACK
            )
        )
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
    return conn.execute(
        _RESOLVE.format(where="id = ANY(%(ids)s)"), {"ids": ids, "by": by, "note": note}
    ).rowcount


def resolve_range(
    conn: psycopg.Connection,
    pipeline: str,
    sink: str,
    partition: int,
    start: int,
    end: int,
    failed: list[int],
    by: str,
    note: str,
) -> int:
    """Re-delivery: the live letters of ``sink`` for records in ``[start, end)`` of
    ``partition``, except the ``failed`` offsets. Returns how many were resolved."""
    return conn.execute(
        _RESOLVE.format(
            where="""pipeline = %(pipeline)s AND sink = %(sink)s
        AND source_partition = %(p)s AND source_offset >= %(a)s AND source_offset < %(b)s
        AND source_offset <> ALL(%(failed)s)"""
        ),
        {
            "pipeline": pipeline,
            "sink": sink,
            "p": partition,
            "a": start,
            "b": end,
            "failed": failed,
            "by": by,
            "note": note,
        },
    ).rowcount


def live_offsets(
    conn: psycopg.Connection, pipeline: str, sink: str, partition: int, offsets: list[int]
) -> set[int]:
    """Which of ``offsets`` a live letter for ``sink`` holds (quarantined or discarded),
    as this transaction sees the ledger (its own letters included)."""
    return {
        o
        for (o,) in conn.execute(
            """SELECT source_offset FROM tidemark.dlq WHERE pipeline = %s AND sink = %s
           AND source_partition = %s AND source_offset = ANY(%s) AND status <> 'redriven'""",
            (pipeline, sink, partition, offsets),
        )
    }


def resolve_offsets(
    conn: psycopg.Connection,
    pipeline: str,
    sink: str,
    partition: int,
    offsets: list[int],
    by: str,
    note: str,
) -> int:
    """Re-delivery: the live letters of ``sink`` for these records of ``partition``, placed
    by a row now (a key fell back to them). Returns how many were resolved."""
    return conn.execute(
        _RESOLVE.format(
            where="""pipeline = %(pipeline)s AND sink = %(sink)s
        AND source_partition = %(p)s AND source_offset = ANY(%(offs)s)"""
        ),
        {
            "pipeline": pipeline,
            "sink": sink,
            "p": partition,
            "offs": offsets,
            "by": by,
            "note": note,
        },
    ).rowcount


SOURCE_GONE = (
    "source timestamp and headers unknown: the source no longer holds this record "
    "(a letter from before V007); a redrive hands the transform a NULL _tm_ts and "
    "the headers as this letter stored them"
)


def fill_source(
    conn: psycopg.Connection,
    pipeline: str,
    found: dict[tuple[int, int], tuple[str | None, datetime | None]],
    gone: list[tuple[int, int]],
) -> int:
    """Letters from before V007: the headers and timestamp the source still holds for their
    records (``found``: (partition, offset) -> (headers text, ts)), and for those it no
    longer holds (``gone``) NULL with the reason in ``source_note``. Every letter of the
    pipeline at those positions (one per sink); only those not known yet, so running it
    again changes nothing. Returns how many letters changed."""
    pos = list(found)
    with conn.transaction():
        n = conn.execute(
            """
            UPDATE tidemark.dlq d SET source_headers = f.h, source_ts = f.ts, source_kept = true
            FROM unnest(%s::int[], %s::bigint[], %s::bytea[], %s::timestamptz[])
                 AS f(p, o, h, ts)
            WHERE d.pipeline = %s AND d.source_partition = f.p AND d.source_offset = f.o
              AND d.source_kept IS NULL""",
            (
                [p for p, _ in pos],
                [o for _, o in pos],
                [header_bytes(found[k][0]) for k in pos],
                [found[k][1] for k in pos],
                pipeline,
            ),
        ).rowcount
        n += conn.execute(
            """
            UPDATE tidemark.dlq d SET source_kept = false, source_note = %s
            FROM unnest(%s::int[], %s::bigint[]) AS f(p, o)
            WHERE d.pipeline = %s AND d.source_partition = f.p AND d.source_offset = f.o
              AND d.source_kept IS NULL""",
            (SOURCE_GONE, [p for p, _ in gone], [o for _, o in gone], pipeline),
        ).rowcount
    return n


# -- positions inside ranges and outside held spans (tidemark/protocol/pruned.py) ----------


def outside(alias: str, part: str, off: str) -> sql.Composed:
    """SQL: position (``alias.part``, ``alias.off``) lies in a range (CTE ``r``) and in no
    held span (CTE ``h``)."""
    a, p, o = sql.SQL(alias), sql.Identifier(part), sql.Identifier(off)
    return sql.SQL(
        "EXISTS (SELECT 1 FROM r WHERE r.p = {a}.{p} AND {a}.{o} >= r.a AND {a}.{o} < r.b) "
        "AND NOT EXISTS (SELECT 1 FROM h WHERE h.p = {a}.{p} AND {a}.{o} >= h.lo "
        "AND {a}.{o} < h.hi)"
    ).format(a=a, p=p, o=o)


CTES = (
    "WITH r(p, a, b) AS (SELECT * FROM unnest(%s::int[], %s::bigint[], %s::bigint[])), "
    "h(p, lo, hi) AS (SELECT * FROM unnest(%s::int[], %s::bigint[], %s::bigint[])) "
)


def span_args(
    ranges: dict[int, tuple[int, int]], held: dict[int, list[tuple[int, int]]]
) -> list[list[int]]:
    spans = [(p, lo, hi) for p, ss in held.items() for lo, hi in ss]
    return [
        list(ranges),
        [a for a, _ in ranges.values()],
        [b for _, b in ranges.values()],
        [p for p, _, _ in spans],
        [lo for _, lo, _ in spans],
        [hi for _, _, hi in spans],
    ]


def outside_held(
    conn: psycopg.Connection,
    pipeline: str,
    sink: str,
    ranges: dict[int, tuple[int, int]],
    held: dict[int, list[tuple[int, int]]],
) -> list[tuple[int, int, int, int]]:
    """Per partition (partition, letters, lowest, highest offset): the live letters of
    ``sink`` in ``ranges`` (partition -> [a, b)) at positions outside ``held`` (partition ->
    [lo, hi) spans the source holds): a re-delivery cannot read their records again."""
    query = sql.SQL(CTES).format() + sql.SQL(
        "SELECT x.source_partition, count(DISTINCT x.source_offset), min(x.source_offset), "
        "max(x.source_offset) FROM tidemark.dlq x WHERE x.pipeline = %s AND x.sink = %s "
        "AND x.status IN ('quarantined', 'discarded') AND {cond} GROUP BY 1"
    ).format(cond=outside("x", "source_partition", "source_offset"))
    rows = conn.execute(query, [*span_args(ranges, held), pipeline, sink]).fetchall()
    return [(p, n, lo, hi) for p, n, lo, hi in rows]
