"""Recovery (docs/design.md): settle every in-doubt run; leave no orphan prepared transaction.

Runs at the start of every run, on demand (`tidemark recover`) and on a schedule. Holds a
ledger advisory lock, so two recoveries never interleave; every step is idempotent.

1. ``committing`` (run, sink): finish its decision as the driver does (:func:`finish`):
   every chosen gid checked first, then committed, the sink's before the ledger's; then
   advance. A chosen gid gone without its marker row (someone else rolled it back) is an
   inconsistency: the decision is settled (aborted, or lost), the pipeline halted, and
   `tidemark settle RUN` named.
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
from tidemark.core.participants import Target
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

    def dsn_for(self, pipeline: str, target: Target) -> str:
        sink = target.name
        if sink is None:  # TargetKind.LEDGER
            return self.ledger_dsn
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
    for rs in runs.committing(ledger):
        run_id, sink, pipeline = rs.run_id, rs.sink, rs.pipeline
        try:
            done = finish(ledger, dbs, pipeline, run_id, sink)
        except (psycopg.Error, TidemarkError) as exc:
            report.error(
                f"run {run_id} sink {sink}: cannot roll forward: {one_line(exc)}", [pipeline]
            )
            continue
        if done.lost:
            report.lost.extend(done.lost)
            # Named per pipeline too: its DAG's recover task and the maintenance alert say it.
            report.error(f"pipeline {pipeline}: {done.reason}", [pipeline])
            continue
        try:
            state.advance(ledger, pipeline, run_id, sink)
        except state.IllegalTransition:
            continue  # its owner got there first
        except psycopg.Error as exc:
            report.error(f"run {run_id} sink {sink}: cannot advance: {one_line(exc)}", [pipeline])
            continue
        report.rolled_forward.append((run_id, sink))


@dataclass
class Finished:
    """How a decision of one (run, sink) ended: ``state`` committing (every chosen gid
    committed: advance next), aborted (one lost before any committed: all rolled back) or
    lost (one lost after others committed: its ranges must be re-delivered). ``lost``: the
    gids someone else rolled back; ``reason``: the halt's, naming them and the command."""

    state: RunState
    lost: list[str] = field(default_factory=list)
    reason: str = ""


def finish(
    ledger: psycopg.Connection,
    dbs: Databases,
    pipeline: str,
    run_id: int,
    sink: str,
    after_each: Callable[[], None] | None = None,
) -> Finished:
    """Step 4 of the commit protocol for one decided (run, sink), by its driver or by
    recovery (docs/design.md): every chosen gid not known committed is checked first
    (prepared, or gone with its marker: committed); only if none is lost are they committed,
    the sink's participants before the ledger's, so that dead letters and a re-delivery's
    status changes never commit without the rows they stand for. A gid lost on the way (a
    race with whoever rolls it back) stops the commits there. Idempotent, and safe beside
    another settler of the same decision: each decides from what the databases say."""
    todo = runs.chosen(ledger, run_id, sink)
    conns = {c.gid: dbs.conn(dbs.dsn_for(pipeline, c.target)) for c in todo}
    lost: list[str] = []
    for gid in conns:
        if twopc.is_prepared(conns[gid], gid):
            continue
        if markers.has(conns[gid], gid):
            runs.record_outcome(ledger, run_id, sink, gid, runs.Outcome.COMMITTED)
        else:
            lost.append(gid)
    if not lost:
        for gid in conns:
            outcome = twopc.commit(conns[gid], gid)
            if after_each:
                after_each()
            runs.record_outcome(ledger, run_id, sink, gid, outcome)
            if outcome == runs.Outcome.LOST:
                lost.append(gid)
                break
        else:
            return Finished(RunState.COMMITTING)
    return _settle_lost(ledger, conns, pipeline, run_id, sink, lost)


def _settle_lost(
    ledger: psycopg.Connection,
    conns: dict[str, psycopg.Connection],
    pipeline: str,
    run_id: int,
    sink: str,
    lost: list[str],
) -> Finished:
    """A chosen gid of (run, sink) is lost: roll back the rest that is still prepared, then
    mark the sink aborted (nothing of the decision committed) or lost (some of it did), and
    halt the pipeline. What committed is read from the markers, not assumed: another settler
    may have committed a gid meanwhile."""
    for gid in conns:
        if gid in lost:
            continue
        if twopc.rollback(conns[gid], gid):
            runs.record_outcome(ledger, run_id, sink, gid, runs.Outcome.ROLLED_BACK)
        elif markers.has(conns[gid], gid):
            runs.record_outcome(ledger, run_id, sink, gid, runs.Outcome.COMMITTED)
        elif runs.outcomes(ledger, run_id, sink).get(gid) != runs.Outcome.ROLLED_BACK:
            lost.append(gid)  # rolled back by someone else as well
    for gid in lost:
        runs.record_outcome(ledger, run_id, sink, gid, runs.Outcome.LOST)
    some_committed = runs.Outcome.COMMITTED in runs.outcomes(ledger, run_id, sink).values()
    what = (
        "others had committed, so its ranges count as delivered and are not whole"
        if some_committed
        else "none of its transactions had committed: rolled back whole, checkpoints stay"
    )
    reason = (
        f"run {run_id} sink {sink}: chosen transaction(s) {', '.join(lost)} rolled back by "
        f"someone else (gone without their marker rows); {what}; run `tidemark settle "
        f"{run_id}`"
    )
    to = RunState.LOST if some_committed else RunState.ABORTED
    try:
        (state.lose if some_committed else state.abandon)(ledger, pipeline, run_id, sink, reason)
    except state.IllegalTransition:
        now = state.state_of(ledger, run_id, sink)
        if now != to:  # another settler got there first: it must have seen the same
            raise
    return Finished(to, lost, reason)


def _abort_dead(ledger: psycopg.Connection, report: Report) -> None:
    for u in runs.unsettled(ledger):
        run_id, sink, pipeline = u.run_id, u.sink, u.pipeline
        if u.alive and u.leased:
            continue
        why = "owner process is gone" if not u.alive else "lease expired or taken over"
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
            # A user without rights on the schema another user made: say what to grant.
            fix = (
                f": {markers.NEEDED}"
                if isinstance(exc, psycopg.errors.InsufficientPrivilege)
                else ""
            )
            report.error(
                f"cannot prune markers on {mask(dsn)}: {one_line(exc)}{fix}", dbs.users(dsn)
            )
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


def _may_still_choose(open_sinks: dict[str, RunState], g: gids.Gid) -> bool:
    return open_sinks.get(g.sink) not in (None, RunState.COMMITTING)
