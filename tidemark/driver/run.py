"""The driver of one run: the commit protocol of docs/design.md, end to end, for every mode
(tidemark/driver/modes.py: deliver, backfill; tidemark/driver/redrive.py: redrive).

:meth:`Run.execute` takes the protocol's steps in order, each on the connection it names:
claim (ledger) -> write (Spark tasks PREPARE on the sink databases and the ledger) -> verify
(every chosen gid still prepared) -> decide (ledger: the commit point, per sink) -> finish
(COMMIT / ROLLBACK PREPARED on each participant's database) -> advance (ledger). A dry run
(a preview) stops after the verification: it reports what the run would do, then aborts its
sinks and rolls back every prepared transaction of the run instead of deciding.

SIGTERM before a sink's decision rolls everything back, releases the leases and exits 143;
after the decision the run finishes its commits first.

Each step is an object built from the claimed run's context (tidemark/driver/context.py):
:class:`~tidemark.driver.tables.Tables`, :class:`~tidemark.driver.writing.Writer`,
:class:`~tidemark.driver.verifying.Verifier`, :class:`~tidemark.driver.committing.Committer`;
:class:`~tidemark.driver.aborting.Aborter` owns every abort path.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from contextlib import closing

from pyspark.sql import SparkSession

from tidemark import sources as src
from tidemark.config import Pipeline
from tidemark.core import faults
from tidemark.core.claims import Claim
from tidemark.core.errors import BadInput, Inconsistency
from tidemark.core.ranges import Range
from tidemark.core.settings import Settings
from tidemark.driver import late
from tidemark.driver.aborting import Aborter, why_aborted
from tidemark.driver.checking import QualityPath
from tidemark.driver.committing import Committer
from tidemark.driver.context import Clock, LedgerSession, RunContext
from tidemark.driver.modes import Backfill, Delivery, Mode
from tidemark.driver.report import RunReport, SinkOutcome, phases
from tidemark.driver.runners import TaskRunner, runner_for
from tidemark.driver.tables import Tables
from tidemark.driver.verifying import Verifier
from tidemark.driver.watch import Heartbeat, Stop
from tidemark.driver.writing import WriteOutcome, Writer
from tidemark.ledger import gaps, state
from tidemark.ledger.migrations import require_current
from tidemark.ledger.state import AirflowRun, RunState
from tidemark.protocol import recovery, sinks
from tidemark.protocol.taskspec import TaskResult

__all__ = ["Backfill", "Delivery", "QualityPath", "Run", "RunReport", "SinkOutcome"]

Log = Callable[[str], None]


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Run:
    """One run of the protocol. ``mode`` says what it delivers (default: the next range of
    each sink); ``quality`` which way its checks may run (docs/quality.md)."""

    def __init__(
        self,
        pipeline: Pipeline,
        settings: Settings,
        *,
        ledger_dsn: str,
        all_pipelines: dict[str, Pipeline] | None = None,
        mode: Mode | None = None,
        quality: QualityPath = QualityPath.WHILE_WRITING,
        sink_names: list[str] | None = None,
        external_id: str | None = None,
        airflow: AirflowRun | None = None,
        log: Log = stderr_log,
        spark: SparkSession | None = None,
        runner: TaskRunner | None = None,
        by: str | None = None,
        where: str | None = None,
        dry_run: bool = False,
        halted_ok: bool = False,
    ) -> None:
        _check_arguments(pipeline, mode, quality, dry_run)
        self.pipeline = pipeline
        self.where = where or f"pipeline {pipeline.name}"  # names the file in config errors
        self.settings = settings
        self.ledger_dsn = ledger_dsn
        self.all_pipelines = all_pipelines or {pipeline.name: pipeline}
        self.mode: Mode = mode if mode is not None else Delivery()
        self.quality = quality
        self.sink_names = sink_names
        self.external_id = external_id
        self.airflow = airflow
        self.log = log
        # Where the write tasks run, chosen once (tidemark/driver/runners.py).
        self.runner = runner or runner_for(
            settings, spark, f"tidemark-{pipeline.name}", pipeline.spark
        )
        refused = self.runner.refusal(self.mode, pipeline)
        if refused is not None:
            raise BadInput(
                f"{pipeline.name}: engine {self.runner.engine} cannot run this {self.mode.name}: "
                f"{refused}; run it with engine spark (TIDEMARK_ENGINE=spark)"
            )
        self.by = by
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self.dry_run = dry_run
        self.halted_ok = halted_ok  # `tidemark settle`'s re-delivery of a lost run's ranges

    # -- the protocol ----------------------------------------------------------------------
    def execute(self) -> RunReport:
        """The mode's before and after (a redrive's request and report) around the protocol."""
        self.mode.begin(self.pipeline)
        report = RunReport(None, self.pipeline.name, self.mode.name, dry_run=self.dry_run)
        results = self._protocol(report)
        self.mode.conclude(report, results, self.log)
        return report

    def _protocol(self, report: RunReport) -> list[TaskResult]:
        """docs/design.md, "Commit protocol", step by step; the results of the write that
        stands (none when there was nothing to replay)."""
        started = time.monotonic()
        faults.mark_job_process_group()
        clock = Clock()
        clock.mark("start")
        resolved = {s.name: s for s in sinks.resolve(self.pipeline, self.sink_names)}
        # The run's own ledger session: the claim takes the run's owner lock on it, which
        # tells recovery that this process is alive.
        ledger = LedgerSession(self.ledger_dsn)
        try:
            self._recover(ledger)  # on every database, with recovery's own connections
            # 1. Claim, on the ledger: one transaction takes the leases and inserts the run.
            claim = self._claim(ledger, list(resolved), report)
            if claim is None:
                report.message = self.mode.idle
                return []
            clock.mark("claim")
            ctx = RunContext(
                pipeline=self.pipeline,
                settings=self.settings,
                mode=self.mode,
                quality=self.quality,
                runner=self.runner,
                claim=claim,
                sinks={s: resolved[s] for s in claim.sinks},
                ledger=ledger,
                report=report,
                log=self.log,
                clock=clock,
                stop=Stop(),
                by=self.by,
                dry_run=self.dry_run,
            )
            return self._claimed(ctx)
        finally:
            report.seconds = time.monotonic() - started
            ledger.close()

    def _claimed(self, ctx: RunContext) -> list[TaskResult]:
        """The claimed run: write, verify, decide, finish, advance (or abort)."""
        aborter = Aborter(ctx)
        ctx.stop.install()
        failure: BaseException | None = None
        try:
            self._announce(ctx)
            self._record_gaps(ctx)
            faults.point("after_claim")
            written = self._steps(ctx, aborter)
            ctx.report.phases = phases(ctx.clock.ends, written.results, read=written.read_phases)
            return written.results
        except BaseException as exc:
            failure = exc
            # Before any decision nothing may stay behind: roll back now, free the leases.
            # After one, only recovery may settle what is in doubt.
            if not ctx.stop.decided:
                with aborter.cleanup(failure):
                    aborter.abort_all(why_aborted(exc))
            raise
        finally:
            ctx.stop.uninstall()
            with aborter.cleanup(failure):
                self._end(ctx)

    def _steps(self, ctx: RunContext, aborter: Aborter) -> WriteOutcome:
        """Write, verify, then decide, finish and advance (a preview: roll back instead);
        the write that stands."""
        with Heartbeat(
            ctx.ledger.dsn, ctx.pipeline.name, ctx.run_id, ctx.settings.lease_ttl_seconds
        ):
            # 2. Write, in Spark tasks: each PREPAREs its rows on every sink's
            # database and each sink's dead letters on the ledger.
            written = Writer(ctx, Tables(ctx, aborter), aborter).write()
            # Verify, on a new connection to each participant's database: every
            # chosen gid still prepared; the ledger marks the sink prepared.
            verified = Verifier(ctx, aborter).verify(written)
            ctx.stop.check()
            faults.point("after_prepare")
            if ctx.dry_run:  # a preview: what it would decide, then nothing
                aborter.preview(verified.prepared)
                return written
            # 3. Decide, on the ledger: per sink one transaction, the commit point.
            commit = Committer(ctx, aborter, written)
            decided = commit.decide(verified.prepared)
            ctx.clock.mark("decide")
        faults.point("after_decide")
        with commit.left_to_recovery(), closing(commit.databases()) as dbs:
            # 4. Finish, on each participant's database: COMMIT PREPARED the chosen
            # gids, ROLLBACK PREPARED the rest.
            lost = commit.finish(dbs, decided)
            # 5. Advance, on the ledger: per sink one transaction moves its
            # checkpoints and marks it committed.
            commit.advance([s for s in decided if s not in lost])
            if lost:
                raise Inconsistency("; ".join(lost.values()) + "; pipeline halted")
        return written

    # -- 1. claim ----------------------------------------------------------------------------
    def _recover(self, ledger: LedgerSession) -> None:
        require_current(ledger.conn)
        sinks.prepare_database(ledger.conn, "ledger")
        rec = recovery.recover(
            self.ledger_dsn,
            self.all_pipelines,
            self.settings.gid_prefix,
            self.settings.prepared_alert_seconds,
        )
        if rec.rolled_forward or rec.aborted or rec.rolled_back or not rec.ok:
            self.log(rec.summary())
        for err in rec.errors:
            self.log(f"recovery: {err}")

    def _claim(self, ledger: LedgerSession, names: list[str], report: RunReport) -> Claim | None:
        """The claim (lease, epoch, ranges), or None when there is nothing to replay."""
        pipeline = self.pipeline
        if not self.mode.pending(ledger.conn, pipeline, names):
            return None
        # Only with work to do: building the expectations imports Great Expectations
        # (seconds), which an idle run must not pay for.
        pipeline.check_expectations(self.where)
        plan, closing_ = self.mode.planner(pipeline)
        try:
            claim = state.claim(
                ledger.conn,
                pipeline=pipeline.name,
                config=pipeline.model_dump(mode="json"),
                sinks=names,
                mode=self.mode.name,
                owner=self.owner,
                delivery=pipeline.delivery,
                ttl_seconds=self.settings.lease_ttl_seconds,
                plan=plan,
                external_id=self.external_id,
                airflow=self.airflow,
                halted_ok=self.halted_ok,
            )
        finally:
            closing_.close()
        if claim is None:
            return None
        report.run_id, report.skipped = claim.run_id, claim.skipped
        for sink, why in claim.skipped.items():
            self.log(f"sink {sink} skipped: {why}")
        return claim

    def _announce(self, ctx: RunContext) -> None:
        ctx.log(ctx.mode.announcement(ctx.claim, ctx.pipeline))
        for sink in ctx.claim.sinks:
            ctx.report.sinks[sink] = SinkOutcome(sink, RunState.PLANNED)

    def _record_gaps(self, ctx: RunContext) -> None:
        """Before the read: the offsets of each sink's ranges the source holds no record at
        (docs/design.md, invariant 2). A record that appears there later lies below the
        checkpoint; they are what `tidemark status` and `recover` look in (ledger/gaps.py).
        Taken before the read, so a segment that appears while the run reads it is reported
        too (a backfill of it places nothing twice), never one missed."""
        if ctx.dry_run or not ctx.mode.reads_ranges:
            return
        plan = src.planner(ctx.pipeline)
        try:
            held: dict[Range, list[tuple[int, int]]] = {}
            found: dict[str, dict[int, list[tuple[int, int]]]] = {}
            for sink, sc in ctx.claim.sinks.items():
                for r in sc.ranges:
                    if r.size == 0:
                        continue
                    if r not in held:
                        held[r] = plan.held(r.partition, r.start, r.end)
                    holes = late.outside(r, held[r])
                    if holes:
                        found.setdefault(sink, {})[r.partition] = holes
        finally:
            plan.close()
        gaps.record(ctx.ledger.conn, ctx.pipeline.name, ctx.run_id, found)

    # -- the run's end -----------------------------------------------------------------------
    def _end(self, ctx: RunContext) -> None:
        """On the ledger: what the run read, on the sinks that did not write it; its end."""
        if ctx.report.records:
            state.note_read(ctx.ledger.conn, ctx.run_id, ctx.report.records)
        state.finish_run(ctx.ledger.conn, ctx.run_id)


def _check_arguments(
    pipeline: Pipeline, mode: Mode | None, quality: QualityPath, dry_run: bool
) -> None:
    """Refuse, before anything runs, what the run cannot do as asked."""
    # Checked here: a mode named by a string once ran a delivery instead, unnoticed.
    if mode is not None and not isinstance(mode, Mode):
        raise TypeError(f"Run(mode=...) takes a Mode such as Backfill(...), not {mode!r}")
    if not isinstance(quality, QualityPath):
        raise TypeError(f"Run(quality=...) takes a QualityPath, not {quality!r}")
    if dry_run and pipeline.delivery != "exactly_once":
        raise BadInput(
            f"{pipeline.name} has delivery: at_least_once, whose write tasks commit; a "
            f"dry run needs delivery: exactly_once, which it can roll back"
        )
    if mode is not None and mode.needs_prepare and pipeline.delivery != "exactly_once":
        raise BadInput(
            f"{pipeline.name} has delivery: at_least_once, whose write tasks commit; a "
            f"{mode.name} needs delivery: exactly_once, whose decision commits it whole"
        )
