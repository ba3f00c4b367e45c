"""Retention: the ledger rows that have outlived their keeping time, and their deletion in
bounded batches (docs/operations.md, "Retention"). Also the rows of one pipeline, for
retiring it.

Selections are keyset pages (``after``: the last id of the previous page), so a dry run that
deletes nothing still walks forward. With ``lock`` they lock their rows (SKIP LOCKED: two
prunes at once never wait on each other), to be deleted in the same transaction.

What is never selected by age (the protocol's needs, docs/design.md):
* a dead letter that is not resolved (quarantined is live), and the row of a discarded one:
  it is its record's one place (invariant 1). Only its payload, headers and detail go;
* a run with a sink not in a final state (recovery settles it), the newest run (the
  recovery sweep's horizon is the highest run id: below it, an orphan prepared transaction
  is rolled back; above it, left alone as a run still starting), the newest run of each
  pipeline, a run any kept letter points at (``dlq.run_id``) and one a lease names;
* a redrive request of a pipeline with a redrive run still open (it may be reading it).
"""

from __future__ import annotations

from typing import Any

import psycopg

from tidemark.core.db import scalar
from tidemark.ledger.runs import OPEN

RESOLVED = ("redriven", "discarded")
# What retention drops of a discarded letter; the rest (the record's position and key, the
# verdict, who discarded it, when and why) stays.
PRUNED = ("payload", "headers", "source_headers", "detail")
_OPEN = [str(s) for s in OPEN]
# ``own``: pipelines with a retention of their own in their file, left out of a prune of
# every pipeline by the global settings (each gets a pass of its own).
_PIPELINE = (
    "(%(pipeline)s::text IS NULL OR {col} = %(pipeline)s) AND NOT ({col} = ANY(%(own)s::text[]))"
)
# A letter of dlq alias d resolved more than %({days})s days ago (one that was resolved
# before resolved_at existed counts from when it was last seen).
_EXPIRED_LETTER = (
    "d.status::text = ANY(%(resolved)s) AND coalesce(d.resolved_at, "
    "d.last_seen) < now() - make_interval(days => %({days})s)"
)


def _ids(conn: psycopg.Connection, sql: str, params: dict[str, Any], lock: str | None) -> list[Any]:
    if lock:
        sql += f" FOR UPDATE OF {lock} SKIP LOCKED"
    return [r[0] if len(r) == 1 else tuple(r) for r in conn.execute(sql, params).fetchall()]


# -- dead letters ---------------------------------------------------------------------------
def letters(
    conn: psycopg.Connection,
    *,
    pipeline: str | None,
    after: int,
    limit: int,
    days: int | None,
    lock: bool = False,
    own: list[str] | None = None,
) -> list[int]:
    """Ids of redriven letters resolved more than ``days`` ago (their records have rows);
    with ``days`` None, every letter of ``pipeline`` whatever its status (retiring it)."""
    where = (
        "d.pipeline = %(pipeline)s"
        if days is None
        else f"""d.status = 'redriven' AND {_EXPIRED_LETTER.format(days="days")}
                 AND {_PIPELINE.format(col="d.pipeline")}"""
    )
    return _ids(
        conn,
        f"""SELECT d.id FROM tidemark.dlq d WHERE {where} AND d.id > %(after)s
                          ORDER BY d.id LIMIT %(limit)s""",
        {
            "pipeline": pipeline,
            "resolved": list(RESOLVED),
            "days": days,
            "after": after,
            "limit": limit,
            "own": own or [],
        },
        "d" if lock else None,
    )


def delete_letters(conn: psycopg.Connection, ids: list[int]) -> int:
    return conn.execute("DELETE FROM tidemark.dlq WHERE id = ANY(%s)", (ids,)).rowcount


def discarded(
    conn: psycopg.Connection,
    *,
    pipeline: str | None,
    after: int,
    limit: int,
    days: int,
    lock: bool = False,
    own: list[str] | None = None,
) -> list[int]:
    """Ids of discarded letters discarded more than ``days`` ago that still carry their
    record's bytes (payload, headers, detail)."""
    return _ids(
        conn,
        f"""SELECT d.id FROM tidemark.dlq d WHERE d.status = 'discarded'
            AND {_EXPIRED_LETTER.format(days="days")} AND d.pruned_at IS NULL
            AND {_PIPELINE.format(col="d.pipeline")} AND d.id > %(after)s
            ORDER BY d.id LIMIT %(limit)s""",
        {
            "pipeline": pipeline,
            "resolved": list(RESOLVED),
            "days": days,
            "after": after,
            "limit": limit,
            "own": own or [],
        },
        "d" if lock else None,
    )


def drop_payloads(conn: psycopg.Connection, ids: list[int]) -> int:
    """Drop what the discarded letters ``ids`` carry of their records (PRUNED); their rows
    stay, marked ``pruned_at``."""
    sets = ", ".join(f"{c} = NULL" for c in PRUNED)
    return conn.execute(
        f"UPDATE tidemark.dlq SET {sets}, pruned_at = now() WHERE id = ANY(%s) "
        "AND status = 'discarded'",
        (ids,),
    ).rowcount


# -- runs -----------------------------------------------------------------------------------
def runs(
    conn: psycopg.Connection,
    *,
    pipeline: str | None,
    after: int,
    limit: int,
    days: int | None,
    letters_days: int = 0,
    lock: bool = False,
    own: list[str] | None = None,
) -> list[int]:
    """Ids of finished runs that finished more than ``days`` ago and nothing protects (the
    module's docstring; a letter resolved more than ``letters_days`` ago does not: the same
    prune deletes it or, discarded, drops its payload, and its page then says the run is not
    in the ledger); with ``days`` None, every run of ``pipeline`` (retiring it: its caller
    has made sure none is open)."""
    if days is None:
        where = "r.pipeline = %(pipeline)s"
    else:
        # A run whose driver died has no finished_at: its sinks' last transition is its end.
        where = f"""{_PIPELINE.format(col="r.pipeline")}
            -- The newest run of each pipeline: the newest of all (the sweep's horizon) too.
            AND r.run_id < (SELECT n.run_id FROM newest n WHERE n.pipeline = r.pipeline)
            AND NOT EXISTS (SELECT 1 FROM tidemark.run_sinks s WHERE s.run_id = r.run_id
                            AND s.state::text = ANY(%(open)s))
            AND NOT EXISTS (SELECT 1 FROM tidemark.dlq d WHERE d.run_id = r.run_id
                            AND NOT ({_EXPIRED_LETTER.format(days="letters_days")}))
            AND NOT EXISTS (SELECT 1 FROM tidemark.leases l WHERE l.run_id = r.run_id)
            AND coalesce(r.finished_at, (SELECT max(s.updated_at) FROM tidemark.run_sinks s
                                         WHERE s.run_id = r.run_id), r.created_at)
                < now() - make_interval(days => %(days)s)"""
    return _ids(
        conn,
        f"""WITH newest AS (SELECT pipeline, max(run_id) AS run_id
                                        FROM tidemark.runs GROUP BY pipeline)
                          SELECT r.run_id FROM tidemark.runs r WHERE {where}
                          AND r.run_id > %(after)s ORDER BY r.run_id LIMIT %(limit)s""",
        {
            "pipeline": pipeline,
            "open": _OPEN,
            "days": days,
            "after": after,
            "limit": limit,
            "resolved": list(RESOLVED),
            "letters_days": letters_days,
            "own": own or [],
        },
        "r" if lock else None,
    )


RUN_CHILDREN = ("participants", "run_ranges", "run_metrics", "dq_results", "run_sinks")


def run_rows(conn: psycopg.Connection, ids: list[int]) -> dict[str, int]:
    """Rows per table that deleting the runs ``ids`` would delete (a dry run)."""
    out = {
        t: scalar(conn.execute(f"SELECT count(*) FROM tidemark.{t} WHERE run_id = ANY(%s)", (ids,)))
        for t in RUN_CHILDREN
    }
    out["runs"] = len(ids)
    return out


def docs_pages(conn: psycopg.Connection, ids: list[int]) -> list[tuple[str, str]]:
    """(pipeline, Data Docs page) of the data-quality results of the runs ``ids``."""
    return conn.execute(
        """SELECT r.pipeline, q.docs_path FROM tidemark.dq_results q
                           JOIN tidemark.runs r USING (run_id)
                           WHERE q.run_id = ANY(%s) AND q.docs_path IS NOT NULL""",
        (ids,),
    ).fetchall()


def delete_runs(conn: psycopg.Connection, ids: list[int]) -> dict[str, int]:
    """Delete the runs ``ids`` with their children (children first: foreign keys)."""
    out = {
        t: conn.execute(f"DELETE FROM tidemark.{t} WHERE run_id = ANY(%s)", (ids,)).rowcount
        for t in RUN_CHILDREN
    }
    out["runs"] = conn.execute("DELETE FROM tidemark.runs WHERE run_id = ANY(%s)", (ids,)).rowcount
    return out


# -- redrive requests -----------------------------------------------------------------------
def requests(
    conn: psycopg.Connection,
    *,
    pipeline: str | None,
    after: int,
    limit: int,
    days: int | None,
    lock: bool = False,
    own: list[str] | None = None,
) -> list[tuple[int, int]]:
    """(id, letters) of redrive requests made more than ``days`` ago and not queued for a
    run since (none of a pipeline whose redrive is open); with ``days`` None, every request
    of ``pipeline``."""
    where = (
        "q.pipeline = %(pipeline)s"
        if days is None
        else f"""{_PIPELINE.format(col="q.pipeline")}
                 AND q.requested_at < now() - make_interval(days => %(days)s)
                 -- a run triggered for it may wait in its pool: kept as long as a request
                 -- is kept after it was made, and a day at least
                 AND coalesce(q.queued_at < now() - make_interval(days => greatest(%(days)s, 1)),
                              true)
                 AND NOT EXISTS (SELECT 1 FROM tidemark.runs r JOIN tidemark.run_sinks s
                                 USING (run_id) WHERE r.pipeline = q.pipeline
                                 AND r.mode = 'redrive' AND s.state::text = ANY(%(open)s))"""
    )
    return _ids(
        conn,
        f"""SELECT q.request_id, q.letters FROM tidemark.redrive_requests q
                          WHERE {where} AND q.request_id > %(after)s ORDER BY q.request_id
                          LIMIT %(limit)s""",
        {
            "pipeline": pipeline,
            "open": _OPEN,
            "days": days,
            "after": after,
            "limit": limit,
            "own": own or [],
        },
        "q" if lock else None,
    )


def request_letters(conn: psycopg.Connection, ids: list[int]) -> int:
    return int(
        scalar(
            conn.execute(
                "SELECT count(*) FROM tidemark.redrive_letters WHERE request_id = ANY(%s)", (ids,)
            )
        )
    )


def delete_requests(conn: psycopg.Connection, ids: list[int]) -> dict[str, int]:
    """Delete the requests ``ids`` and their letter rows."""
    letters_ = conn.execute(
        "DELETE FROM tidemark.redrive_letters WHERE request_id = ANY(%s)", (ids,)
    ).rowcount
    return {
        "redrive_letters": letters_,
        "redrive_requests": conn.execute(
            "DELETE FROM tidemark.redrive_requests WHERE request_id = ANY(%s)", (ids,)
        ).rowcount,
    }


# -- one pipeline (retiring it) ---------------------------------------------------------------
def pipeline_rows(conn: psycopg.Connection, pipeline: str) -> dict[str, int]:
    """Rows per kind that retiring ``pipeline`` deletes."""
    one = {
        "pipelines": "name = %(p)s",
        "checkpoints": "pipeline = %(p)s",
        "leases": "pipeline = %(p)s",
        "runs": "pipeline = %(p)s",
        "redrive_requests": "pipeline = %(p)s",
        "source_gaps": "pipeline = %(p)s",
        "lag_samples": "pipeline = %(p)s",  # the Pipelines page's (ledger/history.py)
    }
    out = {
        t: scalar(conn.execute(f"SELECT count(*) FROM tidemark.{t} WHERE {w}", {"p": pipeline}))
        for t, w in one.items()
    }
    for t in RUN_CHILDREN:
        out[t] = scalar(
            conn.execute(
                f"""SELECT count(*) FROM tidemark.{t} c JOIN tidemark.runs r
                                      USING (run_id) WHERE r.pipeline = %s""",
                (pipeline,),
            )
        )
    out["redrive_letters"] = scalar(
        conn.execute(
            """SELECT count(*) FROM tidemark.redrive_letters l JOIN tidemark.redrive_requests q
               USING (request_id) WHERE q.pipeline = %s""",
            (pipeline,),
        )
    )
    for status, n in conn.execute(
        """SELECT status::text, count(*) FROM tidemark.dlq
                                     WHERE pipeline = %s GROUP BY 1""",
        (pipeline,),
    ):
        out[f"dlq_{status}"] = n
    return out


def open_runs(conn: psycopg.Connection, pipeline: str) -> list[int]:
    """Runs of ``pipeline`` with a sink not settled yet."""
    return [
        r[0]
        for r in conn.execute(
            """SELECT DISTINCT r.run_id FROM tidemark.runs r JOIN tidemark.run_sinks s
           USING (run_id) WHERE r.pipeline = %s AND s.state::text = ANY(%s)
           ORDER BY 1""",
            (pipeline, _OPEN),
        )
    ]


def runs_among(conn: psycopg.Connection, pipeline: str, ids: list[int]) -> list[int]:
    """Those of ``ids`` that are runs of ``pipeline``."""
    return [
        r[0]
        for r in conn.execute(
            "SELECT run_id FROM tidemark.runs WHERE pipeline = %s AND run_id = ANY(%s) ORDER BY 1",
            (pipeline, ids),
        )
    ]


def lock_pipeline(conn: psycopg.Connection, pipeline: str) -> str | None:
    """Lock the pipeline's row (a run's claim locks it first, so none starts meanwhile);
    returns its halt reason, None if not halted or not there."""
    row = conn.execute(
        "SELECT halted_reason FROM tidemark.pipelines WHERE name = %s FOR UPDATE", (pipeline,)
    ).fetchone()
    return row[0] if row else None


def delete_pipeline(conn: psycopg.Connection, pipeline: str) -> dict[str, int]:
    """The pipeline's checkpoints, the gaps its sinks stepped over, lag samples, leases and
    row (its runs, letters and requests gone)."""
    return {
        t: conn.execute(f"DELETE FROM tidemark.{t} WHERE {col} = %s", (pipeline,)).rowcount
        for t, col in (
            ("checkpoints", "pipeline"),
            ("source_gaps", "pipeline"),
            ("staged_holds", "pipeline"),
            ("lag_samples", "pipeline"),
            ("leases", "pipeline"),
            ("pipelines", "name"),
        )
    }
