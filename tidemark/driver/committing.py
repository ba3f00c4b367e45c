"""Steps 3 to 5 of a run (tidemark/driver/run.py): decide, per sink, on the ledger (the commit
point); finish, on each participant's database (COMMIT PREPARED the chosen gids, ROLLBACK
PREPARED the rest); advance, on the ledger (per sink its checkpoints move and it is marked
committed). docs/design.md, "Commit protocol".
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from tidemark.core import faults
from tidemark.core.db import one_line
from tidemark.core.errors import Fenced, TidemarkError
from tidemark.driver.aborting import Aborter
from tidemark.driver.context import RunContext
from tidemark.driver.report import phases
from tidemark.driver.writing import WriteOutcome
from tidemark.ledger import runs, state
from tidemark.ledger.state import RunState
from tidemark.protocol import recovery


class Committer:
    """The decision and what follows it, for the write that stands (``written``)."""

    def __init__(self, ctx: RunContext, aborter: Aborter, written: WriteOutcome) -> None:
        self.ctx = ctx
        self.aborter = aborter
        self.written = written

    # -- 3. decide ---------------------------------------------------------------------------
    def decide(self, prepared: list[str]) -> list[str]:
        """The commit point, sink by sink; the sinks whose decision the ledger recorded. A
        decision that may have committed (a lost connection during it) is settled by reading
        the ledger, never rolled back."""
        stop = self.ctx.stop
        decided: list[str] = []
        for sink in prepared:
            stop.check()
            # While a decision runs SIGTERM waits: it may commit, and then finishes first.
            stop.decided = True
            if self._decide_sink(sink):
                decided.append(sink)
            # SIGTERM aborts again as long as no decision was recorded.
            stop.decided = bool(decided)
        stop.check()  # a SIGTERM during a decision that was not recorded
        return decided

    def _decide_sink(self, sink: str) -> bool:
        """Whether the ledger recorded the decision of ``sink`` (else it is aborted)."""
        ctx = self.ctx
        try:
            state.decide(
                ctx.ledger.conn, ctx.pipeline.name, ctx.run_id, sink, self.written.chosen(sink)
            )
        except Fenced as exc:
            self.aborter.abort(sink, str(exc))
            return False
        except psycopg.OperationalError as exc:
            ctx.ledger.reconnect(ctx.run_id)
            now = state.state_of(ctx.ledger.conn, ctx.run_id, sink)
            ctx.log(
                f"run {ctx.run_id} sink {sink}: lost the ledger during the "
                f"decision ({one_line(exc)}); the ledger says {now}"
            )
            if now != RunState.COMMITTING:
                self.aborter.abort(sink, f"decision not recorded: {one_line(exc)}")
                return False
        ctx.report.sinks[sink].state = RunState.COMMITTING
        return True

    # -- 4. finish, 5. advance ---------------------------------------------------------------
    def databases(self) -> recovery.Databases:
        ctx = self.ctx
        return recovery.Databases(
            ctx.ledger.dsn, {ctx.pipeline.name: ctx.pipeline}, application="tidemark-commit"
        )

    @contextmanager
    def left_to_recovery(self) -> Iterator[None]:
        """After the decision, a lost connection leaves the outcome to recovery."""
        try:
            yield
        except psycopg.OperationalError as exc:
            raise TidemarkError(
                f"run {self.ctx.run_id}: lost a connection while committing "
                f"({one_line(exc)}); the outcome is settled by `tidemark "
                f"recover` (runs automatically before the next run)"
            ) from None

    def finish(self, dbs: recovery.Databases, decided: list[str]) -> dict[str, str]:
        """Finish every decided sink as recovery does (recovery.finish: every chosen gid
        checked before any commits, the ledger's last), then ROLLBACK PREPARED the run's
        rest. Returns {sink: why} of the sinks with a chosen gid someone else rolled back:
        settled already (aborted or lost) and the pipeline halted; the others still
        advance."""
        ctx = self.ctx
        ledger, name = ctx.ledger.conn, ctx.pipeline.name
        keep: set[str] = set()
        for sink in decided:
            keep.update(p.gid for p in self.written.chosen(sink))
            for c in runs.chosen(ledger, ctx.run_id, sink):
                dbs.conn(dbs.dsn_for(name, c.target))  # open before committing
        lost: dict[str, str] = {}
        for sink in decided:
            faults.point("before_commit_prepared")
            done = recovery.finish(
                ledger, dbs, name, ctx.run_id, sink, after_each=lambda: faults.point("mid_finish")
            )
            if done.lost:
                lost[sink] = done.reason
                out = ctx.report.sinks[sink]
                out.state, out.error = done.state, done.reason
                ctx.log(done.reason)
        self.aborter.roll_back(frozenset(keep))
        faults.point("after_finish")
        ctx.clock.mark("commit")
        return lost

    def advance(self, decided: list[str]) -> None:
        ctx, written = self.ctx, self.written
        for sink in decided:
            try:
                state.advance(
                    ctx.ledger.conn,
                    ctx.pipeline.name,
                    ctx.run_id,
                    sink,
                    phases(ctx.clock.ends, written.results, sink, written.read_phases),
                )
            except state.IllegalTransition:
                # A concurrent recovery rolled it forward first: the same outcome.
                if state.state_of(ctx.ledger.conn, ctx.run_id, sink) != RunState.COMMITTED:
                    raise
            ctx.report.sinks[sink].state = RunState.COMMITTED
        faults.point("after_advance")
