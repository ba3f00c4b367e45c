"""Holds on sinks rebuilt from a staged pipeline file (sql/V016__staged_rebuilds.sql;
docs/operations.md, "Change a key: stage, rebuild, promote")."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import psycopg

from tidemark.ledger.run_state import RunState


@dataclass(frozen=True)
class Hold:
    sink: str
    fingerprint: str  # the staged version
    replaces: str  # the live version it replaces
    held_at: datetime
    promoted_at: datetime | None


def hold(
    conn: psycopg.Connection, pipeline: str, sink: str, fingerprint: str, replaces: str
) -> None:
    """Hold ``sink`` for the staged version ``fingerprint``. Held again for the same version,
    it keeps its time: a rebuild committed since still counts."""
    conn.execute(
        """INSERT INTO tidemark.staged_holds (pipeline, sink, fingerprint, replaces)
           VALUES (%s, %s, %s, %s)
           ON CONFLICT (pipeline, sink) DO UPDATE SET fingerprint = EXCLUDED.fingerprint,
               replaces = EXCLUDED.replaces, promoted_at = NULL,
               held_at = CASE WHEN staged_holds.fingerprint = EXCLUDED.fingerprint
                              AND staged_holds.promoted_at IS NULL
                         THEN staged_holds.held_at ELSE now() END""",
        (pipeline, sink, fingerprint, replaces),
    )


def holds(conn: psycopg.Connection, pipeline: str) -> dict[str, Hold]:
    rows = conn.execute(
        """SELECT sink, fingerprint, replaces, held_at, promoted_at FROM tidemark.staged_holds
           WHERE pipeline = %s ORDER BY sink""",
        (pipeline,),
    ).fetchall()
    return {r[0]: Hold(*r) for r in rows}


def rebuilt_since(
    conn: psycopg.Connection, pipeline: str, sink: str, since: datetime
) -> int | None:
    """The newest rebuild of ``sink`` committed since ``since`` (a hold's time), if any."""
    row = conn.execute(
        """SELECT max(r.run_id) FROM tidemark.runs r JOIN tidemark.run_sinks s USING (run_id)
           WHERE r.pipeline = %s AND r.mode = 'rebuild' AND s.sink = %s
           AND s.state::text = %s AND r.created_at >= %s""",
        (pipeline, sink, str(RunState.COMMITTED), since),
    ).fetchone()
    return row[0] if row else None


def promoted(conn: psycopg.Connection, pipeline: str, fingerprint: str) -> int:
    """The staged version ``fingerprint`` is now the live file: its holds only refuse the
    version each replaced from now on."""
    return conn.execute(
        """UPDATE tidemark.staged_holds SET promoted_at = now()
           WHERE pipeline = %s AND fingerprint = %s AND promoted_at IS NULL""",
        (pipeline, fingerprint),
    ).rowcount


def release(conn: psycopg.Connection, pipeline: str, sinks: list[str] | None = None) -> int:
    """Release the holds on ``sinks`` (None: every sink of ``pipeline``)."""
    return conn.execute(
        "DELETE FROM tidemark.staged_holds WHERE pipeline = %s "
        "AND (%s::text[] IS NULL OR sink = ANY(%s::text[]))",
        (pipeline, sinks, sinks),
    ).rowcount


def refused(
    conn: psycopg.Connection, pipeline: str, sinks: list[str], fingerprint: str
) -> dict[str, str]:
    """sink -> why a run of version ``fingerprint`` may not write to it (the claim's check)."""
    out = {}
    for sink, h in holds(conn, pipeline).items():
        if sink not in sinks:
            continue
        if h.promoted_at is None and fingerprint != h.fingerprint:
            out[sink] = (
                f"held for the staged version of {pipeline} (its .next.yaml, rebuilt into "
                f"since {h.held_at:%Y-%m-%d %H:%M} UTC); it goes live with `tidemark pipelines "
                f"promote {pipeline}` once every sink it changes is rebuilt, or `tidemark "
                f"pipelines unstage {pipeline}` if the rebuild did not commit"
            )
        elif h.promoted_at is not None and fingerprint == h.replaces:
            out[sink] = (
                f"this run read the version of {pipeline} that the staged one replaced on "
                f"{h.promoted_at:%Y-%m-%d %H:%M} UTC (its table was rebuilt for the new "
                f"one); run again: it reads the pipeline file anew"
            )
    return out
