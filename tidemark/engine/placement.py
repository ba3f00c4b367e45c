"""What a task places (TaskSpec.placement), chosen once per task by :func:`placing_for` and
asked the same few questions for each of its sinks:

* :class:`Deliver`: the records of each sink's range, which it has not had: rows may go by
  COPY straight into the target;
* :class:`Backfill`: each sink's range again (docs/design.md, "Re-delivery"): rows at its
  positions are replaced, keys that lose their row fall back to older versions, and the
  letters of what is placed now are resolved (tidemark/engine/redelivery.py);
* :class:`Redrive`: the records of the dead letters the task holds for each sink; each letter
  is resolved or quarantined again in the transaction of the sink's letters.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from tidemark.core.columns import OFFSET
from tidemark.engine.redelivery import (
    Redelivery,
    Removal,
    held_positions,
    range_positions,
    show,
)
from tidemark.protocol.taskspec import Backfilling, Delivering, Redriving, TaskSpec

if TYPE_CHECKING:
    from tidemark.engine.dead_letters import DeadLetters
    from tidemark.engine.sink_writer import SinkWriter
    from tidemark.protocol.taskspec import SinkTarget


class SinkTask(Protocol):
    """What a placement asks of a sink's task (tidemark/engine/sink_task.py, which holds its
    placement: this module does not import it)."""

    t: SinkTarget
    w: SinkWriter
    dead: DeadLetters


class Placing(ABC):
    direct = False  # rows may go by COPY straight into the target
    fallback = False  # a backfill's fallback versions follow the range (column FALLBACK)

    def removal(self, t: SinkTarget, dead: DeadLetters, gid: str) -> Removal | None:
        """What the sink's writer removes as its transaction ``gid`` begins (re-delivery's
        step 1); None: nothing."""
        return None

    def open(self, s: SinkTask) -> None:  # noqa: B027 - most placements need nothing first
        """Before the task's first batch."""

    @abstractmethod
    def scope(self, s: SinkTask, partition: int, batch: pa.RecordBatch) -> pa.RecordBatch:
        """The records of ``batch`` (all of ``partition``) that sink ``s`` must place."""

    def finish(self, s: SinkTask, fallback: list[pa.RecordBatch]) -> int:
        """After the task's last batch: everything placed, nothing prepared yet. Returns how
        many fallback versions it examined (SinkCounts.fallback)."""
        s.w.flush()
        return 0

    def extra(self, s: SinkTask) -> dict[str, Any]:
        """Its own part of the sink's result (SinkResult)."""
        return {}


def in_range(s: SinkTask, partition: int, batch: pa.RecordBatch) -> pa.RecordBatch:
    span = s.t.ranges.get(partition)
    if span is None:
        return batch.slice(0, 0)
    off = batch.column(OFFSET)
    lo, hi = (v.as_py() for v in pc.min_max(off).values())
    if lo is not None and span[0] <= lo and hi < span[1]:
        return batch  # the usual case, all of it: no copy of every column
    return batch.filter(pc.and_(pc.greater_equal(off, span[0]), pc.less(off, span[1])))


class Deliver(Placing):
    direct = True

    def scope(self, s: SinkTask, partition: int, batch: pa.RecordBatch) -> pa.RecordBatch:
        return in_range(s, partition, batch)


class Backfill(Placing):
    def __init__(self, how: Backfilling, run_id: int) -> None:
        self.how, self.run_id = how, run_id
        self.by = how.by or "tidemark"
        self.fallback = how.fallback

    def removal(self, t: SinkTarget, dead: DeadLetters, gid: str) -> Removal:
        positions = range_positions(t)
        return Removal(t, gid, lambda: positions)

    def scope(self, s: SinkTask, partition: int, batch: pa.RecordBatch) -> pa.RecordBatch:
        return in_range(s, partition, batch)

    def finish(self, s: SinkTask, fallback: list[pa.RecordBatch]) -> int:
        """Steps 4 and 5: fall back, then resolve the letters of what is placed now."""
        redelivery = Redelivery(
            s.t,
            s.w,
            s.dead,
            moved=self.how.moved.get(s.t.name),
            fallback_failed=self.how.fallback_failed.get(s.t.name),
        )
        lost = redelivery.settle()
        if lost is None:
            return 0
        placed = redelivery.fall_back(lost, fallback)
        if s.w.failed:
            return redelivery.fallback
        for part, (a, b) in s.t.ranges.items():
            s.dead.resolve(part, a, b, self.by, f"delivered again by backfill run {self.run_id}")
        for part, offs in placed.items():
            s.dead.resolve_offsets(
                part, offs, self.by, f"fallen back to by backfill run {self.run_id}"
            )
        return redelivery.fallback


class Redrive(Placing):
    def __init__(self, how: Redriving, run_id: int) -> None:
        self.how, self.run_id = how, run_id
        self.by = how.by or "tidemark"

    def removal(self, t: SinkTarget, dead: DeadLetters, gid: str) -> Removal:
        return Removal(t, gid, lambda: held_positions(dead))  # the letters open() holds

    def open(self, s: SinkTask) -> None:
        """Locks the sink's letters of the request (a concurrent discard waits)."""
        s.dead.hold(self.how.request)

    def scope(self, s: SinkTask, partition: int, batch: pa.RecordBatch) -> pa.RecordBatch:
        offs = s.dead.held_offsets.get(partition)
        if offs is None:
            return batch.slice(0, 0)
        return batch.filter(pc.is_in(batch.column(OFFSET), value_set=offs))

    def finish(self, s: SinkTask, fallback: list[pa.RecordBatch]) -> int:
        lost = Redelivery(s.t, s.w, s.dead).settle()
        if lost is None:
            return 0
        if lost:
            s.w.fail(
                RuntimeError(
                    f"key ({', '.join(s.t.key)})={show(next(iter(lost)))} had its row at "
                    f"the position of a live dead letter (placed twice); backfill that range "
                    f"instead of redriving it"
                )
            )
            return 0
        s.dead.resolve_held(self.by, f"redriven by run {self.run_id}")
        return 0

    def extra(self, s: SinkTask) -> dict[str, Any]:
        failed = set(s.dead.failed_again)
        return {
            "redriven": len(s.dead.held) - len(failed),
            "failed_again": sorted(failed),
            "skipped": s.dead.skipped,
        }


def placing_for(spec: TaskSpec) -> Placing:
    match spec.placement:
        case Delivering():
            return Deliver()
        case Backfilling() as how:
            return Backfill(how, spec.run_id)
        case Redriving() as how:
            return Redrive(how, spec.run_id)
    raise AssertionError(f"unknown placement {spec.placement!r}")
