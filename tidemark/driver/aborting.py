"""Every abort path of a run (tidemark/driver/run.py) in one place: a sink aborted (one ledger
transition each: tidemark/ledger/state.py), the run's prepared transactions that no decision
chose rolled back on each participant's database, a dry run ending instead of its decision,
and the cleanup after a failure, which never hides the run's own error.

Before any decision nothing may stay behind; after one, only recovery settles what is in
doubt (docs/design.md, "Commit protocol").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import psycopg

from tidemark.core.db import connect, one_line
from tidemark.core.dsn import mask
from tidemark.core.errors import TidemarkError, terminated_in
from tidemark.driver.context import RunContext
from tidemark.ledger import state
from tidemark.ledger.state import RunState
from tidemark.protocol import gids, twopc


class Aborter:
    """Rolls back what a run prepared and records its aborts."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    def abort(self, sink: str, error: str) -> None:
        """One sink aborted: the ledger's transition, the report, the log."""
        ctx = self.ctx
        state.abort(ctx.ledger.conn, ctx.pipeline.name, ctx.run_id, sink, error)
        out = ctx.report.sinks[sink]
        out.state, out.error = RunState.ABORTED, error
        ctx.log(f"run {ctx.run_id} sink {sink}: aborted: {error}")

    def abort_sinks(self, sinks: Iterable[str], error: str) -> None:
        """Each of ``sinks`` aborted, then every prepared transaction of the run rolled back."""
        for sink in sinks:
            self.abort(sink, error)
        self.roll_back()

    def abort_all(self, error: str) -> None:
        """After a failure before any decision: every sink aborted (without the report: the
        run raises), every prepared transaction rolled back, even when the ledger is gone too
        (recovery aborts the run then, but nothing waits for it)."""
        ctx = self.ctx
        try:
            for sink in ctx.claim.sinks:
                state.abort(ctx.ledger.conn, ctx.pipeline.name, ctx.run_id, sink, error)
        finally:
            self.roll_back()

    def preview(self, prepared: list[str]) -> None:
        """A dry run instead of its decision: each prepared sink previewed (the ledger keeps
        the run and its counts), every prepared transaction of the run rolled back. Nothing was visible, so nothing changes: rows, letters and checkpoints stay."""
        ctx = self.ctx
        for sink in prepared:
            state.preview(ctx.ledger.conn, ctx.pipeline.name, ctx.run_id, sink)
            out = ctx.report.sinks[sink]
            out.state, out.previewed = RunState.PREVIEWED, True
        self.roll_back()
        ctx.log(f"run {ctx.run_id}: dry run: every prepared transaction rolled back")

    def roll_back(self, keep: frozenset[str] = frozenset()) -> None:
        """Roll back every prepared transaction of this run but the gids in ``keep`` (those a
        decision chose), on the ledger and each sink's database."""
        ctx = self.ctx
        like = gids.like_run(ctx.settings.gid_prefix, ctx.run_id)
        for dsn in dict.fromkeys([ctx.ledger.dsn, *(s.dsn for s in ctx.sinks.values())]):
            try:
                with connect(dsn, autocommit=True) as conn:
                    for gid, _ in twopc.prepared(conn, like):
                        if gid not in keep:
                            twopc.rollback(conn, gid)
            except (psycopg.Error, TidemarkError) as exc:
                # An unreachable sink holds nothing of ours, or recovery's sweep gets it later.
                ctx.log(f"run {ctx.run_id}: cleanup skipped {mask(dsn)}: {one_line(exc)}")

    @contextmanager
    def cleanup(self, failure: BaseException | None) -> Iterator[None]:
        """Cleanup after the run. After its ``failure`` a failing cleanup (the ledger session
        may be gone as well) is logged, never raised in its place: the user sees the run's
        own error and exit code. Recovery settles what the cleanup left."""
        try:
            yield
        except (psycopg.Error, TidemarkError) as exc:
            if failure is None:
                raise
            self.ctx.log(
                f"run {self.ctx.run_id}: cleanup after {type(failure).__name__} failed too, "
                f"left to `tidemark recover`: {one_line(exc)}"
            )


def why_aborted(exc: BaseException) -> str:
    """The error a run's sinks are aborted with after ``exc``."""
    if terminated_in(exc) is not None:
        return "terminated (SIGTERM) before the decision"
    return f"{type(exc).__name__}: {one_line(exc)}"
