"""A key change staged beside the live pipeline, rebuilt into, then promoted
(docs/operations.md, "Change a key: stage, rebuild, promote").

``<name>.next.yaml`` is the pipeline's next version (config.py: runs and DAGs ignore it).
``tidemark sink rebuild NAME SINK --staged`` holds the sink for that version in the ledger
(ledger/staging.py: a run of another version is then refused for it), rebuilds its table
with it, and :func:`promote` swaps the file in once every sink the version changes has a
table rebuilt for it: the staged file becomes ``<name>.yaml`` (the one it replaces is kept as
``<name>.yaml.before-run<N>``, N the last rebuild). Promoting is idempotent: a crash between
the rename and the ledger's note is finished by promoting again.

May import: core, config, ledger.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from tidemark import config as cfg
from tidemark.core.db import connect
from tidemark.core.errors import NotFound, TidemarkError
from tidemark.ledger import staging
from tidemark.protocol import sinks
from tidemark.protocol.sink_schema import static_output


@dataclass
class Readiness:
    """Whether the staged version of ``pipeline`` may go live, and what it waits for."""

    pipeline: str
    fingerprint: str
    changed: list[str]  # sinks the staged version changes (each needs its rebuild)
    rebuilt: dict[str, int] = field(default_factory=dict)  # sink -> its committed rebuild
    waiting: list[str] = field(default_factory=list)  # one line each, naming the fix

    @property
    def ready(self) -> bool:
        return not self.waiting


def changed_sinks(live: cfg.Pipeline, staged: cfg.Pipeline) -> list[str]:
    """The sinks whose rows the staged version may make otherwise: its own settings differ,
    or how every record becomes a row does (decode, transform, tombstones)."""
    whole = any(
        getattr(live, a) != getattr(staged, a) for a in ("decode", "transform", "tombstones")
    )
    have = {s.name: s for s in live.sinks}
    return [s.name for s in staged.sinks if whole or have.get(s.name) != s]


def readiness(ledger_dsn: str, folder: Path, name: str) -> Readiness:
    live = cfg.find(folder, name, deep=False)
    staged = cfg.load_staged(folder, name, deep=False)
    fp = cfg.fingerprint(staged)
    out = Readiness(name, fp, changed_sinks(live, staged))
    with connect(ledger_dsn, autocommit=True, what="ledger") as conn:
        held = staging.holds(conn, name)
        for sink in out.changed:
            h = held.get(sink)
            run = (
                staging.rebuilt_since(conn, name, sink, h.held_at)
                if h is not None and h.fingerprint == fp and h.promoted_at is None
                else None
            )
            if run is None:
                out.waiting.append(
                    f"sink {sink}: not rebuilt for the staged version yet; "
                    f"`tidemark sink rebuild {name} {sink} --staged`"
                )
            else:
                out.rebuilt[sink] = run
    columns = static_output(staged)
    for s in sinks.resolve(staged):
        for problem in sinks.table_problems(s, columns, f"sink {s.name}"):
            out.waiting.append(problem)
    return out


@dataclass
class Promoted:
    pipeline: str
    live: Path
    kept: Path | None  # the replaced file, None when promoting again after a crash
    already: bool = False


def promote(ledger_dsn: str, folder: Path, name: str) -> Promoted:
    """Make the staged version of ``name`` live, or say what it waits for."""
    live_path = cfg.file_of(folder, name)
    staged_path = cfg.staged_file(folder, name)
    if not staged_path.exists():
        # Promoted already (perhaps by a run that crashed before noting it in the ledger).
        live = cfg.find(folder, name, deep=False)
        fp = cfg.fingerprint(live)
        with connect(ledger_dsn, autocommit=True, what="ledger") as conn:
            unbuilt = [
                sink
                for sink, h in staging.holds(conn, name).items()
                if h.fingerprint == fp
                and h.promoted_at is None
                and staging.rebuilt_since(conn, name, sink, h.held_at) is None
            ]
            if unbuilt:
                raise TidemarkError(
                    f"pipeline {name}: its live file is the staged version, but sink(s) "
                    f"{', '.join(unbuilt)} held for it were not rebuilt; `tidemark sink "
                    f"rebuild {name} {unbuilt[0]}` first"
                )
            n = staging.promoted(conn, name, fp)
        if n:
            return Promoted(name, live_path, None, already=True)
        raise NotFound(f"pipeline {name}: nothing staged ({staged_path} does not exist)")
    r = readiness(ledger_dsn, folder, name)
    if not r.ready:
        raise TidemarkError(
            f"the staged version of {name} cannot go live yet: " + "; ".join(r.waiting)
        )
    run = max(r.rebuilt.values(), default=None)
    kept = live_path.with_name(
        live_path.name + (f".before-run{run}" if run is not None else ".before-promote")
    )
    # Kept first, then the atomic rename over the live file: there is a live file at every
    # moment, and promoting again after a crash finishes the job.
    shutil.copy2(live_path, kept)
    os.replace(staged_path, live_path)
    with connect(ledger_dsn, autocommit=True, what="ledger") as conn:
        staging.promoted(conn, name, r.fingerprint)
    return Promoted(name, live_path, kept)


def unstage(ledger_dsn: str, name: str, sink_names: list[str] | None = None) -> list[str]:
    """Release the holds of sinks whose staged rebuild did not commit (their tables are the
    live version's still); refused for one that did."""
    with connect(ledger_dsn, autocommit=True, what="ledger") as conn:
        held = staging.holds(conn, name)
        chosen = [s for s in held if sink_names is None or s in sink_names]
        if not chosen:
            raise NotFound(f"pipeline {name}: no sink is held for a staged version")
        for sink in chosen:
            h = held[sink]
            if h.promoted_at is not None:
                raise TidemarkError(
                    f"sink {sink}: its staged version is live already (promoted "
                    f"{h.promoted_at:%Y-%m-%d %H:%M} UTC)"
                )
            run = staging.rebuilt_since(conn, name, sink, h.held_at)
            if run is not None:
                raise TidemarkError(
                    f"sink {sink}: rebuild run {run} committed its table for the staged "
                    f"version; promote it (`tidemark pipelines promote {name}`), or change "
                    f"the staged file and rebuild again"
                )
        staging.release(conn, name, chosen)
    return chosen


def held_for(ledger_dsn: str, live: cfg.Pipeline, staged: cfg.Pipeline, sink: str) -> None:
    """Hold ``sink`` for ``staged`` before its rebuild claims it."""
    with connect(ledger_dsn, autocommit=True, what="ledger") as conn:
        staging.hold(conn, live.name, sink, cfg.fingerprint(staged), cfg.fingerprint(live))


def release_unless_rebuilt(ledger_dsn: str, name: str, sink: str) -> bool:
    """After a staged rebuild that did not commit: release its hold unless a rebuild of the
    sink for that version committed since it was taken. Whether it was released."""
    with connect(ledger_dsn, autocommit=True, what="ledger") as conn:
        h = staging.holds(conn, name).get(sink)
        if h is None or h.promoted_at is not None:
            return False
        if staging.rebuilt_since(conn, name, sink, h.held_at) is not None:
            return False
        return bool(staging.release(conn, name, [sink]))
