"""Between step 2 and 3 of a run (tidemark/driver/run.py): whether its write can be decided.
The tasks must have accounted for every record (docs/design.md, "Task accounting"; else the
run aborts), no sink may quarantine more than its ceiling (else the run and the pipeline
halt), and per sink no task failed it and each of its chosen gids is still prepared,
checked on a new connection to each participant's database.

:class:`Verifier` is built from the run's context (tidemark/driver/context.py) and returns
what it :class:`Verified`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidemark.core.db import connect
from tidemark.core.errors import OverCeiling, TidemarkError
from tidemark.core.participants import TargetKind
from tidemark.driver import ceiling
from tidemark.driver.aborting import Aborter
from tidemark.driver.context import RunContext
from tidemark.driver.modes import Layout
from tidemark.driver.writing import WriteOutcome
from tidemark.ledger import state
from tidemark.ledger.state import RunState
from tidemark.protocol import coverage, twopc
from tidemark.protocol.taskspec import ByKey, TaskResult


@dataclass(frozen=True)
class Verified:
    """The write that stands and the sinks of it that can be decided (each marked
    ``prepared`` on the ledger)."""

    written: WriteOutcome
    prepared: list[str]


class Verifier:
    """The verification of one run's write."""

    def __init__(self, ctx: RunContext, aborter: Aborter) -> None:
        self.ctx = ctx
        self.aborter = aborter

    def verify(self, written: WriteOutcome) -> Verified:
        """The sinks whose write can be decided: the tasks accounted for every record
        (docs/design.md, "Task accounting"; else the run aborts), then per sink no task
        failed it and each of its chosen gids is still prepared."""
        live = written.live
        if not live or written.layout is None:
            return Verified(written, [])
        self._account(written.results, written.layout, live)
        self._under_ceiling(written, live)
        return Verified(written, [s for s in live if self._verify_sink(written, s)])

    def _under_ceiling(self, written: WriteOutcome, live: list[str]) -> None:
        """Halt the run, nothing committed, when a sink would quarantine more than
        ``quality.max_quarantined`` of its records (driver/ceiling.py), and the pipeline with
        it until `tidemark resume`: the next run would read the same records and do the same.
        A delivery only: a backfill or redrive is an operator's deliberate re-delivery
        (previewed with --dry-run), whose letters also count older versions outside its
        range; at least once has committed its rows already."""
        ctx = self.ctx
        if not ctx.mode.halts_over_ceiling or not ctx.exactly_once:
            return
        over = [m for s in live if (m := ceiling.breach(ctx.pipeline, s, written.of_sink(s)))]
        if not over:
            return
        self.aborter.abort_sinks(live, over[0])
        reason = f"run {ctx.run_id}: {'; '.join(over)}"
        state.halt(ctx.ledger.conn, ctx.pipeline.name, reason)
        raise OverCeiling(
            f"{reason}; pipeline {ctx.pipeline.name} halted: `tidemark resume "
            f"{ctx.pipeline.name}` once fixed"
        )

    def _account(self, results: list[TaskResult], layout: Layout, live: list[str]) -> None:
        ctx = self.ctx
        ctx.report.records = sum(r.records for r in results)
        accounting = [r.error for r in results if r.error]
        if len(results) != layout.tasks:
            accounting.append(f"{len(results)} task results for {layout.tasks} tasks")
        elif isinstance(layout.accounting, ByKey) and not accounting:
            # Each task saw a part of every range: only together do they cover them.
            spread = layout.accounting.spread
            problem = coverage.problem(spread, [r.seen for r in results])
            if problem:
                accounting.append(problem)
        if accounting:
            how = ctx.pipeline.transform.python or "select"
            msg = (
                f"records not accounted for (transform {how}): {accounting[0]}; a "
                f"transform must keep every record exactly once (quarantine a bad one)"
            )
            self.aborter.abort_sinks(live, msg)
            raise TidemarkError(f"run {ctx.run_id}: {msg}")

    def _verify_sink(self, written: WriteOutcome, sink: str) -> bool:
        ctx = self.ctx
        out = ctx.report.sinks[sink]
        mine = written.of_sink(sink)
        errors = [m.error for m in mine if m.error]
        out.take_counts(mine)
        if out.csv_why:  # slower, not wrong: say why once per run
            ctx.log(f"run {ctx.run_id} sink {sink}: rows go by CSV COPY ({out.csv_why})")
        if not errors:
            missing = self._not_prepared(written, sink)
            if missing:
                errors.append(
                    f"prepared transaction(s) vanished before the decision: {', '.join(missing)}"
                )
        if errors:
            self.aborter.abort(sink, errors[0])
            return False
        state.mark_prepared(
            ctx.ledger.conn, ctx.pipeline.name, ctx.run_id, sink, out.counts, out.schema_changes
        )
        out.state = RunState.PREPARED
        return True

    def _not_prepared(self, written: WriteOutcome, sink: str) -> list[str]:
        ctx = self.ctx
        if not ctx.exactly_once:
            return []
        missing = []
        for p in written.chosen(sink):
            dsn = ctx.ledger.dsn if p.target.kind is TargetKind.LEDGER else ctx.sinks[sink].dsn
            with connect(dsn, autocommit=True) as conn:
                if not twopc.is_prepared(conn, p.gid):
                    missing.append(p.gid)
        return missing
