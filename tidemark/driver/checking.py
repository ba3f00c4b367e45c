"""How a run's checks judge its batch (docs/quality.md): one strategy per run, chosen once by
:func:`choose`, asked before each write what to write (:meth:`Strategy.check`) and after it
whether the write stands (:meth:`Strategy.judge`).

* :class:`NoChecks`: the pipeline has none.
* :class:`CheckFirst`: Great Expectations checks a cached batch before anything is written
  (docs/design.md: the gate comes before step 2); the write carries its verdict.
* :class:`CheckWhileWriting`: the write job runs the checks itself (docs/quality.md, "One
  pass") and GX judges what it observed once every task has prepared. A write that is not
  exactly what checking first would have written does not stand: the run rolls it back
  (nothing is visible before the decision) and writes the batch again, checking first.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg
from pyspark.sql import DataFrame

from tidemark.config import Pipeline
from tidemark.core import faults
from tidemark.core.ranges import Range
from tidemark.driver import gate
from tidemark.protocol.taskspec import RowCheck, TaskResult

Log = Callable[[str], None]


class QualityPath(enum.StrEnum):
    """Which way a run may check, as its caller picks it; the run then picks the strategy
    (a pipeline without checks has none to run either way)."""

    WHILE_WRITING = "while_writing"  # in the write job where docs/quality.md allows it
    FIRST = "first"  # always a cached batch before writing (tests and benchmarks compare)


@dataclass(frozen=True)
class Context:
    """What the checks need of their run."""

    pipeline: Pipeline  # as the run's mode checks it (Mode.quality)
    run_id: int
    ledger: psycopg.Connection
    docs_dir: str
    sink_ranges: dict[str, list[Range]]
    policy: str | None  # overrides the pipeline's on_gate_failure (a re-delivery halts)
    log: Log
    mark: Callable[[str], None]  # the run's clock: a phase ends


@dataclass(frozen=True)
class Checked:
    """The batch to write and what the checks said of it before the write."""

    df: DataFrame
    verdict: gate.Verdict | None = None  # checked first: the rows and sinks it failed
    row_checks: list[RowCheck] = field(default_factory=list)  # for the write job to run


@dataclass(frozen=True)
class Job:
    """What the Spark write job did: every task's result, or why it failed."""

    results: list[TaskResult]
    failure: str | None = None


@dataclass(frozen=True)
class Stands:
    """The write stands: the run goes on to verify and decide."""


@dataclass(frozen=True)
class Redo:
    """The write does not stand: roll back what it prepared and write again with ``then``."""

    why: str
    then: Strategy


@dataclass(frozen=True)
class Fails:
    """The write failed and writing again would not help: the run aborts."""

    why: str


Judgement = Stands | Redo | Fails


class Strategy(ABC):
    # The checks read the batch before the write: read it once and cache it.
    caches = False

    @abstractmethod
    def check(self, df: DataFrame, ctx: Context) -> Checked:
        """Before the write: the batch to write, checked as far as this strategy checks
        before writing."""

    def judge(self, job: Job, ctx: Context) -> Judgement:
        """After the write: whether it stands."""
        return Stands() if job.failure is None else Fails(job.failure)


class NoChecks(Strategy):
    def check(self, df: DataFrame, ctx: Context) -> Checked:
        return Checked(df)


class CheckFirst(Strategy):
    caches = True

    def check(self, df: DataFrame, ctx: Context) -> Checked:
        ctx.log(f"run {ctx.run_id}: checking data quality (Great Expectations)")
        verdict = gate.evaluate(
            ctx.pipeline,
            df,
            ctx.run_id,
            ctx.sink_ranges,
            ctx.ledger,
            ctx.docs_dir,
            ctx.policy,
        )
        failed = sum(len(offs) for f in verdict.rows.values() for offs in f.values())
        ctx.mark("gate")
        ctx.log(
            f"run {ctx.run_id}: data quality: {failed:,} rows failed, gate "
            f"{'failed' if verdict.halted or verdict.quarantine else 'passed'} "
            f"(`tidemark dq show {ctx.run_id}`)"
        )
        return Checked(df, verdict)


class CheckWhileWriting(Strategy):
    """``ahead``: the checks planned on the batch this strategy was chosen on, which is the
    batch it writes (its one write: a redo checks first)."""

    def __init__(self, ahead: gate.Speculation) -> None:
        self.ahead = ahead

    def check(self, df: DataFrame, ctx: Context) -> Checked:
        ctx.log(f"run {ctx.run_id}: checking data quality (Great Expectations) while writing")
        return Checked(self.ahead.df, row_checks=self.ahead.checks)

    def judge(self, job: Job, ctx: Context) -> Judgement:
        if job.failure is not None:
            # Perhaps an expectation Spark cannot evaluate: checking first, GX says which.
            return Redo(job.failure, CheckFirst())
        faults.point("before_verdict")
        records = sum(r.records for r in job.results)
        judged = gate.settle(self.ahead, ctx.run_id, records, ctx.ledger, ctx.docs_dir)
        if not judged.stands:
            return Redo(judged.why, CheckFirst())
        ctx.mark("gate")
        ctx.log(
            f"run {ctx.run_id}: data quality: {judged.failed:,} rows failed, gate passed "
            f"(`tidemark dq show {ctx.run_id}`)"
        )
        return Stands()


def choose(
    path: QualityPath,
    checks: Pipeline,
    df: DataFrame,
    run_id: int,
    may_check_while_writing: Callable[[], bool],
) -> Strategy:
    """The strategy for a run whose mode checks ``checks`` on the batch ``df``. Checking
    while writing needs the caller's leave (``path``), the run's (asked last: it reads the
    sinks' databases) and checks the write job can compute (else :func:`gate.speculate`
    says None)."""
    if not checks.has_quality():
        return NoChecks()
    if path is QualityPath.WHILE_WRITING and may_check_while_writing():
        ahead = gate.speculate(checks, df, run_id)
        if ahead is not None:
            return CheckWhileWriting(ahead)
    return CheckFirst()
