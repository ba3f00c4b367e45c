"""Executor side of the commit protocol: one Spark task places its records in every sink
(docs/design.md, step 2). The Spark entry point (:func:`make_task`) and the task itself
(:func:`run_task`), which dispatches once on what the driver chose for the run:

* how it accounts for its records (TaskSpec.accounting; tidemark/engine/accounts.py): before
  it prepares, every record it should see seen exactly once, and per sink rows written +
  quarantined + superseded = records (docs/design.md, "Task accounting");
* what it places (TaskSpec.placement; tidemark/engine/placement.py): a delivery, or a
  re-delivery that replaces by position (backfill, redrive: tidemark/engine/redelivery.py).

Per sink, two transactions, each ending in ``PREPARE TRANSACTION``: on the sink database its
rows (tidemark/engine/sink_writer.py), on the ledger its dead letters
(tidemark/engine/dead_letters.py); tidemark/engine/sink_task.py says which records are the
sink's and which go to its dead letters. A sink whose connection or statements fail is
reported failed in the task's result and rolled back; the other sinks carry on. Ledger and
source errors fail the task, and Spark retries it with a new attempt, which first rolls back
what earlier ones left prepared (tidemark/engine/transactions.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pyarrow as pa
import pyarrow.compute as pc

from tidemark.core import faults
from tidemark.core.clock import Phases
from tidemark.core.columns import PARTITION
from tidemark.engine import transactions
from tidemark.engine.accounts import Accounts, NotAccountable, accounts_for
from tidemark.engine.placement import Placing, placing_for
from tidemark.engine.sink_task import SinkTask
from tidemark.protocol import gids
from tidemark.protocol.taskspec import FALLBACK, Prepared, TaskResult, TaskSpec

RESULT_SCHEMA = "task int, attempt int, result string"
Task = Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]


def make_task(spec: TaskSpec) -> Task:
    """The function Spark runs per partition (mapInArrow): returns one result row."""
    shipped = spec.model_dump_json()

    def run_in_spark(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        spec = TaskSpec.model_validate_json(shipped)  # validated at this end too
        ctx = TaskContext.get()
        assert ctx is not None  # inside a Spark task
        task, attempt = ctx.partitionId(), ctx.attemptNumber()
        result = run_task(spec, task, attempt, batches)
        yield pa.RecordBatch.from_pydict(
            {"task": [task], "attempt": [attempt], "result": [result.model_dump_json()]},
            schema=pa.schema(
                [("task", pa.int32()), ("attempt", pa.int32()), ("result", pa.string())]
            ),
        )

    return run_in_spark


def run_task(
    spec: TaskSpec, task: int, attempt: int, batches: Iterator[pa.RecordBatch]
) -> TaskResult:
    transactions.rollback_earlier_tries(spec, task, attempt)
    placing = placing_for(spec)

    def gid(stage: str) -> str:
        return str(gids.Gid(spec.prefix, spec.run_id, stage, task, attempt, spec.write))

    sinks = [SinkTask(spec, t, placing, gid) for t in spec.sinks]
    try:
        accounts = accounts_for(spec.accounting, task)
    except NotAccountable as exc:
        return TaskResult(task=task, attempt=attempt, records=0, error=str(exc))
    phases = Phases()
    try:
        for s in sinks:
            placing.open(s)
        seen = _place(placing, sinks, accounts, batches, phases)
        problem = _unaccounted(sinks, accounts)
        if problem is not None:  # nothing is prepared: the driver aborts the run
            _close(sinks)
            return TaskResult(task=task, attempt=attempt, records=seen, error=problem)
        # Only the run's first try fails on purpose (TIDEMARK_FAIL_AT).
        participants = _prepare(sinks, attempt if spec.write == 0 else None)
    except BaseException:
        _close(sinks)
        raise
    _close(sinks)  # a failed sink's letters roll back with it
    return TaskResult(
        task=task,
        attempt=attempt,
        records=seen,
        participants=participants,
        sinks={s.t.name: s.result() for s in sinks},
        phases=phases.rounded(),
        seen=accounts.bitmaps(),
    )


def _place(
    placing: Placing,
    sinks: list[SinkTask],
    accounts: Accounts,
    batches: Iterator[pa.RecordBatch],
    phases: Phases,
) -> int:
    """Every batch, each record accounted for and handed to the sinks whose it is; returns
    how many records the task read."""
    seen = 0
    # Upstream of this function Spark reads, decodes and transforms: the time spent waiting
    # for each next batch is theirs.
    for whole in phases.waiting("read_transform", batches):
        with phases("checks"):  # scope, accounting, row verdicts, dead letters
            if placing.fallback and whole.num_rows:
                whole = _set_aside_fallback(whole, sinks)
            for partition, batch in _by_partition(whole) if whole.num_rows else ():
                seen += batch.num_rows
                accounts.add(partition, batch)
                for s in sinks:
                    mine = s.scope(partition, batch)
                    if mine.num_rows:
                        s.place(partition, mine)
        for s in sinks:
            s.w.flush_full()
    return seen


def _unaccounted(sinks: list[SinkTask], accounts: Accounts) -> str | None:
    """Why the task cannot prepare: a record not seen exactly once, or a sink whose records
    are not all written, quarantined or superseded (None: it can). Finishes every sink."""
    problem = accounts.problem([s.dead.held_offsets for s in sinks])
    if problem is not None:
        return problem
    for s in sinks:
        s.finish()
        off = s.counts().unbalanced()
        if not s.w.failed and off is not None:
            problem = f"sink {s.t.name}: {off}"
    return problem


def _prepare(sinks: list[SinkTask], fail_at: int | None) -> list[Prepared]:
    participants: list[Prepared] = []
    for s in sinks:
        mine = s.prepare()
        if mine and not participants:
            faults.point("task_after_prepare", fail_at)
        participants += mine
    return participants


def _set_aside_fallback(batch: pa.RecordBatch, sinks: list[SinkTask]) -> pa.RecordBatch:
    """A backfill's fallback versions wait for the end of the range (Placing.finish); the
    rest is the range, accounted for as usual."""
    tag = batch.column(FALLBACK)
    extra = pc.is_valid(tag)
    if not pc.any(extra).as_py():
        return batch
    for s in sinks:
        mine = batch.filter(pc.equal(tag, s.t.name))
        if mine.num_rows:
            s.set_aside(mine)
    return batch.filter(pc.invert(extra))


def _by_partition(batch: pa.RecordBatch) -> Iterator[tuple[int, pa.RecordBatch]]:
    """A source's batches hold one partition; a redrive's may mix them."""
    parts = batch.column(PARTITION)
    lo, hi = pc.min_max(parts).values()
    if lo == hi:
        yield lo.as_py(), batch
        return
    for p in pc.unique(parts).to_pylist():
        yield p, batch.filter(pc.equal(parts, p))


def _close(sinks: list[SinkTask]) -> None:
    for s in sinks:
        s.close()
