"""What every step of one claimed run uses (tidemark/driver/run.py): the pipeline, its
settings, the mode, the claim and its sinks, the ledger session, the log, the clock, the task
runner. Built once the claim is made and fixed for the run; the steps (tables, writing,
verifying, committing, aborting) are objects built from it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg

from tidemark.config import Pipeline
from tidemark.core.claims import Claim
from tidemark.core.db import connect
from tidemark.core.settings import Settings
from tidemark.driver.checking import QualityPath
from tidemark.driver.modes import Mode
from tidemark.driver.report import RunReport
from tidemark.driver.runners import TaskRunner
from tidemark.driver.watch import Stop
from tidemark.ledger import state
from tidemark.protocol import sinks

Log = Callable[[str], None]
Sinks = dict[str, sinks.ResolvedSink]  # the run's sinks by name


class LedgerSession:
    """The run's own ledger session: the claim takes the run's owner lock on it, which tells
    recovery that this process is alive. The one thing of a run that may change: a session
    lost during a decision is replaced (:meth:`reconnect`)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.conn: psycopg.Connection = connect(dsn, autocommit=True, what="ledger")

    def reconnect(self, run_id: int) -> None:
        """A new session, holding the owner's lock again (recovery may meanwhile have
        aborted what it saw as orphaned: the transitions then refuse, and we say so)."""
        self.conn.close()
        self.conn = connect(self.dsn, autocommit=True, what="ledger")
        state.hold_owner_lock(self.conn, run_id)

    def close(self) -> None:
        self.conn.close()


@dataclass
class Clock:
    """Where the time went: phase -> the monotonic time it ended."""

    ends: dict[str, float] = field(default_factory=dict)

    def mark(self, phase: str) -> None:
        self.ends[phase] = time.monotonic()


@dataclass(frozen=True)
class RunContext:
    """One claimed run, as its steps see it. ``report`` is what the run says at its end,
    filled in by the steps as they go; ``sinks`` are the claimed sinks by name."""

    pipeline: Pipeline
    settings: Settings
    mode: Mode
    quality: QualityPath
    runner: TaskRunner
    claim: Claim
    sinks: Sinks
    ledger: LedgerSession
    report: RunReport
    log: Log
    clock: Clock
    stop: Stop
    by: str | None  # who asked (a re-delivery resolves their letters in this name)
    dry_run: bool

    @property
    def run_id(self) -> int:
        return self.claim.run_id

    @property
    def exactly_once(self) -> bool:
        return self.pipeline.delivery == "exactly_once"
