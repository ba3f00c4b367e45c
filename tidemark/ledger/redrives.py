"""Redrive requests (sql/V006__redrive_requests.sql): the dead letters one redrive replays,
chosen once and kept in the ledger with who asked.

Only the request id travels: on spark-submit's command line, in a DAG run's conf and XCom, in
the spec Spark ships to the task. A list of 100,000 ids does not fit a command line (the
kernel refuses one argument past 128 KiB) and has no business in a task's JSON. The driver
plans from the request, reads the records' bytes from it, and the task locks its letters by
it, all here, in SQL over the ledger.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from tidemark.core.db import scalar
from tidemark.core.errors import BadInput
from tidemark.ledger import dlq, letters

# One redrive is one Spark task holding every letter's row lock in one transaction; its
# records go through the driver's memory once. Tested at 100,000 (tests/test_redrive.py).
MAX_LETTERS = 200_000
FETCH = 10_000  # rows per round trip when reading the records


@dataclass(frozen=True)
class Request:
    request_id: int
    pipeline: str
    requested_by: str
    letters: int
    selection: dict[str, Any]


def create(
    conn: psycopg.Connection,
    pipeline: str,
    by: str,
    *,
    ids: list[int] | None = None,
    filters: dlq.Filters | None = None,
) -> Request | None:
    """A request for ``ids`` (kept as given: the redrive reports those that do not exist or
    are no longer quarantined) or for the pipeline's quarantined letters ``filters`` match
    now. None when it would hold no letter. BadInput past MAX_LETTERS."""
    if (ids is None) == (filters is None):
        raise ValueError("give ids or filters")
    by = (by or "").strip()
    if not by:
        raise BadInput("by: required; who asks for the redrive")
    if filters is not None:
        filters = filters.model_copy(update={"pipeline": pipeline, "status": "quarantined"})
        selection: dict[str, str | int] = {
            k: v for k, v in filters.query().items() if k != "status"
        }
        if filters.ids is not None:
            selection["ids"] = len(filters.ids)
    else:
        ids = sorted(set(ids or []))
        selection = {"ids": len(ids)}
    with conn.transaction():
        rid = scalar(
            conn.execute(
                """INSERT INTO tidemark.redrive_requests (pipeline, requested_by, selection,
                   letters) VALUES (%s, %s, %s, 0) RETURNING request_id""",
                (pipeline, by, json.dumps(selection)),
            )
        )
        if filters is not None:
            where, args = dlq.condition(filters)
            n = conn.execute(
                sql.SQL(
                    """INSERT INTO tidemark.redrive_letters (request_id, letter_id)
                   SELECT {}, id FROM tidemark.dlq WHERE {} LIMIT {}"""
                ).format(sql.Literal(rid), where, sql.Literal(MAX_LETTERS + 1)),
                args,
            ).rowcount
        else:
            n = conn.execute(
                """INSERT INTO tidemark.redrive_letters (request_id, letter_id)
                                SELECT %s, unnest(%s::bigint[])""",
                (rid, ids),
            ).rowcount
        if n > MAX_LETTERS:
            raise BadInput(
                f"redrive of {pipeline}: more than {MAX_LETTERS:,} dead letters "
                f"match; redrive them in parts (by sink, class or time window)"
            )
        if n == 0:
            conn.execute("DELETE FROM tidemark.redrive_requests WHERE request_id = %s", (rid,))
            return None
        conn.execute(
            "UPDATE tidemark.redrive_requests SET letters = %s WHERE request_id = %s", (n, rid)
        )
    return Request(rid, pipeline, by, n, selection)


def get(conn: psycopg.Connection, request_id: int) -> Request | None:
    row = conn.execute(
        """SELECT request_id, pipeline, requested_by, letters, selection
                          FROM tidemark.redrive_requests WHERE request_id = %s""",
        (request_id,),
    ).fetchone()
    return Request(*row) if row else None


def queue(conn: psycopg.Connection, request_id: int) -> bool:
    """A run is about to redrive the request: keep it from ``prune`` until that run has had
    time to claim (ledger/retention.py). False when the request is gone."""
    return (
        conn.execute(
            "UPDATE tidemark.redrive_requests SET queued_at = now() WHERE request_id = %s",
            (request_id,),
        ).rowcount
        == 1
    )


def delete(conn: psycopg.Connection, request_id: int) -> None:
    """A request nobody will run (its trigger failed)."""
    conn.execute("DELETE FROM tidemark.redrive_requests WHERE request_id = %s", (request_id,))


def statuses(conn: psycopg.Connection, request_id: int) -> dict[str, int]:
    """The request's letters by their status now (``missing``: ids that no longer exist).
    A preview changes none; a redrive marks the delivered ones ``redriven``."""
    return dict(
        conn.execute(
            """SELECT coalesce(d.status::text, 'missing'), count(*)
               FROM tidemark.redrive_letters r LEFT JOIN tidemark.dlq d ON d.id = r.letter_id
               WHERE r.request_id = %s GROUP BY 1 ORDER BY 1""",
            (request_id,),
        ).fetchall()
    )


# The request's letters a redrive places now: of this pipeline, for one of ``sinks``,
# quarantined, and below their sink's checkpoint (a sink that has not got that far will read
# the record itself). The planner, the driver's read and the task's lock all use this one
# definition, so they agree on the set.
_PLACEABLE = """
    FROM tidemark.redrive_letters r
    JOIN tidemark.dlq d ON d.id = r.letter_id
    JOIN tidemark.checkpoints c ON c.pipeline = d.pipeline AND c.sink = d.sink
         AND c.partition = d.source_partition
    WHERE r.request_id = %(request)s AND d.pipeline = %(pipeline)s
      AND d.sink = ANY(%(sinks)s::text[]) AND d.source_offset < c.next_offset"""


def _args(request_id: int, pipeline: str, sinks: list[str]) -> dict[str, Any]:
    return {"request": request_id, "pipeline": pipeline, "sinks": list(sinks)}


def placement(
    conn: psycopg.Connection, request_id: int, pipeline: str, sinks: list[str]
) -> tuple[list[tuple[str, int, int, int, int]], dict[int, str]]:
    """Planning a redrive: per (sink, partition) of the placeable letters (sink, partition,
    first offset, end offset, letters), and why each other letter of the request is left
    out. Aggregated here: the driver never holds one Python row per placeable letter."""
    a = _args(request_id, pipeline, sinks)
    ranges = conn.execute(
        "SELECT d.sink, d.source_partition, min(d.source_offset), max(d.source_offset) + 1, "
        "count(*)" + _PLACEABLE + " AND d.status = 'quarantined' GROUP BY 1, 2 ORDER BY 1, 2",
        a,
    ).fetchall()
    unplaced = conn.execute(
        """
        SELECT r.letter_id, CASE
            -- one answer for both: whoever may redrive this pipeline learns nothing of
            -- another's letters (their pipeline's name, or that they exist)
            WHEN d.id IS NULL OR d.pipeline <> %(pipeline)s
                THEN 'no such dead letter in this pipeline'
            WHEN d.status <> 'quarantined' THEN 'is ' || d.status::text
            WHEN d.sink <> ALL(%(sinks)s::text[])
                THEN 'sink ' || d.sink || ' is no longer in the pipeline'
            ELSE 'sink ' || d.sink || ' has not got this far yet' END
        FROM tidemark.redrive_letters r
        LEFT JOIN tidemark.dlq d ON d.id = r.letter_id
        LEFT JOIN tidemark.checkpoints c ON c.pipeline = d.pipeline AND c.sink = d.sink
             AND c.partition = d.source_partition
        WHERE r.request_id = %(request)s
          AND NOT coalesce(d.pipeline = %(pipeline)s AND d.status = 'quarantined'
                           AND d.sink = ANY(%(sinks)s::text[])
                           AND d.source_offset < c.next_offset, false)
        ORDER BY r.letter_id""",
        a,
    ).fetchall()
    return ranges, dict(unplaced)


def records(
    conn: psycopg.Connection, request_id: int, pipeline: str, sinks: list[str]
) -> Iterator[list[tuple[Any, ...]]]:
    """Each source record of the placeable letters once (several sinks' letters may hold it),
    as (partition, offset, key, payload, headers, timestamp) rows, the sources' schema, in
    chunks from a server-side cursor: memory holds one chunk of rows at a time.

    Headers and timestamp as the source had them (docs/design.md, "Re-delivery"). For a
    letter whose source no longer held its record when they were looked up (a letter from
    before V007, ``source_kept`` false): a NULL timestamp and the headers as the letter
    stored them (jsonb text). Of one record's letters, one that kept them is read first."""
    query = (
        "SELECT DISTINCT ON (d.source_partition, d.source_offset) d.source_partition, "
        "d.source_offset, d.key, d.payload, CASE WHEN d.source_kept THEN d.source_headers "
        "END, CASE WHEN d.source_kept IS NOT TRUE THEN d.headers::text END, "
        "CASE WHEN d.source_kept THEN d.source_ts END"
        + _PLACEABLE
        + " AND d.status = 'quarantined' "
        "ORDER BY d.source_partition, d.source_offset, d.source_kept DESC NULLS LAST, d.id"
    )
    with conn.transaction(), conn.cursor(name="tidemark_redrive_records") as cur:
        cur.itersize = FETCH
        cur.execute(query, _args(request_id, pipeline, sinks))
        while rows := cur.fetchmany(FETCH):
            yield [
                (p, o, k, v, letters.header_text(exact) if exact is not None else stored, ts)
                for p, o, k, v, exact, stored, ts in rows
            ]


def unknown_source(
    conn: psycopg.Connection, request_id: int, pipeline: str, sinks: list[str]
) -> dict[int, list[int]]:
    """The source positions (partition -> offsets) of the placeable letters whose source
    headers and timestamp the ledger does not know yet (letters from before V007)."""
    out: dict[int, list[int]] = {}
    for part, off in conn.execute(
        "SELECT DISTINCT d.source_partition, d.source_offset"
        + _PLACEABLE
        + " AND d.status = 'quarantined' AND d.source_kept IS NULL ORDER BY 1, 2",
        _args(request_id, pipeline, sinks),
    ):
        out.setdefault(part, []).append(off)
    return out


def source_unknown(
    conn: psycopg.Connection, request_id: int, pipeline: str, sinks: list[str]
) -> list[int]:
    """Ids of the placeable letters whose source headers and timestamp are unknown (the
    source no longer held the record): replayed with a NULL timestamp."""
    return [
        i
        for (i,) in conn.execute(
            "SELECT d.id" + _PLACEABLE + " AND d.status = 'quarantined' "
            "AND d.source_kept IS NOT TRUE ORDER BY d.id",
            _args(request_id, pipeline, sinks),
        )
    ]


def hold(
    conn: psycopg.Connection, request_id: int, pipeline: str, sink: str
) -> list[tuple[int, int, int, bool]]:
    """In a redrive task's ledger transaction: lock this sink's letters of the request (a
    concurrent discard waits). Returns (id, partition, offset, still quarantined): one
    discarded or resolved since the plan is left out by the caller."""
    return conn.execute(
        "SELECT d.id, d.source_partition, d.source_offset, d.status = 'quarantined'"
        + _PLACEABLE
        + " ORDER BY d.id FOR UPDATE OF d",
        _args(request_id, pipeline, [sink]),
    ).fetchall()
