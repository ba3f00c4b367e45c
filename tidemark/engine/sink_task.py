"""One sink's part of a Spark task: which of the task's records are that sink's (as the
task's placement says), their verdicts, and the two transactions that take them: the sink's
rows (tidemark/engine/sink_writer.py) and its dead letters (tidemark/engine/dead_letters.py).

Every verdict (decode, transform, row-level expectation, batch gate, NULL key, sink write)
binds only the sinks whose range holds the record (docs/design.md, "Which sinks a verdict
applies to"), so each sink gets its own dead letters and nothing is shared between sinks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from tidemark.core.clock import Phases
from tidemark.core.columns import OFFSET, PARTITION
from tidemark.core.sink_counts import SinkCounts
from tidemark.engine.dead_letters import TOP_REASONS, DeadLetters, Record
from tidemark.engine.placement import Placing
from tidemark.engine.records import ERR_CLASS, ERR_REASON, TOMBSTONE, TOMBSTONE_KEPT
from tidemark.engine.sink_writer import SinkWriter
from tidemark.protocol import gids
from tidemark.protocol.taskspec import CHECK, Prepared, SinkResult, SinkTarget, TaskSpec
from tidemark.quality import reasons


class SinkTask:
    """One sink's part of one task; ``gid`` names the task's transaction of a stage."""

    def __init__(
        self, spec: TaskSpec, target: SinkTarget, placing: Placing, gid: Callable[[str], str]
    ) -> None:
        self.spec, self.t, self.placing = spec, target, placing
        self.dead = DeadLetters(spec, target.name, gid(gids.dlq_stage(target.name)), Phases())
        # A rebuild's new table starts empty: its rows may go straight in, as a first
        # delivery's do, until a key repeats.
        direct = placing.direct or target.rebuild is not None
        rows_gid = gid(gids.sink_stage(target.name))
        self.w = SinkWriter(
            spec,
            target,
            rows_gid,
            self.dead,
            direct=direct,
            removal=placing.removal(target, self.dead, rows_gid),
        )
        self.fallback: list[pa.RecordBatch] = []  # backfill: versions to fall back on
        self.records = 0  # of the sink's range, seen
        self.fell_back = 0  # backfill: fallback versions examined (Placing.finish)

    def scope(self, partition: int, batch: pa.RecordBatch) -> pa.RecordBatch:
        """The records of ``batch`` this sink must place."""
        return self.placing.scope(self, partition, batch)

    def place(self, partition: int, batch: pa.RecordBatch) -> None:
        self.records += batch.num_rows
        why = self.spec.quarantine or self.t.quarantine
        bad = pc.is_valid(batch.column(ERR_CLASS))
        if pc.any(bad).as_py():  # decode and transform failures, and tombstones
            rows = batch.filter(bad).to_pylist()
            batch = batch.filter(pc.invert(bad))
            tombs = [r for r in rows if r[ERR_CLASS] == TOMBSTONE]
            if tombs:
                rows = [r for r in rows if r[ERR_CLASS] != TOMBSTONE] + self._tombstones(tombs, why)
            self.dead.add(rows)
        if why is not None:  # a failed batch gate under quarantine_batch: this sink's range
            self.dead.add(batch.to_pylist(), "dq_gate", why)
            return
        if self.spec.checks and batch.num_rows:  # the write job ran the row checks
            batch = self._checked(batch)
        for failures in (self.spec.failed.get(partition), self.t.failed.get(partition)):
            if failures and batch.num_rows:
                hit = _offsets_in(batch, list(failures))
                if pc.any(hit).as_py():
                    rows = batch.filter(hit).to_pylist()
                    for r in rows:
                        r[ERR_CLASS], r[ERR_REASON] = "validation", failures[r[OFFSET]]
                    self.dead.add(rows)
                    batch = batch.filter(pc.invert(hit))
        for col in (c for c in self.t.key + [self.t.version] if c):
            nulls = pc.is_null(batch.column(col))
            if pc.any(nulls).as_py():  # a NULL key would vanish in DISTINCT ON
                self.dead.add(batch.filter(nulls).to_pylist(), "transform", self._null_reason(col))
                batch = batch.filter(pc.invert(nulls))
        self.w.add(batch)

    def _tombstones(self, tombs: list[Record], why: str | None) -> list[Record]:
        """Hands the writer the tombstones that delete their key; returns those to quarantine:
        every one where the sink keeps tombstones, or its batch gate quarantined the range,
        and one whose key the transform could not derive (from ``_tm_key``)."""
        deletes: list[Record] = []
        kept: list[Record] = []
        for r in tombs:
            null = next((k for k in self.t.key if r[k] is None), None)
            if self.t.tombstones != "delete":
                r[ERR_CLASS], r[ERR_REASON] = "decode", TOMBSTONE_KEPT
            elif why is not None:
                r[ERR_CLASS], r[ERR_REASON] = "dq_gate", why
            elif null is not None:
                r[ERR_CLASS], r[ERR_REASON] = (
                    "transform",
                    (
                        f"tombstone: key column {null} is NULL; to delete, the transform must "
                        f"derive the sink key from _tm_key (a tombstone has no payload)"
                    ),
                )
            else:
                deletes.append(r)
                continue
            kept.append(r)
        self.w.add_tombstones(deletes)
        return kept

    def _checked(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """Quarantines the records a row check failed (column CHECK: the first one's index in
        TaskSpec.checks), with the reason the driver would give them; returns the rest."""
        hit = pc.is_valid(batch.column(CHECK))
        if not pc.any(hit).as_py():
            return batch
        rows = batch.filter(hit).to_pylist()
        for r in rows:
            check = self.spec.checks[r[CHECK]]
            seen = {c: r[c] for c in (PARTITION, OFFSET, *reasons.columns_of(check.kwargs))}
            r[ERR_CLASS], r[ERR_REASON] = (
                "validation",
                reasons.reason(check.type, check.kwargs, seen),
            )
        self.dead.add(rows)
        return batch.filter(pc.invert(hit))

    def _null_reason(self, col: str) -> str:
        return f"{'key' if col in self.t.key else 'version'} column {col} is NULL"

    def set_aside(self, fallback: pa.RecordBatch) -> None:
        """A backfill's fallback versions for this sink, placed at :meth:`finish`."""
        self.fallback.append(fallback)

    def finish(self) -> None:
        """After the last batch: flush; a re-delivery then falls back and resolves."""
        self.fell_back = self.placing.finish(self, self.fallback)
        self.fallback = []

    def counts(self) -> SinkCounts:
        w = self.w
        return SinkCounts(
            records=self.records,
            rows=w.rows,
            dead=self.dead.rows,
            superseded=w.superseded,
            removed=w.removed,
            resolved=self.dead.resolved,
            fallback=self.fell_back,
            tombstones=w.tombstones,
        )

    def result(self) -> SinkResult:
        extra: dict[str, Any] = self.placing.extra(self)
        return SinkResult(
            counts=self.counts(),
            reasons=dict(self.dead.reasons.most_common(TOP_REASONS)),
            classes=dict(self.dead.classes),
            error=self.w.failed,
            copy_format=self.w.copy_format,
            csv_why=self.w.csv_why,
            phases=self.w.phases.rounded(),
            **extra,
        )

    def prepare(self) -> list[Prepared]:
        """PREPARE the sink's rows, then (unless they failed) its dead letters: a failed
        sink's letters roll back with it."""
        return [
            p for p in (self.w.prepare(), self.dead.prepare() if not self.w.failed else None) if p
        ]

    def close(self) -> None:
        self.w.close()
        self.dead.close()


def _offsets_in(batch: pa.RecordBatch, offsets: list[int]) -> pa.Array:
    return pc.is_in(batch.column(OFFSET), value_set=pa.array(offsets, pa.int64()))
