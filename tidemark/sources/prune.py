"""Pruning a ``postgres_log`` source (`tidemark source prune`; docs/operations.md, "Pruning
a postgres_log source"): delete the rows of each partition below the lowest offset anything
may still read. That is, per partition, the lowest of

* every sink's checkpoint, of every pipeline reading the table (in the pipelines folder, or
  only in the ledger): below it a sink has everything (a partition a sink has no checkpoint
  in yet keeps every row: that sink may start at the first);
* the lowest quarantined dead letter (a redrive of a letter from before ledger V007 reads
  its record again), the lowest open gap (a late record may land in it), the lowest range of
  a run not settled (recovery may re-deliver it);
* the first record of the last ``keep_days`` days: the rebuild and backfill horizon. A
  rebuild or backfill reaching below it then needs --accept-pruned.

It says, per partition, how many rows it deletes below which offset and what kept the rest.

May import: protocol, ledger, config, quality, core.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from tidemark.config import Pipeline, PostgresLogSource
from tidemark.core.db import connect, scalar
from tidemark.core.errors import BadInput, TidemarkError
from tidemark.ledger import source_needs
from tidemark.sources.postgres_log import PostgresLogPlanner

BATCH = 10_000  # rows per DELETE statement (each its own short transaction)


@dataclass
class Partition:
    partition: int
    floor: int | None  # delete below this; None: nothing (the reason says why)
    reason: str  # what holds the floor where it is
    kept_by: list[str] = field(default_factory=list)  # every constraint, lowest first
    rows: int = 0  # deleted (dry run: to delete)


@dataclass
class SourcePrune:
    pipeline: str
    table: str
    keep_days: int
    dry_run: bool
    readers: list[str]
    partitions: list[Partition] = field(default_factory=list)

    def lines(self) -> list[str]:
        verb = "would delete" if self.dry_run else "deleted"
        out = [
            f"source {self.table} of {self.pipeline} (read by {', '.join(self.readers)}); "
            f"records of the last {self.keep_days} days kept for rebuilds and backfills"
            + ("; dry run, nothing deleted" if self.dry_run else "")
        ]
        for p in self.partitions:
            if p.floor is None or p.rows == 0:
                out.append(f"  partition {p.partition}: nothing {verb.split()[-1]}: {p.reason}")
            else:
                out.append(
                    f"  partition {p.partition}: {verb} {p.rows:,} rows below offset "
                    f"{p.floor:,}; kept from there: {p.reason}"
                )
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "pipeline": self.pipeline,
            "table": self.table,
            "keep_days": self.keep_days,
            "dry_run": self.dry_run,
            "readers": self.readers,
            "partitions": [vars(p) for p in self.partitions],
            "rows": sum(p.rows for p in self.partitions),
        }


def prune_source(
    ledger_dsn: str,
    pipeline: Pipeline,
    pipelines: dict[str, Pipeline],
    keep_days: int,
    *,
    dry_run: bool = False,
    now: datetime | None = None,
) -> SourcePrune:
    src = pipeline.source
    if not isinstance(src, PostgresLogSource):
        raise BadInput(
            f"pipeline {pipeline.name}: its source is {src.type}; only a postgres_log source "
            f"is pruned by Tidemark (delete archive segments below every checkpoint yourself)"
        )
    dsn = pipeline.source_dsn()
    # Every pipeline reading the same table of the same database, by its file; and every
    # pipeline the ledger knows reading a table of that name (its file perhaps gone): its
    # checkpoints count too, so a shared name can only keep more.
    files = [p.name for p in pipelines.values() if _same_table(p, src.table, dsn)]
    with connect(ledger_dsn, autocommit=True, what="ledger") as conn:
        known = source_needs.reading(conn, src.table)
        readers = sorted({pipeline.name, *files, *known})
        needs = source_needs.needs(conn, readers)
    sinks = sorted(
        {(name, s.name) for name in readers if name in pipelines for s in pipelines[name].sinks}
        | set(needs.checkpoints)
    )
    cutoff = (now or datetime.now(UTC)) - timedelta(days=keep_days)
    out = SourcePrune(pipeline.name, src.table, keep_days, dry_run, readers)
    planner = PostgresLogPlanner(src, dsn)
    try:
        for part in planner.partitions():
            out.partitions.append(_partition(planner, part, sinks, needs, cutoff, dry_run))
    finally:
        planner.close()
    return out


def _same_table(p: Pipeline, table: str, dsn: str) -> bool:
    if not isinstance(p.source, PostgresLogSource) or p.source.table != table:
        return False
    try:
        return p.source_dsn() == dsn
    except TidemarkError:
        return True  # its database cannot be told: counted, which only keeps more


def _partition(
    planner: PostgresLogPlanner,
    part: int,
    sinks: list[tuple[str, str]],
    needs: source_needs.Needs,
    cutoff: datetime,
    dry_run: bool,
) -> Partition:
    holds: list[tuple[int, str]] = []
    for pipeline, sink in sinks:
        at = needs.checkpoints.get((pipeline, sink), {}).get(part)
        if at is None:
            return Partition(
                part, None, f"sink {pipeline}/{sink} has no checkpoint in it yet (it may start "
                f"at its first record)"
            )  # fmt: skip
        holds.append((at, f"sink {pipeline}/{sink} checkpoint {at:,}"))
    if part in needs.letters:
        lo, n = needs.letters[part]
        holds.append((lo, f"{n:,} quarantined dead letter(s) from offset {lo:,}"))
    if part in needs.gaps:
        holds.append((needs.gaps[part], f"an open gap from offset {needs.gaps[part]:,}"))
    if part in needs.runs:
        lo, run_id = needs.runs[part]
        holds.append((lo, f"run {run_id}, not settled, reads from offset {lo:,}"))
    recent = scalar(
        planner.conn.execute(
            planner._q("SELECT min({offset}) FROM {t} WHERE {partition} = %s AND ({ts} >= %s OR {ts} IS NULL)"),
            (part, cutoff),
        )
    )  # fmt: skip
    if recent is not None:
        holds.append((recent, f"records since {cutoff:%Y-%m-%d %H:%M} UTC from offset {recent:,}"))
    if not holds:
        return Partition(part, None, "no sink reads it")
    holds.sort()
    floor, why = holds[0]
    p = Partition(part, floor, why, [w for _, w in holds])
    if dry_run:
        p.rows = int(
            scalar(
                planner.conn.execute(
                    planner._q("SELECT count(*) FROM {t} WHERE {partition} = %s AND {offset} < %s"),
                    (part, floor),
                )
            )
        )
        return p
    while True:
        n = planner.conn.execute(
            planner._q(
                "DELETE FROM {t} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {t} "
                "WHERE {partition} = %s AND {offset} < %s LIMIT %s))"
            ),
            (part, floor, BATCH),
        ).rowcount
        p.rows += n
        if n < BATCH:
            return p
