"""What a run reports (tidemark/driver/run.py): per sink its state and counts, the records it
read, and where the time went."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from tidemark.core.sink_counts import SinkCounts
from tidemark.ledger.state import RunState
from tidemark.protocol.taskspec import TASK_PHASES, CopyFormat, SinkResult, TaskResult

UP_TO_DATE = "up to date: nothing to replay"


@dataclass
class SinkOutcome:
    sink: str
    state: str
    counts: SinkCounts = field(default_factory=SinkCounts)  # summed over the sink's tasks
    error: str | None = None
    copy_format: CopyFormat | None = None  # None: no rows went in
    csv_why: str = ""  # CSV: the first column binary COPY cannot carry
    schema_changes: list[str] = field(default_factory=list)  # what the run changed in its table
    classes: dict[str, int] = field(default_factory=dict)  # ``dead`` by error class
    previewed: bool = False  # a dry run prepared it, then rolled it back: the run would commit

    def take_counts(self, results: list[SinkResult]) -> None:
        """The sink's counts over its tasks' results."""
        self.counts = SinkCounts.total(r.counts for r in results)
        self.classes = {}
        for r in results:
            for cls, n in r.classes.items():
                self.classes[cls] = self.classes.get(cls, 0) + n
        self.take_copy_format(results)

    def take_copy_format(self, results: Iterable[SinkResult]) -> None:
        """The format of the first task that wrote rows: every task chooses the same one (the
        schema is the transform's, the columns the sink's)."""
        first = next((r for r in results if r.copy_format is not None), None)
        if first is not None:
            self.copy_format, self.csv_why = first.copy_format, first.csv_why

    def to_dict(self) -> dict[str, Any]:
        """The report's shape: its counts in line with the rest (the records read are the
        run's, not repeated per sink)."""
        out: dict[str, Any] = {"sink": self.sink, "state": self.state}
        out.update((k, v) for k, v in self.counts.to_json().items() if k != "records")
        out.update((f.name, getattr(self, f.name)) for f in fields(self) if f.name not in out)
        del out["counts"]
        return out


@dataclass
class RunReport:
    run_id: int | None
    pipeline: str
    mode: str
    records: int = 0
    sinks: dict[str, SinkOutcome] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    message: str = ""
    redrive: dict[str, Any] | None = None  # redriven / failed_again / skipped dead letters
    layout: str = ""  # how records reached the write tasks (modes.Layout.kind)
    quality: list[str] = field(default_factory=list)  # each write's quality strategy, in order
    phases: dict[str, float] = field(default_factory=dict)  # where the time went (seconds)
    dry_run: bool = False  # a preview: prepared, reported, rolled back

    @property
    def ok(self) -> bool:
        """Every sink committed; in a dry run, every sink prepared (the run would commit)."""
        if self.dry_run:
            return all(s.previewed for s in self.sinks.values())
        return all(s.state == RunState.COMMITTED for s in self.sinks.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "dry_run": self.dry_run,
            "pipeline": self.pipeline,
            "mode": self.mode,
            "records": self.records,
            "seconds": round(self.seconds, 2),
            "message": self.message,
            "skipped": self.skipped,
            "redrive": self.redrive,
            "layout": self.layout,
            "quality": self.quality,
            "phases": self.phases,
            "sinks": {k: v.to_dict() for k, v in self.sinks.items()},
        }

    def summary(self) -> str:
        if self.run_id is None:
            return f"{self.pipeline}: {self.message}"
        if self.dry_run:
            return preview_summary(self)
        lines = [
            f"run {self.run_id} ({self.pipeline}, {self.mode}): {self.records:,} records "
            f"read in {self.seconds:.1f}s"
        ]
        for s in self.sinks.values():
            tail = f" - {s.error}" if s.error else ""
            c = s.counts
            more = "".join(
                f", {n:,} {what}"
                for n, what in (
                    (c.superseded, "superseded by newer versions"),
                    (c.removed, "rows removed"),
                    (c.resolved, "dead letters resolved"),
                    (c.fallback, "older versions of their keys placed again"),
                    (c.tombstones, "tombstones"),
                )
                if n
            )
            lines.append(
                f"  sink {s.sink}: {s.state}, {c.rows:,} rows written, "
                f"{c.dead:,} quarantined{more}{tail}"
            )
            if s.schema_changes:
                lines.append(f"    table: {'; '.join(s.schema_changes)}")
        for sink, why in self.skipped.items():
            lines.append(f"  sink {sink}: skipped ({why})")
        if self.redrive is not None and self.run_id is not None:
            r = self.redrive
            lines.append(
                f"  dead letters: {r['redriven']:,} redriven, "
                f"{len(r['failed_again']):,} failed again (still quarantined, "
                f"attempts + 1), {len(r['skipped']):,} skipped"
            )
            if r.get("source_unknown"):
                lines.append(
                    f"  {len(r['source_unknown']):,} replayed with a NULL _tm_ts: "
                    f"the source no longer holds their records (source_note)"
                )
        return "\n".join(lines)


def preview_summary(r: RunReport) -> str:
    """A dry run's report: what the run would do to each sink, said as a preview."""
    lines = [
        f"dry run: nothing was committed - run {r.run_id} ({r.pipeline}, {r.mode}) read "
        f"{r.records:,} records in {r.seconds:.1f}s, prepared its writes and rolled them "
        f"all back; the {r.mode} would:"
    ]
    for s in r.sinks.values():
        if not s.previewed:
            lines.append(f"  sink {s.sink}: fail ({s.state}: {s.error or 'not prepared'})")
            continue
        lines.append(f"  sink {s.sink}: commit")
        lines += [f"    {line}" for line in _would(r.mode, s)]
        lines += [f"    table: {change}" for change in s.schema_changes]
    for sink, why in r.skipped.items():
        lines.append(f"  sink {sink}: skipped ({why})")
    if r.redrive is not None:
        d = r.redrive
        lines.append(
            f"  dead letters: {d['redriven']:,} would be redriven, "
            f"{len(d['failed_again']):,} would fail again (stay quarantined, attempts + 1), "
            f"{len(d['skipped']):,} skipped; none was changed"
        )
        lines.append(
            f"  redrive request {d['request']} stays: `tidemark dlq redrive {r.pipeline} "
            f"--request {d['request']}` runs it (or the redrive DAG with request "
            f"{d['request']}, or Redrive on the Dead letters page's preview)"
        )
    return "\n".join(lines)


def _would(mode: str, s: SinkOutcome) -> list[str]:
    """What a previewed sink would get, one count a line: superseded versions and
    tombstones where there are some, the rest always; dead letters by class."""
    classes = ", ".join(f"{c} {n:,}" for c, n in sorted(s.classes.items()))
    dead = (
        "records quarantined again"
        if mode == "redrive"
        else "records quarantined (new letters or live again)"
    )
    c = s.counts
    return [
        f"{what}: {n:,}{more}"
        for what, n, more, always in (
            ("rows written (inserted or replaced)", c.rows, "", True),
            ("rows removed (the range's, replaced by position)", c.removed, "", True),
            ("keys falling back (older versions placed again)", c.fallback, "", True),
            ("versions superseded by newer ones", c.superseded, "", False),
            ("keys deleted by tombstones", c.tombstones, "", False),
            (dead, c.dead, f" ({classes})" if classes else "", True),
            ("dead letters resolved", c.resolved, "", True),
        )
        if always or n
    ]


READ_PHASES = ("read", "decode")  # the reader's (tidemark/sources/read_clock.py)


def phases(
    clock: dict[str, float],
    results: list[TaskResult],
    sink: str | None = None,
    read: dict[str, float] | None = None,
) -> dict[str, float]:
    """Where the time went: the wall seconds of each of the run's phases (``clock``: phase ->
    the monotonic time it ended) and the task-seconds per task phase, summed over the run's
    tasks: the reader's (``read``: the source's batches, Arrow's JSON parse), the task's own
    (waiting on Spark's read, decode and transform; row checks) and its writes to ``sink``
    (every sink's if None). Tasks run side by side, so these add up to more than the wall
    time; the reader runs beside its write task, so its seconds are part of that wait."""
    # By time: a one-pass run's gate ends after its write.
    have = sorted(clock, key=lambda phase: clock[phase])
    out = {
        f"{b}_seconds": round(clock[b] - clock[a], 3) for a, b in zip(have, have[1:], strict=False)
    }
    total = {**dict.fromkeys(READ_PHASES, 0.0), **(read or {}), **dict.fromkeys(TASK_PHASES, 0.0)}
    for r in results:
        parts = [r.phases, *(m.phases for name, m in r.sinks.items() if sink in (None, name))]
        for task_phases in parts:
            for k, v in task_phases.items():
                total[k] = total.get(k, 0.0) + v
    out.update((f"task_{k}_seconds", round(v, 3)) for k, v in total.items())
    return out
