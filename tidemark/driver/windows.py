"""What a backfill re-delivers, as the user says it: one partition's offsets, every
partition's (``--partition all``), or a time window mapped to each partition's offsets from the
source's record times. Only what every chosen sink has committed can be re-delivered, and
nothing below where a sink began (each sink gets the part at or above its start: the claim's
planner, driver/modes.py, cuts it per sink; :func:`below_start` says so beforehand).

May import: sources, ledger, config, core.
"""

from __future__ import annotations

from datetime import UTC, datetime

from tidemark import sources
from tidemark.config import Pipeline
from tidemark.core.db import connect
from tidemark.core.errors import BadInput
from tidemark.core.ranges import Range
from tidemark.ledger import checkpoints
from tidemark.ledger.migrations import require_current


def committed(ledger_dsn: str, pipeline: Pipeline, sinks: list[str] | None) -> dict[int, int]:
    """Per partition, the end of what every chosen sink has committed (a partition one of
    them has never received is left out: there is nothing to re-deliver to it)."""
    names = sinks or [s.name for s in pipeline.sinks]
    with connect(ledger_dsn, autocommit=True, what="ledger") as conn:
        require_current(conn)
        cps = checkpoints.positions(conn, pipeline.name, names)
    if any(n not in cps for n in names):
        missing = [n for n in names if n not in cps]
        raise BadInput(
            f"backfill of {pipeline.name}: sink(s) {', '.join(missing)} have received nothing "
            f"yet - run the pipeline instead"
        )
    parts = set.intersection(*(set(cps[n]) for n in names))
    return {p: min(cps[n][p] for n in names) for p in sorted(parts)}


def began(
    ledger_dsn: str, pipeline: Pipeline, sinks: list[str] | None
) -> dict[str, dict[int, int]]:
    """{sink: {partition: offset}}: where each chosen sink began, where the ledger knows it."""
    names = sinks or [s.name for s in pipeline.sinks]
    with connect(ledger_dsn, autocommit=True, what="ledger") as conn:
        require_current(conn)
        return checkpoints.starts(conn, pipeline.name, names)


def below_start(
    pipeline: Pipeline, ranges: list[Range], starts: dict[str, dict[int, int]], sinks: list[str]
) -> tuple[list[Range], list[str]]:
    """``ranges`` cut at the lowest start of the chosen ``sinks`` (nothing below it was
    delivered to any of them; a range wholly below it is left out), and a line per range
    that reaches below where a sink began, saying what that sink gets of it (the claim's
    planner cuts each sink's own range the same way)."""
    out, notes = [], []
    for r in ranges:
        floors = {s: starts.get(s, {}).get(r.partition) for s in sinks}
        known = [f for f in floors.values() if f is not None]
        cut = r.above(min(known) if len(known) == len(floors) else None)
        late = {s: f for s, f in floors.items() if f is not None and f > r.start}
        if late:
            each = "; ".join(
                f"sink {s} began at offset {f}: "
                + (f"it gets [{f}, {r.end})" if f < r.end else "it gets none of it")
                for s, f in late.items()
            )
            notes.append(
                f"backfill of {pipeline.name} partition {r.partition} [{r.start}, {r.end}): "
                f"{each} (nothing below where a sink began was delivered to it)"
            )
        if cut.size:
            out.append(cut)
    return out, notes


def by_offsets(
    pipeline: Pipeline, ends: dict[int, int], start: int | None, end: int | None
) -> list[Range]:
    """Every partition's [start, end) (default: from the first record the source still has to
    the committed end), cut at the committed end; partitions with nothing left are skipped."""
    plan = sources.planner(pipeline)
    try:
        out = []
        for p, done in ends.items():
            first = plan.earliest(p) if start is None else start
            last = done if end is None else min(end, done)
            if first is not None and last > first:
                out.append(Range(p, first, last))
        return out
    finally:
        plan.close()


def utc(value: datetime) -> datetime:
    """``value`` as a UTC instant: a naive time is UTC (docs/design.md, "Re-delivery")."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def by_time(
    pipeline: Pipeline, ends: dict[int, int], since: datetime, until: datetime
) -> list[Range]:
    """Per partition, the smallest offset range below the committed end holding every record
    whose time is in [since, until) (sources.Planner.window). A naive time is UTC, as the
    sources store theirs; the planners get UTC instants, never a time a session's TimeZone
    would read."""
    since, until = utc(since), utc(until)
    if until <= since:
        raise BadInput(f"--until ({until.isoformat()}) must be after --since ({since.isoformat()})")
    plan = sources.planner(pipeline)
    try:
        found = ((p, plan.window(p, since, until, done)) for p, done in ends.items())
        return [Range(p, w[0], w[1]) for p, w in found if w is not None]
    finally:
        plan.close()


def backfill_ranges(
    ledger_dsn: str,
    pipeline: Pipeline,
    partition: int | str | None,
    start: int | None,
    end: int | None,
    since: datetime | None,
    until: datetime | None,
    sinks: list[str] | None,
) -> tuple[list[Range], list[str]]:
    """The ranges a backfill's arguments mean (checked by the caller: one partition with
    offsets, ``"all"`` or None with offsets or a time window), and what to tell the user of
    them. No re-delivery reaches below where a sink began: a range below it is cut there (its
    records were never delivered), said in the notes; one partition's offsets wholly below it
    are refused."""
    timed = since is not None and until is not None
    if isinstance(partition, int) and not timed:
        assert start is not None and end is not None
        asked = [Range(partition, start, end)]
    else:
        ends = committed(ledger_dsn, pipeline, sinks)
        if isinstance(partition, int):
            ends = {p: e for p, e in ends.items() if p == partition}
        if timed:
            assert since is not None and until is not None
            asked = by_time(pipeline, ends, since, until)
        else:
            asked = by_offsets(pipeline, ends, start, end)
    names = sinks or [s.name for s in pipeline.sinks]
    ranges, notes = below_start(pipeline, asked, began(ledger_dsn, pipeline, names), names)
    if isinstance(partition, int) and not timed and not ranges:
        raise BadInput(f"{notes[0]}; nothing to backfill - give offsets at or above that")
    return ranges, notes
