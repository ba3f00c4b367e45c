"""The sink tables of a run (tidemark/driver/run.py), before its write: checked against what
the pipeline writes before Spark starts, refused once the transform's types are known, and
created or evolved just before the write (docs/design.md, "Tables"). A rebuild checks instead
what its new table would leave out, and names the table it writes and the one it retires
(tidemark/protocol/rebuild.py).

:class:`Tables` is built from the run's context (tidemark/driver/context.py); a sink it
refuses is aborted through the run's :class:`~tidemark.driver.aborting.Aborter`. What it finds
before Spark starts is a :class:`TableFindings`; where each sink's write goes, once its table
is ready, a :class:`SinkTable` (the writer's task spec reads both).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

import psycopg

from tidemark import sources
from tidemark.core.db import connect
from tidemark.core.errors import TidemarkError
from tidemark.driver import preflight
from tidemark.driver.aborting import Aborter
from tidemark.driver.context import RunContext
from tidemark.driver.modes import RunKind
from tidemark.ledger import checkpoints
from tidemark.ledger.state import RunState
from tidemark.protocol import pruned, rebuild, sink_schema, sinks
from tidemark.protocol.taskspec import Rebuilding


@dataclass(frozen=True)
class Rebuilt:
    """A rebuild's sink: the table it writes and the name the old one is kept under (if
    there is one: ``existed``)."""

    new: str
    retired: str
    existed: bool
    left_out: int = 0  # rows whose records the source no longer holds (--accept-pruned)
    carried: int = 0  # tombstones the source no longer holds, kept (--accept-pruned)


@dataclass(frozen=True)
class TableFindings:
    """What :meth:`Tables.check` found before Spark starts, per sink."""

    rebuilt: Mapping[str, Rebuilt] = field(default_factory=dict)  # its new and retired table
    # A re-delivery with --accept-pruned: the spans of its ranges the source holds
    # (SinkTarget.held); what lies outside them stays as it is.
    held: Mapping[str, pruned.Spans] = field(default_factory=dict)


@dataclass(frozen=True)
class SinkTable:
    """Where a sink's write goes, its table ready (:meth:`Tables.ensure`)."""

    table: str
    omit: tuple[str, ...] = ()  # a dry run's: output columns the table lacks, left out
    rebuild: Rebuilding | None = None  # a rebuild's new table, made from the output columns
    held: pruned.Spans | None = None  # TableFindings.held


class Tables:
    """The sink tables of one run: checked, refused, created or evolved."""

    def __init__(self, ctx: RunContext, aborter: Aborter) -> None:
        self.ctx = ctx
        self.aborter = aborter

    def _live(self) -> list[str]:
        report = self.ctx.report
        return [s for s in self.ctx.claim.sinks if report.sinks[s].state != RunState.ABORTED]

    def check(self) -> TableFindings | None:
        """Before Spark starts: refuse each sink whose table cannot take what the pipeline
        writes, as far as its file says (tidemark/driver/preflight.py); what it found. None
        when no sink is left to write."""
        kind = self.ctx.mode.kind
        rebuilt: dict[str, Rebuilt] = {}
        held: dict[str, pruned.Spans] = {}
        if kind is RunKind.REBUILD:
            for sink in self._live():
                found = self._check_rebuild(self.ctx.sinks[sink])
                if found is not None:
                    rebuilt[sink], spans = found
                    if spans is not None:
                        held[sink] = spans
        else:
            for sink, problems in preflight.sink_problems(self.ctx.pipeline, self._live()).items():
                if problems:
                    self.aborter.abort(sink, "; ".join(problems))
            if kind is RunKind.BACKFILL:
                for sink in self._live():
                    spans = self._check_backfill(self.ctx.sinks[sink])
                    if spans is not None:
                        held[sink] = spans
        return TableFindings(rebuilt, held) if self._live() else None

    def refuse(self, columns: list[tuple[str, str]], found: TableFindings) -> None:
        """Once the transform's output types are known, before the batch is read and
        checked: abort each sink whose table cannot take them (changing nothing yet)."""
        for sink in self._live():
            if sink in found.rebuilt:
                continue  # a rebuild's new table is made from these types
            problems = sinks.table_problems(self.ctx.sinks[sink], list(columns), f"sink {sink}")
            if problems:
                self.aborter.abort(sink, "; ".join(problems))

    def ensure(
        self, sink: sinks.ResolvedSink, columns: list[tuple[str, str]], found: TableFindings
    ) -> SinkTable | None:
        """A sink about to be written: its table created, or evolved as its ``schema`` says,
        what changed in the report; where its write goes (None: refused, the sink aborted).
        A dry run changes no table: it says what the run would change and writes the
        columns the table has."""
        ctx = self.ctx
        deletes = ctx.pipeline.tombstones_of(sink.config) == "delete"
        out = ctx.report.sinks[sink.name]
        held = found.held.get(sink.name)
        rebuilt = found.rebuilt.get(sink.name)
        if rebuilt is not None:
            out.schema_changes = self._rebuilding(sink, rebuilt, len(columns))
            rebuilding = Rebuilding(
                live=sink.config.table, retired=rebuilt.retired, columns=columns
            )
            return SinkTable(rebuilt.new, rebuild=rebuilding, held=held)
        try:
            if ctx.dry_run:
                omit, out.schema_changes = self._plan_table(sink, columns, deletes)
                return SinkTable(sink.config.table, omit=omit, held=held)
            changes = sinks.ensure_table(sink, columns, f"sink {sink.name}", deletes)
        except TidemarkError as exc:
            self.aborter.abort(sink.name, str(exc))
            return None
        out.schema_changes += changes
        for change in changes:
            ctx.log(f"run {ctx.run_id} sink {sink.name}: {change}")
        return SinkTable(sink.config.table, held=held)

    def _held(self, sink: str) -> pruned.Spans:
        """The spans of ``sink``'s ranges the source holds now (Planner.held)."""
        plan = sources.planner(self.ctx.pipeline)
        try:
            return {
                r.partition: plan.held(r.partition, r.start, r.end)
                for r in self.ctx.claim.sinks[sink].ranges
            }
        finally:
            plan.close()

    def _pruned(
        self, sink: sinks.ResolvedSink, ranges: dict[int, tuple[int, int]], held: pruned.Spans
    ) -> pruned.Found:
        """What the sink and its dead letters hold in ``ranges`` outside ``held``."""
        with connect(sink.dsn, autocommit=True, what=f"sink {sink.name}") as conn:
            found = pruned.in_sink(conn, sink.config.table, ranges, held)
        return pruned.in_ledger(
            self.ctx.ledger.conn, found, self.ctx.pipeline.name, sink.name, ranges, held
        )

    def _check_backfill(self, sink: sinks.ResolvedSink) -> pruned.Spans | None:
        """Before Spark starts: a backfill would remove what the sink holds at positions
        whose records the source no longer holds, and could not place them again (a
        tombstone among them: its key would come back). Refused, unless the user accepts
        backfilling what the source holds, leaving the rest as it is: then the spans it
        holds (None: nothing pruned, or refused)."""
        ctx = self.ctx
        ranges = {r.partition: (r.start, r.end) for r in ctx.claim.sinks[sink.name].ranges}
        try:
            held = self._held(sink.name)
            found = self._pruned(sink, ranges, held)
        except (psycopg.Error, TidemarkError) as exc:
            self.aborter.abort(sink.name, str(exc))
            return None
        if not found:
            return None
        why = f"sink {sink.name}: {found.describe(sink.config.table)}; retention pruned them)"
        if not ctx.mode.accept_pruned:
            self.aborter.abort(
                sink.name,
                f"{why}; a backfill would remove them. Backfill what the source holds with "
                f"--accept-pruned (what it no longer holds stays as it is)",
            )
            return None
        ctx.log(f"run {ctx.run_id}: {why}; they stay as they are (--accept-pruned)")
        return held

    def _plan_table(
        self, sink: sinks.ResolvedSink, columns: list[tuple[str, str]], deletes: bool
    ) -> tuple[tuple[str, ...], list[str]]:
        """A dry run's table: the columns the run would add, left out of its write, and
        what the report says of them."""
        plan = sinks.plan_table(sink, columns, f"sink {sink.name}", deletes)
        keyed = [c for c, _ in plan.adds if c in sink.config.key]
        if keyed:
            raise TidemarkError(
                f"sink {sink.name}: key column(s) {', '.join(keyed)} not in table "
                f"{sink.config.table}; a dry run cannot write without them"
            )
        omit = tuple(c for c, _ in plan.adds)
        return omit, [f"would add column {c} {t}" for c, t in plan.adds]

    def _check_rebuild(
        self, sink: sinks.ResolvedSink
    ) -> tuple[Rebuilt, pruned.Spans | None] | None:
        """Before Spark starts: the sink's database takes prepared transactions, and the new
        table would hold every row the old one does, unless the user accepts leaving out
        those whose records the source no longer holds (retention pruned them). Its new and
        retired table, and with --accept-pruned the spans the source holds (None: refused)."""
        ctx = self.ctx
        cfg, what, run_id = sink.config, f"sink {sink.name}", ctx.run_id
        # Everything the sink holds from where it began, in every partition it has a
        # checkpoint in: a rebuild re-delivers all of it (a partition the source holds
        # nothing of has no range). Rows below where it began were never delivered to it
        # (an older backfill put them there): left out, with no --accept-pruned to ask for.
        ledger, name = ctx.ledger.conn, ctx.pipeline.name
        cps = checkpoints.positions(ledger, name, [sink.name]).get(sink.name, {})
        began = checkpoints.starts(ledger, name, [sink.name]).get(sink.name, {})
        parts = {*cps, *(r.partition for r in ctx.claim.sinks[sink.name].ranges)}
        every = {p: (began.get(p) or 0, pruned.EVERYTHING) for p in sorted(parts)}
        try:
            with connect(sink.dsn, autocommit=True, what=what) as conn:
                sinks.prepare_database(conn, what)
                exists = sink_schema.table_columns(conn, cfg.table) is not None
                never = rebuild.placed_below(conn, cfg.table, began) if exists else {}
            held = self._held(sink.name)
            found = self._pruned(sink, every, held) if exists else pruned.Found()
        except (psycopg.Error, TidemarkError) as exc:
            self.aborter.abort(sink.name, str(exc))
            return None
        if never:
            ctx.log(
                f"run {run_id}: {what}: {sum(never.values()):,} rows of {cfg.table} lie "
                f"below where the sink began ("
                + ", ".join(f"partition {p}: offset {began[p]:,}" for p in never)
                + "): never delivered to it, left out of the new table"
            )
        if found:
            why = f"{what}: {found.describe(cfg.table)}; retention pruned them)"
            if not ctx.mode.accept_pruned:
                self.aborter.abort(
                    sink.name,
                    f"{why}; a rebuild would leave them out of the new table. Rebuild from "
                    f"what the source holds with --accept-pruned (the old table keeps them; "
                    f"deleted keys stay deleted)",
                )
                return None
            ctx.log(f"run {run_id}: {why}; left out of the new table (--accept-pruned)")
        now = datetime.now(UTC)
        rebuilt = Rebuilt(
            new=rebuild.new_table(cfg.table, run_id),
            retired=rebuild.retired_table(cfg.table, run_id, now),
            existed=exists,
            left_out=found.total_rows,
            carried=found.total_tombstones,
        )
        return rebuilt, (held if found else None)

    def _rebuilding(self, sink: sinks.ResolvedSink, r: Rebuilt, columns: int) -> list[str]:
        """What a rebuild does to the sink's tables, as the report says it."""
        would = "would be " if self.ctx.dry_run else ""
        made = (
            f"{sink.config.table} {would}rebuilt from the pipeline: key "
            f"({', '.join(sink.config.key)}), {columns} columns"
        )
        kept = (
            f"the old table {would}kept as {r.retired} (drop it when you no longer need it)"
            if r.existed
            else "there was no old table to keep"
        )
        notes = (
            [
                f"left out {r.left_out:,} rows whose records the source no longer holds "
                f"(the old table keeps them)"
            ]
            if r.left_out
            else []
        )
        if r.carried:
            notes.append(
                f"kept {r.carried:,} deleted key(s) deleted whose tombstones the source no "
                f"longer holds"
            )
        return [*notes, made, kept]


def table_exists(sink: sinks.ResolvedSink) -> bool:
    try:
        return sinks.table_exists(sink)
    except (psycopg.Error, TidemarkError):  # checking first, the write says what is wrong
        return False
