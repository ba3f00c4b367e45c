"""A task accounts for its records (docs/design.md, "Task accounting"): every offset it
should see, seen exactly once, before anything is prepared; a transform that drops or
multiplies rows is caught here. How depends on TaskSpec.accounting, chosen once per task by
:func:`accounts_for`:

* by ranges: the task reads whole spans and counts each offset (in a dense span none may be
  missing);
* by key: the task sees part of every span, so it can tell copies and strays only; the driver
  checks what is missing from every task's bitmaps together (tidemark/protocol/coverage.py);
* by records: a redrive's task must see each record of the letters it holds exactly once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from tidemark.core.columns import OFFSET
from tidemark.protocol import coverage
from tidemark.protocol.taskspec import Accounting, ByKey, ByRanges, ByRecords, Span

Held = dict[int, pa.Array]  # one sink's letters held by a redrive: partition -> offsets


class NotAccountable(Exception):
    """The task cannot account for its records at all (its result says why)."""


class Accounts(ABC):
    @abstractmethod
    def add(self, partition: int, batch: pa.RecordBatch) -> None:
        """The records of ``batch``, all of ``partition``, were seen."""

    @abstractmethod
    def problem(self, held: list[Held]) -> str | None:
        """Why the records seen are not the task's records exactly once (None: they are).
        ``held``: per sink, the letters a redrive holds."""

    def bitmaps(self) -> dict[int, str]:
        """The offsets seen, for the driver to check (TaskResult.seen); by key only."""
        return {}


class SpanAccounts(Accounts):
    """Each offset of ``spans`` counted."""

    spread = False  # sees only part of each span

    def __init__(self, spans: list[Span]) -> None:
        self.spans = {s.partition: s for s in spans}
        self.counts = {s.partition: np.zeros(s.size, np.int32) for s in spans}
        self.stray = 0

    def add(self, partition: int, batch: pa.RecordBatch) -> None:
        offs = batch.column(OFFSET).to_numpy(zero_copy_only=False)
        span = self.spans.get(partition)
        if span is None:
            self.stray += len(offs)
            return
        idx = offs - span.start
        inside = (idx >= 0) & (idx < span.size)
        self.stray += int((~inside).sum())
        idx = idx[inside]
        if not len(idx):
            return
        lo, hi = int(idx.min()), int(idx.max())
        counts = self.counts[partition]
        if hi - lo < 4 * len(idx):  # a source's batch is a run of offsets: count the window
            counts[lo : hi + 1] += np.bincount(idx - lo).astype(np.int32)
        else:  # a spread task's batch is scattered over the range
            np.add.at(counts, idx, 1)

    def problem(self, held: list[Held]) -> str | None:
        for p, s in self.spans.items():
            counts = self.counts[p]
            dropped = int((counts == 0).sum()) if s.dense and not self.spread else 0
            extra = int(counts[counts > 1].sum() - (counts > 1).sum())
            if dropped or extra or self.stray:
                bad = counts > 1 if self.spread else counts != 1
                first = int(np.argmax(bad)) + s.start if (dropped or extra) else None
                return (
                    f"partition {s.partition} [{s.start}, {s.end}): {dropped} record(s) "
                    f"missing, {extra} extra cop(ies), {self.stray} outside the range"
                    + (f" (first at offset {first})" if first is not None else "")
                )
        return None


class KeyAccounts(SpanAccounts):
    """Part of each span of ``spread`` counted: copies and strays here, gaps by the driver."""

    spread = True

    def bitmaps(self) -> dict[int, str]:
        return {p: coverage.encode(c > 0) for p, c in self.counts.items()}


class RecordAccounts(Accounts):
    """The offsets seen, per partition, against the letters held."""

    def __init__(self) -> None:
        self.seen: dict[int, list[npt.NDArray[np.int64]]] = {}

    def add(self, partition: int, batch: pa.RecordBatch) -> None:
        self.seen.setdefault(partition, []).append(
            batch.column(OFFSET).to_numpy(zero_copy_only=False)
        )

    def problem(self, held: list[Held]) -> str | None:
        twice: list[tuple[int, int]] = []
        missing: list[tuple[int, int]] = []
        none = np.array([], np.int64)
        for p in sorted(set(self.seen) | {p for h in held for p in h}):
            seen, counts = np.unique(np.concatenate(self.seen.get(p) or [none]), return_counts=True)
            want = np.concatenate(
                [h[p].to_numpy(zero_copy_only=False) for h in held if p in h] or [none]
            )
            twice += [(p, int(o)) for o in seen[counts > 1]]
            missing += [(p, int(o)) for o in np.setdiff1d(want, seen)]
        if twice or missing:
            return (
                f"{len(twice)} record(s) seen more than once, {len(missing)} missing "
                f"(e.g. partition/offset {(twice or missing)[0]})"
            )
        return None


def accounts_for(accounting: Accounting, task: int) -> Accounts:
    """Task ``task``'s accounts, as the driver chose them for the run."""
    match accounting:
        case ByRanges(reads=reads):
            if task >= len(reads):
                raise NotAccountable(
                    f"Spark task {task} beyond the {len(reads)} task(s) of the ranges read: "
                    f"the transform changed the partitioning (a union, join or repartition)"
                )
            return SpanAccounts(reads[task])
        case ByKey(spread=spread):
            return KeyAccounts(spread)
        case ByRecords():
            return RecordAccounts()
    raise AssertionError(f"unknown accounting {accounting!r}")
