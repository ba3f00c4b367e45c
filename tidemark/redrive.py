"""Redrive: replay quarantined records' stored bytes through the current pipeline code.

A redrive is a run (mode ``redrive``) of the same protocol whose source is the dead-letter
table instead of the log: it takes the leases of the sinks its records belong to, decodes,
transforms and checks them with the pipeline's row-level expectations (batch-level ones
judge whole batches and do not apply to a hand-picked few), writes them with PREPARE
TRANSACTION, and changes the dead letters' status in a prepared ledger transaction that the
same decision commits (tidemark/writer.py: ``Redriven``). All its sinks decide at once, so
either every sink gets the records and the dead letters say ``redriven``, or nothing changes.
Checkpoints never move.

Which sinks a record goes to: the sink its dead letter names, or, for one quarantined before
the sinks, every sink whose checkpoint is past it (a sink that has not got that far will
read the record from the source itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
import pyarrow as pa

from tidemark import sources, state
from tidemark.config import Pipeline
from tidemark.db import connect
from tidemark.errors import BadInput, TidemarkError
from tidemark.job import Run, RunReport
from tidemark.state import Claim, Range


@dataclass(frozen=True)
class Letter:
    id: int
    sink: str | None
    partition: int
    offset: int
    error_class: str


def select(conn: psycopg.Connection, pipeline: str, ids: list[int] | None = None,
           error_class: str | None = None, sink: str | None = None) -> list[int]:
    """Ids of the quarantined dead letters of ``pipeline`` to redrive: the given ids, or all
    of an error class and/or sink (sink ``-``: quarantined before the sinks)."""
    from tidemark import dlq

    f = dlq.Filters.parse(pipeline=pipeline, ids=ids, error_class=error_class, sink=sink,
                          status="quarantined")
    return dlq.matching_ids(conn, f)


class Redrive(Run):
    def __init__(self, pipeline: Pipeline, settings, *, ledger_dsn: str, ids: list[int],
                 by: str, **kw):
        super().__init__(pipeline, settings, ledger_dsn=ledger_dsn, mode="redrive", **kw)
        if not ids:
            raise BadInput(f"redrive {pipeline.name}: no dead letters given")
        self.ids = sorted(set(ids))
        self.by = by
        self.letters: dict[tuple[int, int], Letter] = {}
        self.unplaced: dict[int, str] = {}  # id -> why it is left out

    # -- planning: the dead letters, not the source, say what to read -----------------------
    def _planner(self):
        sinks = [s.name for s in self.p.sinks]

        def plan(free: dict[str, dict[int, int]]) -> dict[str, list[Range]]:
            with connect(self.ledger_dsn, autocommit=True, what="ledger") as conn:
                rows = conn.execute(
                    """SELECT id, sink, source_partition, source_offset, error_class::text,
                              status::text, pipeline FROM tidemark.dlq WHERE id = ANY(%s)
                       ORDER BY id""", (self.ids,)).fetchall()
                checkpoints: dict[str, dict[int, int]] = {}
                for s, part, nxt in conn.execute(
                        "SELECT sink, partition, next_offset FROM tidemark.checkpoints "
                        "WHERE pipeline = %s", (self.p.name,)):
                    checkpoints.setdefault(s, {})[part] = nxt
            found = {r[0] for r in rows}
            for i in self.ids:
                if i not in found:
                    self.unplaced[i] = "no such dead letter"
            targets: dict[str, dict[int, list[int]]] = {}
            for i, sink, part, off, cls, status, pipeline in rows:
                if pipeline != self.p.name:
                    self.unplaced[i] = f"belongs to pipeline {pipeline}"
                elif status != "quarantined":
                    self.unplaced[i] = f"is {status}"
                elif sink is not None and sink not in sinks:
                    self.unplaced[i] = f"sink {sink} is no longer in the pipeline"
                elif (part, off) in self.letters:
                    self.unplaced[i] = (f"same record as dead letter "
                                        f"{self.letters[(part, off)].id}; redrive it after")
                else:
                    to = [s for s in ([sink] if sink else sinks)
                          if checkpoints.get(s, {}).get(part, 0) > off]
                    if not to:
                        self.unplaced[i] = "no sink has got this far yet"
                        continue
                    self.letters[(part, off)] = Letter(i, sink, part, off, cls)
                    for s in to:
                        targets.setdefault(s, {}).setdefault(part, []).append(off)
            self.targets = targets
            busy = sorted(set(targets) - set(free))
            if busy:  # all or nothing: never redriven while one of its sinks is missed
                raise TidemarkError(f"redrive of {self.p.name}: sink(s) {', '.join(busy)} busy "
                                    f"(another run holds the lease); try again when free")
            return {s: [Range(p, min(offs), max(offs) + 1) for p, offs in sorted(parts.items())]
                    for s, parts in targets.items()}

        class _Nothing:
            def close(self) -> None:
                pass

        return plan, _Nothing()

    def execute(self) -> RunReport:
        report = super().execute()
        for i, why in sorted(self.unplaced.items()):
            self.log(f"dead letter {i} not redriven: {why}")
        if report.run_id is None:
            report.message = "nothing to redrive"
            report.redrive = {"redriven": 0, "failed_again": [], "skipped": sorted(self.unplaced)}
        return report

    # -- the protocol's hooks --------------------------------------------------------------
    def _protocol(self, ledger, claim: Claim, by_name, report: RunReport) -> None:
        self.log(f"run {claim.run_id}: redriving {len(self.letters):,} dead letter(s) of "
                 f"{self.p.name} into {', '.join(claim.sinks)} for {self.by}")
        super()._protocol(ledger, claim, by_name, report)
        got = [r["redrive"] for r in getattr(self, "results", [])]
        report.redrive = {"redriven": sum(g["redriven"] for g in got),
                          "failed_again": sorted(i for g in got for i in g["failed"]),
                          "skipped": sorted({i for g in got for i in g["skipped"]}
                                            | set(self.unplaced))}

    def _source(self, spark, claim: Claim, read: list[Range]):
        with connect(self.ledger_dsn, autocommit=True, what="ledger") as conn:
            rows = conn.execute(
                """SELECT source_partition, source_offset, key, payload, headers::text, NULL
                   FROM tidemark.dlq WHERE id = ANY(%s)""",
                ([d.id for d in self.letters.values()],)).fetchall()
        cols = list(zip(*rows, strict=True)) if rows else [[]] * 6
        table = pa.Table.from_arrays([pa.array(list(c), f.type)
                                      for c, f in zip(cols, sources.SCHEMA, strict=True)],
                                     schema=sources.SCHEMA)
        # One task: the records are few, and the status change is one transaction.
        return spark.createDataFrame(table).coalesce(1)

    def _quality_pipeline(self) -> Pipeline:
        def rows_only(q):
            return q.model_copy(update={"batch": []})

        return self.p.model_copy(update={
            "quality": rows_only(self.p.quality),
            "sinks": [s.model_copy(update={"quality": rows_only(s.quality)})
                      for s in self.p.sinks]})

    def _task_spec(self, claim: Claim, live: list[str]) -> dict:
        return {
            "redrive": {"by": self.by, "records": [
                {"id": d.id, "sink": d.sink, "partition": d.partition, "offset": d.offset,
                 "error_class": d.error_class} for d in self.letters.values()]},
            "offsets": {s: {str(p): offs for p, offs in self.targets[s].items()} for s in live},
        }

    def _tasks(self, read: list[Range]) -> int:
        return 1

    def _decide(self, ledger, claim: Claim, live: list[str], report: RunReport) -> list[str]:
        failed = [s for s in claim.sinks if s not in live]
        if failed:  # all or nothing: the dead letters' status change is shared
            raise TidemarkError(f"run {claim.run_id}: redrive aborted: " + "; ".join(
                f"sink {s}: {report.sinks[s].error}" for s in failed))
        self.stop.check()
        self.stop.decided = True
        try:
            state.decide_all(ledger, self.p.name, claim.run_id,
                             {s: self._chosen(s) for s in live})
        except BaseException:
            self.stop.decided = False
            raise
        for s in live:
            report.sinks[s].state = "committing"
        return live
