"""What the driver hands a Spark task and what the task returns: typed, validated at both ends.

The driver builds one :class:`TaskSpec` per run and Spark ships it to every task as JSON; the
task validates it, writes, and returns one :class:`TaskResult`, which the driver validates
before it counts anything or chooses a gid (docs/design.md, "Task accounting").
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from tidemark.config import Source

Mode = Literal["run", "backfill", "redrive"]
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


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Span(_Model):
    """Offsets ``[start, end)`` of one partition. ``dense``: the source holds every offset of
    it (postgres_log); a compacted archive may have gaps, so only duplicates and strays can be
    told there, not a dropped record."""

    partition: int
    start: int
    end: int
    dense: bool = True

    @property
    def size(self) -> int:
        return self.end - self.start


class RowCheck(_Model):
    """A row-level expectation as a task writes its reason (tidemark/quality/reasons.py)."""

    type: str
    kwargs: dict[str, str | list[str]]  # only those naming its columns


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
    fallback_failed: Failures = {}  # row-level failures of its fallback versions
    # Keys a backfill's failing records map to now where their rows go (driver/fallback.py).
    moved: list[list[Any]] = []
    tombstones: Literal["quarantine", "delete"] = "quarantine"  # config.Tombstones


class TaskSpec(_Model):
    run_id: int
    pipeline: str
    mode: Mode
    prefix: str
    prepare: bool  # exactly once (PREPARE) or at least once (COMMIT)
    lock_timeout_ms: int
    ledger_dsn: str
    columns: list[str]
    by: str | None = None  # who a re-delivery resolves dead letters for
    request: int | None = None  # redrive: its request (the letters are in the ledger)
    reads: list[list[Span]] | None = None  # task i reads the spans reads[i]; None: a redrive
    spread: list[Span] | None = None  # or every task sees part of these (records by key)
    failed: Failures = {}  # pipeline-level row expectations' failures
    quarantine: str | None = None  # pipeline batch gate failed under quarantine_batch
    checks: list[RowCheck] = []  # the pipeline's row checks, indexed by CHECK
    fallback: bool = False  # a backfill's fallback versions come too (FALLBACK)
    # The reader left out the payloads of the records it decoded: a task reads those it
    # quarantines again from here (tidemark.sources.payload_source). None: all are carried.
    payloads: Source | None = None
    sinks: list[SinkTarget]
    write: int = 0  # which write of the run's batch (gids.Gid.write)

    @property
    def redelivery(self) -> bool:
        """Backfill and redrive give sinks records they had before (docs/design.md)."""
        return self.mode != "run"


class Prepared(_Model):
    """One participant: a transaction the task prepared (or committed, at least once)."""

    gid: str
    target: str  # 'ledger' or 'sink:<name>'
    sink: str
    rows: int


class SinkResult(_Model):
    records: int = 0  # records of this sink's range the task saw
    rows: int = 0  # rows written (inserted or replaced)
    dead: int = 0  # records quarantined for this sink
    superseded: int = 0  # versions not written: a newer one won
    removed: int = 0  # re-delivery: own rows removed (now quarantined)
    resolved: int = 0  # re-delivery: live letters resolved (now delivered)
    fallback: int = 0  # backfill: older versions placed again (see FALLBACK)
    tombstones: int = 0  # tombstones that delete their key (none placed a row)
    redriven: int = 0  # redrive: letters delivered
    failed_again: list[int] = []  # redrive: letter ids quarantined again
    skipped: list[int] = []  # redrive: letter ids no longer quarantined
    error: str | None = None  # this sink failed in this task
    copy_format: str = ""  # "binary", or "csv: <why>" (no rows: "")
    phases: dict[str, float] = {}  # seconds: encode, copy, merge, prepare


class TaskResult(_Model):
    task: int
    attempt: int
    records: int  # records the task read
    participants: list[Prepared] = []
    sinks: dict[str, SinkResult] = {}
    error: str | None = None  # the task could not account for its range
    seen: dict[int, str] = {}  # spread: partition -> offsets seen (protocol.coverage)
    phases: dict[str, float] = {}  # seconds: read_transform (waiting on Spark), checks
