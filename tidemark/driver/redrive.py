"""Redrive: replay quarantined records' stored bytes through the current pipeline code, with
the key, headers and source timestamp a delivery of them would give (fill_source_fields for
letters from before ledger V007).

A redrive is a re-delivery (docs/design.md, "Re-delivery") and a mode of the one protocol
(tidemark/driver/run.py): its records come from the dead letters instead of the log. Each letter
names the sink it applies to, so each letter goes back to its own sink only. The records go
through the current decode, transform and row-level expectations (batch-level ones judge
whole batches and do not apply to a hand-picked few). The letters are a redrive request's
(tidemark/ledger/redrives.py): only its id travels to the job and its task. Per sink, one
task's ledger transaction locks that sink's letters (a concurrent discard waits; a letter discarded
meanwhile is left out), quarantines again those that fail (attempts + 1, the new class and
reason) and marks the others ``redriven``; it is prepared and chosen with the sink's rows, so
the status change commits in the same two-phase commit as the sink write. Each sink decides
on its own. Checkpoints never move.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession

from tidemark import sources
from tidemark.config import Pipeline, Quality, Sink
from tidemark.core.claims import Claim
from tidemark.core.clock import Phases
from tidemark.core.db import connect
from tidemark.core.errors import BadInput, TidemarkError
from tidemark.core.ranges import Range
from tidemark.core.settings import Settings
from tidemark.driver.modes import Layout, LayoutKind, Mode, NothingToClose, RunKind
from tidemark.driver.report import RunReport
from tidemark.driver.run import Run
from tidemark.ledger import letters, redrives
from tidemark.ledger.state import Planner, RunState
from tidemark.protocol.taskspec import ByRecords, Placement, Redriving, TaskResult

if TYPE_CHECKING:
    from tidemark.driver.fallback import Fallback

Log = Callable[[str], None]
SHOW_UNPLACED = 20  # letters left out, logged one by one; the rest as a count


class RedriveMode(Mode):
    """``tidemark dlq redrive``: re-deliver the records of one redrive request's letters (or
    of ``ids``, for which it makes the request before the run plans), and report on them."""

    reads_ranges = False  # hand-picked records: it steps over nothing
    kind = RunKind.REDRIVE
    idle = "nothing to redrive"

    def __init__(
        self,
        pipeline: Pipeline,
        ledger_dsn: str,
        request: int | None,
        *,
        ids: list[int] | None = None,
        by: str | None = None,
    ):
        if request is not None and ids is not None:
            raise ValueError("give a redrive request or ids, not both")
        if ids is not None and not ids:
            raise BadInput(f"redrive {pipeline.name}: no dead letters given")
        self.ledger_dsn = ledger_dsn
        self.request = request
        self.ids = ids
        self.by = by
        self.by_sink: dict[str, int] = {}  # sink -> letters planned
        self.unplaced: dict[int, str] = {}  # id -> why it is left out
        self.source_unknown: list[int] = []  # ids replayed with a NULL timestamp

    @property
    def request_id(self) -> int:
        """The request being replayed: Redrive makes it (from ids) before the run plans."""
        if self.request is None:
            raise RuntimeError("a redrive planned before its request was made")
        return self.request

    def planner(self, pipeline: Pipeline) -> tuple[Planner, NothingToClose]:
        names = [s.name for s in pipeline.sinks]

        def plan(
            free: dict[str, dict[int, int]], began: dict[str, dict[int, int]]
        ) -> dict[str, list[Range]]:
            # A letter lies where its sink received its record: at or above where it began.
            with connect(self.ledger_dsn, autocommit=True, what="ledger") as conn:
                ranges, self.unplaced = redrives.placement(
                    conn, self.request_id, pipeline.name, names
                )
            out: dict[str, list[Range]] = {}
            self.by_sink = {}
            for sink, part, start, end, n in ranges:
                out.setdefault(sink, []).append(Range(part, start, end))
                self.by_sink[sink] = self.by_sink.get(sink, 0) + n
            busy = sorted(set(out) - set(free))
            if busy:  # never redriven while one of its sinks is missed
                raise TidemarkError(
                    f"redrive of {pipeline.name}: sink(s) {', '.join(busy)} "
                    f"busy (another run holds the lease); try again when free"
                )
            return out

        return plan, NothingToClose()

    def source(self, spark: SparkSession, pipeline: Pipeline, read: list[Range]) -> DataFrame:
        # One task: each sink's status change is one transaction with its sink write.
        return spark.createDataFrame(self._records(pipeline)).coalesce(1)

    def arrow(
        self,
        pipeline: Pipeline,
        read: list[Range],
        phases: Phases,
        reader: Callable[[], Any] | None = None,
    ) -> Iterator[pa.RecordBatch]:
        with phases("read"):
            records = self._records(pipeline)
        yield from records.to_batches()

    def _records(self, pipeline: Pipeline) -> pa.Table:
        """Each record once (several sinks' letters may hold it), from the stored bytes, read
        from the ledger in chunks straight into Arrow."""
        batches = []
        request = self.request_id
        fill_source_fields(self.ledger_dsn, pipeline, request, list(self.by_sink))
        with connect(self.ledger_dsn, autocommit=True, what="ledger") as conn:
            self.source_unknown = redrives.source_unknown(
                conn, request, pipeline.name, list(self.by_sink)
            )
            for rows in redrives.records(conn, request, pipeline.name, list(self.by_sink)):
                cols = zip(*rows, strict=True)
                batches.append(
                    pa.RecordBatch.from_arrays(
                        [pa.array(c, f.type) for c, f in zip(cols, sources.SCHEMA, strict=True)],
                        schema=sources.SCHEMA,
                    )
                )
        return pa.Table.from_batches(batches, schema=sources.SCHEMA)

    def payloads(self, pipeline: Pipeline) -> None:
        return None  # the stored bytes are the batch's: every payload is carried

    def quality(self, pipeline: Pipeline) -> Pipeline:
        def rows_only(q: Quality) -> Quality:
            return q.model_copy(update={"batch": []})

        return pipeline.model_copy(
            update={
                "quality": rows_only(pipeline.quality),
                "sinks": [
                    s.model_copy(update={"quality": rows_only(s.quality)}) for s in pipeline.sinks
                ],
            }
        )

    def begin(self, pipeline: Pipeline) -> None:
        """The request: made from ``ids``, or checked to be the pipeline's."""
        with connect(self.ledger_dsn, autocommit=True, what="ledger") as conn:
            if self.request is None:
                req = redrives.create(conn, pipeline.name, self.by or "tidemark", ids=self.ids)
                if req is None:  # ids holds one at least (checked in __init__)
                    raise BadInput(f"redrive {pipeline.name}: no dead letters given")
                self.request = req.request_id
                return
            req = redrives.get(conn, self.request)
        if req is None or req.pipeline != pipeline.name:
            raise BadInput(
                f"redrive of {pipeline.name}: no redrive request {self.request} for this pipeline"
            )

    def announcement(self, claim: Claim, pipeline: Pipeline) -> str:
        # Not "reading N records": the letters' records are read by position, not the span
        # their positions cover.
        n = sum(self.by_sink.values())
        return (
            f"run {claim.run_id}: claimed {', '.join(claim.sinks)}; redriving {n:,} dead "
            f"letter(s) of {pipeline.name} (request {self.request}) for {self.by}"
        )

    def conclude(self, report: RunReport, results: list[TaskResult], log: Log) -> None:
        """The report of the letters: what the sinks committed (a dry run's: would have)."""
        unplaced = sorted(self.unplaced.items())
        for i, why in unplaced[:SHOW_UNPLACED]:
            log(f"dead letter {i} not redriven: {why}")
        if len(unplaced) > SHOW_UNPLACED:
            log(f"... and {len(unplaced) - SHOW_UNPLACED:,} more dead letters not redriven")
        done = [
            r
            for t in results
            for s, r in t.sinks.items()
            if report.sinks[s].state == RunState.COMMITTED or report.sinks[s].previewed
        ]
        report.redrive = {
            "request": self.request,
            "redriven": sum(r.redriven for r in done),
            "failed_again": sorted(i for r in done for i in r.failed_again),
            "skipped": sorted(
                {i for t in results for r in t.sinks.values() for i in r.skipped}
                | set(self.unplaced)
            ),
            "source_unknown": self.source_unknown,
        }
        unknown = self.source_unknown
        if unknown:  # the transform saw no source timestamp for these: say so
            shown = ", ".join(map(str, unknown[:SHOW_UNPLACED]))
            more = (
                f" and {len(unknown) - SHOW_UNPLACED:,} more"
                if len(unknown) > SHOW_UNPLACED
                else ""
            )
            log(
                f"dead letter(s) {shown}{more}: the source no longer holds the record; "
                f"replayed with a NULL _tm_ts and the headers as the letter stored them"
            )

    def layout(self, read: list[Range], sinks: list[Sink], **_: Any) -> Layout:
        return Layout(LayoutKind.RECORDS, 1, read, ByRecords())  # one task over hand-picked records

    def placement(self, by: str | None, fallen: Fallback | None) -> Placement:
        if self.request is None:
            raise TidemarkError("a redrive places the letters of its request: none made")
        return Redriving(request=self.request, by=by)


def fill_source_fields(ledger_dsn: str, pipeline: Pipeline, request: int, sinks: list[str]) -> int:
    """Before a redrive reads its letters: a letter from before V007 kept neither its
    record's headers as the source had them nor its timestamp. Read them from the source
    now, or note that the source no longer holds the record (retention, compaction). Each
    letter once: later redrives find them known. Returns how many letters changed."""
    with connect(ledger_dsn, autocommit=True, what="ledger") as conn:
        wanted = redrives.unknown_source(conn, request, pipeline.name, sinks)
        if not wanted:
            return 0
        try:
            found = sources.headers_and_ts(pipeline, wanted)
        except TidemarkError as exc:
            n = sum(len(offs) for offs in wanted.values())
            raise TidemarkError(
                f"redrive of {pipeline.name}: {n:,} dead letter(s) from before "
                f"V007 need their record's headers and timestamp from the "
                f"source, which cannot be read: {exc}"
            ) from None
        gone = [(p, o) for p, offs in wanted.items() for o in offs if (p, o) not in found]
        return letters.fill_source(conn, pipeline.name, found, gone)


def redrive_run(
    pipeline: Pipeline,
    settings: Settings,
    *,
    ledger_dsn: str,
    by: str,
    request: int | None = None,
    ids: list[int] | None = None,
    **kw: Any,
) -> Run:
    """A run in redrive mode over one redrive request (or ``ids``, for which it makes one)."""
    if (request is None) == (ids is None):
        raise ValueError("give a redrive request or ids")
    mode = RedriveMode(pipeline, ledger_dsn, request, ids=ids, by=by)
    return Run(pipeline, settings, ledger_dsn=ledger_dsn, mode=mode, by=by, **kw)
