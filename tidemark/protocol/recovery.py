"""Recovery (docs/design.md): settle every in-doubt run; leave no orphan prepared transaction.

Runs at the start of every run, on demand (`tidemark recover`) and on a schedule. Holds a
ledger advisory lock, so two recoveries never interleave; every step is idempotent.

1. ``committing`` (run, sink): commit its chosen gids that are still prepared, then advance.
   A chosen gid that is gone without its marker row is an inconsistency: halt the pipeline.
2. ``planned``/``writing``/``prepared`` whose owner is gone (its session advisory lock is
   released the moment its process dies) or whose lease expired or moved: roll back its
   sink's prepared transactions and mark it ``aborted``.
3. Any prepared transaction with our prefix that no live run may still choose: roll back.
   Runs newer than this recovery's view of the ledger are left alone. One with our prefix
   whose gid does not parse (no run, stage or task can be read from it) is never guessed
   at: it stays prepared and is reported as an error naming its database and gid.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import psycopg

from tidemark.config import Pipeline
from tidemark.core.db import connect, one_line
from tidemark.core.dsn import mask
from tidemark.core.errors import TidemarkError
from tidemark.ledger import markers, runs, state
from tidemark.ledger.state import RunState
from tidemark.protocol import gids, twopc

LOCK_KEY = 0x7464726B  # 'tdrk'


@dataclass
class Report:
    rolled_forward: list[tuple[int, str]] = field(default_factory=list)
    aborted: list[tuple[int, str]] = field(default_factory=list)
    rolled_back: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    old_prepared: list[tuple[str, str, float]] = field(default_factory=list)  # db, gid, age
    unparsed: list[tuple[str, str]] = field(default_factory=list)  # db, gid: left prepared
    errors: list[str] = field(default_factory=list)
    # pipeline -> its errors: one pipeline's broken database never fails another's checks.
    errors_of: dict[str, list[str]] = field(default_factory=dict)

    def error(self, what: str, pipelines: Iterable[str]) -> None:
        self.errors.append(what)
        for name in pipelines:
            self.errors_of.setdefault(name, []).append(what)

    @property
    def ok(self) -> bool:
        return not self.errors and not self.lost

    def summary(self) -> str:
        parts = [
            f"rolled forward {len(self.rolled_forward)}",
            f"aborted {len(self.aborted)}",
            f"rolled back {len(self.rolled_back)} prepared transaction(s)",
        ]
        if self.lost:
            parts.append(f"LOST {len(self.lost)}")
        if self.errors:
            parts.append(f"{len(self.errors)} error(s)")
        return "recovery: " + ", ".join(parts)


class Databases:
    """Autocommit connections to every database in play, opened on first use."""

    def __init__(
        self, ledger_dsn: str, pipelines: dict[str, Pipeline], application: str = "tidemark-recover"
    ):
        self.ledger_dsn = ledger_dsn
        self.application = application
        self.sink_dsns: dict[tuple[str, str], str] = {}
        self.errors: list[tuple[str, str]] = []  # (pipeline, what)
        for p in pipelines.values():
            for s in p.sinks:
                try:
                    self.sink_dsns[(p.name, s.name)] = p.sink_dsn(s)
                except TidemarkError as exc:
                    self.errors.append((p.name, str(exc)))
        self._conns: dict[str, psycopg.Connection] = {}

    def conn(self, dsn: str) -> psycopg.Connection:
        if dsn not in self._conns:
            self._conns[dsn] = connect(
                dsn, autocommit=True, what="database", application=self.application
            )
        return self._conns[dsn]

    def dsn_for(self, pipeline: str, target: str) -> str:
        if target == "ledger":
            return self.ledger_dsn
        sink = target.split(":", 1)[1]
        try:
            return self.sink_dsns[(pipeline, sink)]
        except KeyError:
            raise TidemarkError(
                f"pipeline {pipeline}: sink {sink} is not configured (pipeline "
                f"file missing or changed); cannot reach its database"
            ) from None

    def users(self, dsn: str) -> list[str]:
        """The pipelines with a sink on ``dsn`` (the ledger's: every pipeline)."""
        if dsn == self.ledger_dsn:
            return sorted({p for p, _ in self.sink_dsns} | {p for p, _ in self.errors})
        return sorted({p for (p, _), d in self.sink_dsns.items() if d == dsn})

    def all_dsns(self) -> list[str]:
        return list(dict.fromkeys([self.ledger_dsn, *self.sink_dsns.values()]))

    def close(self) -> None:
        for c in self._conns.values():
            c.close()


def recover(
    ledger_dsn: str, pipelines: dict[str, Pipeline], prefix: str, alert_seconds: float = 900.0
) -> Report:
    report = Report()
    dbs = Databases(ledger_dsn, pipelines)
    for pipeline, what in dbs.errors:
        report.error(what, [pipeline])
    with connect(ledger_dsn, autocommit=True, what="ledger") as ledger:
        ledger.execute("SELECT pg_advisory_lock(%s)", (LOCK_KEY,))
        try:
            horizon = runs.newest(ledger)
            _roll_forward(ledger, dbs, report)
            _abort_dead(ledger, report)
            _sweep(ledger, dbs, prefix, horizon, alert_seconds, report)
        finally:
            ledger.execute("SELECT pg_advisory_unlock(%s)", (LOCK_KEY,))
            dbs.close()
    return report


def _roll_forward(ledger: psycopg.Connection, dbs: Databases, report: Report) -> None:
    for run_id, sink, pipeline in runs.committing(ledger):
        try:
            lost = commit_chosen(ledger, dbs, pipeline, run_id, sink)
        except (psycopg.Error, TidemarkError) as exc:
            report.error(
                f"run {run_id} sink {sink}: cannot roll forward: {one_line(exc)}", [pipeline]
            )
            continue
        if lost:
            report.lost.extend(lost)
            state.halt(
                ledger,
                pipeline,
                f"run {run_id} sink {sink}: chosen transaction(s) "
                f"{', '.join(lost)} vanished without their marker rows",
            )
            continue
        try:
            state.advance(ledger, pipeline, run_id, sink)
        except state.IllegalTransition:
            continue  # its owner got there first
        except psycopg.Error as exc:
            report.error(f"run {run_id} sink {sink}: cannot advance: {one_line(exc)}", [pipeline])
            continue
        report.rolled_forward.append((run_id, sink))


def commit_chosen(
    ledger: psycopg.Connection,
    dbs: Databases,
    pipeline: str,
    run_id: int,
    sink: str,
    after_each: Callable[[], None] | None = None,
) -> list[str]:
    """Commit the decision's gids; returns those that were lost (gone, no marker)."""
    lost = []
    for gid, target in runs.chosen(ledger, run_id, sink):
        outcome = twopc.commit(dbs.conn(dbs.dsn_for(pipeline, target)), gid)
        if after_each:
            after_each()
        runs.record_outcome(ledger, run_id, sink, gid, outcome)
        if outcome == runs.Outcome.LOST:
            lost.append(gid)
    return lost


def _abort_dead(ledger: psycopg.Connection, report: Report) -> None:
    for run_id, sink, pipeline, alive, leased in runs.unsettled(ledger):
        if alive and leased:
            continue
        why = "owner process is gone" if not alive else "lease expired or taken over"
        try:
            if state.abort(ledger, pipeline, run_id, sink, f"recovery: {why}"):
                report.aborted.append((run_id, sink))
        except psycopg.Error as exc:  # one bad item never stops the rest
            report.error(f"run {run_id} sink {sink}: cannot abort: {one_line(exc)}", [pipeline])
        # Its prepared work is rolled back by the sweep below (same rule as any orphan).


def _sweep(
    ledger: psycopg.Connection,
    dbs: Databases,
    prefix: str,
    horizon: int,
    alert_seconds: float,
    report: Report,
) -> None:
    live = runs.open_sinks(ledger, horizon)
    settled_below = min([*live, horizon + 1])
    chosen = runs.decided_gids(ledger)
    for dsn in dbs.all_dsns():
        try:
            conn = dbs.conn(dsn)
            found = twopc.prepared(conn, f"{prefix}:%")
        except (psycopg.Error, TidemarkError) as exc:
            report.error(f"cannot scan {mask(dsn)}: {one_line(exc)}", dbs.users(dsn))
            continue
        try:
            markers.prune(conn, settled_below)
        except psycopg.Error as exc:
            report.error(f"cannot prune markers on {mask(dsn)}: {one_line(exc)}", dbs.users(dsn))
        for gid, age in found:
            g = gids.parse(gid, prefix)
            if g is None:  # ours by its prefix, but whose? Never guess: a human decides.
                report.unparsed.append((mask(dsn), gid))
                report.error(
                    f"{mask(dsn)}: prepared transaction {gid} has the gid prefix "
                    f"{prefix} but no run, stage or task can be read from it; left "
                    f"prepared: COMMIT PREPARED or ROLLBACK PREPARED it by hand",
                    dbs.users(dsn),
                )
                continue
            if g.run_id > horizon:
                continue
            if gid in chosen or _may_still_choose(live.get(g.run_id, {}), g):
                if age >= alert_seconds:
                    report.old_prepared.append((mask(dsn), gid, age))
                continue
            try:
                if twopc.rollback(conn, gid):
                    report.rolled_back.append(gid)
            except psycopg.Error as exc:
                report.error(f"cannot roll back {gid}: {one_line(exc)}", dbs.users(dsn))


def _may_still_choose(open_sinks: dict[str, str], g: gids.Gid) -> bool:
    return open_sinks.get(g.sink) not in (None, RunState.COMMITTING)
