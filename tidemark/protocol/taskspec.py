"""What the driver hands a Spark task and what the task returns: typed, validated at both ends.

The driver builds one :class:`TaskSpec` per run and Spark ships it to every task as JSON; the
task validates it, writes, and returns one :class:`TaskResult`, which the driver validates
before it counts anything or chooses a gid (docs/design.md, "Task accounting").

Two choices of a run reach its tasks as discriminated unions, each decided once by the driver
and dispatched on once by the task (tidemark/engine/writer.py):

* :data:`Accounting`, how a task accounts for its records: :class:`ByRanges` (task i reads
  whole spans), :class:`ByKey` (records spread over the tasks by key) or :class:`ByRecords`
  (a redrive's hand-picked records);
* :data:`Placement`, what it places: :class:`Delivering` (records the sinks have not had),
  :class:`Backfilling` or :class:`Redriving` (re-delivery, docs/design.md).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tidemark.config import Source
from tidemark.core.participants import Target
from tidemark.core.ranges import Range
from tidemark.core.sink_counts import SinkCounts

# Where a task's time goes (seconds, TaskResult.phases and SinkResult.phases): waiting for
# Spark to read, decode and transform the next batch; scoping, accounting and row verdicts;
# then per sink encoding, COPY, the staging merge, writing the dead letters, and the marker row
# with PREPARE.
TASK_PHASES = ("read_transform", "checks", "encode", "copy", "merge", "quarantine", "prepare")
Failures = dict[int, dict[int, str]]  # partition -> offset -> reason
# A backfill's records outside its batch: versions of a key whose row the backfill removes,
# tagged with the sink they fall back for (tidemark/driver/fallback.py).
FALLBACK = "_tm_fallback"
# The index (in TaskSpec.checks) of a record's first failing row check, when the write job
# itself runs the row checks (docs/quality.md, "One pass"); None: it passes them all.
CHECK = "_tm_check"


class CopyFormat(StrEnum):
    """How a sink's rows go in (tidemark/engine/sink_writer.py): binary COPY when every
    column's type carries over exactly, else CSV, which lets PostgreSQL parse and cast."""

    BINARY = "binary"
    CSV = "csv"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Span(_Model):
    """A :class:`~tidemark.core.ranges.Range` as a task reads it: its offsets ``[start, end)``
    of one partition, sent as JSON, with what the task can check there. ``dense``: the source
    holds every offset of it (postgres_log); a compacted archive may have gaps, so only
    duplicates and strays can be told there, not a dropped record."""

    partition: int
    start: int
    end: int
    dense: bool = True

    @classmethod
    def of(cls, r: Range, dense: bool) -> Span:
        return cls(partition=r.partition, start=r.start, end=r.end, dense=dense)

    @property
    def size(self) -> int:
        return self.end - self.start


class RowCheck(_Model):
    """A row-level expectation as a task writes its reason (tidemark/quality/reasons.py)."""

    type: str
    kwargs: dict[str, str | list[str]]  # only those naming its columns


class Rebuilding(_Model):
    """A rebuild's sink (tidemark/protocol/rebuild.py): the task creates the target table
    (SinkTarget.table, a new one) with ``columns`` and the sink's key, writes into it, and
    before PREPARE renames ``live`` to ``retired`` and the new table to ``live``."""

    live: str
    retired: str  # the dated name the live table is kept under
    columns: list[tuple[str, str]]  # the transform's output: name, PostgreSQL type


class SinkTarget(_Model):
    """One sink of the run, as a task sees it: where it is and what it must place."""

    name: str
    dsn: str
    table: str
    key: list[str]
    version: str | None = None
    ranges: dict[int, tuple[int, int]]  # partition -> [start, end): this sink's offsets
    failed: Failures = {}  # its own row-level expectations' failures
    quarantine: str | None = None  # its batch gate failed under quarantine_batch: why
    tombstones: Literal["quarantine", "delete"] = "quarantine"  # config.Tombstones
    # Output columns its table lacks and a dry run does not add (tidemark/driver/writing.py):
    # the task writes the others.
    omit: list[str] = []
    rebuild: Rebuilding | None = None  # a rebuild writes a new table and swaps it in
    # --accept-pruned: partition -> the [lo, hi) spans of its range the source holds. A
    # backfill removes only rows and tombstones inside them; a rebuild carries the live
    # table's tombstones outside them into its new table (deleted keys stay deleted).
    held: dict[int, list[tuple[int, int]]] | None = None


# -- how a task accounts for its records (docs/design.md, "Task accounting") ----------------
class ByRanges(_Model):
    """Task i reads the spans ``reads[i]`` and sees each of their offsets exactly once (in a
    dense span, every one)."""

    kind: Literal["ranges"] = "ranges"
    reads: list[list[Span]]


class ByKey(_Model):
    """Records spread over the tasks by key: each task sees part of every span of ``spread``
    and returns what it saw (TaskResult.seen); together they must see each offset once,
    which the driver checks (tidemark/protocol/coverage.py)."""

    kind: Literal["key"] = "key"
    spread: list[Span]


class ByRecords(_Model):
    """A redrive's one task over hand-picked records: each record of a letter it holds seen
    exactly once."""

    kind: Literal["records"] = "records"


Accounting = Annotated[ByRanges | ByKey | ByRecords, Field(discriminator="kind")]


# -- what a task places (docs/design.md, "Re-delivery") -------------------------------------
class Delivering(_Model):
    """A first delivery: records the sinks have not had, so rows may go by COPY straight
    into the target."""

    mode: Literal["run"] = "run"


class Backfilling(_Model):
    """Re-delivers each sink's ranges: rows at their positions are replaced, keys that lose
    their row fall back to older versions (tidemark/driver/fallback.py)."""

    mode: Literal["backfill"] = "backfill"
    by: str | None = None  # who resolves the dead letters it places
    fallback: bool = False  # fallback versions come after the range (column FALLBACK)
    fallback_failed: dict[str, Failures] = {}  # sink -> row-level failures of its versions
    # sink -> keys the range's failing records map to now, where their rows go
    moved: dict[str, list[list[Any]]] = {}


class Redriving(_Model):
    """Re-delivers the records of a redrive request's dead letters, each to its sink."""

    mode: Literal["redrive"] = "redrive"
    request: int  # the letters are in the ledger (tidemark/ledger/redrives.py)
    by: str | None = None  # who resolves them


Placement = Annotated[Delivering | Backfilling | Redriving, Field(discriminator="mode")]


class TaskSpec(_Model):
    run_id: int
    pipeline: str
    prefix: str
    prepare: bool  # exactly once (PREPARE) or at least once (COMMIT)
    lock_timeout_ms: int
    ledger_dsn: str
    columns: list[str]
    accounting: Accounting
    placement: Placement
    failed: Failures = {}  # pipeline-level row expectations' failures
    quarantine: str | None = None  # pipeline batch gate failed under quarantine_batch
    checks: list[RowCheck] = []  # the pipeline's row checks, indexed by CHECK
    # The reader left out what only letters need (tidemark.sources.LEFT_OUT): a task reads
    # the records it quarantines again from here (sources.payload_source). None: all carried.
    payloads: Source | None = None
    sinks: list[SinkTarget]
    write: int = 0  # which write of the run's batch (gids.Gid.write)

    @model_validator(mode="after")
    def _accounts_for_what_it_places(self) -> TaskSpec:
        # A redrive's records are hand-picked; a re-delivery resolves the letters of its
        # whole range in each task, which tasks holding parts of one range would fight over.
        redrive = isinstance(self.placement, Redriving)
        if redrive != isinstance(self.accounting, ByRecords):
            raise ValueError("a redrive, and only a redrive, accounts by records")
        if self.redelivery and isinstance(self.accounting, ByKey):
            raise ValueError("a re-delivery cannot spread its records by key")
        return self

    @property
    def redelivery(self) -> bool:
        """Backfill and redrive give sinks records they had before (docs/design.md)."""
        return not isinstance(self.placement, Delivering)


class Prepared(_Model):
    """One participant: a transaction the task prepared (or committed, at least once)."""

    gid: str
    target: Target  # the ledger's database or the sink's (JSON: {kind, name})
    sink: str  # whose participant it is (the ledger's holds the sink's dead letters)
    rows: int


class SinkResult(_Model):
    counts: SinkCounts = SinkCounts()  # records, rows written, quarantined, superseded, ...
    reasons: dict[str, int] = {}  # the task's most frequent "<class>: <reason>" of ``dead``
    classes: dict[str, int] = {}  # ``counts.dead`` by error class
    redriven: int = 0  # redrive: letters delivered
    failed_again: list[int] = []  # redrive: letter ids quarantined again
    skipped: list[int] = []  # redrive: letter ids no longer quarantined
    error: str | None = None  # this sink failed in this task
    copy_format: CopyFormat | None = None  # None: no rows
    csv_why: str = ""  # CSV: the first column binary COPY cannot carry
    phases: dict[str, float] = {}  # seconds: encode, copy, merge, prepare

    @model_validator(mode="after")
    def _csv_says_why(self) -> SinkResult:
        if (self.copy_format == CopyFormat.CSV) != bool(self.csv_why):
            raise ValueError("csv_why is given for CSV COPY, and only for it")
        return self


class TaskResult(_Model):
    task: int
    attempt: int
    records: int  # records the task read
    participants: list[Prepared] = []
    sinks: dict[str, SinkResult] = {}
    error: str | None = None  # the task could not account for its range
    seen: dict[int, str] = {}  # spread: partition -> offsets seen (protocol.coverage)
    phases: dict[str, float] = {}  # seconds: read_transform (waiting on Spark), checks
