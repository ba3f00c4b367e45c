"""Step 2 of a run (tidemark/driver/run.py): the write. Write tasks (in Spark or in the run's
process: tidemark/driver/runners.py) PREPARE the batch on every
sink's database and each sink's dead letters on the ledger, as the run's layout spreads the
records over them; the quality strategy (tidemark/driver/checking.py) judges each write, and
one that does not stand is rolled back and the batch written again with the next write
number in its gids.

:class:`Writer` is built from the run's context (tidemark/driver/context.py) and returns a
:class:`WriteOutcome`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidemark.config import Pipeline, PostgresLogSource
from tidemark.core.errors import TidemarkError
from tidemark.core.participants import Participant
from tidemark.driver import checking, fallback, gate
from tidemark.driver.aborting import Aborter
from tidemark.driver.checking import Checked, Fails, Job, Stands
from tidemark.driver.context import RunContext
from tidemark.driver.modes import Layout, LayoutKind, Mode, RunKind
from tidemark.driver.runners import Batch
from tidemark.driver.tables import SinkTable, TableFindings, Tables, table_exists
from tidemark.ledger import checkpoints, state
from tidemark.ledger.state import RunState
from tidemark.protocol import sinks
from tidemark.protocol.taskspec import SinkResult, SinkTarget, TaskResult, TaskSpec


@dataclass(frozen=True)
class WriteOutcome:
    """What the write that stands did: the sinks it wrote, how its records reached its tasks
    (None: nothing was read, no sink left to write), every task's result, the reader's time."""

    live: list[str]
    layout: Layout | None
    results: list[TaskResult]
    read_phases: dict[str, float]

    def chosen(self, sink: str) -> list[Participant]:
        """The participants of ``sink`` its decision chooses: one per task and database."""
        return [
            Participant(p.gid, p.target, r.task, p.rows)
            for r in self.results
            for p in r.participants
            if p.sink == sink
        ]

    def of_sink(self, sink: str) -> list[SinkResult]:
        """What each task did for ``sink``."""
        return [r.sinks[sink] for r in self.results if sink in r.sinks]


NOTHING_WRITTEN = WriteOutcome([], None, [], {})


def may_check_while_writing(
    pipeline: Pipeline, mode: Mode, written: list[sinks.ResolvedSink]
) -> bool:
    """The pipeline's checks may run in the job that writes the batch (docs/quality.md,
    "One pass") where nothing it writes is visible before the decision (exactly once),
    the batch is the run's own (no re-delivery, no fallback versions), no sink has
    checks of its own, and every sink's table exists (a failed gate creates none)."""
    return (
        pipeline.delivery == "exactly_once"
        and mode.checks_while_writing
        and all(s.config.quality.empty for s in written)
        and all(table_exists(s) for s in written)
    )


class Writer:
    """The write of one run: writes of its batch until one stands."""

    def __init__(self, ctx: RunContext, tables: Tables, aborter: Aborter) -> None:
        self.ctx = ctx
        self.tables = tables
        self.aborter = aborter

    def write(self) -> WriteOutcome:
        """Writes of the batch until one stands; returns what stands. The quality
        strategy is chosen once, on the first read of the batch, and judges each write; one
        that does not stand is rolled back (nothing is visible before the decision) and the
        batch is read and written again as the judgement says, with the next write number in
        its gids (gids.Gid.write)."""
        found = self.tables.check()
        if found is None:
            return NOTHING_WRITTEN
        read_time = self.ctx.runner.reader_clock()
        layout: Layout | None = None
        live: list[str] = []
        job = Job([])
        try:
            self.ctx.stop.check()
            layout = self._layout()
            live, job = self._writes(layout, found)
        finally:
            read = read_time()
        return WriteOutcome(live, layout, job.results, read)

    def _writes(self, layout: Layout, found: TableFindings) -> tuple[list[str], Job]:
        ctx = self.ctx
        checks = self._checks_context()
        batch = self._read(layout)
        claimed = [ctx.sinks[s] for s in ctx.claim.sinks]
        quality = ctx.runner.choose(
            ctx.quality,
            checks.pipeline,
            batch,
            ctx.run_id,
            lambda: may_check_while_writing(ctx.pipeline, ctx.mode, claimed),
        )
        write = 0
        while True:
            live, job = self._write_once(layout, found, batch, checks, quality, write)
            if job is None:  # no sink left to write
                return live, Job([])
            judged = quality.judge(job, checks)
            if isinstance(judged, Stands):
                return live, job
            if isinstance(judged, Fails):
                self.aborter.abort_sinks(live, judged.why)
                raise TidemarkError(f"run {ctx.run_id}: {judged.why}")
            ctx.log(
                f"run {ctx.run_id}: data quality: {judged.why}; rolled back the write, "
                f"checking the batch before writing it again"
            )
            self.aborter.roll_back()
            ctx.stop.check()
            quality, batch, write = judged.then, self._read(layout), write + 1

    def _write_once(
        self,
        layout: Layout,
        found: TableFindings,
        batch: Batch,
        checks: checking.Context,
        quality: checking.Strategy,
        write: int,
    ) -> tuple[list[str], Job | None]:
        """One write of ``batch``, checked as ``quality`` says; the sinks it writes and what
        its write tasks did (None: no sink left to write)."""
        ctx, runner, report = self.ctx, self.ctx.runner, self.ctx.report
        columns = runner.columns(batch)
        self.tables.refuse(columns, found)
        cached = fallen = None
        if quality.caches or ctx.mode.falls_back:
            # Read once: the expectations, the fallback keys and the writes all use this
            # cached batch.
            batch = cached = runner.cache(batch)
        try:
            report.layout = layout.kind
            report.quality.append(type(quality).__name__)
            checked = quality.check(batch, checks)
            if checked.verdict is not None and checked.verdict.halted:
                report.records = runner.count(batch)  # a sink writes none of it: still, it read it
                self._halt(checked.verdict)
            tables = self._start_writing(columns, checked, found)
            live = list(tables)
            if not live:
                return [], None
            out = checked.df
            if ctx.mode.falls_back:
                plans = self._plans(live, checked.verdict)
                # Before any transaction is prepared: a sink the backfill would leave with
                # versions placed by nothing (a key split) is refused (fallback.refusals).
                for sink, why in runner.refusals(ctx.pipeline, out, plans).items():
                    self.aborter.abort(sink, why)
                    live.remove(sink)
                    del plans[sink]
                if not live:
                    return [], None
                fallen = self._fallback(layout, out, plans)
                out = fallen.df if fallen is not None else out
            targets = {s: tables[s] for s in live}
            spec = self._spec(layout, targets, [c for c, _ in columns], checked, fallen, write)
            return live, self._run_tasks(layout, out, spec)
        finally:
            if cached is not None:
                runner.release(cached)
            if fallen is not None:
                fallen.release()

    def _layout(self) -> Layout:
        ctx = self.ctx
        layout = ctx.mode.layout(
            ctx.claim.read_ranges(),
            [ctx.sinks[s].config for s in ctx.claim.sinks],
            dense=isinstance(ctx.pipeline.source, PostgresLogSource),
            parallelism=ctx.runner.parallelism(),
            split_min=ctx.pipeline.limits.split_min_records,
        )
        if layout.kind in (LayoutKind.SPREAD, LayoutKind.TOGETHER):
            if layout.kind is LayoutKind.SPREAD:
                how = f"records spread by ({', '.join(layout.by or [])})"
            elif ctx.mode.kind is RunKind.BACKFILL:
                how = "a backfill of several partitions writes in one task"
            elif ctx.mode.kind is RunKind.REBUILD:
                how = "a rebuild writes its new table in one task"
            else:
                how = "a sink orders versions by a column"
            ctx.log(
                f"run {ctx.run_id}: {layout.tasks} write task(s) over "
                f"{len(layout.read)} read(s), {how}"
            )
        return layout

    def _read(self, layout: Layout) -> Batch:
        """The batch: the mode's records, decoded and transformed (lazily in Spark)."""
        return self.ctx.runner.read(self.ctx.mode, self.ctx.pipeline, layout.read)

    def _checks_context(self) -> checking.Context:
        ctx = self.ctx
        return checking.Context(
            pipeline=ctx.mode.quality(ctx.pipeline),
            run_id=ctx.run_id,
            ledger=ctx.ledger.conn,
            docs_dir=str(ctx.settings.docs_dir(ctx.pipeline.name)),
            sink_ranges={s: c.ranges for s, c in ctx.claim.sinks.items()},
            policy=ctx.mode.gate_policy,
            log=ctx.log,
            mark=ctx.clock.mark,
        )

    def _halt(self, verdict: gate.Verdict) -> None:
        """A failed gate under ``halt``: its sinks end ``dq_failed``, nothing written."""
        ctx = self.ctx
        for sink, why in verdict.halted.items():
            out = ctx.report.sinks[sink]
            if out.state == RunState.ABORTED:
                continue
            state.dq_failed(ctx.ledger.conn, ctx.pipeline.name, ctx.run_id, sink, why)
            out.state, out.error = RunState.DQ_FAILED, why
            ctx.log(f"run {ctx.run_id} sink {sink}: dq_failed: {why}")

    def _start_writing(
        self, columns: list[tuple[str, str]], checked: Checked, found: TableFindings
    ) -> dict[str, SinkTable]:
        """The sinks this write writes, each with its table (created or evolved only now:
        a halted run leaves no table behind) and in state ``writing``."""
        ctx = self.ctx
        halted = checked.verdict.halted if checked.verdict is not None else {}
        live: dict[str, SinkTable] = {}
        for sink in ctx.claim.sinks:
            out = ctx.report.sinks[sink]
            if out.state == RunState.ABORTED or sink in halted:
                continue
            table = self.tables.ensure(ctx.sinks[sink], columns, found)
            if table is None:
                continue
            if out.state != RunState.WRITING:  # else it writes again (a write that did not stand)
                state.start_writing(ctx.ledger.conn, ctx.pipeline.name, ctx.run_id, sink)
            out.state = RunState.WRITING
            live[sink] = table
        return live

    def _plans(self, live: list[str], verdict: gate.Verdict | None) -> dict[str, fallback.SinkPlan]:
        """Each sink of a backfill as the fallback sees it (tidemark/driver/fallback.py)."""
        ctx = self.ctx
        v = verdict or gate.Verdict()
        positions = checkpoints.positions(ctx.ledger.conn, ctx.pipeline.name, live)
        began = checkpoints.starts(ctx.ledger.conn, ctx.pipeline.name, live)
        plans = {}
        for s in live:
            failed: dict[int, dict[int, str]] = {}
            for scope in (gate.PIPELINE, s):
                for partition, offsets in v.rows.get(scope, {}).items():
                    failed.setdefault(partition, {}).update(offsets)
            plans[s] = fallback.SinkPlan(
                ctx.sinks[s].config,
                ctx.sinks[s].dsn,
                ctx.claim.sinks[s].ranges,
                positions.get(s, {}),
                failed,
                began=began.get(s, {}),
            )
        return plans

    def _fallback(
        self, layout: Layout, batch: Batch, plans: dict[str, fallback.SinkPlan]
    ) -> fallback.Fallback | None:
        """A backfill's fallback versions (tidemark/driver/fallback.py); one write task."""
        ctx = self.ctx
        if layout.tasks != 1:
            raise TidemarkError(f"a backfill writes in one task, not {layout.tasks}")
        return ctx.runner.fallback(
            ctx.pipeline, ctx.mode, batch, plans, lambda m: ctx.log(f"run {ctx.run_id}: {m}")
        )

    def _target(self, sink: str, table: SinkTable, verdict: gate.Verdict) -> SinkTarget:
        """Where and how the tasks write ``sink`` (TaskSpec.sinks)."""
        ctx = self.ctx
        cfg = ctx.sinks[sink].config
        return SinkTarget(
            name=sink,
            dsn=ctx.sinks[sink].dsn,
            table=table.table,
            key=cfg.key,
            version=cfg.version,
            ranges={r.partition: (r.start, r.end) for r in ctx.claim.sinks[sink].ranges},
            failed=verdict.rows.get(sink, {}),
            quarantine=verdict.quarantine.get(sink),
            tombstones=ctx.pipeline.tombstones_of(cfg),
            omit=list(table.omit),
            rebuild=table.rebuild,
            held=table.held,
        )

    def _spec(
        self,
        layout: Layout,
        live: dict[str, SinkTable],
        columns: list[str],
        checked: Checked,
        fallen: fallback.Fallback | None,
        write: int,
    ) -> TaskSpec:
        ctx = self.ctx
        verdict = checked.verdict or gate.Verdict()
        return TaskSpec(
            run_id=ctx.run_id,
            pipeline=ctx.pipeline.name,
            prefix=ctx.settings.gid_prefix,
            prepare=ctx.exactly_once,
            lock_timeout_ms=ctx.settings.lock_timeout_ms,
            ledger_dsn=ctx.ledger.dsn,
            columns=columns,
            accounting=layout.accounting,
            placement=ctx.mode.placement(ctx.by, fallen),
            failed=verdict.rows.get(gate.PIPELINE, {}),
            quarantine=verdict.quarantine.get(gate.PIPELINE),
            payloads=ctx.mode.payloads(ctx.pipeline),
            sinks=[self._target(s, table, verdict) for s, table in live.items()],
            checks=checked.row_checks,
            write=write,
        )

    def _run_tasks(self, layout: Layout, batch: Batch, spec: TaskSpec) -> Job:
        """The write tasks: one per layout task, each returning its TaskResult."""
        job = self.ctx.runner.run(batch, spec, layout, self.ctx.run_id, self.ctx.log)
        if job.failure is None:
            self.ctx.clock.mark("write")
        return job
