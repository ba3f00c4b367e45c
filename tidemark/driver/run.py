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
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager

import psycopg
from pyspark.sql import SparkSession

from tidemark import sources as src
from tidemark.config import Pipeline
from tidemark.core import faults
from tidemark.core.claims import Claim
from tidemark.core.db import connect, one_line
from tidemark.core.dsn import mask
from tidemark.core.errors import (
    BadInput,
    Fenced,
    Inconsistency,
    TidemarkError,
    terminated_in,
)
from tidemark.core.participants import Participant, Target
from tidemark.core.ranges import Range
from tidemark.core.settings import Settings
from tidemark.driver import late
from tidemark.driver.checking import QualityPath
from tidemark.driver.modes import Backfill, Delivery, Mode
from tidemark.driver.report import UP_TO_DATE, RunReport, SinkOutcome, phases
from tidemark.driver.runners import TaskRunner, runner_for
from tidemark.driver.tables import Rebuilt, Sinks
from tidemark.driver.verifying import Verifying
from tidemark.driver.watch import Heartbeat, Stop
from tidemark.driver.writing import Writing
from tidemark.ledger import gaps, runs, state
from tidemark.ledger.migrations import require_current
from tidemark.ledger.state import AirflowRun, RunState
from tidemark.protocol import gids, recovery, sinks, twopc
from tidemark.protocol.taskspec import TaskResult

__all__ = ["Backfill", "Delivery", "QualityPath", "Run", "RunReport", "SinkOutcome"]

Log = Callable[[str], None]


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Run(Writing, Verifying):
    """One run of the protocol. ``mode`` says what it delivers (default: the next range of
    each sink); ``quality`` which way its checks may run (docs/quality.md). The write (step
    2) is tidemark/driver/writing.py's, its verification tidemark/driver/verifying.py's."""

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
        self.p = pipeline
        self.where = where or f"pipeline {pipeline.name}"  # names the file in config errors
        self.s = settings
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
        self.stop = Stop()
        self.clock: dict[str, float] = {}  # phase -> monotonic time it ended
        self.results: list[TaskResult] = []  # the write that stands: one per task
        self.read_phases: dict[str, float] = {}  # the reader's own, every read of the run
        self.dry_run = dry_run
        self.halted_ok = halted_ok  # `tidemark settle`'s re-delivery of a lost run's ranges
        self.omit: dict[str, list[str]] = {}  # a dry run's columns its tables lack
        self.rebuilt: dict[str, Rebuilt] = {}  # a rebuild's new and retired tables
        self.held: dict[str, dict[int, list[tuple[int, int]]]] = {}  # --accept-pruned

    # -- the protocol ----------------------------------------------------------------------
    def execute(self) -> RunReport:
        """The mode's before and after (a redrive's request and report) around the protocol."""
        self.mode.begin(self.p)
        report = self._protocol()
        self.mode.conclude(report, self.results, self.log)
        return report

    def _protocol(self) -> RunReport:
        """docs/design.md, "Commit protocol", step by step."""
        started = time.monotonic()
        faults.mark_job_process_group()
        self._mark("start")
        report = RunReport(None, self.p.name, self.mode.name, dry_run=self.dry_run)
        by_name = {s.name: s for s in sinks.resolve(self.p, self.sink_names)}
        # The run's own ledger session: the claim takes the run's owner lock on it, which
        # tells recovery that this process is alive.
        self.ledger = connect(self.ledger_dsn, autocommit=True, what="ledger")
        try:
            self._recover()  # on every database, with recovery's own connections
            # 1. Claim, on the ledger: one transaction takes the leases and inserts the run.
            claim = self._claim(list(by_name), report)
            if claim is None:
                report.message = UP_TO_DATE
                return report
            self.stop.install()
            failure: BaseException | None = None
            try:
                self._announce(claim, report)
                self._record_gaps(claim)
                faults.point("after_claim")
                with Heartbeat(
                    self.ledger_dsn, self.p.name, claim.run_id, self.s.lease_ttl_seconds
                ):
                    # 2. Write, in Spark tasks: each PREPAREs its rows on every sink's
                    # database and each sink's dead letters on the ledger.
                    written = self._write(claim, by_name, report)
                    self.results, self.read_phases = written.results, written.read_phases
                    # Verify, on a new connection to each participant's database: every
                    # chosen gid still prepared; the ledger marks the sink prepared.
                    prepared = self._verify(claim, by_name, written, report)
                    self.stop.check()
                    faults.point("after_prepare")
                    if self.dry_run:  # a preview: what it would decide, then nothing
                        self._roll_back_preview(claim, by_name, prepared, report)
                        return report
                    # 3. Decide, on the ledger: per sink one transaction, the commit point.
                    decided = self._decide(claim, prepared, report)
                    self._mark("decide")
                faults.point("after_decide")
                with self._left_to_recovery(claim.run_id), closing(self._databases()) as dbs:
                    # 4. Finish, on each participant's database: COMMIT PREPARED the chosen
                    # gids, ROLLBACK PREPARED the rest.
                    lost = self._finish(dbs, claim, by_name, decided, report)
                    # 5. Advance, on the ledger: per sink one transaction moves its
                    # checkpoints and marks it committed.
                    self._advance(claim, [s for s in decided if s not in lost], report)
                    if lost:
                        raise Inconsistency("; ".join(lost.values()) + "; pipeline halted")
            except BaseException as exc:
                failure = exc
                # Before any decision nothing may stay behind: roll back now, free the leases.
                # After one, only recovery may settle what is in doubt.
                if not self.stop.decided:
                    with self._cleanup(failure, claim.run_id):
                        self._abort_all(claim, _why_aborted(exc))
                raise
            finally:
                self.stop.uninstall()
                with self._cleanup(failure, claim.run_id):
                    self._end(claim, report)
            return report
        finally:
            report.seconds = time.monotonic() - started
            self.ledger.close()

    # -- 1. claim ----------------------------------------------------------------------------
    def _recover(self) -> None:
        require_current(self.ledger)
        sinks.prepare_database(self.ledger, "ledger")
        rec = recovery.recover(
            self.ledger_dsn,
            self.all_pipelines,
            self.s.gid_prefix,
            self.s.prepared_alert_seconds,
        )
        if rec.rolled_forward or rec.aborted or rec.rolled_back or not rec.ok:
            self.log(rec.summary())
        for err in rec.errors:
            self.log(f"recovery: {err}")

    def _claim(self, names: list[str], report: RunReport) -> Claim | None:
        """The claim (lease, epoch, ranges), or None when there is nothing to replay."""
        if not self.mode.pending(self.ledger, self.p, names):
            return None
        # Only with work to do: building the expectations imports Great Expectations
        # (seconds), which an idle run must not pay for.
        self.p.check_expectations(self.where)
        plan, closing_ = self.mode.planner(self.p)
        try:
            claim = state.claim(
                self.ledger,
                pipeline=self.p.name,
                config=self.p.model_dump(mode="json"),
                sinks=names,
                mode=self.mode.name,
                owner=self.owner,
                delivery=self.p.delivery,
                ttl_seconds=self.s.lease_ttl_seconds,
                plan=plan,
                external_id=self.external_id,
                airflow=self.airflow,
                halted_ok=self.halted_ok,
            )
        finally:
            closing_.close()
        if claim is None:
            return None
        self._mark("claim")
        report.run_id, report.skipped = claim.run_id, claim.skipped
        for sink, why in claim.skipped.items():
            self.log(f"sink {sink} skipped: {why}")
        return claim

    def _announce(self, claim: Claim, report: RunReport) -> None:
        self.log(self.mode.announcement(claim, self.p))
        self._planned(claim, report)

    def _record_gaps(self, claim: Claim) -> None:
        """Before the read: the offsets of each sink's ranges the source holds no record at
        (docs/design.md, invariant 2). A record that appears there later lies below the
        checkpoint; they are what `tidemark status` and `recover` look in (ledger/gaps.py).
        Taken before the read, so a segment that appears while the run reads it is reported
        too (a backfill of it places nothing twice), never one missed."""
        if self.dry_run or not self.mode.reads_ranges:
            return
        plan = src.planner(self.p)
        try:
            held: dict[Range, list[tuple[int, int]]] = {}
            found: dict[str, dict[int, list[tuple[int, int]]]] = {}
            for sink, sc in claim.sinks.items():
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
        gaps.record(self.ledger, self.p.name, claim.run_id, found)

    def _planned(self, claim: Claim, report: RunReport) -> None:
        for sink in claim.sinks:
            report.sinks[sink] = SinkOutcome(sink, RunState.PLANNED)

    # -- 2. write: tidemark/driver/writing.py; verify: tidemark/driver/verifying.py ---------
    def _chosen(self, sink: str) -> list[Participant]:
        return [
            Participant(p.gid, Target.parse(p.target), r.task, p.rows)
            for r in self.results
            for p in r.participants
            if p.sink == sink
        ]

    # -- a dry run ends before the decision --------------------------------------------------
    def _roll_back_preview(
        self, claim: Claim, by_name: Sinks, prepared: list[str], report: RunReport
    ) -> None:
        """A dry run instead of its decision: each prepared sink previewed (the ledger keeps
        the run and its counts), every prepared transaction of the run rolled back. Nothing was visible, so nothing changes: rows, letters and checkpoints stay."""
        for sink in prepared:
            state.preview(self.ledger, self.p.name, claim.run_id, sink)
            out = report.sinks[sink]
            out.state, out.previewed = RunState.PREVIEWED, True
        self._rollback_run(claim, by_name, keep=set())
        self.log(f"run {claim.run_id}: dry run: every prepared transaction rolled back")
        report.phases = phases(self.clock, self.results, read=self.read_phases)

    # -- 3. decide ---------------------------------------------------------------------------
    def _decide(self, claim: Claim, live: list[str], report: RunReport) -> list[str]:
        """The commit point, sink by sink. A decision that may have committed (a lost
        connection during it) is settled by reading the ledger, never rolled back."""
        decided: list[str] = []
        for sink in live:
            self.stop.check()
            # While a decision runs SIGTERM waits: it may commit, and then finishes first.
            self.stop.decided = True
            if self._decide_sink(claim, sink, report):
                decided.append(sink)
            # SIGTERM aborts again as long as no decision was recorded.
            self.stop.decided = bool(decided)
        self.stop.check()  # a SIGTERM during a decision that was not recorded
        return decided

    def _decide_sink(self, claim: Claim, sink: str, report: RunReport) -> bool:
        """Whether the ledger recorded the decision of ``sink`` (else it is aborted)."""
        try:
            state.decide(self.ledger, self.p.name, claim.run_id, sink, self._chosen(sink))
        except Fenced as exc:
            self._abort(claim.run_id, sink, str(exc), report)
            return False
        except psycopg.OperationalError as exc:
            self._reconnect(claim.run_id)
            now = state.state_of(self.ledger, claim.run_id, sink)
            self.log(
                f"run {claim.run_id} sink {sink}: lost the ledger during the "
                f"decision ({one_line(exc)}); the ledger says {now}"
            )
            if now != RunState.COMMITTING:
                self._abort(claim.run_id, sink, f"decision not recorded: {one_line(exc)}", report)
                return False
        report.sinks[sink].state = RunState.COMMITTING
        return True

    def _reconnect(self, run_id: int) -> None:
        """A new ledger session, holding the owner's lock again (recovery may meanwhile have
        aborted what it saw as orphaned: the transitions then refuse, and we say so)."""
        self.ledger.close()
        self.ledger = connect(self.ledger_dsn, autocommit=True, what="ledger")
        state.hold_owner_lock(self.ledger, run_id)

    # -- 4. finish, 5. advance ---------------------------------------------------------------
    def _databases(self) -> recovery.Databases:
        return recovery.Databases(
            self.ledger_dsn, {self.p.name: self.p}, application="tidemark-commit"
        )

    @contextmanager
    def _left_to_recovery(self, run_id: int) -> Iterator[None]:
        """After the decision, a lost connection leaves the outcome to recovery."""
        try:
            yield
        except psycopg.OperationalError as exc:
            raise TidemarkError(
                f"run {run_id}: lost a connection while committing "
                f"({one_line(exc)}); the outcome is settled by `tidemark "
                f"recover` (runs automatically before the next run)"
            ) from None

    def _finish(
        self,
        dbs: recovery.Databases,
        claim: Claim,
        by_name: Sinks,
        decided: list[str],
        report: RunReport,
    ) -> dict[str, str]:
        """Finish every decided sink as recovery does (recovery.finish: every chosen gid
        checked before any commits, the ledger's last), then ROLLBACK PREPARED the run's
        rest. Returns {sink: why} of the sinks with a chosen gid someone else rolled back:
        settled already (aborted or lost) and the pipeline halted; the others still
        advance."""
        ledger = self.ledger
        keep: set[str] = set()
        for sink in decided:
            keep.update(p.gid for p in self._chosen(sink))
            for c in runs.chosen(ledger, claim.run_id, sink):
                dbs.conn(dbs.dsn_for(self.p.name, c.target))  # open before committing
        lost: dict[str, str] = {}
        for sink in decided:
            faults.point("before_commit_prepared")
            done = recovery.finish(
                ledger,
                dbs,
                self.p.name,
                claim.run_id,
                sink,
                after_each=lambda: faults.point("mid_finish"),
            )
            if done.lost:
                lost[sink] = done.reason
                report.sinks[sink].state, report.sinks[sink].error = done.state, done.reason
                self.log(done.reason)
        self._rollback_run(claim, by_name, keep)
        faults.point("after_finish")
        self._mark("commit")
        return lost

    def _advance(self, claim: Claim, decided: list[str], report: RunReport) -> None:
        for sink in decided:
            try:
                state.advance(
                    self.ledger,
                    self.p.name,
                    claim.run_id,
                    sink,
                    phases(self.clock, self.results, sink, self.read_phases),
                )
            except state.IllegalTransition:
                # A concurrent recovery rolled it forward first: the same outcome.
                if state.state_of(self.ledger, claim.run_id, sink) != RunState.COMMITTED:
                    raise
            report.sinks[sink].state = RunState.COMMITTED
        report.phases = phases(self.clock, self.results, read=self.read_phases)
        faults.point("after_advance")

    # -- abort paths -------------------------------------------------------------------------
    def _abort(self, run_id: int, sink: str, error: str, report: RunReport) -> None:
        state.abort(self.ledger, self.p.name, run_id, sink, error)
        report.sinks[sink].state = RunState.ABORTED
        report.sinks[sink].error = error
        self.log(f"run {run_id} sink {sink}: aborted: {error}")

    def _abort_all(self, claim: Claim, error: str) -> None:
        try:
            for sink in claim.sinks:
                state.abort(self.ledger, self.p.name, claim.run_id, sink, error)
        finally:  # the ledger gone too: recovery aborts the run, but nothing waits for it
            self._rollback_run(
                claim, {s.name: s for s in sinks.resolve(self.p, list(claim.sinks))}, keep=set()
            )

    def _end(self, claim: Claim, report: RunReport) -> None:
        """On the ledger: what the run read, on the sinks that did not write it; its end."""
        if report.records:
            state.note_read(self.ledger, claim.run_id, report.records)
        state.finish_run(self.ledger, claim.run_id)

    @contextmanager
    def _cleanup(self, failure: BaseException | None, run_id: int) -> Iterator[None]:
        """Cleanup after the run. After its ``failure`` a failing cleanup (the ledger session
        may be gone as well) is logged, never raised in its place: the user sees the run's
        own error and exit code. Recovery settles what the cleanup left."""
        try:
            yield
        except (psycopg.Error, TidemarkError) as exc:
            if failure is None:
                raise
            self.log(
                f"run {run_id}: cleanup after {type(failure).__name__} failed too, left to "
                f"`tidemark recover`: {one_line(exc)}"
            )

    def _rollback_run(self, claim: Claim, by_name: Sinks, keep: set[str]) -> None:
        """Roll back every prepared transaction of this run that no decision chose."""
        for dsn in dict.fromkeys([self.ledger_dsn, *(s.dsn for s in by_name.values())]):
            try:
                with connect(dsn, autocommit=True) as conn:
                    for gid, _ in twopc.prepared(
                        conn, gids.like_run(self.s.gid_prefix, claim.run_id)
                    ):
                        if gid not in keep:
                            twopc.rollback(conn, gid)
            except (psycopg.Error, TidemarkError) as exc:
                # An unreachable sink holds nothing of ours, or recovery's sweep gets it later.
                self.log(f"run {claim.run_id}: cleanup skipped {mask(dsn)}: {one_line(exc)}")

    # -- where the time went -----------------------------------------------------------------
    def _mark(self, phase: str) -> None:
        self.clock[phase] = time.monotonic()


def _why_aborted(exc: BaseException) -> str:
    if terminated_in(exc) is not None:
        return "terminated (SIGTERM) before the decision"
    return f"{type(exc).__name__}: {one_line(exc)}"
