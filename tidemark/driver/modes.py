"""What a run delivers: the strategies of one protocol (tidemark/driver/run.py).

A run *delivers* the next range of each sink (mode ``run``); a *backfill* re-delivers a
committed range; a *redrive* (tidemark/driver/redrive.py) re-delivers the records of chosen dead
letters. They differ only in how they plan, where their records come from, what a failed
batch gate means, and which records each sink must place; the protocol (claim, write,
decide, finish, advance) is the same code for all three.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

from tidemark import sources
from tidemark.config import Pipeline, Sink, Source
from tidemark.core.claims import Claim
from tidemark.core.clock import Phases
from tidemark.core.errors import TidemarkError
from tidemark.core.ranges import Range
from tidemark.driver.report import UP_TO_DATE
from tidemark.ledger import state
from tidemark.ledger.state import Planner
from tidemark.protocol.taskspec import (
    Accounting,
    Backfilling,
    ByKey,
    ByRanges,
    Delivering,
    Placement,
    Span,
)

if TYPE_CHECKING:  # Spark: planning and pending() need none of it
    from collections.abc import Callable, Iterator

    import psycopg
    from pyspark.sql import DataFrame, SparkSession

    from tidemark.driver.fallback import Fallback
    from tidemark.driver.report import RunReport
    from tidemark.protocol.taskspec import TaskResult

    Log = Callable[[str], None]


class Closing(Protocol):
    def close(self) -> None: ...


class RunKind(StrEnum):
    """What kind of run a mode makes: the one way the driver asks (its value is the mode's
    name in the ledger, the report and the CLI)."""

    DELIVERY = "run"
    BACKFILL = "backfill"
    REBUILD = "rebuild"
    REDRIVE = "redrive"


class Mode(ABC):
    kind = RunKind.DELIVERY
    gate_policy: str | None = None  # None: the pipeline's on_gate_failure
    spreads = False  # may spread its records over tasks by key (Layout)
    falls_back = False  # removed rows fall back to older versions (fallback.py)
    # May run the pipeline's checks in its write job (docs/quality.md, "One pass"): only a
    # first delivery, whose batch is the run's own and whose writes replace nothing.
    checks_while_writing = False
    # Re-deliver what the source holds where it no longer holds some of what the sink does
    # (--accept-pruned; docs/design.md, "Re-delivery"): else such a re-delivery is refused.
    accept_pruned = False
    reads_ranges = True  # reads whole ranges: records the gaps it steps over (ledger/gaps.py)
    needs_prepare = False  # only with delivery: exactly_once (its change must ride the 2PC)
    # Over quality.max_quarantined the run and the pipeline halt (driver/ceiling.py): a
    # delivery only, not an operator's deliberate re-delivery.
    halts_over_ceiling = False
    idle = UP_TO_DATE  # the report's message when the run claims nothing

    @property
    def name(self) -> str:
        return self.kind.value

    @abstractmethod
    def planner(self, pipeline: Pipeline) -> tuple[Planner, Closing]:
        """(plan, something to close once the claim is made)."""

    def pending(self, ledger: psycopg.Connection, pipeline: Pipeline, sinks: list[str]) -> bool:
        """Whether a claim may find work (read-only); a mode that cannot tell cheaply says
        yes and lets the claim decide."""
        return True

    def source(self, spark: SparkSession, pipeline: Pipeline, read: list[Range]) -> DataFrame:
        return sources.dataframe(spark, pipeline, read)

    def arrow(
        self,
        pipeline: Pipeline,
        read: list[Range],
        phases: Phases,
        reader: Callable[[], Any] | None = None,
    ) -> Iterator[pa.RecordBatch]:
        """The records of ``read`` as the local runner reads them (tidemark/driver/runners.py):
        the batches :meth:`source` would hand Spark, read by ``read`` in order, each as the
        source hands it (the runner decodes and writes one while the next is read);
        ``phases`` gets the reader's time; ``reader``: the runner's source connection (None:
        one per read), asked for only by a mode that reads the source."""
        job = sources.read_job(pipeline, read)
        conn = reader() if reader is not None else None
        for r in read:
            yield from job.batches(r, phases, conn)

    def begin(self, pipeline: Pipeline) -> None:  # noqa: B027 - nothing by default
        """Before the run plans (a redrive makes its request)."""

    def announcement(self, claim: Claim, pipeline: Pipeline) -> str:
        """The line that says what the run claimed and reads."""
        read = claim.read_ranges()
        return (
            f"run {claim.run_id}: claimed {', '.join(claim.sinks)} "
            f"(epochs {', '.join(str(c.epoch) for c in claim.sinks.values())}); "
            f"reading {sum(r.size for r in read):,} records from {len(read)} partition(s)"
        )

    def conclude(  # noqa: B027 - nothing by default
        self, report: RunReport, results: list[TaskResult], log: Log
    ) -> None:
        """After the run, whatever it did: the mode's own part of the report."""

    def payloads(self, pipeline: Pipeline) -> Source | None:
        """Where a task reads again a payload its batch left out (None: it left none out)."""
        return sources.payload_source(pipeline)

    def quality(self, pipeline: Pipeline) -> Pipeline:
        return pipeline

    def placement(self, by: str | None, fallen: Fallback | None) -> Placement:
        """What its tasks place (TaskSpec.placement); ``by`` resolves a re-delivery's
        letters, ``fallen`` holds a backfill's fallback versions."""
        return Delivering()

    def layout(
        self, read: list[Range], sinks: list[Sink], *, dense: bool, parallelism: int, split_min: int
    ) -> Layout:
        """How the records of ``read`` reach the run's Spark write tasks (see :class:`Layout`).

        ``spread`` when a first delivery has fewer ranges than Spark has cores (or versions of
        a key may sit in several partitions) and is big enough to be worth a shuffle; else one
        task per range, or one task for them all when a sink orders versions by a column."""
        spans = [Span.of(r, dense) for r in read]
        versioned = len(read) > 1 and any(s.version for s in sinks)
        by = common_key(sinks)
        total = sum(r.size for r in read)
        if (
            self.spreads
            and dense
            and by
            and total >= split_min
            and (len(read) < parallelism or versioned)
        ):
            tasks = max(parallelism, len(read))
            return Layout(LayoutKind.SPREAD, tasks, pieces(read, tasks), ByKey(spread=spans), by=by)
        if versioned:
            return Layout(LayoutKind.TOGETHER, 1, read, ByRanges(reads=[spans]))
        return Layout(LayoutKind.RANGES, len(read), read, ByRanges(reads=[[s] for s in spans]))


class LayoutKind(StrEnum):
    """The ways a run's records reach its write tasks (:class:`Layout`)."""

    RANGES = "ranges"
    TOGETHER = "together"
    SPREAD = "spread"
    RECORDS = "records"


@dataclass(frozen=True)
class Layout:
    """How a run's records reach its Spark write tasks; each task is one participant per
    database, with its own gid.

    * ``ranges``: task i reads and writes range i (``reads[i]``).
    * ``together``: one task writes every range (``reads[0]``): versions of one key may sit in
      several partitions, and two tasks writing one key would deadlock. The second waits on
      the first's row lock, which its prepared transaction holds until the decision, and the
      decision waits for the second. In one task the staging merge keeps the newest version.
    * ``spread``: the source reads ``read`` (the ranges cut into sub-ranges, read side by
      side), then Spark hash-partitions the records on the sinks' common key columns ``by``
      into ``tasks`` tasks. Every version of a key lands in one task, so no two tasks write
      one key; each task accounts for what it saw of the spans, and the driver checks that
      together they saw every offset once (tidemark/protocol/coverage.py).
    * ``records``: a redrive's one task over hand-picked records, accounted per record.

    ``accounting`` is how the tasks account for their records (TaskSpec.accounting): by
    ranges for ``ranges`` and ``together``, by key for ``spread``, by records for
    ``records``.
    """

    kind: LayoutKind
    tasks: int
    read: list[Range]
    accounting: Accounting
    by: list[str] | None = None


def common_key(sinks: list[Sink]) -> list[str]:
    """The key columns every sink's key has (a row's value on them decides its task)."""
    if not sinks:
        return []
    rest = [set(s.key) for s in sinks[1:]]
    return [k for k in sinks[0].key if all(k in r for r in rest)]


def pieces(read: list[Range], n: int) -> list[Range]:
    """``read`` cut into about ``n`` sub-ranges of similar size (each range at least one)."""
    total = sum(r.size for r in read) or 1
    out = []
    for r in read:
        k = max(1, min(r.size, round(n * r.size / total)))
        step = -(-r.size // k) if r.size else 1
        out += [
            Range(r.partition, a, min(a + step, r.end))
            for a in range(r.start, max(r.end, r.start + 1), step)
        ]
    return out


class Delivery(Mode):
    """The next range of every sink: from its checkpoint (or the pipeline's ``start`` for a
    partition it has none in), at most ``limit`` records from the lowest checkpoint."""

    # A first delivery may spread: a re-delivery resolves the letters of its whole range in
    # each task, which tasks holding parts of one range would fight over.
    spreads = True
    checks_while_writing = True
    halts_over_ceiling = True

    def planner(self, pipeline: Pipeline, limit: int | None = None) -> tuple[Planner, Closing]:
        limit = limit or pipeline.limits.max_records_per_partition
        src = sources.planner(pipeline)

        def first(partition: int) -> int | None:
            return sources.first_offset(pipeline, src, partition)

        def plan(
            checkpoints: dict[str, dict[int, int]], began: dict[str, dict[int, int]]
        ) -> dict[str, list[Range]]:
            parts = src.partitions()
            starts: dict[int, int | None] = {}
            for cps in checkpoints.values():
                for p in parts:
                    if p not in cps and p not in starts:
                        starts[p] = first(p)
            out: dict[str, dict[int, int]] = {}
            for s, cps in checkpoints.items():
                out[s] = {}
                for p in parts:
                    start = cps[p] if p in cps else starts[p]
                    if start is not None:
                        out[s][p] = start
            # One read per partition, from the minimum over the sinks and at most `limit`
            # records long; each sink gets the part at or above its own checkpoint (a sink far
            # ahead of a lagging one gets nothing until the laggard catches up).
            lows = {
                p: min(los) for p in parts if (los := [cps[p] for cps in out.values() if p in cps])
            }
            ends = {p: max(end, lows[p]) for p, end in src.safe_ends(lows, limit).items()}
            return {
                s: [Range(p, start, max(start, ends[p])) for p, start in sorted(cps.items())]
                for s, cps in out.items()
            }

        return plan, src

    def pending(self, ledger: psycopg.Connection, pipeline: Pipeline, sinks: list[str]) -> bool:
        # The claim's own plan over the current checkpoints, without the claim: an idle
        # scheduled run ends here, before Spark or Great Expectations is loaded. One record
        # per partition is enough to tell, and keeps this cheap before a big claim (the
        # plan counts the settled rows of each range it measures).
        plan, closing = self.planner(pipeline, limit=1)
        try:
            return state.pending(ledger, pipeline.name, sinks, plan)
        finally:
            closing.close()


@dataclass
class Backfill(Mode):
    """Re-deliver committed ranges, at most one per partition, to sinks that already have
    them (tidemark/driver/windows.py turns what the user says into them). ``accept_pruned``:
    backfill although the source no longer holds records the sinks hold in the ranges (their
    rows, tombstones and letters stay as they are)."""

    ranges: list[Range]
    accept_pruned: bool = False
    kind = RunKind.BACKFILL
    gate_policy = "halt"  # re-delivery never quarantines a whole batch
    falls_back = True

    def __post_init__(self) -> None:
        parts = [r.partition for r in self.ranges]
        if not self.ranges or len(set(parts)) != len(parts):
            raise ValueError("a backfill takes one or more ranges, one per partition at most")
        for r in self.ranges:
            if r.start < 0 or r.end <= r.start:
                raise ValueError(f"range [{r.start}, {r.end}) of partition {r.partition} is empty")

    def describe(self) -> str:
        return ", ".join(f"partition {r.partition} [{r.start}, {r.end})" for r in self.ranges)

    def placement(self, by: str | None, fallen: Fallback | None) -> Placement:
        if fallen is None:
            return Backfilling(by=by)
        return Backfilling(
            by=by,
            fallback=True,
            fallback_failed=fallen.failed,
            moved={s: [list(k) for k in keys] for s, keys in fallen.moved.items()},
        )

    def layout(
        self, read: list[Range], sinks: list[Sink], *, dense: bool, parallelism: int, split_min: int
    ) -> Layout:
        # One task for every range: the fallback's versions of a key go to the backfill's one
        # write task (driver/fallback.py), wherever in the ranges the key's row was.
        return one_task(read, dense)

    def planner(self, pipeline: Pipeline) -> tuple[Planner, Closing]:
        def plan(
            checkpoints: dict[str, dict[int, int]], began: dict[str, dict[int, int]]
        ) -> dict[str, list[Range]]:
            for sink, cps in checkpoints.items():
                for r in self.ranges:
                    if r.partition not in cps or r.end > cps[r.partition]:
                        have = cps.get(r.partition, "none")
                        raise TidemarkError(
                            f"backfill of {pipeline.name} sink {sink} partition {r.partition} "
                            f"[{r.start}, {r.end}) goes past the checkpoint ({have}); only "
                            f"committed ranges can be backfilled - run the pipeline instead"
                        )

            # Each sink gets only the part at or above where it began: below, it never
            # received a record (docs/design.md, "Re-delivery"); a sink with none is left out.
            # With --accept-pruned, nor below the first record the source still holds: the
            # reader cannot read there, and what the sink holds there stays as it is.
            def floor(sink: str, r: Range) -> int | None:
                b = began.get(sink, {}).get(r.partition)
                if src is None:
                    return b
                if r.partition not in first:
                    first[r.partition] = src.earliest(r.partition)
                e = first[r.partition]
                return max(b or 0, r.end if e is None else e)

            return {
                s: [c for r in self.ranges if (c := r.above(floor(s, r))).size > 0]
                for s in checkpoints
            }

        src = sources.planner(pipeline) if self.accept_pruned else None
        first: dict[int, int | None] = {}
        return plan, src or NothingToClose()


def one_task(read: list[Range], dense: bool) -> Layout:
    """Every range in one write task (``together``; ``ranges`` when there is one)."""
    spans = [Span.of(r, dense) for r in read]
    kind = LayoutKind.TOGETHER if len(read) > 1 else LayoutKind.RANGES
    return Layout(kind, 1, read, ByRanges(reads=[spans]))


@dataclass
class Rebuild(Mode):
    """Re-deliver everything ``sink`` has received, from where it began (or the first record
    the source still holds, if later) to its checkpoint in each partition, into a new table made from the current
    pipeline, swapped in for the old one in the same two-phase commit
    (tidemark/protocol/rebuild.py). ``accept_pruned``: rebuild although the source no
    longer holds records whose rows the table has (they are left out of the new table)."""

    sink: str
    accept_pruned: bool = False
    kind = RunKind.REBUILD
    gate_policy = "halt"  # re-delivery never quarantines a whole batch
    # At least once commits in the write task: a retried task would swap a second time.
    needs_prepare = True

    def planner(self, pipeline: Pipeline) -> tuple[Planner, Closing]:
        src = sources.planner(pipeline)

        def plan(
            checkpoints: dict[str, dict[int, int]], began: dict[str, dict[int, int]]
        ) -> dict[str, list[Range]]:
            # Read under the sink's lease: the ranges end exactly where its checkpoints are,
            # and start where it began (or at the first record the source still holds), so
            # the new table holds what the old one should, no more and no less.
            out = []
            for p, end in sorted(checkpoints.get(self.sink, {}).items()):
                first = src.earliest(p)
                if first is not None:
                    r = Range(p, first, max(first, end)).above(began.get(self.sink, {}).get(p))
                    if r.size > 0:
                        out.append(r)
            return {self.sink: out}

        return plan, src

    def placement(self, by: str | None, fallen: Fallback | None) -> Placement:
        # A re-delivery into an empty table: nothing is removed, no key falls back; its
        # letters are resolved or quarantined again as a backfill's are.
        return Backfilling(by=by)

    def layout(
        self, read: list[Range], sinks: list[Sink], *, dense: bool, parallelism: int, split_min: int
    ) -> Layout:
        # One task: it alone creates the new table and swaps it in, in its own transaction.
        return one_task(read, dense)


class NothingToClose:
    def close(self) -> None:
        pass
