"""A run's progress lines on Spark Connect (tidemark/driver/runners.py: ConnectRunner). No
SparkContext, so no status tracker to poll (tidemark/driver/watch.py: Progress): the server
reports the query's stages to its client instead, when they change and at most every
spark.connect.progress.reportInterval (2 s by default), and PySpark hands each report to the
session's progress handlers. The latest report is logged on the classic engine's beat."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from pyspark.sql.connect.shell.progress import ProgressHandler, StageInfo

from tidemark.driver.watch import progress_line

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

Log = Callable[[str], None]


class _Latest(ProgressHandler):
    """The last report: (tasks done, tasks in all, tasks running)."""

    def __init__(self) -> None:
        self.seen: tuple[int, int, int] | None = None

    def __call__(
        self,
        stages: Iterable[StageInfo] | None,
        inflight_tasks: int,
        operation_id: str | None,
        done: bool,
    ) -> None:
        seen = list(stages or [])
        total = sum(s.num_tasks for s in seen)
        if total:
            self.seen = (sum(s.num_completed_tasks for s in seen), total, inflight_tasks)


class ConnectProgress(threading.Thread):
    """Logs the write job's tasks every ``every`` seconds while it runs, as Progress does on
    the classic engine (a job shorter than that says nothing)."""

    def __init__(self, spark: SparkSession, run_id: int, log: Log, every: float = 5.0) -> None:
        super().__init__(daemon=True, name="tidemark-connect-progress")
        self.spark, self.run_id, self.log, self.every = spark, run_id, log, every
        self.latest = _Latest()
        self._stop_evt = threading.Event()

    def start(self) -> None:
        # Reports reach the handlers of the session, whichever query they are of: the run's
        # job is the one query this process has running on it meanwhile.
        self.spark.registerProgressHandler(self.latest)
        super().start()

    def run(self) -> None:
        started, last = time.monotonic(), None
        while not self._stop_evt.wait(self.every):
            if self.latest.seen is None:
                continue  # no report yet
            done, total, running = self.latest.seen
            line = progress_line(self.run_id, done, total, running, started)
            if line != last:
                self.log(line)
                last = line

    def stop(self) -> None:
        self._stop_evt.set()
        self.spark.removeProgressHandler(self.latest)
