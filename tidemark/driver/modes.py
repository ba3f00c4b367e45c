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

from tidemark import sources
from tidemark.config import Pipeline
from tidemark.core.errors import TidemarkError
from tidemark.ledger import state
from tidemark.ledger.state import Planner, Range
from tidemark.protocol.taskspec import Span


class Mode(ABC):
    name = "run"
    gate_policy: str | None = None   # None: the pipeline's on_gate_failure
    request: int | None = None       # redrive: the request whose letters it replays

    @abstractmethod
    def planner(self, pipeline: Pipeline) -> tuple[Planner, object]:
        """(plan, something to close once the claim is made)."""

    def pending(self, ledger, pipeline: Pipeline, sinks: list[str]) -> bool:
        """Whether a claim may find work (read-only); a mode that cannot tell cheaply says
        yes and lets the claim decide."""
        return True

    def source(self, spark, pipeline: Pipeline, read: list[Range]):
        return sources.dataframe(spark, pipeline, read)

    def quality(self, pipeline: Pipeline) -> Pipeline:
        return pipeline

    def reads(self, read: list[Range], dense: bool, together: bool) -> list[list[Span]] | None:
        """What task i reads, for its accounting: one Spark task per range read, or one task
        for them all (``together``, see :meth:`tidemark.driver.run.Run._together`)."""
        spans = [Span(partition=r.partition, start=r.start, end=r.end, dense=dense)
                 for r in read]
        return [spans] if together else [[s] for s in spans]

    def tasks(self, read: list[Range], together: bool) -> int:
        return 1 if together else len(read)


class Delivery(Mode):
    """The next range of every sink: from its checkpoint (or the pipeline's ``start`` for a
    partition it has none in), at most ``limit`` records from the lowest checkpoint."""

    def planner(self, pipeline: Pipeline):
        limit = pipeline.limits.max_records_per_partition
        src = sources.planner(pipeline)

        def first(partition: int) -> int | None:
            if pipeline.start == "latest":
                return src.latest(partition)
            return src.earliest(partition)

        def plan(checkpoints: dict[str, dict[int, int]]) -> dict[str, list[Range]]:
            parts = src.partitions()
            starts: dict[int, int | None] = {}
            for cps in checkpoints.values():
                for p in parts:
                    if p not in cps and p not in starts:
                        starts[p] = first(p)
            out: dict[str, dict[int, int]] = {
                s: {p: cps[p] if p in cps else starts[p] for p in parts
                    if p in cps or starts[p] is not None}
                for s, cps in checkpoints.items()}
            # One read per partition, from the minimum over the sinks and at most `limit`
            # records long; each sink gets the part at or above its own checkpoint (a sink far
            # ahead of a lagging one gets nothing until the laggard catches up).
            ends = {}
            for p in parts:
                los = [cps[p] for cps in out.values() if p in cps]
                if los:
                    lo = min(los)
                    ends[p] = max(src.safe_end(p, lo, limit), lo)
            return {s: [Range(p, start, max(start, ends[p])) for p, start in sorted(cps.items())]
                    for s, cps in out.items()}

        return plan, src

    def pending(self, ledger, pipeline: Pipeline, sinks: list[str]) -> bool:
        # The claim's own plan over the current checkpoints, without the claim: an idle
        # scheduled run ends here, before Spark or Great Expectations is loaded.
        plan, closing = self.planner(pipeline)
        try:
            return state.pending(ledger, pipeline.name, sinks, plan)
        finally:
            closing.close()


@dataclass
class Backfill(Mode):
    """Re-deliver ``[start, end)`` of one partition to sinks that already have it."""

    partition: int
    start: int
    end: int
    name = "backfill"
    gate_policy = "halt"  # re-delivery never quarantines a whole batch

    def planner(self, pipeline: Pipeline):
        def plan(checkpoints: dict[str, dict[int, int]]) -> dict[str, list[Range]]:
            for sink, cps in checkpoints.items():
                if self.partition not in cps or self.end > cps[self.partition]:
                    have = cps.get(self.partition, "none")
                    raise TidemarkError(
                        f"backfill of {pipeline.name} sink {sink} partition {self.partition} "
                        f"[{self.start}, {self.end}) goes past the checkpoint ({have}); only "
                        f"committed ranges can be backfilled - run the pipeline instead")
            return {s: [Range(self.partition, self.start, self.end)] for s in checkpoints}

        return plan, NothingToClose()


class NothingToClose:
    def close(self) -> None:
        pass
