"""What watches a run while it writes and decides (tidemark/driver/run.py): SIGTERM, the
lease's heartbeat, and the write's progress in the log."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

import psycopg
from pyspark.sql import SparkSession

from tidemark.core.db import connect
from tidemark.core.errors import Terminated, TidemarkError
from tidemark.ledger import state

Log = Callable[[str], None]


class Stop:
    """SIGTERM: abort if no sink has decided yet, else finish committing first."""

    def __init__(self) -> None:
        self.decided = False
        self.requested = False
        self._previous: Any = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        if not self.decided:
            raise Terminated("SIGTERM before the decision: rolled back")

    def check(self) -> None:
        if self.requested and not self.decided:
            raise Terminated("SIGTERM before the decision: rolled back")


class Heartbeat(threading.Thread):
    """Renews the run's leases every third of their lifetime, on a ledger connection of its
    own. A dropped connection is reopened (a restart or a network blip must not cost the
    lease); the run is fenced only if the lease really moved or expired, which the decision
    checks. As a context manager: beats while the block runs."""

    def __init__(self, dsn: str, pipeline: str, run_id: int, ttl: int) -> None:
        super().__init__(daemon=True, name="tidemark-heartbeat")
        self.args_ = (dsn, pipeline, run_id, ttl)
        self._stop_evt = threading.Event()
        self.beats = 0

    def run(self) -> None:
        dsn, pipeline, run_id, ttl = self.args_
        every = max(ttl / 3, 1)
        while not self._stop_evt.is_set():
            try:
                with connect(
                    dsn, autocommit=True, what="ledger", application="tidemark-heartbeat"
                ) as conn:
                    while not self._stop_evt.wait(every):
                        if state.heartbeat(conn, pipeline, run_id, ttl) == 0:
                            return  # the leases moved on: nothing left to renew
                        self.beats += 1
            except (psycopg.Error, TidemarkError):
                self._stop_evt.wait(min(every, 2.0))  # reconnect

    def stop(self) -> None:
        self._stop_evt.set()

    def __enter__(self) -> Heartbeat:
        self.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class Progress(threading.Thread):
    """Prints task progress of the write stage every few seconds."""

    def __init__(
        self, spark: SparkSession, run_id: int, tasks: int, log: Log, every: float = 5.0
    ) -> None:
        super().__init__(daemon=True, name="tidemark-progress")
        self.spark, self.run_id, self.tasks, self.log, self.every = spark, run_id, tasks, log, every
        self._stop_evt = threading.Event()

    def run(self) -> None:
        tracker = self.spark.sparkContext.statusTracker()
        started, last = time.monotonic(), None
        while not self._stop_evt.wait(self.every):
            done = running = 0
            total = self.tasks
            stages = tracker.getActiveStageIds()
            for sid in stages:
                info = tracker.getStageInfo(sid)
                if info:
                    done += info.numCompletedTasks
                    running += info.numActiveTasks
                    if len(stages) == 1:  # a spread run reads in one stage, writes in the next
                        total = info.numTasks
            line = progress_line(self.run_id, done, total, running, started)
            if line != last:
                self.log(line)
                last = line

    def stop(self) -> None:
        self._stop_evt.set()


def progress_line(run_id: int, done: int, total: int, running: int, started: float) -> str:
    """A run's progress line, on either engine: tasks done of all, running, seconds since
    ``started`` (time.monotonic)."""
    return (
        f"run {run_id}: writing, {done}/{total} tasks done, "
        f"{running} running, {time.monotonic() - started:.0f}s"
    )
