"""A backfill's fallback versions: the driver's part of docs/design.md, "Re-delivery", step 4
(the task's part is tidemark/engine/redelivery.py).

A backfill removes every row whose position lies in its range, and places the range again
with the current pipeline. A key whose row goes and that no record of the range places again
(its records fail now, or the current pipeline maps them to another key) falls back to its
newest remaining version that passes now. So, before the write, per sink:

1. ask the sink for the keys of its rows in the range (one query; what step 1 will remove);
2. add the keys the range's records that fail now map to, where such a record had a row (or
   a tombstone) of its own: after a transform change its older versions outside the range,
   which that row placed, are versions of that key now (``_moved_keys``);
3. less the keys of the range's records that pass now: the keys that will lose their row
   (usually none, and the backfill goes on as before);
4. read every version of those keys below the sink's checkpoint and at or above where it
   began, outside the range (the same partition; every partition for a sink that orders
   versions by a column), with the current pipeline, and judge them by the current row-level expectations;
5. hand them to the backfill's one write task, tagged with their sink (``FALLBACK``), and
   the keys of 2 in its spec (``SinkTarget.moved``). After the range is placed, the task
   walks the versions of each of those keys that has no row, newest first. Same
   transactions, same decision.

Before all that, :func:`refusals`: a row of the range whose record the current pipeline maps
to another key (a key change) stood for older versions whose old keys nothing records; unless
the range holds every one of them, the sink is refused (the design's rule of step 4).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import psycopg
from psycopg import sql
from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructField, StructType

from tidemark import sources
from tidemark.config import Pipeline, Sink
from tidemark.core.db import qualified
from tidemark.core.errors import TidemarkError
from tidemark.core.ranges import Range
from tidemark.driver import gate
from tidemark.engine import records, tombstones
from tidemark.engine.redelivery import show
from tidemark.protocol import pruned
from tidemark.protocol.sinks import tombstone_table
from tidemark.protocol.taskspec import FALLBACK, Failures

PART, OFF = "_tm_partition", "_tm_offset"


class Reads(Protocol):
    """What the fallback asks of the run's mode (driver/modes.py): its source's records,
    and whether it may read over positions the source no longer holds."""

    accept_pruned: bool

    def source(self, spark: SparkSession, pipeline: Pipeline, read: list[Range]) -> DataFrame: ...


@dataclass
class SinkPlan:
    """One sink of the backfill: where it is, its range, its checkpoints, and the row-level
    failures the gate found in its range (the pipeline's and its own)."""

    config: Sink
    dsn: str
    ranges: list[Range]
    checkpoints: dict[int, int]
    failed: Failures = field(default_factory=dict)
    # partition -> where the sink began (known starts only): older versions lie at or above
    began: dict[int, int] = field(default_factory=dict)
    moved: list[tuple[Any, ...]] = field(default_factory=list)  # keys of _moved_keys, for the task
    # (partition, offset, *key) of its rows and tombstones in the range (_held), asked once
    held: set[tuple[Any, ...]] | None = None


@dataclass
class Fallback:
    df: DataFrame  # the backfill's records, then the fallback versions
    failed: dict[str, Failures]  # sink -> row-level failures of its versions
    cached: list[DataFrame]
    moved: dict[str, list[tuple[Any, ...]]]  # sink -> keys of _moved_keys (step 2 above)

    def release(self) -> None:
        for d in self.cached:
            d.unpersist()


def _ask(
    s: SinkPlan, what: sql.Composable, where: str, args: list[tuple[Any, ...]]
) -> set[tuple[Any, ...]]:
    """``SELECT DISTINCT what ... WHERE _tm_partition = %s AND where`` over the sink's table
    and its tombstones (a tombstone is a version with a position too), once per ``args``."""
    found: set[tuple[Any, ...]] = set()
    with psycopg.connect(
        s.dsn, autocommit=True, connect_timeout=10, application_name="tidemark-backfill"
    ) as conn:
        tables: list[sql.Composable] = [sql.SQL(qualified(s.config.table))]
        if tombstones.exists(conn, s.config.table):
            tables.append(tombstone_table(s.config.table))
        for table in tables:
            query = sql.SQL("SELECT DISTINCT {} FROM {} WHERE _tm_partition = %s AND {}").format(
                what, table, sql.SQL(where)
            )
            for a in args:
                found |= set(conn.execute(query, a).fetchall())
    return found


def _held(s: SinkPlan) -> set[tuple[Any, ...]]:
    """(partition, offset, *key) of the sink's rows, and tombstones, whose position lies in
    the range (step 1 removes them)."""
    if s.held is None:
        s.held = _ask(
            s,
            sql.SQL(", ").join(sql.Identifier(c) for c in [PART, OFF, *s.config.key]),
            "_tm_offset >= %s AND _tm_offset < %s",
            [(r.partition, r.start, r.end) for r in s.ranges],
        )
    return s.held


def _removed_keys(spark: SparkSession, df: DataFrame, s: SinkPlan) -> DataFrame | None:
    """The keys of the sink's rows, and tombstones, whose position lies in the range."""
    found = {h[2:] for h in _held(s)}
    if not found:
        return None
    schema = StructType([df.schema[k] for k in s.config.key])
    return spark.createDataFrame(list(found), schema)


@dataclass
class KeyChange:
    partition: int
    offset: int
    old: tuple[Any, ...]  # the key its row has (an earlier pipeline's)
    new: tuple[Any, ...]  # the key the current pipeline maps its record to


EXAMPLES = 3


def refusals(
    spark: SparkSession, pipeline: Pipeline, df: DataFrame, plans: dict[str, SinkPlan]
) -> dict[str, str]:
    """Per sink the backfill must not write, why (docs/design.md, "Re-delivery", step 4): a
    row of the range whose record the current pipeline maps to another key stood for the
    older versions of its old key, and which records those are, the old transform alone
    knew. Where the range holds every version older than such a row, the current pipeline
    places each of them itself; elsewhere some may map now to a key nothing places (a split),
    so the sink is refused before anything is written. A record that fails now before it has
    a key shows no key change."""
    out: dict[str, str] = {}
    for name, s in plans.items():
        n, changes, parts = _key_changes(spark, df, s)
        if not n or _covers(pipeline, s, parts):
            continue
        shown = "; ".join(
            f"partition {c.partition} offset {c.offset}: {show(c.old)} -> {show(c.new)}"
            for c in changes
        )
        out[name] = (
            f"a key change: {n:,} record(s) of the range map now to another key "
            f"({', '.join(s.config.key)}) than their rows have ({shown}"
            f"{'; ...' if n > len(changes) else ''}); the older versions those rows stood for "
            f"may lie outside the range, and which key each maps to now only re-delivering "
            f"them tells (after a split, some would be placed by nothing). Nothing was "
            f"written. Re-deliver everything the sink received: tidemark sink rebuild "
            f"{pipeline.name} {name}, or tidemark backfill {pipeline.name} --partition all "
            f"--sink {name}"
        )
    return out


def _key_changes(
    spark: SparkSession, df: DataFrame, s: SinkPlan
) -> tuple[int, list[KeyChange], set[int]]:
    """How many rows (and tombstones) of the range hold a key other than the one the current
    pipeline maps their record to, the first few by position, and their partitions."""
    held = _held(s)
    if not held:
        return 0, [], set()
    keys = s.config.key
    old = [f"_tm_old_{i}" for i in range(len(keys))]
    schema = StructType(
        [df.schema[PART], df.schema[OFF]]
        + [StructField(o, df.schema[k].dataType) for o, k in zip(old, keys, strict=True)]
    )
    rows = spark.createDataFrame(list(held), schema)
    now = gate.in_ranges(df, s.ranges).select(PART, OFF, *keys)
    for k in keys:
        now = now.where(F.col(k).isNotNull())
    same = functools.reduce(
        Column.__and__, [F.col(k).eqNullSafe(F.col(o)) for k, o in zip(keys, old, strict=True)]
    )
    changed = now.join(rows, [PART, OFF]).where(~same).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        n = changed.count()
        if not n:
            return 0, [], set()
        first = changed.orderBy(PART, OFF).limit(EXAMPLES).collect()
        parts = {r[PART] for r in changed.select(PART).distinct().collect()}
    finally:
        changed.unpersist()
    return (
        n,
        [
            KeyChange(r[PART], r[OFF], tuple(r[o] for o in old), tuple(r[k] for k in keys))
            for r in first
        ],
        parts,
    )


def _covers(pipeline: Pipeline, s: SinkPlan, changed: set[int]) -> bool:
    """Whether the range holds every version older than a row of ``changed`` partitions:
    its partition from the first record the source holds (or where the sink began, if
    later: nothing below was delivered to it); where the sink orders versions by a column,
    every partition, from there to the checkpoint."""
    parts = sorted(s.checkpoints) if s.config.version else sorted(changed)
    ranges = {r.partition: r for r in s.ranges}
    planner = sources.planner(pipeline)
    try:
        for p in parts:
            first, end = planner.earliest(p), s.checkpoints.get(p, 0)
            if first is not None:  # no version below where the sink began (the planner cut)
                first = max(first, s.began.get(p, first))
            if first is None or first >= end:
                continue  # the source holds nothing the sink received there
            r = ranges.get(p)
            if r is None or r.start > first or (s.config.version and r.end < end):
                return False
    finally:
        planner.close()
    return True


def _passing(df: DataFrame, s: SinkPlan) -> DataFrame:
    """The range's records that pass now (the sink's step 2 places them)."""
    cols = [c for c in s.config.key + [s.config.version] if c]
    good = gate.in_ranges(df, s.ranges).where(F.col(records.ERR_CLASS).isNull())
    for c in cols:
        good = good.where(F.col(c).isNotNull())
    flagged = [(p, o) for p, offs in s.failed.items() for o in offs]
    if flagged:
        bad = df.sparkSession.createDataFrame(flagged, f"{PART} int, {OFF} bigint")
        good = good.join(F.broadcast(bad), [PART, OFF], "left_anti")
    return good


def _moved_keys(df: DataFrame, s: SinkPlan) -> list[tuple[Any, ...]]:
    """The keys the range's records that do not pass now map to, where such a record has a
    row or a tombstone in the sink (step 1 removes it). Usually the key that row has; after
    a transform change, another: the older versions that row placed are that key's now."""
    keys = s.config.key
    failing = gate.in_ranges(df, s.ranges).join(
        _passing(df, s).select(PART, OFF), [PART, OFF], "left_anti"
    )
    for k in keys:
        failing = failing.where(F.col(k).isNotNull())
    at: dict[tuple[int, int], tuple[Any, ...]] = {
        (r[PART], r[OFF]): tuple(r[k] for k in keys)
        for r in failing.select(PART, OFF, *keys).collect()
    }
    if not at:
        return []
    by_part: dict[int, list[int]] = {}
    for p, o in at:
        by_part.setdefault(p, []).append(o)
    held = _ask(
        s, sql.SQL("_tm_partition, _tm_offset"), "_tm_offset = ANY(%s)", list(by_part.items())
    )
    return sorted({at[pos] for pos in held}, key=repr)


def _within(ranges: list[Range]) -> Column:
    cond = F.lit(False)
    for r in ranges:
        cond = cond | (
            (F.col(PART) == r.partition) & (F.col(OFF) >= r.start) & (F.col(OFF) < r.end)
        )
    return cond


def attach(
    spark: SparkSession,
    pipeline: Pipeline,
    mode: Reads,
    df: DataFrame,
    plans: dict[str, SinkPlan],
    log: Callable[[str], None],
) -> Fallback | None:
    """The backfill's records with the fallback versions of every sink appended (one Spark
    partition: the backfill's one task), or None when no key loses its row."""
    cached: list[DataFrame] = []
    lost = _lost_keys(spark, df, plans, cached, log)
    if not lost:
        return None
    reads, scope = _scopes(pipeline, lost, plans, mode.accept_pruned)
    for name in lost:
        log(
            f"sink {name}: reading the older versions of those keys from "
            + ", ".join(f"partition {r.partition} [{r.start}, {r.end})" for r in scope[name])
        )
    versions = records.rows(mode.source(spark, pipeline, list(reads.values())), pipeline)
    each = []
    for name, keys in lost.items():
        s = plans[name]
        outside = gate.in_ranges(versions, scope[name]).where(~_within(s.ranges))
        each.append(outside.join(keys, s.config.key, "left_semi").withColumn(FALLBACK, F.lit(name)))
    # lost holds a sink at least (checked above)
    found = functools.reduce(DataFrame.unionByName, each).persist(StorageLevel.MEMORY_AND_DISK)
    cached.append(found)
    failed = {
        name: gate.row_verdicts(
            pipeline, found.where(F.col(FALLBACK) == name), name, f"pipeline {pipeline.name}"
        )
        for name in lost
    }
    sizes = {r[FALLBACK]: r["count"] for r in found.groupBy(FALLBACK).count().collect()}
    log("fallback versions: " + ", ".join(f"sink {name} {sizes.get(name, 0):,}" for name in lost))
    out = df.withColumn(FALLBACK, F.lit(None).cast("string")).unionByName(found).coalesce(1)
    return Fallback(out, failed, cached, {name: plans[name].moved for name in lost})


def _lost_keys(
    spark: SparkSession,
    df: DataFrame,
    plans: dict[str, SinkPlan],
    cached: list[DataFrame],
    log: Callable[[str], None],
) -> dict[str, DataFrame]:
    """Per sink, the keys that lose their row in the range and get none back (steps 1-3
    above), cached (in ``cached``); sinks with none are left out."""
    lost: dict[str, DataFrame] = {}
    for name, s in plans.items():
        removed = _removed_keys(spark, df, s)
        if removed is None:
            continue
        s.moved = _moved_keys(df, s)
        if s.moved:
            removed = removed.unionByName(spark.createDataFrame(s.moved, removed.schema))
        passing = _passing(df, s).select(*s.config.key).distinct()
        keys = (
            removed.distinct()
            .join(passing, s.config.key, "left_anti")
            .persist(StorageLevel.MEMORY_AND_DISK)
        )
        n = keys.count()
        if n:
            lost[name] = keys
            cached.append(keys)
            log(f"sink {name}: {n:,} key(s) lose their row in the range and get none back")
        else:
            keys.unpersist()
    return lost


def _scopes(
    pipeline: Pipeline,
    lost: dict[str, DataFrame],
    plans: dict[str, SinkPlan],
    accept_pruned: bool = False,
) -> tuple[dict[int, Range], dict[str, list[Range]]]:
    """Where the older versions lie (step 4 above): one read per partition for every sink,
    and each sink's own ranges of it, below its checkpoints. A scope where the sink holds
    rows or tombstones the source no longer holds (a deleted segment) is refused without
    --accept-pruned: the version a key falls back to may not be its newest."""
    planner = sources.planner(pipeline)
    try:
        reads: dict[int, Range] = {}
        scope: dict[str, list[Range]] = {}
        for name in lost:
            s = plans[name]
            parts = (
                sorted(s.checkpoints)
                if s.config.version
                else sorted({r.partition for r in s.ranges})
            )
            mine = []
            for p in parts:
                first = planner.earliest(p)
                if first is None or first >= s.checkpoints.get(p, 0):
                    continue
                # Never below where the sink began: a version there was never delivered to
                # it, so it is no version the key can fall back to.
                first = max(first, s.began.get(p, first))
                if first >= s.checkpoints[p]:
                    continue
                mine.append(Range(p, first, s.checkpoints[p]))
                have = reads.get(p)
                reads[p] = Range(p, first, max(s.checkpoints[p], have.end if have else 0))
            scope[name] = mine
            if not accept_pruned and mine:
                _refuse_pruned(s, planner, mine)
    finally:
        planner.close()
    return reads, scope


def _refuse_pruned(s: SinkPlan, planner: sources.Planner, scope: list[Range]) -> None:
    held = {r.partition: planner.held(r.partition, r.start, r.end) for r in scope}
    with psycopg.connect(
        s.dsn, autocommit=True, connect_timeout=10, application_name="tidemark-backfill"
    ) as conn:
        found = pruned.in_sink(
            conn, s.config.table, {r.partition: (r.start, r.end) for r in scope}, held
        )
    if found:
        raise TidemarkError(
            f"sink {s.config.name}: keys fall back to older versions, but "
            f"{found.describe(s.config.table)}; retention pruned them) where those versions "
            f"lie. Backfill with --accept-pruned to fall back to what the source holds"
        )
