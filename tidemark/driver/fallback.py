"""A backfill's fallback versions (docs/design.md, "Re-delivery": the sink ends as one delivery
with the current pipeline would leave it).

A backfill removes the row of a record that now fails. If that row was its key's, the older
versions of the key were placed only by it (superseded): without it they would be placed
nowhere, and the key would vanish where one delivery would keep its newest version that
passes. So, before the write:

1. probe: of the range's records each sink will quarantine (decode, transform, NULL key,
   row-level expectations), which have their own row in the sink (asked of the sink by a Spark
   task: tidemark/engine/probe.py). Usually none, and the backfill goes on as before;
2. read every version of their keys below the sink's checkpoint, in the range or outside it
   (the same partition; every partition for a sink that orders versions by a column), matched
   by source key or by sink key, and judge them by the current row-level expectations;
3. hand them to the backfill's one write task, tagged with their sink (``FALLBACK``). After it
   removes the rows, the task places each version no live letter or own row places: merged if
   it passes (the newest wins), else quarantined unless a newer row of its key places it
   (tidemark/engine/writer.py, ``_Sink.fall_back``). Same transactions, same decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pyspark import StorageLevel
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from tidemark import sources
from tidemark.config import Pipeline, Sink
from tidemark.driver import gate
from tidemark.engine import records
from tidemark.engine.probe import PROBE_SCHEMA, SINK, own_rows
from tidemark.ledger.state import Range
from tidemark.protocol.taskspec import FALLBACK, Failures

PART, OFF = "_tm_partition", "_tm_offset"


@dataclass
class SinkPlan:
    """One sink of the backfill: where it is, its range, its checkpoints, and the row-level
    failures the gate found in its range (the pipeline's and its own)."""

    config: Sink
    dsn: str
    ranges: list[Range]
    checkpoints: dict[int, int]
    failed: Failures = field(default_factory=dict)


@dataclass
class Fallback:
    df: DataFrame                          # the backfill's records, then the fallback versions
    failed: dict[str, Failures]            # sink -> row-level failures of its versions
    cached: list[DataFrame]

    def release(self) -> None:
        for d in self.cached:
            d.unpersist()


def _failing(df: DataFrame, s: SinkPlan) -> DataFrame:
    """The records of ``s``'s range it will quarantine: (partition, offset, source key, key)."""
    cols = [c for c in s.config.key + [s.config.version] if c]
    mine = gate.in_ranges(df, s.ranges)
    cond = F.col(records.ERR_CLASS).isNotNull()
    for c in cols:
        cond = cond | F.col(c).isNull()
    out = mine.where(cond)
    flagged = [(p, o) for p, offs in s.failed.items() for o in offs]
    if flagged:
        bad = df.sparkSession.createDataFrame(flagged, f"{PART} int, {OFF} bigint")
        out = out.unionByName(mine.join(F.broadcast(bad), [PART, OFF], "left_semi"))
    return out.select(PART, OFF, "_tm_key", *s.config.key).dropDuplicates([PART, OFF])


def attach(spark, pipeline: Pipeline, mode, df: DataFrame, plans: dict[str, SinkPlan],
           log) -> Fallback | None:
    """The backfill's records with the fallback versions of every sink appended (one Spark
    partition: the backfill's one task), or None when no row of a failing record is in any
    sink."""
    failing = {name: _failing(df, s) for name, s in plans.items()}
    probe = None
    for name, f in failing.items():
        one = f.select(F.lit(name).alias(SINK), PART, OFF)
        probe = one if probe is None else probe.unionByName(one)
    hits = probe.mapInArrow(own_rows({n: (s.dsn, s.config.table) for n, s in plans.items()}),
                            PROBE_SCHEMA).persist(StorageLevel.MEMORY_AND_DISK)
    counts = {r[SINK]: r["count"] for r in hits.groupBy(SINK).count().collect()}
    if not counts:
        hits.unpersist()
        return None
    planner = sources.planner(pipeline)
    try:
        reads: dict[int, Range] = {}
        scope: dict[str, list[Range]] = {}
        for name in counts:
            s = plans[name]
            parts = (sorted(s.checkpoints) if s.config.version
                     else sorted({r.partition for r in s.ranges}))
            mine = []
            for p in parts:
                first = planner.earliest(p)
                if first is None or first >= s.checkpoints.get(p, 0):
                    continue
                mine.append(Range(p, first, s.checkpoints[p]))
                have = reads.get(p)
                reads[p] = Range(p, first, max(s.checkpoints[p], have.end if have else 0))
            scope[name] = mine
    finally:
        planner.close()
    for name, n in counts.items():
        log(f"sink {name}: {n:,} row(s) of records that fail now go; reading the older "
            f"versions of their keys from "
            + ", ".join(f"partition {r.partition} [{r.start}, {r.end})" for r in scope[name]))
    versions = records.rows(mode.source(spark, pipeline, list(reads.values())), pipeline)
    found = None
    for name in counts:
        s = plans[name]
        removed = failing[name].join(hits.where(F.col(SINK) == name).drop(SINK), [PART, OFF],
                                     "left_semi")
        mine = gate.in_ranges(versions, scope[name])
        by_source = mine.join(removed.select("_tm_key").where(F.col("_tm_key").isNotNull())
                              .distinct(), "_tm_key", "left_semi")
        by_key = mine.join(removed.select(*s.config.key).distinct(), s.config.key, "left_semi")
        one = (by_source.unionByName(by_key).dropDuplicates([PART, OFF])
               .withColumn(FALLBACK, F.lit(name)))
        found = one if found is None else found.unionByName(one)
    found = found.persist(StorageLevel.MEMORY_AND_DISK)
    failed = {name: gate.row_verdicts(pipeline, found.where(F.col(FALLBACK) == name), name,
                                      f"pipeline {pipeline.name}") for name in counts}
    sizes = {r[FALLBACK]: r["count"] for r in found.groupBy(FALLBACK).count().collect()}
    log("fallback versions: " + ", ".join(f"sink {name} {sizes.get(name, 0):,}"
                                          for name in counts))
    out = (df.withColumn(FALLBACK, F.lit(None).cast("string")).unionByName(found)
           .coalesce(1))
    return Fallback(out, failed, [hits, found])
