"""Redrive: replay quarantined records' stored bytes through the current pipeline code.

A redrive is a re-delivery (docs/design.md, "Re-delivery") and a mode of the one protocol
(tidemark/driver/run.py): its records come from the dead letters instead of the log. Each letter
names the sink it applies to, so each letter goes back to its own sink only. The records go
through the current decode, transform and row-level expectations (batch-level ones judge
whole batches and do not apply to a hand-picked few). Per sink, one task's ledger
transaction locks that sink's letters (a concurrent discard waits; a letter discarded
meanwhile is left out), quarantines again those that fail (attempts + 1, the new class and
reason) and marks the others ``redriven``; it is prepared and chosen with the sink's rows, so
the status change commits in the same two-phase commit as the sink write. Each sink decides
on its own. Checkpoints never move.
"""

from __future__ import annotations

import psycopg
import pyarrow as pa

from tidemark import sources
from tidemark.config import Pipeline
from tidemark.core.db import connect
from tidemark.core.errors import BadInput, TidemarkError
from tidemark.driver.modes import Mode, NothingToClose
from tidemark.driver.run import Run, RunReport
from tidemark.ledger import dlq
from tidemark.ledger.checkpoints import positions
from tidemark.ledger.state import Range, RunState


def select(conn: psycopg.Connection, pipeline: str, ids: list[int] | None = None,
           error_class: str | None = None, sink: str | None = None) -> list[int]:
    """Ids of the quarantined dead letters of ``pipeline`` to redrive: the given ids, or all
    of an error class and/or sink."""
    f = dlq.Filters.parse(pipeline=pipeline, ids=ids, error_class=error_class, sink=sink,
                          status="quarantined")
    return dlq.matching_ids(conn, f)


class RedriveMode(Mode):
    name = "redrive"

    def __init__(self, pipeline: Pipeline, ledger_dsn: str, ids: list[int]):
        if not ids:
            raise BadInput(f"redrive {pipeline.name}: no dead letters given")
        self.ledger_dsn = ledger_dsn
        self.ids = sorted(set(ids))
        self.by_sink: dict[str, list[int]] = {}
        self.unplaced: dict[int, str] = {}         # id -> why it is left out

    def planner(self, pipeline: Pipeline):
        names = [s.name for s in pipeline.sinks]

        def plan(free: dict[str, dict[int, int]]) -> dict[str, list[Range]]:
            with connect(self.ledger_dsn, autocommit=True, what="ledger") as conn:
                rows = dlq.placement(conn, self.ids)
                checkpoints = positions(conn, pipeline.name)
            for i in sorted(set(self.ids) - {r[0] for r in rows}):
                self.unplaced[i] = "no such dead letter"
            offsets: dict[str, dict[int, list[int]]] = {}
            for i, sink, part, off, status, owner in rows:
                if owner != pipeline.name:
                    self.unplaced[i] = f"belongs to pipeline {owner}"
                elif status != "quarantined":
                    self.unplaced[i] = f"is {status}"
                elif sink not in names:
                    self.unplaced[i] = f"sink {sink} is no longer in the pipeline"
                elif checkpoints.get(sink, {}).get(part, 0) <= off:
                    self.unplaced[i] = f"sink {sink} has not got this far yet"
                else:
                    self.by_sink.setdefault(sink, []).append(i)
                    offsets.setdefault(sink, {}).setdefault(part, []).append(off)
            busy = sorted(set(offsets) - set(free))
            if busy:  # never redriven while one of its sinks is missed
                raise TidemarkError(f"redrive of {pipeline.name}: sink(s) {', '.join(busy)} "
                                    f"busy (another run holds the lease); try again when free")
            return {s: [Range(p, min(o), max(o) + 1) for p, o in sorted(parts.items())]
                    for s, parts in offsets.items()}

        return plan, NothingToClose()

    def source(self, spark, pipeline: Pipeline, read: list[Range]):
        """Each record once (several sinks' letters may hold it), from the stored bytes."""
        with connect(self.ledger_dsn, autocommit=True, what="ledger") as conn:
            rows = dlq.records(conn, [i for ids in self.by_sink.values() for i in ids])
        cols = list(zip(*rows, strict=True)) if rows else [[]] * 6
        table = pa.Table.from_arrays([pa.array(list(c), f.type)
                                      for c, f in zip(cols, sources.SCHEMA, strict=True)],
                                     schema=sources.SCHEMA)
        # One task: the records are few, and each sink's status change is one transaction.
        return spark.createDataFrame(table).coalesce(1)

    def quality(self, pipeline: Pipeline) -> Pipeline:
        def rows_only(q):
            return q.model_copy(update={"batch": []})

        return pipeline.model_copy(update={
            "quality": rows_only(pipeline.quality),
            "sinks": [s.model_copy(update={"quality": rows_only(s.quality)})
                      for s in pipeline.sinks]})

    def reads(self, read: list[Range], dense: bool, together: bool):
        return None  # one task over hand-picked records: accounted per record

    def letters(self, sink: str) -> list[int] | None:
        return self.by_sink.get(sink, [])

    def tasks(self, read: list[Range], together: bool) -> int:
        return 1


class Redrive(Run):
    """``tidemark dlq redrive``: a run in redrive mode, with its report of the letters."""

    def __init__(self, pipeline: Pipeline, settings, *, ledger_dsn: str, ids: list[int],
                 by: str, **kw):
        self.redrive = RedriveMode(pipeline, ledger_dsn, ids)
        super().__init__(pipeline, settings, ledger_dsn=ledger_dsn, mode=self.redrive, by=by,
                         **kw)

    def execute(self) -> RunReport:
        report = super().execute()
        for i, why in sorted(self.redrive.unplaced.items()):
            self.log(f"dead letter {i} not redriven: {why}")
        done = [r for t in self.results for s, r in t.sinks.items()
                if report.sinks[s].state == RunState.COMMITTED]
        report.redrive = {
            "redriven": sum(len(r.redriven) for r in done),
            "failed_again": sorted(i for r in done for i in r.failed_again),
            "skipped": sorted({i for t in self.results for r in t.sinks.values()
                               for i in r.skipped} | set(self.redrive.unplaced))}
        if report.run_id is None:
            report.message = "nothing to redrive"
        return report

    def _protocol(self, claim, by_name, report: RunReport) -> None:
        n = sum(len(v) for v in self.redrive.by_sink.values())
        self.log(f"run {claim.run_id}: redriving {n:,} dead letter(s) of {self.p.name} into "
                 f"{', '.join(claim.sinks)} for {self.by}")
        super()._protocol(claim, by_name, report)
