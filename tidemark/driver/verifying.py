"""Between step 2 and 3 of a run (tidemark/driver/run.py): whether its write can be decided.
The tasks must have accounted for every record (docs/design.md, "Task accounting"; else the
run aborts), no sink may quarantine more than its ceiling (else the run and the pipeline
halt), and per sink no task failed it and each of its chosen gids is still prepared,
checked on a new connection to each participant's database.

:class:`Verifying` is mixed into :class:`tidemark.driver.run.Run`, whose state it uses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import psycopg

from tidemark.config import Pipeline
from tidemark.core.claims import Claim
from tidemark.core.db import connect
from tidemark.core.errors import OverCeiling, TidemarkError
from tidemark.core.participants import Participant, TargetKind
from tidemark.driver import ceiling
from tidemark.driver.modes import Layout, Mode
from tidemark.driver.report import RunReport
from tidemark.driver.tables import Sinks
from tidemark.driver.writing import WriteOutcome
from tidemark.ledger import state
from tidemark.ledger.state import RunState
from tidemark.protocol import coverage, twopc
from tidemark.protocol.taskspec import ByKey, SinkResult, TaskResult


class Verifying:
    """The verification of a :class:`~tidemark.driver.run.Run`'s write."""

    # What the verification uses of its run (set in Run.__init__ and Run.execute).
    p: Pipeline
    ledger: psycopg.Connection
    ledger_dsn: str
    results: list[TaskResult]
    log: Callable[[str], None]
    mode: Mode

    if TYPE_CHECKING:  # the run's own, tidemark/driver/run.py

        def _abort(self, run_id: int, sink: str, error: str, report: RunReport) -> None: ...
        def _rollback_run(self, claim: Claim, by_name: Sinks, keep: set[str]) -> None: ...
        def _chosen(self, sink: str) -> list[Participant]: ...

    def _verify(
        self, claim: Claim, by_name: Sinks, written: WriteOutcome, report: RunReport
    ) -> list[str]:
        """The sinks whose write can be decided: the tasks accounted for every record
        (docs/design.md, "Task accounting"; else the run aborts), then per sink no task
        failed it and each of its chosen gids is still prepared."""
        live = written.live
        if not live or written.layout is None:
            return []
        self._account(claim, by_name, written.layout, live, report)
        self._under_ceiling(claim, by_name, live, report)
        return [s for s in live if self._verify_sink(claim, by_name, s, report)]

    def _under_ceiling(
        self, claim: Claim, by_name: Sinks, live: list[str], report: RunReport
    ) -> None:
        """Halt the run, nothing committed, when a sink would quarantine more than
        ``quality.max_quarantined`` of its records (driver/ceiling.py), and the pipeline with
        it until `tidemark resume`: the next run would read the same records and do the same.
        A delivery only: a backfill or redrive is an operator's deliberate re-delivery
        (previewed with --dry-run), whose letters also count older versions outside its
        range; at least once has committed its rows already."""
        if not self.mode.halts_over_ceiling or self.p.delivery != "exactly_once":
            return
        over = [m for s in live if (m := ceiling.breach(self.p, s, self._mine(s)))]
        if not over:
            return
        for sink in live:
            self._abort(claim.run_id, sink, over[0], report)
        self._rollback_run(claim, by_name, keep=set())
        reason = f"run {claim.run_id}: {'; '.join(over)}"
        state.halt(self.ledger, self.p.name, reason)
        raise OverCeiling(
            f"{reason}; pipeline {self.p.name} halted: `tidemark resume {self.p.name}` once fixed"
        )

    def _mine(self, sink: str) -> list[SinkResult]:
        return [r.sinks[sink] for r in self.results if sink in r.sinks]

    def _account(
        self, claim: Claim, by_name: Sinks, layout: Layout, live: list[str], report: RunReport
    ) -> None:
        report.records = sum(r.records for r in self.results)
        accounting = [r.error for r in self.results if r.error]
        if len(self.results) != layout.tasks:
            accounting.append(f"{len(self.results)} task results for {layout.tasks} tasks")
        elif isinstance(layout.accounting, ByKey) and not accounting:
            # Each task saw a part of every range: only together do they cover them.
            spread = layout.accounting.spread
            problem = coverage.problem(spread, [r.seen for r in self.results])
            if problem:
                accounting.append(problem)
        if accounting:
            how = self.p.transform.python or "select"
            msg = (
                f"records not accounted for (transform {how}): {accounting[0]}; a "
                f"transform must keep every record exactly once (quarantine a bad one)"
            )
            for sink in live:
                self._abort(claim.run_id, sink, msg, report)
            self._rollback_run(claim, by_name, keep=set())
            raise TidemarkError(f"run {claim.run_id}: {msg}")

    def _verify_sink(self, claim: Claim, by_name: Sinks, sink: str, report: RunReport) -> bool:
        out = report.sinks[sink]
        mine = self._mine(sink)
        errors = [m.error for m in mine if m.error]
        out.take_counts(mine)
        if out.csv_why:  # slower, not wrong: say why once per run
            self.log(f"run {claim.run_id} sink {sink}: rows go by CSV COPY ({out.csv_why})")
        if not errors:
            missing = self._not_prepared(sink, by_name)
            if missing:
                errors.append(
                    f"prepared transaction(s) vanished before the decision: {', '.join(missing)}"
                )
        if errors:
            self._abort(claim.run_id, sink, errors[0], report)
            return False
        state.mark_prepared(
            self.ledger, self.p.name, claim.run_id, sink, out.counts, out.schema_changes
        )
        out.state = RunState.PREPARED
        return True

    def _not_prepared(self, sink: str, by_name: Sinks) -> list[str]:
        if self.p.delivery != "exactly_once":
            return []
        missing = []
        for p in self._chosen(sink):
            dsn = self.ledger_dsn if p.target.kind is TargetKind.LEDGER else by_name[sink].dsn
            with connect(dsn, autocommit=True) as conn:
                if not twopc.is_prepared(conn, p.gid):
                    missing.append(p.gid)
        return missing
