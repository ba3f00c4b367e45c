"""A Spark task's transactions (docs/design.md, step 2): each opened with the run's lock
timeout, ended by its marker row and ``PREPARE TRANSACTION gid`` (or a COMMIT, at least
once); and, before a retried attempt writes, what earlier tries of its task left prepared
rolled back."""

from __future__ import annotations

import psycopg
from psycopg import sql

from tidemark.ledger import markers
from tidemark.protocol import gids, twopc
from tidemark.protocol.taskspec import TaskSpec


def begin(dsn: str, lock_timeout_ms: int, what: str) -> psycopg.Connection:
    conn = psycopg.connect(dsn, application_name=f"tidemark-{what}", connect_timeout=10)
    conn.execute(sql.SQL("SET lock_timeout = {}").format(sql.Literal(f"{lock_timeout_ms}ms")))
    return conn


def finish(conn: psycopg.Connection, gid: str, run_id: int, prepare: bool) -> None:
    """The marker row, then PREPARE (exactly once) or COMMIT (at least once)."""
    markers.record(conn, gid, run_id)
    if prepare:
        conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
    else:
        conn.commit()


def rollback_earlier_attempts(
    dsn: str, prefix: str, run_id: int, stage: str, task: int, attempt: int, write: int = 0
) -> list[str]:
    """A retried attempt first rolls back what *earlier* attempts of its task left prepared
    (no decision can exist yet), or it would wait forever on their row locks; so does each
    task of a second write (``write``), for what the first left. A later attempt (this one is
    a zombie, say after a lost executor) is never touched."""
    me = gids.Gid(prefix, run_id, stage, task, attempt, write)
    done = []
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        for gid, _age in twopc.prepared(conn, gids.like_task(prefix, run_id, stage, task)):
            parsed = gids.parse(gid, prefix)
            if parsed and parsed.earlier_than(me) and twopc.rollback(conn, gid):
                done.append(gid)
    return done


def rollback_earlier_tries(spec: TaskSpec, task: int, attempt: int) -> None:
    """What earlier tries of this task left prepared, on the ledger and every sink."""
    if attempt == 0 and spec.write == 0:
        return  # the first try: nothing earlier
    args = (spec.prefix, spec.run_id)
    rollback_earlier_attempts(spec.ledger_dsn, *args, "%", task, attempt, spec.write)
    for t in spec.sinks:
        stage = gids.sink_stage(t.name)
        rollback_earlier_attempts(t.dsn, *args, stage, task, attempt, spec.write)
