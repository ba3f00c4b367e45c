"""Records that appeared below a checkpoint, inside a gap a sink stepped over (docs/design.md,
invariant 2; docs/operations.md, "A late record below the checkpoint").

A file archive's writer that broke its contract, or a replayed upload, can put a segment
inside offsets a run already read as a gap: its records lie below the checkpoint and were
placed nowhere. The ledger keeps the gaps each sink stepped over (tidemark/ledger/gaps.py);
:func:`find` asks the source whether it holds anything in them now (the segments' listing,
and the footer of a segment inside a gap only) and says which backfill places it.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

from tidemark import sources
from tidemark.config import Pipeline
from tidemark.core.errors import TidemarkError
from tidemark.core.ranges import Range
from tidemark.ledger import gaps


def outside(r: Range, held: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The [lo, hi) spans of ``r`` not in ``held`` (sorted, disjoint spans inside ``r``)."""
    out, at = [], r.start
    for lo, hi in held:
        if lo > at:
            out.append((at, lo))
        at = max(at, hi)
    if at < r.end:
        out.append((at, r.end))
    return out


@dataclass(frozen=True)
class Late:
    gap: gaps.Gap
    held: list[tuple[int, int]]  # what the source holds in the gap now
    records: int  # how many records (read from the spans held)

    @property
    def command(self) -> str:
        g = self.gap
        return (
            f"tidemark backfill {g.pipeline} --partition {g.partition} --from {g.lo} "
            f"--to {g.hi} --sink {g.sink}"
        )

    def line(self) -> str:
        g = self.gap
        return (
            f"sink {g.sink} partition {g.partition}: {self.records:,} record(s) at offsets "
            f"[{g.lo}, {g.hi}) appeared below the checkpoint, in a gap the sink stepped over; "
            f"place them: {self.command}"
        )


def find(
    ledger: psycopg.Connection, pipelines: dict[str, Pipeline], name: str | None = None
) -> tuple[list[Late], list[str]]:
    """The late records of the open gaps (of pipeline ``name``), and one line per pipeline
    whose source could not be asked (its gaps are not known to be empty)."""
    by_pipeline: dict[str, list[gaps.Gap]] = {}
    for g in gaps.open_gaps(ledger, name):
        by_pipeline.setdefault(g.pipeline, []).append(g)
    found: list[Late] = []
    errors: list[str] = []
    for pname, open_ in by_pipeline.items():
        p = pipelines.get(pname)
        if p is None:
            continue  # retired or renamed: no source to ask
        try:
            plan = sources.planner(p)
            try:
                for g in open_:
                    held = plan.held(g.partition, g.lo, g.hi)
                    if held:
                        found.append(Late(g, held, _count(p, g.partition, held)))
            finally:
                plan.close()
        except (TidemarkError, psycopg.Error) as exc:
            errors.append(f"pipeline {pname}: cannot look for late records: {exc}")
    return found, errors


def _count(p: Pipeline, partition: int, held: list[tuple[int, int]]) -> int:
    src = sources.reader_source(p)
    return sum(
        b.num_rows for lo, hi in held for b in sources.read_range(src, Range(partition, lo, hi))
    )
