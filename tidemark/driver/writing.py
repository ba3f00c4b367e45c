"""Step 2 of a run (tidemark/driver/run.py): the write. Write tasks (in Spark or in the run's
process: tidemark/driver/runners.py) PREPARE the batch on every
sink's database and each sink's dead letters on the ledger, as the run's layout spreads the
records over them; the quality strategy (tidemark/driver/checking.py) judges each write, and
one that does not stand is rolled back and the batch written again with the next write
number in its gids.

:class:`Writing` is mixed into :class:`tidemark.driver.run.Run`, whose state it uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import psycopg

from tidemark.config import Pipeline, PostgresLogSource
from tidemark.core.claims import Claim
from tidemark.core.errors import TidemarkError
from tidemark.core.settings import Settings
from tidemark.driver import checking, fallback, gate
from tidemark.driver.checking import Checked, Fails, Job, QualityPath, Stands
from tidemark.driver.modes import Layout, LayoutKind, Mode
from tidemark.driver.report import RunReport
from tidemark.driver.runners import Batch, TaskRunner
from tidemark.driver.tables import Sinks, Tables, table_exists
from tidemark.driver.watch import Stop
from tidemark.ledger import checkpoints, state
from tidemark.ledger.state import RunState
from tidemark.protocol.taskspec import Rebuilding, SinkTarget, TaskResult, TaskSpec


@dataclass(frozen=True)
class WriteOutcome:
    """What the write that stands did: the sinks it wrote, how its records reached its tasks
    (None: nothing was read, no sink left to write), every task's result, the reader's time."""

    live: list[str]
    layout: Layout | None
    results: list[TaskResult]
    read_phases: dict[str, float]


class Writing(Tables):
    """The write phase of a :class:`~tidemark.driver.run.Run`."""

    # What the write uses of its run (set in Run.__init__ and Run.execute).
    p: Pipeline
    s: Settings
    ledger: psycopg.Connection
    ledger_dsn: str
    mode: Mode
    quality: QualityPath
    runner: TaskRunner
    by: str | None
    stop: Stop
    log: checking.Log
    dry_run: bool

    if TYPE_CHECKING:  # the run's own, tidemark/driver/run.py

        def _mark(self, phase: str) -> None: ...
        def _rollback_run(self, claim: Claim, by_name: Sinks, keep: set[str]) -> None: ...

    def _write(self, claim: Claim, by_name: Sinks, report: RunReport) -> WriteOutcome:
        """Writes of the batch until one stands; returns what stands. The quality
        strategy is chosen once, on the first read of the batch, and judges each write; one
        that does not stand is rolled back (nothing is visible before the decision) and the
        batch is read and written again as the judgement says, with the next write number in
        its gids (gids.Gid.write)."""
        if not self._check_tables(claim, by_name, report):
            return WriteOutcome([], None, [], {})
        read_time = self.runner.reader_clock()
        layout: Layout | None = None
        live: list[str] = []
        job = Job([])
        try:
            self.stop.check()
            layout = self._layout(claim, by_name)
            live, job = self._writes(layout, claim, by_name, report)
        finally:
            read = read_time()
        return WriteOutcome(live, layout, job.results, read)

    def _writes(
        self, layout: Layout, claim: Claim, by_name: Sinks, report: RunReport
    ) -> tuple[list[str], Job]:
        ctx = self._checks_context(claim)
        df = self._read(layout)
        quality = self.runner.choose(
            self.quality,
            ctx.pipeline,
            df,
            claim.run_id,
            lambda: self._may_check_while_writing(claim, by_name),
        )
        write = 0
        while True:
            live, job = self._write_once(layout, df, claim, by_name, report, ctx, quality, write)
            if job is None:  # no sink left to write
                return live, Job([])
            judged = quality.judge(job, ctx)
            if isinstance(judged, Stands):
                return live, job
            if isinstance(judged, Fails):
                for sink in live:
                    self._abort(claim.run_id, sink, judged.why, report)
                self._rollback_run(claim, by_name, keep=set())
                raise TidemarkError(f"run {claim.run_id}: {judged.why}")
            self.log(
                f"run {claim.run_id}: data quality: {judged.why}; rolled back the write, "
                f"checking the batch before writing it again"
            )
            self._rollback_run(claim, by_name, keep=set())
            self.stop.check()
            quality, df, write = judged.then, self._read(layout), write + 1

    def _write_once(
        self,
        layout: Layout,
        df: Batch,
        claim: Claim,
        by_name: Sinks,
        report: RunReport,
        ctx: checking.Context,
        quality: checking.Strategy,
        write: int,
    ) -> tuple[list[str], Job | None]:
        """One write of the batch ``df``, checked as ``quality`` says; the sinks it writes
        and what its write tasks did (None: no sink left to write)."""
        columns = self.runner.columns(df)
        self._refuse_tables(claim, by_name, columns, report)
        cached = fallen = None
        if quality.caches or self.mode.falls_back:
            # Read once: the expectations, the fallback keys and the writes all use this
            # cached batch.
            df = cached = self.runner.cache(df)
        try:
            report.layout = layout.kind
            report.quality.append(type(quality).__name__)
            checked = quality.check(df, ctx)
            if checked.verdict is not None and checked.verdict.halted:
                report.records = self.runner.count(
                    df
                )  # a sink writes none of the batch: still, it read it
                self._halt(claim, checked.verdict, report)
            live = self._start_writing(claim, by_name, columns, checked, report)
            if not live:
                return [], None
            out = checked.df
            if self.mode.falls_back:
                plans = self._plans(claim, by_name, live, checked.verdict)
                # Before any transaction is prepared: a sink the backfill would leave with
                # versions placed by nothing (a key split) is refused (fallback.refusals).
                for sink, why in self.runner.refusals(self.p, out, plans).items():
                    self._abort(claim.run_id, sink, why, report)
                    live.remove(sink)
                    del plans[sink]
                if not live:
                    return [], None
                fallen = self._fallback(layout, out, claim, plans)
                out = fallen.df if fallen is not None else out
            spec = self._spec(
                layout, claim, by_name, live, [c for c, _ in columns], checked, fallen, write
            )
            return live, self._run_tasks(layout, out, spec, claim.run_id)
        finally:
            if cached is not None:
                self.runner.release(cached)
            if fallen is not None:
                fallen.release()

    def _layout(self, claim: Claim, by_name: Sinks) -> Layout:
        layout = self.mode.layout(
            claim.read_ranges(),
            [by_name[s].config for s in claim.sinks],
            dense=isinstance(self.p.source, PostgresLogSource),
            parallelism=self.runner.parallelism(),
            split_min=self.p.limits.split_min_records,
        )
        if layout.kind in (LayoutKind.SPREAD, LayoutKind.TOGETHER):
            if layout.kind is LayoutKind.SPREAD:
                how = f"records spread by ({', '.join(layout.by or [])})"
            elif self.mode.falls_back:
                how = "a backfill of several partitions writes in one task"
            elif self.mode.rebuilds:
                how = "a rebuild writes its new table in one task"
            else:
                how = "a sink orders versions by a column"
            self.log(
                f"run {claim.run_id}: {layout.tasks} write task(s) over "
                f"{len(layout.read)} read(s), {how}"
            )
        return layout

    def _read(self, layout: Layout) -> Batch:
        """The batch: the mode's records, decoded and transformed (lazily in Spark)."""
        return self.runner.read(self.mode, self.p, layout.read)

    def _checks_context(self, claim: Claim) -> checking.Context:
        return checking.Context(
            pipeline=self.mode.quality(self.p),
            run_id=claim.run_id,
            ledger=self.ledger,
            docs_dir=str(self.s.docs_dir(self.p.name)),
            sink_ranges={s: c.ranges for s, c in claim.sinks.items()},
            policy=self.mode.gate_policy,
            log=self.log,
            mark=self._mark,
        )

    def _may_check_while_writing(self, claim: Claim, by_name: Sinks) -> bool:
        """The pipeline's checks may run in the job that writes the batch (docs/quality.md,
        "One pass") where nothing it writes is visible before the decision (exactly once),
        the batch is the run's own (no re-delivery, no fallback versions), no sink has
        checks of its own, and every sink's table exists (a failed gate creates none)."""
        return (
            self.p.delivery == "exactly_once"
            and self.mode.checks_while_writing
            and all(by_name[s].config.quality.empty for s in claim.sinks)
            and all(table_exists(by_name[s]) for s in claim.sinks)
        )

    def _halt(self, claim: Claim, verdict: gate.Verdict, report: RunReport) -> None:
        """A failed gate under ``halt``: its sinks end ``dq_failed``, nothing written."""
        for sink, why in verdict.halted.items():
            if report.sinks[sink].state == RunState.ABORTED:
                continue
            state.dq_failed(self.ledger, self.p.name, claim.run_id, sink, why)
            report.sinks[sink].state, report.sinks[sink].error = RunState.DQ_FAILED, why
            self.log(f"run {claim.run_id} sink {sink}: dq_failed: {why}")

    def _start_writing(
        self,
        claim: Claim,
        by_name: Sinks,
        columns: list[tuple[str, str]],
        checked: Checked,
        report: RunReport,
    ) -> list[str]:
        """The sinks this write writes, each with its table (created or evolved only now:
        a halted run leaves no table behind) and in state ``writing``."""
        halted = checked.verdict.halted if checked.verdict is not None else {}
        live: list[str] = []
        for sink in claim.sinks:
            now = report.sinks[sink].state
            if now == RunState.ABORTED or sink in halted:
                continue
            if not self._ensure_table(claim, by_name[sink], columns, report):
                continue
            if now != RunState.WRITING:  # else it writes again (a write that did not stand)
                state.start_writing(self.ledger, self.p.name, claim.run_id, sink)
            report.sinks[sink].state = RunState.WRITING
            live.append(sink)
        return live

    def _plans(
        self, claim: Claim, by_name: Sinks, live: list[str], verdict: gate.Verdict | None
    ) -> dict[str, fallback.SinkPlan]:
        """Each sink of a backfill as the fallback sees it (tidemark/driver/fallback.py)."""
        v = verdict or gate.Verdict()
        cps = checkpoints.positions(self.ledger, self.p.name, live)
        began = checkpoints.starts(self.ledger, self.p.name, live)
        plans = {}
        for s in live:
            failed: dict[int, dict[int, str]] = {}
            for scope in (gate.PIPELINE, s):
                for p, offs in v.rows.get(scope, {}).items():
                    failed.setdefault(p, {}).update(offs)
            plans[s] = fallback.SinkPlan(
                by_name[s].config,
                by_name[s].dsn,
                claim.sinks[s].ranges,
                cps.get(s, {}),
                failed,
                began=began.get(s, {}),
            )
        return plans

    def _fallback(
        self, layout: Layout, df: Batch, claim: Claim, plans: dict[str, fallback.SinkPlan]
    ) -> fallback.Fallback | None:
        """A backfill's fallback versions (tidemark/driver/fallback.py); one write task."""
        if layout.tasks != 1:
            raise TidemarkError(f"a backfill writes in one task, not {layout.tasks}")
        return self.runner.fallback(
            self.p, self.mode, df, plans, lambda m: self.log(f"run {claim.run_id}: {m}")
        )

    def _spec(
        self,
        layout: Layout,
        claim: Claim,
        by_name: Sinks,
        live: list[str],
        columns: list[str],
        checked: Checked,
        fallen: fallback.Fallback | None,
        write: int,
    ) -> TaskSpec:
        v = checked.verdict or gate.Verdict()
        targets = []
        for s in live:
            cfg = by_name[s].config
            r = self.rebuilt.get(s)
            targets.append(
                SinkTarget(
                    name=s,
                    dsn=by_name[s].dsn,
                    table=r.new if r else cfg.table,
                    key=cfg.key,
                    version=cfg.version,
                    ranges={r.partition: (r.start, r.end) for r in claim.sinks[s].ranges},
                    failed=v.rows.get(s, {}),
                    quarantine=v.quarantine.get(s),
                    tombstones=self.p.tombstones_of(cfg),
                    omit=self.omit.get(s, []),
                    rebuild=Rebuilding(live=cfg.table, retired=r.retired, columns=r.columns)
                    if r
                    else None,
                    held=self.held.get(s),
                )
            )
        return TaskSpec(
            run_id=claim.run_id,
            pipeline=self.p.name,
            prefix=self.s.gid_prefix,
            prepare=self.p.delivery == "exactly_once",
            lock_timeout_ms=self.s.lock_timeout_ms,
            ledger_dsn=self.ledger_dsn,
            columns=columns,
            accounting=layout.accounting,
            placement=self.mode.placement(self.by, fallen),
            failed=v.rows.get(gate.PIPELINE, {}),
            quarantine=v.quarantine.get(gate.PIPELINE),
            payloads=self.mode.payloads(self.p),
            sinks=targets,
            checks=checked.row_checks,
            write=write,
        )

    def _run_tasks(self, layout: Layout, df: Batch, spec: TaskSpec, run_id: int) -> Job:
        """The write tasks: one per layout task, each returning its TaskResult."""
        job = self.runner.run(df, spec, layout, run_id, self.log)
        if job.failure is None:
            self._mark("write")
        return job
