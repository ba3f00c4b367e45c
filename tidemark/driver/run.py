"""The driver of one run: the commit protocol of docs/design.md, end to end, for every mode
(tidemark/driver/modes.py: deliver, backfill; tidemark/driver/redrive.py: redrive).

claim (lease, epoch, ranges) -> read + decode + transform + write/PREPARE in Spark tasks
-> check every chosen gid is still prepared -> decide (the commit point, per sink)
-> COMMIT PREPARED / ROLLBACK PREPARED -> advance checkpoints.

SIGTERM before a sink's decision rolls everything back, releases the leases and exits 143;
after the decision the run finishes its commits first.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg

from tidemark.config import Pipeline, PostgresLogSource
from tidemark.core import faults
from tidemark.core.db import connect, one_line
from tidemark.core.dsn import mask
from tidemark.core.errors import Fenced, Inconsistency, Terminated, TidemarkError
from tidemark.core.settings import Settings
from tidemark.driver import fallback, gate
from tidemark.driver.modes import Backfill, Delivery, Layout, Mode
from tidemark.engine import records
from tidemark.ledger import checkpoints, runs, state
from tidemark.ledger.migrations import require_current
from tidemark.ledger.state import AirflowRun, Claim, Participant, Range, RunState
from tidemark.protocol import coverage, gids, recovery, sinks, twopc
from tidemark.protocol.taskspec import (
    TASK_PHASES,
    RowCheck,
    SinkTarget,
    TaskResult,
    TaskSpec,
)

Log = Callable[[str], None]
UP_TO_DATE = "up to date: nothing to replay"


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class SinkOutcome:
    sink: str
    state: str
    rows: int = 0
    dead: int = 0
    superseded: int = 0  # versions not written: a newer one of their key won
    removed: int = 0  # re-delivery: rows of the range removed (then placed again)
    resolved: int = 0  # re-delivery: dead letters resolved (their records now delivered)
    fallback: int = 0  # backfill: older versions examined for keys that lost their row
    tombstones: int = 0  # tombstones that delete their key (tombstones: delete)
    error: str | None = None
    copy_format: str = ""  # "binary", or "csv: <the column binary COPY cannot carry>"


@dataclass
class RunReport:
    run_id: int | None
    pipeline: str
    mode: str
    records: int = 0
    sinks: dict[str, SinkOutcome] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    message: str = ""
    redrive: dict | None = None  # redriven / failed_again / skipped dead letters
    phases: dict[str, float] = field(default_factory=dict)  # where the time went (seconds)

    @property
    def ok(self) -> bool:
        return all(s.state == RunState.COMMITTED for s in self.sinks.values())

    def to_dict(self) -> dict:
        return {
            "run_id": self.run_id,
            "pipeline": self.pipeline,
            "mode": self.mode,
            "records": self.records,
            "seconds": round(self.seconds, 2),
            "message": self.message,
            "skipped": self.skipped,
            "redrive": self.redrive,
            "phases": self.phases,
            "sinks": {k: vars(v) for k, v in self.sinks.items()},
        }

    def summary(self) -> str:
        if self.run_id is None:
            return f"{self.pipeline}: {self.message}"
        lines = [
            f"run {self.run_id} ({self.pipeline}, {self.mode}): {self.records:,} records "
            f"read in {self.seconds:.1f}s"
        ]
        for s in self.sinks.values():
            tail = f" - {s.error}" if s.error else ""
            more = "".join(
                f", {n:,} {what}"
                for n, what in (
                    (s.superseded, "superseded by newer versions"),
                    (s.removed, "rows removed"),
                    (s.resolved, "dead letters resolved"),
                    (s.fallback, "older versions of their keys placed again"),
                    (s.tombstones, "tombstones"),
                )
                if n
            )
            lines.append(
                f"  sink {s.sink}: {s.state}, {s.rows:,} rows written, "
                f"{s.dead:,} quarantined{more}{tail}"
            )
        for sink, why in self.skipped.items():
            lines.append(f"  sink {sink}: skipped ({why})")
        if self.redrive is not None and self.run_id is not None:
            r = self.redrive
            lines.append(
                f"  dead letters: {r['redriven']:,} redriven, "
                f"{len(r['failed_again']):,} failed again (still quarantined, "
                f"attempts + 1), {len(r['skipped']):,} skipped"
            )
            if r.get("source_unknown"):
                lines.append(
                    f"  {len(r['source_unknown']):,} replayed with a NULL _tm_ts: "
                    f"the source no longer holds their records (source_note)"
                )
        return "\n".join(lines)


class _Stop:
    """SIGTERM: abort if no sink has decided yet, else finish committing first."""

    def __init__(self) -> None:
        self.decided = False
        self.requested = False
        self._previous = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def _handle(self, signum, frame) -> None:
        self.requested = True
        if not self.decided:
            raise Terminated("SIGTERM before the decision: rolled back")

    def check(self) -> None:
        if self.requested and not self.decided:
            raise Terminated("SIGTERM before the decision: rolled back")


class Run:
    """One run of the protocol: claim -> write (Spark tasks prepare) -> decide per sink ->
    finish (COMMIT / ROLLBACK PREPARED) -> advance. ``mode`` says what it delivers."""

    # The pipeline's checks run in the write job where they may (_may_check_while_writing);
    # tests compare that with checking a cached batch first.
    one_pass = True

    def __init__(
        self,
        pipeline: Pipeline,
        settings: Settings,
        *,
        ledger_dsn: str,
        all_pipelines: dict[str, Pipeline] | None = None,
        mode: str | Mode = "run",
        backfill: Backfill | None = None,
        sink_names: list[str] | None = None,
        external_id: str | None = None,
        airflow: AirflowRun | None = None,
        log: Log = stderr_log,
        spark=None,
        by: str | None = None,
        where: str | None = None,
    ):
        self.p = pipeline
        self.where = where or f"pipeline {pipeline.name}"  # names the file in config errors
        self.s = settings
        self.ledger_dsn = ledger_dsn
        self.all_pipelines = all_pipelines or {pipeline.name: pipeline}
        self.mode: Mode = mode if isinstance(mode, Mode) else (backfill or Delivery())
        if self.mode.name == "backfill" and not isinstance(self.mode, Backfill):
            raise TidemarkError("a backfill needs its range")
        self.sink_names = sink_names
        self.external_id = external_id
        self.airflow = airflow
        self.log = log
        self.spark = spark
        self.by = by
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self.stop = _Stop()
        self.clock: dict[str, float] = {}  # phase -> monotonic time it ended
        self.results: list[TaskResult] = []
        self.layout: Layout | None = None  # how records reach the write tasks (per run)

    def _mark(self, phase: str) -> None:
        self.clock[phase] = time.monotonic()

    def _timings(self) -> dict[str, float]:
        # By time: a one-pass run's gate ends after its write.
        have = sorted(self.clock, key=self.clock.get)
        return {
            f"{b}_seconds": round(self.clock[b] - self.clock[a], 3)
            for a, b in zip(have, have[1:], strict=False)
        }

    # -- the protocol ----------------------------------------------------------------------
    def execute(self) -> RunReport:
        started = time.monotonic()
        faults.mark_job_process_group()
        self._mark("start")
        report = RunReport(None, self.p.name, self.mode.name)
        resolved = sinks.resolve(self.p, self.sink_names)
        by_name = {s.name: s for s in resolved}
        self.ledger = connect(self.ledger_dsn, autocommit=True, what="ledger")
        try:
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
            if not self.mode.pending(self.ledger, self.p, list(by_name)):
                report.message = UP_TO_DATE
                return report
            # Only with work to do: building the expectations imports Great Expectations
            # (seconds), which an idle run must not pay for.
            self.p.check_expectations(self.where)
            plan, closing = self.mode.planner(self.p)
            try:
                claim = state.claim(
                    self.ledger,
                    pipeline=self.p.name,
                    config=self.p.model_dump(mode="json"),
                    sinks=list(by_name),
                    mode=self.mode.name,
                    owner=self.owner,
                    delivery=self.p.delivery,
                    ttl_seconds=self.s.lease_ttl_seconds,
                    plan=plan,
                    external_id=self.external_id,
                    airflow=self.airflow,
                )
            finally:
                closing.close()
            if claim is None:
                report.message = UP_TO_DATE
                return report
            self._mark("claim")
            report.run_id, report.skipped = claim.run_id, claim.skipped
            for sink, why in claim.skipped.items():
                self.log(f"sink {sink} skipped: {why}")
            self.stop.install()
            try:
                self._protocol(claim, by_name, report)
            except BaseException as exc:
                # Before any decision nothing may stay behind: roll back now, free the leases.
                # After one, only recovery may settle what is in doubt.
                if not self.stop.decided:
                    why = (
                        "terminated (SIGTERM) before the decision"
                        if isinstance(exc, Terminated)
                        else f"{type(exc).__name__}: {one_line(exc)}"
                    )
                    self._abort_all(claim, why)
                raise
            finally:
                self.stop.uninstall()
                if report.records:
                    state.note_read(self.ledger, claim.run_id, report.records)
                state.finish_run(self.ledger, claim.run_id)
            return report
        finally:
            report.seconds = time.monotonic() - started
            self.ledger.close()

    def _protocol(
        self, claim: Claim, by_name: dict[str, sinks.ResolvedSink], report: RunReport
    ) -> None:
        run_id = claim.run_id
        read = claim.read_ranges()
        total = sum(r.size for r in read)
        self.log(
            f"run {run_id}: claimed {', '.join(claim.sinks)} "
            f"(epochs {', '.join(str(c.epoch) for c in claim.sinks.values())}); "
            f"reading {total:,} records from {len(read)} partition(s)"
        )
        for sink in claim.sinks:
            report.sinks[sink] = SinkOutcome(sink, RunState.PLANNED)
        faults.point("after_claim")
        heart = _Heartbeat(self.ledger_dsn, self.p.name, run_id, self.s.lease_ttl_seconds)
        heart.start()
        try:
            live = self._write(claim, by_name, read, report, self.one_pass)
            self.stop.check()
            faults.point("after_prepare")
            decided = self._decide(claim, live, report)
            self._mark("decide")
        finally:
            heart.stop()
        faults.point("after_decide")
        self._finish(claim, by_name, decided, report)

    def _write(
        self,
        claim: Claim,
        by_name,
        read: list[Range],
        report: RunReport,
        one_pass: bool = True,
        first_attempt: int = 0,
    ) -> list[str]:
        """``one_pass``: the pipeline's checks may run in the write job itself (see
        :meth:`_may_check_while_writing`); else, or if that write does not stand, the
        expectations check a cached batch before anything is written (that second write's
        attempts count from ``first_attempt``)."""
        from tidemark.engine.session import session

        run_id, ledger = claim.run_id, self.ledger
        spark = self.spark or session(self.s.spark_master, f"tidemark-{self.p.name}")
        self.stop.check()
        layout = self.layout = self.mode.layout(
            read,
            [by_name[s].config for s in claim.sinks],
            dense=isinstance(self.p.source, PostgresLogSource),
            parallelism=spark.sparkContext.defaultParallelism,
            split_min=self.p.limits.split_min_records,
        )
        if layout.kind in ("spread", "together"):
            self.log(
                f"run {run_id}: {layout.tasks} write task(s) over "
                f"{len(layout.read)} read(s), "
                + (
                    f"records spread by ({', '.join(layout.by)})"
                    if layout.kind == "spread"
                    else "a sink orders versions by a column"
                )
            )
        df = records.rows(self.mode.source(spark, self.p, layout.read), self.p)
        columns = records.output_columns(df)
        verdict = None
        checks = self.mode.quality(self.p)
        ahead = None
        if one_pass and checks.has_quality() and self._may_check_while_writing(claim, by_name):
            ahead = gate.speculate(checks, df, run_id)
        first = checks.has_quality() and ahead is None  # check a cached batch first
        cached = None
        if first or self.mode.falls_back:
            from pyspark import StorageLevel

            # Read once: the expectations, the fallback keys and the writes all use this
            # cached batch.
            df = cached = df.persist(StorageLevel.MEMORY_AND_DISK)
        if ahead is not None:
            self.log(f"run {run_id}: checking data quality (Great Expectations) while writing")
            df = ahead.df
        elif first:
            self.log(f"run {run_id}: checking data quality (Great Expectations)")
            verdict = gate.evaluate(
                checks,
                df,
                run_id,
                {s: c.ranges for s, c in claim.sinks.items()},
                ledger,
                str(self.s.docs_dir(self.p.name)),
                self.mode.gate_policy,
            )
            failed = sum(len(offs) for f in verdict.rows.values() for offs in f.values())
            self._mark("gate")
            if verdict.halted:  # a sink writes none of the batch: still, the run read it
                report.records = cached.count()
            self.log(
                f"run {run_id}: data quality: {failed:,} rows failed, gate "
                f"{'failed' if verdict.halted or verdict.quarantine else 'passed'} "
                f"(`tidemark dq show {run_id}`)"
            )
            for sink, why in verdict.halted.items():
                if report.sinks[sink].state == RunState.ABORTED:
                    continue
                state.dq_failed(ledger, self.p.name, run_id, sink, why)
                report.sinks[sink].state, report.sinks[sink].error = RunState.DQ_FAILED, why
                self.log(f"run {run_id} sink {sink}: dq_failed: {why}")
        live: list[str] = []
        for sink in claim.sinks:
            now = report.sinks[sink].state
            if now == RunState.ABORTED or (verdict and sink in verdict.halted):
                continue
            try:
                sinks.ensure_table(
                    by_name[sink],
                    columns,
                    f"sink {sink}",
                    tombstones=(self.p.tombstones_of(by_name[sink].config) == "delete"),
                )
            except TidemarkError as exc:
                self._abort(run_id, sink, str(exc), report)
                continue
            if now != RunState.WRITING:  # else it writes again (a one-pass write undone)
                state.start_writing(ledger, self.p.name, run_id, sink)
            report.sinks[sink].state = RunState.WRITING
            live.append(sink)
        if not live:
            if cached is not None:
                cached.unpersist()
            return []
        fallen = None
        if self.mode.falls_back:
            fallen = self._fallback(spark, df, claim, by_name, live, verdict)
            if fallen is not None:
                df = fallen.df
        spec = self._spec(
            claim,
            by_name,
            live,
            read,
            [c for c, _ in columns],
            verdict,
            fallen,
            ahead.checks if ahead else [],
            first_attempt,
        )
        from tidemark.engine.writer import RESULT_SCHEMA, make_task

        if layout.kind == "spread":
            df = df.repartition(layout.tasks, *layout.by)
        elif layout.kind == "together":
            df = df.coalesce(1)
        progress = _Progress(spark, run_id, layout.tasks, self.log)
        progress.start()
        undo = None  # why a one-pass write does not stand
        try:
            rows = df.mapInArrow(make_task(spec), RESULT_SCHEMA).collect()
        except Terminated:
            spark.sparkContext.cancelAllJobs()
            raise
        except Exception as exc:  # the Spark job failed after its retries: abort every sink
            msg = f"Spark job failed: {_spark_error(exc)}"
            if ahead is None:
                for sink in live:
                    self._abort(run_id, sink, msg, report)
                self._rollback_run(claim, by_name, keep=set())
                raise TidemarkError(f"run {run_id}: {msg}") from None
            # Perhaps an expectation Spark cannot evaluate: checking first, GX says which.
            undo = msg
        finally:
            progress.stop()
            if cached is not None:
                cached.unpersist()
            if fallen is not None:
                fallen.release()
        if undo is None:
            self.results = [TaskResult.model_validate_json(r["result"]) for r in rows]
            self._mark("write")
            if ahead is not None:
                undo = self._settle(ahead, run_id)
        if undo is not None:
            # Nothing is visible before the decision: undo the write, check first, write again.
            self.log(
                f"run {run_id}: data quality: {undo}; rolled back the write, checking "
                f"the batch before writing it again"
            )
            self._rollback_run(claim, by_name, keep=set())
            self.stop.check()
            return self._write(
                claim, by_name, read, report, one_pass=False, first_attempt=gids.REWRITE_ATTEMPT
            )
        report.records = sum(r.records for r in self.results)
        accounting = [r.error for r in self.results if r.error]
        if len(self.results) != layout.tasks:
            accounting.append(f"{len(self.results)} task results for {layout.tasks} tasks")
        elif layout.spread is not None and not accounting:
            # Each task saw a part of every range: only together do they cover them.
            problem = coverage.problem(layout.spread, [r.seen for r in self.results])
            if problem:
                accounting.append(problem)
        if accounting:
            how = self.p.transform.python or "select"
            msg = (
                f"records not accounted for (transform {how}): {accounting[0]}; a "
                f"transform must keep every record exactly once (quarantine a bad one)"
            )
            for sink in live:
                self._abort(run_id, sink, msg, report)
            self._rollback_run(claim, by_name, keep=set())
            raise TidemarkError(f"run {run_id}: {msg}")
        still: list[str] = []
        for sink in live:
            out = report.sinks[sink]
            mine = [r.sinks[sink] for r in self.results]
            errors = [m.error for m in mine if m.error]
            for name in (
                "rows",
                "dead",
                "superseded",
                "removed",
                "resolved",
                "fallback",
                "tombstones",
            ):
                setattr(out, name, sum(getattr(m, name) for m in mine))
            out.copy_format = next((m.copy_format for m in mine if m.copy_format), "")
            if out.copy_format.startswith("csv"):  # slower, not wrong: say why once per run
                self.log(f"run {run_id} sink {sink}: rows go by CSV COPY ({out.copy_format[5:]})")
            if not errors:
                missing = self._not_prepared(sink, by_name)
                if missing:
                    errors.append(
                        f"prepared transaction(s) vanished before the decision: "
                        f"{', '.join(missing)}"
                    )
            if errors:
                self._abort(run_id, sink, errors[0], report)
                continue
            counts = {
                "records": sum(m.records for m in mine),
                "rows": out.rows,
                "dead": out.dead,
                "superseded": out.superseded,
                "removed": out.removed,
                "resolved": out.resolved,
                "fallback": out.fallback,
                "tombstones": out.tombstones,
            }
            state.mark_prepared(ledger, self.p.name, run_id, sink, counts)
            out.state = RunState.PREPARED
            still.append(sink)
        return still

    def _settle(self, ahead: gate.Speculation, run_id: int) -> str | None:
        """GX's verdict on a write that ran the checks: None if it stands, else why not."""
        faults.point("before_verdict")
        judged = gate.settle(
            ahead,
            run_id,
            sum(r.records for r in self.results),
            self.ledger,
            str(self.s.docs_dir(self.p.name)),
        )
        if not judged.stands:
            return judged.why
        self._mark("gate")
        self.log(
            f"run {run_id}: data quality: {judged.failed:,} rows failed, gate passed "
            f"(`tidemark dq show {run_id}`)"
        )
        return None

    def _may_check_while_writing(self, claim: Claim, by_name) -> bool:
        """The pipeline's checks may run in the job that writes the batch (docs/quality.md,
        "One pass") where nothing it writes is visible before the decision (exactly once),
        the batch is the run's own (no re-delivery, no fallback versions), no sink has
        checks of its own, and every sink's table exists (a failed gate creates none)."""
        return (
            self.p.delivery == "exactly_once"
            and self.mode.checks_while_writing
            and all(by_name[s].config.quality.empty for s in claim.sinks)
            and all(_table_exists(by_name[s]) for s in claim.sinks)
        )

    def _fallback(
        self, spark, df, claim: Claim, by_name, live: list[str], verdict: gate.Verdict | None
    ) -> fallback.Fallback | None:
        """A backfill's fallback versions (tidemark/driver/fallback.py); one write task."""
        v = verdict or gate.Verdict()
        cps = checkpoints.positions(self.ledger, self.p.name, live)
        plans = {}
        for s in live:
            failed: dict[int, dict[int, str]] = {}
            for scope in (gate.PIPELINE, s):
                for p, offs in v.rows.get(scope, {}).items():
                    failed.setdefault(p, {}).update(offs)
            plans[s] = fallback.SinkPlan(
                by_name[s].config, by_name[s].dsn, claim.sinks[s].ranges, cps.get(s, {}), failed
            )
        if self.layout.tasks != 1:
            raise TidemarkError(f"a backfill writes in one task, not {self.layout.tasks}")
        return fallback.attach(
            spark, self.p, self.mode, df, plans, lambda m: self.log(f"run {claim.run_id}: {m}")
        )

    def _spec(
        self,
        claim: Claim,
        by_name,
        live: list[str],
        read: list[Range],
        columns: list[str],
        verdict: gate.Verdict | None,
        fallen: fallback.Fallback | None = None,
        checks: list[RowCheck] | None = None,
        first_attempt: int = 0,
    ) -> TaskSpec:
        v = verdict or gate.Verdict()
        targets = []
        for s in live:
            cfg = by_name[s].config
            targets.append(
                SinkTarget(
                    name=s,
                    dsn=by_name[s].dsn,
                    table=cfg.table,
                    key=cfg.key,
                    version=cfg.version,
                    ranges={r.partition: (r.start, r.end) for r in claim.sinks[s].ranges},
                    failed=v.rows.get(s, {}),
                    quarantine=v.quarantine.get(s),
                    fallback_failed=fallen.failed.get(s, {}) if fallen else {},
                    moved=[list(k) for k in fallen.moved.get(s, [])] if fallen else [],
                    tombstones=self.p.tombstones_of(cfg),
                )
            )
        return TaskSpec(
            run_id=claim.run_id,
            pipeline=self.p.name,
            mode=self.mode.name,
            prefix=self.s.gid_prefix,
            prepare=self.p.delivery == "exactly_once",
            lock_timeout_ms=self.s.lock_timeout_ms,
            ledger_dsn=self.ledger_dsn,
            columns=columns,
            by=self.by,
            request=self.mode.request,
            reads=self.layout.reads,
            spread=self.layout.spread,
            failed=v.rows.get(gate.PIPELINE, {}),
            quarantine=v.quarantine.get(gate.PIPELINE),
            fallback=fallen is not None,
            payloads=self.mode.payloads(self.p),
            sinks=targets,
            checks=checks or [],
            first_attempt=first_attempt,
        )

    def _task_phases(self, sink: str | None) -> dict[str, float]:
        """Task-seconds per phase summed over the run's tasks: the task's own (waiting on
        Spark's read, decode and transform; row checks) and its writes to ``sink`` (every
        sink's if None). Tasks run side by side, so these add up to more than the wall time."""
        total = dict.fromkeys(TASK_PHASES, 0.0)
        for r in self.results:
            parts = [
                r.phases,
                *(m.phases for name, m in r.sinks.items() if sink is None or name == sink),
            ]
            for phases in parts:
                for k, v in phases.items():
                    total[k] = total.get(k, 0.0) + v
        return {f"task_{k}_seconds": round(v, 3) for k, v in total.items()}

    def _phases(self) -> dict[str, float]:
        return {**self._timings(), **self._task_phases(None)}

    def _chosen(self, sink: str) -> list[Participant]:
        return [
            Participant(p.gid, p.target, r.task, p.rows)
            for r in self.results
            for p in r.participants
            if p.sink == sink
        ]

    def _not_prepared(self, sink: str, by_name) -> list[str]:
        if self.p.delivery != "exactly_once":
            return []
        missing = []
        for p in self._chosen(sink):
            dsn = self.ledger_dsn if p.target == "ledger" else by_name[sink].dsn
            with connect(dsn, autocommit=True) as conn:
                if not twopc.is_prepared(conn, p.gid):
                    missing.append(p.gid)
        return missing

    def _decide(self, claim: Claim, live: list[str], report: RunReport) -> list[str]:
        """The commit point, sink by sink. A decision that may have committed (a lost
        connection during it) is settled by reading the ledger, never rolled back."""
        decided = []
        for sink in live:
            self.stop.check()
            # From here on SIGTERM no longer aborts: a decided sink finishes its commit.
            self.stop.decided = True
            try:
                state.decide(self.ledger, self.p.name, claim.run_id, sink, self._chosen(sink))
            except Fenced as exc:
                self.stop.decided = bool(decided)
                self._abort(claim.run_id, sink, str(exc), report)
                continue
            except psycopg.OperationalError as exc:
                self._reconnect(claim.run_id)
                now = state.state_of(self.ledger, claim.run_id, sink)
                self.log(
                    f"run {claim.run_id} sink {sink}: lost the ledger during the "
                    f"decision ({one_line(exc)}); the ledger says {now}"
                )
                if now != RunState.COMMITTING:
                    self._abort(
                        claim.run_id, sink, f"decision not recorded: {one_line(exc)}", report
                    )
                    continue
            report.sinks[sink].state = RunState.COMMITTING
            decided.append(sink)
        return decided

    def _reconnect(self, run_id: int) -> None:
        """A new ledger session, holding the owner's lock again (recovery may meanwhile have
        aborted what it saw as orphaned: the transitions then refuse, and we say so)."""
        self.ledger.close()
        self.ledger = connect(self.ledger_dsn, autocommit=True, what="ledger")
        state.hold_owner_lock(self.ledger, run_id)

    def _finish(self, claim: Claim, by_name, decided: list[str], report: RunReport) -> None:
        dbs = recovery.Databases(
            self.ledger_dsn, {self.p.name: self.p}, application="tidemark-commit"
        )
        ledger = self.ledger
        try:
            keep: set[str] = set()
            for sink in decided:
                keep.update(p.gid for p in self._chosen(sink))
                for _gid, target in runs.chosen(ledger, claim.run_id, sink):
                    dbs.conn(dbs.dsn_for(self.p.name, target))  # open before committing
            for sink in decided:
                faults.point("before_commit_prepared")
                lost = recovery.commit_chosen(
                    ledger,
                    dbs,
                    self.p.name,
                    claim.run_id,
                    sink,
                    after_each=lambda: faults.point("mid_finish"),
                )
                if lost:
                    reason = (
                        f"run {claim.run_id} sink {sink}: chosen transaction(s) "
                        f"{', '.join(lost)} vanished without their marker rows"
                    )
                    state.halt(ledger, self.p.name, reason)
                    raise Inconsistency(reason + "; pipeline halted")
            self._rollback_run(claim, by_name, keep)
            faults.point("after_finish")
            self._mark("commit")
            for sink in decided:
                try:
                    state.advance(
                        ledger,
                        self.p.name,
                        claim.run_id,
                        sink,
                        {**self._timings(), **self._task_phases(sink)},
                    )
                except state.IllegalTransition:
                    # A concurrent recovery rolled it forward first: the same outcome.
                    if state.state_of(ledger, claim.run_id, sink) != RunState.COMMITTED:
                        raise
                report.sinks[sink].state = RunState.COMMITTED
            report.phases = self._phases()
            faults.point("after_advance")
        except psycopg.OperationalError as exc:
            raise TidemarkError(
                f"run {claim.run_id}: lost a connection while committing "
                f"({one_line(exc)}); the outcome is settled by `tidemark "
                f"recover` (runs automatically before the next run)"
            ) from None
        finally:
            dbs.close()

    # -- abort paths -------------------------------------------------------------------------
    def _abort(self, run_id: int, sink: str, error: str, report: RunReport) -> None:
        state.abort(self.ledger, self.p.name, run_id, sink, error)
        report.sinks[sink].state = RunState.ABORTED
        report.sinks[sink].error = error
        self.log(f"run {run_id} sink {sink}: aborted: {error}")

    def _abort_all(self, claim: Claim, error: str) -> None:
        for sink in claim.sinks:
            state.abort(self.ledger, self.p.name, claim.run_id, sink, error)
        self._rollback_run(
            claim, {s.name: s for s in sinks.resolve(self.p, list(claim.sinks))}, keep=set()
        )

    def _rollback_run(self, claim: Claim, by_name, keep: set[str]) -> None:
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


def _table_exists(sink: sinks.ResolvedSink) -> bool:
    try:
        return sinks.table_exists(sink)
    except (psycopg.Error, TidemarkError):  # checking first, the write says what is wrong
        return False


_EXC_LINE = re.compile(r"^([\w.]+(Error|Exception|Terminated|Held|Fenced)): (.*)$")


def _spark_error(exc: BaseException) -> str:
    """The Python exception a failed task raised, as one line, out of Spark's wrapping."""
    found = None
    for line in str(exc).splitlines():
        m = _EXC_LINE.match(line.strip())
        if m and not m.group(1).startswith(("org.apache", "java.", "py4j")):
            found = f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(3)}"
    return mask(found) if found else one_line(exc)


class _Heartbeat(threading.Thread):
    """Renews the run's leases every third of their lifetime. A dropped ledger connection is
    reopened (a restart or a network blip must not cost the lease); the run is fenced only if
    the lease really moved or expired, which the decision checks."""

    def __init__(self, dsn: str, pipeline: str, run_id: int, ttl: int):
        super().__init__(daemon=True, name="tidemark-heartbeat")
        self.args_ = (dsn, pipeline, run_id, ttl)
        self._stop_evt = threading.Event()
        self.beats = 0

    def run(self) -> None:
        dsn, pipeline, run_id, ttl = self.args_
        every = max(ttl / 3, 1)
        while not self._stop_evt.is_set():
            try:
                with connect(
                    dsn, autocommit=True, what="ledger", application="tidemark-heartbeat"
                ) as conn:
                    while not self._stop_evt.wait(every):
                        if state.heartbeat(conn, pipeline, run_id, ttl) == 0:
                            return  # the leases moved on: nothing left to renew
                        self.beats += 1
            except (psycopg.Error, TidemarkError):
                self._stop_evt.wait(min(every, 2.0))  # reconnect

    def stop(self) -> None:
        self._stop_evt.set()


class _Progress(threading.Thread):
    """Prints task progress of the write stage every few seconds."""

    def __init__(self, spark, run_id: int, tasks: int, log: Log, every: float = 5.0):
        super().__init__(daemon=True, name="tidemark-progress")
        self.spark, self.run_id, self.tasks, self.log, self.every = spark, run_id, tasks, log, every
        self._stop_evt = threading.Event()

    def run(self) -> None:
        tracker = self.spark.sparkContext.statusTracker()
        started, last = time.monotonic(), None
        while not self._stop_evt.wait(self.every):
            done = running = 0
            total = self.tasks
            stages = tracker.getActiveStageIds()
            for sid in stages:
                info = tracker.getStageInfo(sid)
                if info:
                    done += info.numCompletedTasks
                    running += info.numActiveTasks
                    if len(stages) == 1:  # a spread run reads in one stage, writes in the next
                        total = info.numTasks
            line = (
                f"run {self.run_id}: writing, {done}/{total} tasks done, "
                f"{running} running, {time.monotonic() - started:.0f}s"
            )
            if line != last:
                self.log(line)
                last = line

    def stop(self) -> None:
        self._stop_evt.set()
