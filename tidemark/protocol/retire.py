"""Retiring a pipeline (docs/operations.md, "Retiring a pipeline"): its ledger rows of every
kind and its Data Docs are deleted; its sink tables are left as they are.

Refused while a run of it is open or a prepared transaction of its runs remains: recovery
settles those from the rows this deletes (`tidemark recover` first). Its row is locked and
the pipeline halted before anything is deleted, so no run of it starts meanwhile (a claim
locks the pipeline's row first and refuses a halted pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from tidemark.config import Pipeline
from tidemark.core.db import connect, one_line
from tidemark.core.dsn import mask
from tidemark.core.errors import NotFound, TidemarkError
from tidemark.ledger import markers, retention, state
from tidemark.protocol import gids, twopc
from tidemark.protocol.prune import locked, walk
from tidemark.protocol.prune_summary import Progress, Summary
from tidemark.quality import docs

HALT = "retiring (tidemark pipelines retire)"


@dataclass
class Plan:
    """What retiring a pipeline deletes, counted before anything is."""

    pipeline: str
    rows: dict[str, int]
    docs_dir: Path
    docs_files: int
    docs_bytes: int
    unchecked: list[str] = field(default_factory=list)  # databases not scanned, and why

    @property
    def empty(self) -> bool:
        return not any(self.rows.values()) and not self.docs_dir.exists()


def _databases(
    ledger_dsn: str, name: str, pipelines: dict[str, Pipeline]
) -> tuple[list[str], list[str]]:
    """(DSNs to scan for its prepared transactions: the ledger and every sink database of a
    pipeline file, each once; what cannot be scanned)."""
    dsns, unchecked = [ledger_dsn], []
    for p in pipelines.values():
        for s in p.sinks:
            try:
                dsns.append(p.sink_dsn(s))
            except TidemarkError as exc:
                if p.name == name:
                    unchecked.append(str(exc))
    if name not in pipelines:
        unchecked.append(
            f"pipeline {name}: no pipeline file, so only the ledger and the "
            f"sink databases of other pipeline files are scanned"
        )
    return list(dict.fromkeys(dsns)), unchecked


def blockers(
    conn: psycopg.Connection,
    ledger_dsn: str,
    name: str,
    pipelines: dict[str, Pipeline],
    prefix: str,
) -> tuple[list[str], list[str]]:
    """(why retiring ``name`` must wait, databases that could not be scanned)."""
    why = []
    open_ = retention.open_runs(conn, name)
    if open_:
        why.append(f"run(s) {', '.join(map(str, open_[:5]))} not settled")
    dsns, unchecked = _databases(ledger_dsn, name, pipelines)
    found: dict[int, str] = {}
    for dsn in dsns:
        try:
            with connect(dsn, autocommit=True, what="database", application="tidemark-retire") as c:
                for gid, _ in twopc.prepared(c, f"{prefix}:%"):
                    g = gids.parse(gid, prefix)
                    if g is not None:
                        found.setdefault(g.run_id, gid)
        except (psycopg.Error, TidemarkError) as exc:
            unchecked.append(f"cannot scan {mask(dsn)}: {one_line(exc)}")
    if found:
        mine = retention.runs_among(conn, name, sorted(found))
        if mine:
            why.append(f"prepared transaction {found[mine[0]]} of its run {mine[0]} remains")
    return why, unchecked


def plan(
    ledger_dsn: str, name: str, pipelines: dict[str, Pipeline], prefix: str, docs_root: Path
) -> Plan:
    """Count what retiring ``name`` deletes, or refuse (one line) while it must wait."""
    with connect(ledger_dsn, autocommit=True, what="ledger") as conn:
        why, unchecked = blockers(conn, ledger_dsn, name, pipelines, prefix)
        if why:
            raise TidemarkError(
                f"pipeline {name} cannot be retired yet: {'; '.join(why)}; "
                f"run `tidemark recover` first"
            )
        rows = retention.pipeline_rows(conn, name)
    folder = docs_root / name
    files, size = docs.tree_size(str(folder))
    p = Plan(name, rows, folder, files, size, unchecked)
    if p.empty:
        raise NotFound(f"pipeline {name}: nothing to retire (no ledger rows, no Data Docs)")
    return p


def retire(
    ledger_dsn: str,
    name: str,
    pipelines: dict[str, Pipeline],
    prefix: str,
    docs_root: Path,
    batch: int,
    progress: Progress = lambda m: None,
) -> Summary:
    summary = Summary()
    dsns, _ = _databases(ledger_dsn, name, pipelines)
    with connect(ledger_dsn, autocommit=True, what="ledger", application="tidemark-retire") as conn:
        locked(conn)
        with conn.transaction():
            # Checked again under the pipeline's row lock: no run can start or be open now.
            previous = retention.lock_pipeline(conn, name)
            why, _ = blockers(conn, ledger_dsn, name, pipelines, prefix)
            if why:
                raise TidemarkError(
                    f"pipeline {name} cannot be retired yet: "
                    f"{'; '.join(why)}; run `tidemark recover` first"
                )
            if previous != HALT:
                state.halt(conn, name, HALT)
        walk(
            conn,
            "dead letters",
            lambda c, **kw: retention.letters(c, pipeline=name, days=None, **kw),
            lambda ids: {"dlq": retention.delete_letters(conn, ids)},
            lambda ids: {"dlq": len(ids)},
            summary,
            batch,
            progress,
        )
        walk(
            conn,
            "runs",
            lambda c, **kw: retention.runs(c, pipeline=name, days=None, **kw),
            lambda ids: (
                retention.delete_runs(conn, ids)
                | {"markers": _forget_markers(dsns, prefix, ids, summary)}
            ),
            lambda ids: {},
            summary,
            batch,
            progress,
        )
        walk(
            conn,
            "redrive requests",
            lambda c, **kw: retention.requests(c, pipeline=name, days=None, **kw),
            lambda ids: retention.delete_requests(conn, ids),
            lambda ids: {},
            summary,
            batch,
            progress,
        )
        with conn.transaction():
            summary.add(retention.delete_pipeline(conn, name))
    files, size = docs.remove_tree(str(docs_root / name))
    summary.docs_files, summary.docs_bytes = files, size
    return summary


def _forget_markers(dsns: list[str], prefix: str, run_ids: list[int], summary: Summary) -> int:
    """Its runs' commit markers on every database reachable (settled runs: no decision of
    theirs can be in doubt any more). One that cannot be reached keeps them: harmless."""
    n = 0
    for dsn in dsns:
        try:
            with connect(dsn, autocommit=True, what="database", application="tidemark-retire") as c:
                n += markers.forget(c, prefix, run_ids)
        except (psycopg.Error, TidemarkError) as exc:
            summary.notes.append(f"commit markers kept on {mask(dsn)}: {one_line(exc)}")
    return n
