"""The data-quality gate of a run (driver side), with Great Expectations.

Either in the job that writes the batch (:func:`speculate`, then :func:`settle` once every task
has prepared: docs/quality.md, "One pass"), or before anything is written (docs/design.md: the
gate precedes step 2), on the transformed batch, cached once so that every expectation reads
the same cached rows (:func:`evaluate`):

1. pipeline ``quality.rows``: each failing row is quarantined (class ``validation``) for every
   sink whose range holds it;
2. pipeline ``quality.batch`` on the rows that remain: if it fails, ``halt`` ends every sink
   ``dq_failed`` (nothing written, no checkpoint moved), ``quarantine_batch`` quarantines, per
   sink, that sink's own range (class ``dq_gate``) and lets the checkpoints advance;
3. the same per sink, on what that sink would receive, for its stricter ``quality``.

The verdicts bind only the sinks of the run, each for its own range (docs/design.md, "Which sinks
a verdict applies to"); the writer applies them per sink. A re-delivery never quarantines a
whole batch: its caller passes ``policy="halt"``.

Results (per expectation, observed values, the GX result, the Data Docs page) go to
``tidemark.dq_results``.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
from pyspark.sql import DataFrame, Observation, SparkSession
from pyspark.sql import functions as F

from tidemark.config import Pipeline, Quality, is_meta
from tidemark.core.columns import OFFSET, PARTITION
from tidemark.core.ranges import Range
from tidemark.engine.records import ERR_CLASS
from tidemark.ledger.status import save_dq_result
from tidemark.protocol.taskspec import CHECK, RowCheck
from tidemark.quality import checks as quality
from tidemark.quality import expectations
from tidemark.quality.outcomes import observed
from tidemark.quality.reasons import COLUMN_KWARGS

PIPELINE = ""  # the scope of pipeline-level checks

Failures = dict[int, dict[int, str]]  # partition -> offset -> reason


@dataclass
class Verdict:
    rows: dict[str, Failures] = field(default_factory=dict)  # scope -> row failures
    quarantine: dict[str, str] = field(default_factory=dict)  # scope -> why (whole batch)
    halted: dict[str, str] = field(default_factory=dict)  # scope -> why (dq_failed)


def _summary(outcome: quality.GateOutcome) -> str:
    parts = []
    for r in outcome.failed():
        parts.append(f"{r['expectation']}({_args(r.get('kwargs', {}))}) {observed(r)}")
    return "data-quality gate failed: " + "; ".join(parts)


def _args(kwargs: dict[str, Any]) -> str:
    return ", ".join(
        f"{k}={v}"
        for k, v in kwargs.items()
        if k in ("column", "min_value", "max_value", "value_set")
    )


FILTER_MAX = 10_000  # failing rows a filter names; beyond, an anti-join with their keys


def _without(df: DataFrame, failures: Failures) -> DataFrame:
    """``df`` less the failing rows. A few are named in a filter (``isin`` becomes a hash set
    lookup): a broadcast anti-join would run a broadcast job of its own under every one of
    GX's metric queries (5 of the demo's 16 jobs)."""
    if not failures:
        return df
    if sum(len(offs) for offs in failures.values()) <= FILTER_MAX:
        hit = functools.reduce(
            operator.or_,
            (
                (F.col(PARTITION) == p) & F.col(OFFSET).isin(sorted(offs))
                for p, offs in failures.items()
            ),
        )
        return df.where(~hit)
    spark = df.sparkSession
    bad = spark.createDataFrame(
        [(p, o) for p, offs in failures.items() for o in offs],
        "_tm_partition int, _tm_offset bigint",
    )
    return df.join(F.broadcast(bad), ["_tm_partition", "_tm_offset"], "left_anti")


def in_ranges(df: DataFrame, ranges: list[Range]) -> DataFrame:
    """The records of ``df`` inside ``ranges`` (none if there are none)."""
    cond = None
    for r in ranges:
        c = (
            (F.col("_tm_partition") == r.partition)
            & (F.col("_tm_offset") >= r.start)
            & (F.col("_tm_offset") < r.end)
        )
        cond = c if cond is None else cond | c
    return df.where(cond) if cond is not None else df.limit(0)


def _check(
    df: DataFrame, q: Quality, label: str, docs_dir: str
) -> tuple[Failures, quality.GateOutcome]:
    failures: Failures = {}
    rows = expectations.parse_expectations(q.rows, label, "quality.rows") if q.rows else []
    batch = expectations.parse_expectations(q.batch, label, "quality.batch")
    first = quality.first_passes(df, rows, batch, label)
    if rows:
        for (p, o), reason in quality.row_failures(df, rows, first=first).items():
            failures.setdefault(p, {})[o] = reason
    outcome = quality.gate(
        _without(df, failures), batch, docs_dir, label, first=first.gate if first else None
    )
    return failures, outcome


def _for_gx(df: DataFrame, checks: list[Quality], where: str) -> DataFrame:
    """The rows GX reads: decoded, with their index, and only the columns the expectations
    read (all output columns if one may read the whole table). No cache of its own: the
    expectations' counts take one scan of the batch cache (tidemark/quality/aggregates.py),
    which reads only these columns."""
    outputs = [c for c in df.columns if not is_meta(c)]
    used: set[str] | None = set()
    for q in checks:
        for items, part in ((q.rows, "quality.rows"), (q.batch, "quality.batch")):
            more = expectations.columns_read(expectations.parse_expectations(items, where, part))
            used = None if more is None or used is None else used | more
    # A column the batch lacks: keep them all, so that GX itself reports it.
    keep = (
        outputs if used is None or not used <= set(outputs) else [c for c in outputs if c in used]
    )
    return df.where(F.col(ERR_CLASS).isNull()).select(PARTITION, OFFSET, *keep)


@contextmanager
def _many_small_queries(spark: SparkSession) -> Iterator[None]:
    """Spark settings for GX's metric queries, restored afterwards.

    The gate asks one-row questions of the cached batch (a few dozen when GX computes a suite
    itself). Adaptive execution splits each into two jobs and plans it twice; a limited collect
    that finds few rows (the failing rows, GX's unexpected values) scans its partitions in one
    job instead of growing in steps.
    """
    conf = {
        "spark.sql.adaptive.enabled": "false",
        "spark.sql.limit.initialNumPartitions": str(2**31 - 1),
    }
    saved = {k: spark.conf.get(k, None) for k in conf}
    for k, v in conf.items():
        spark.conf.set(k, v)
    try:
        yield
    finally:
        for k, was in saved.items():
            if was is None:
                spark.conf.unset(k)
            else:
                spark.conf.set(k, was)


def evaluate(
    pipeline: Pipeline,
    df: DataFrame,
    run_id: int,
    sink_ranges: dict[str, list[Range]],
    ledger: psycopg.Connection,
    docs_dir: str,
    policy: str | None = None,
) -> Verdict:
    """``policy`` overrides the pipeline's ``on_gate_failure`` (a re-delivery halts)."""
    checks = [pipeline.quality] + [s.quality for s in pipeline.sinks if s.name in sink_ranges]
    good = _for_gx(df, checks, f"pipeline {pipeline.name}")
    with _many_small_queries(df.sparkSession):
        return _evaluate(
            pipeline,
            good,
            run_id,
            sink_ranges,
            ledger,
            docs_dir,
            policy or pipeline.quality.on_gate_failure,
        )


def _evaluate(
    pipeline: Pipeline,
    good: DataFrame,
    run_id: int,
    sink_ranges: dict[str, list[Range]],
    ledger: psycopg.Connection,
    docs_dir: str,
    policy: str,
) -> Verdict:
    verdict = Verdict()
    label = f"{pipeline.name}-run-{run_id}"
    failures, outcome = _check(good, pipeline.quality, label, docs_dir)
    _store(ledger, run_id, PIPELINE, failures, outcome)
    verdict.rows[PIPELINE] = failures
    if not outcome.success:
        why = _summary(outcome)
        if policy == "halt":
            verdict.halted = {s: why for s in sink_ranges}
        else:
            verdict.quarantine[PIPELINE] = why
        return verdict
    kept = _without(good, failures)
    for sink in pipeline.sinks:
        if sink.name not in sink_ranges or sink.quality.empty:
            continue
        mine = in_ranges(kept, sink_ranges[sink.name])
        failures, outcome = _check(mine, sink.quality, f"{label}-{sink.name}", docs_dir)
        _store(ledger, run_id, sink.name, failures, outcome)
        verdict.rows[sink.name] = failures
        if not outcome.success:
            why = _summary(outcome)
            if policy == "halt":
                verdict.halted[sink.name] = why
            else:
                verdict.quarantine[sink.name] = why
    return verdict


@dataclass
class Speculation:
    """The pipeline's checks, run by the job that writes the batch (docs/quality.md, "One
    pass"): ``df`` carries each record's first failing row check (column CHECK, indexing
    ``checks``) and observes the aggregates GX judges after the write."""

    df: DataFrame
    checks: list[RowCheck]
    plan: quality.OnePass
    observation: Observation
    batch: list[Any]
    label: str


def speculate(pipeline: Pipeline, df: DataFrame, run_id: int) -> Speculation | None:
    """The pipeline-level checks in the write job, or None when they need the batch first
    (a metric that is not a plain aggregate: a median, uniqueness, a row condition)."""
    q, where = pipeline.quality, f"pipeline {pipeline.name}"
    rows = expectations.parse_expectations(q.rows, where, "quality.rows") if q.rows else []
    batch = expectations.parse_expectations(q.batch, where, "quality.batch")
    label = f"{pipeline.name}-run-{run_id}"
    plan = quality.one_pass(df, rows, batch, label, F.col(ERR_CLASS).isNull(), CHECK)
    if plan is None:
        return None
    if plan.checks:
        df = df.withColumn(CHECK, plan.check)
    observation = Observation()
    checks = [
        RowCheck(
            type=c.type, kwargs={k: v for k, v in dict(c.kwargs).items() if k in COLUMN_KWARGS}
        )
        for c in plan.checks
    ]
    return Speculation(
        df.observe(observation, *plan.observed), checks, plan, observation, batch, label
    )


def settle(
    s: Speculation, run_id: int, records: int, ledger: psycopg.Connection, docs_dir: str
) -> quality.Judged:
    """After the write job: GX's verdicts on what it observed. If the write stands, its
    results are stored as :func:`evaluate` stores them."""
    judged = quality.judged(s.plan, s.observation.get, records)
    if judged.stands:
        outcome = quality.gate(None, s.batch, docs_dir, s.label, first=judged.gate)
        save_dq_result(
            ledger,
            run_id,
            PIPELINE,
            True,
            judged.failed,
            outcome.results,
            outcome.raw,
            outcome.docs_path,
        )
    return judged


def row_verdicts(pipeline: Pipeline, df: DataFrame, sink: str, label: str) -> Failures:
    """The row-level expectations alone (pipeline's, then the sink's) on records outside a
    run's batch: a backfill's fallback versions (tidemark/driver/fallback.py). No batch
    gate: they are not a batch."""
    out: Failures = {}
    good = df.where(F.col(ERR_CLASS).isNull())
    for q in (pipeline.quality, pipeline.sink(sink).quality):
        if q.rows:
            rows = expectations.parse_expectations(q.rows, label, "quality.rows")
            first = quality.first_passes(good, rows, [], label)
            for (p, o), reason in quality.row_failures(good, rows, first=first).items():
                out.setdefault(p, {}).setdefault(o, reason)
    return out


def _store(
    ledger: psycopg.Connection,
    run_id: int,
    scope: str,
    failures: Failures,
    outcome: quality.GateOutcome,
) -> None:
    save_dq_result(
        ledger,
        run_id,
        scope,
        outcome.success,
        sum(len(v) for v in failures.values()),
        outcome.results,
        outcome.raw,
        outcome.docs_path,
    )
