"""Where a run's write tasks run (step 2 of tidemark/driver/run.py): one strategy per run,
chosen once from ``Settings.engine`` (:func:`runner_for`).

* :class:`SparkRunner`: the batch is a Spark DataFrame; Spark reads, decodes and transforms
  it and runs one write task per layout task (mapInArrow), retrying a failed task.
* :class:`ConnectRunner`: as SparkRunner, on a Spark Connect server (``Engine.CONNECT``).
* :class:`LocalRunner`: no JVM. The run's process reads the same Arrow batches from the
  source, decodes and transforms them in Arrow (tidemark/engine/local_records.py) and hands
  them to the same task code (tidemark/engine/writer.py: run_task), task by task, as the
  layout spreads them, retrying a failed task as Spark does. A task's next batches are read,
  decoded and transformed in a thread beside it while it encodes and COPYs
  (tidemark/core/ahead.py): Arrow and ADBC release the GIL, and PostgreSQL takes the COPY on
  the other core. For tests and pipelines up to a few million records:
  it refuses, before the claim, what needs Spark (:meth:`LocalRunner.refusal`): a transform
  expression, data-quality checks, a backfill's fallback versions.

Both give the write the same things: the batch's sink columns, the tasks' results (a
:class:`~tidemark.driver.checking.Job`), the reader's time.
"""

from __future__ import annotations

import contextlib
import os
import re
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from tidemark.config import Pipeline
from tidemark.core.ahead import Ahead
from tidemark.core.clock import Phases
from tidemark.core.db import one_line
from tidemark.core.dsn import mask
from tidemark.core.engines import Engine
from tidemark.core.errors import BadInput, Terminated, terminated_in
from tidemark.core.ranges import Range
from tidemark.core.settings import Settings
from tidemark.driver import checking
from tidemark.driver.checking import Job, NoChecks, QualityPath, Strategy
from tidemark.driver.modes import Layout, LayoutKind, Mode
from tidemark.protocol.taskspec import TaskResult, TaskSpec

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from tidemark.driver.fallback import Fallback, SinkPlan

Log = Callable[[str], None]
# A DataFrame (SparkRunner) or a LocalBatch: only its runner looks inside.
Batch = Any
# As spark.task.maxFailures (tidemark/engine/session.py): a task's tries before the job fails.
TASK_TRIES = 4
# The local runner's batches read, decoded and transformed ahead of the write (each up to
# sources.schema.BATCH_ROWS records): enough to keep the COPY fed, little memory.
READ_AHEAD = 3


class TaskRunner(ABC):
    engine: Engine

    def refusal(self, mode: Mode, pipeline: Pipeline) -> str | None:
        """Why this runner cannot run ``pipeline`` in ``mode`` (None: it can)."""
        return None

    @abstractmethod
    def parallelism(self) -> int:
        """How many tasks run side by side (a layout spreads a small batch over them)."""

    @abstractmethod
    def reader_clock(self) -> Callable[[], dict[str, float]]:
        """From now: a function saying the reader's time since, per phase."""

    @abstractmethod
    def read(self, mode: Mode, pipeline: Pipeline, read: list[Range]) -> Batch:
        """The batch: the mode's records of ``read``, decoded and transformed."""

    @abstractmethod
    def columns(self, batch: Batch) -> list[tuple[str, str]]:
        """(name, PostgreSQL type) of the sink columns the batch carries."""

    def cache(self, batch: Batch) -> Batch:
        """The batch, read once for the several passes over it that follow."""
        return batch

    def release(self, batch: Batch) -> None:  # noqa: B027 - nothing to free by default
        """The cache of :meth:`cache` freed."""

    @abstractmethod
    def count(self, batch: Batch) -> int: ...

    def choose(
        self,
        path: QualityPath,
        checks: Pipeline,
        batch: Batch,
        run_id: int,
        may_check_while_writing: Callable[[], bool],
    ) -> Strategy:
        return checking.choose(path, checks, batch, run_id, may_check_while_writing)

    def refusals(
        self, pipeline: Pipeline, batch: Batch, plans: dict[str, SinkPlan]
    ) -> dict[str, str]:
        """A backfill's sinks refused before anything is prepared (fallback.refusals)."""
        raise NotImplementedError(f"engine {self.engine}: no backfill fallback")

    def fallback(
        self,
        pipeline: Pipeline,
        mode: Mode,
        batch: Batch,
        plans: dict[str, SinkPlan],
        log: Log,
    ) -> Fallback | None:
        """A backfill's fallback versions (fallback.attach)."""
        raise NotImplementedError(f"engine {self.engine}: no backfill fallback")

    @abstractmethod
    def run(self, batch: Batch, spec: TaskSpec, layout: Layout, run_id: int, log: Log) -> Job:
        """The write tasks, one per layout task, each returning its TaskResult; a job that
        failed after its retries says why. SIGTERM (Terminated) stops it and is raised."""


class SparkRunner(TaskRunner):
    """The write tasks in Spark: the given session, or one started on first use."""

    engine = Engine.SPARK

    def __init__(
        self,
        spark: SparkSession | None,
        settings: Settings,
        app: str,
        conf: dict[str, str] | None = None,
    ) -> None:
        self._spark = spark
        self.master, self.app = settings.spark_master, app
        self.conf = conf or {}  # the pipeline's `spark:` block (docs/production.md)

    @property
    def spark(self) -> SparkSession:
        if self._spark is None:
            from tidemark.engine.session import session

            self._spark = session(self.master, self.app, conf=self.conf)
        return self._spark

    def parallelism(self) -> int:
        return self.spark.sparkContext.defaultParallelism

    def reader_clock(self) -> Callable[[], dict[str, float]]:
        from tidemark.sources import read_clock

        sc = self.spark.sparkContext
        before = dict(read_clock.clock(sc).value)
        return lambda: read_clock.since(sc, before)

    def read(self, mode: Mode, pipeline: Pipeline, read: list[Range]) -> Batch:
        from tidemark.engine import records

        return records.rows(mode.source(self.spark, pipeline, read), pipeline)

    def columns(self, batch: Batch) -> list[tuple[str, str]]:
        from tidemark.engine import records

        return records.output_columns(batch)

    def cache(self, batch: Batch) -> Batch:
        from pyspark import StorageLevel

        return batch.persist(StorageLevel.MEMORY_AND_DISK)

    def release(self, batch: Batch) -> None:
        batch.unpersist()

    def count(self, batch: Batch) -> int:
        return int(batch.count())

    def refusals(
        self, pipeline: Pipeline, batch: Batch, plans: dict[str, SinkPlan]
    ) -> dict[str, str]:
        from tidemark.driver import fallback

        return fallback.refusals(self.spark, pipeline, batch, plans)

    def fallback(
        self,
        pipeline: Pipeline,
        mode: Mode,
        batch: Batch,
        plans: dict[str, SinkPlan],
        log: Log,
    ) -> Fallback | None:
        from tidemark.driver import fallback

        return fallback.attach(self.spark, pipeline, mode, batch, plans, log)

    def run(self, batch: Batch, spec: TaskSpec, layout: Layout, run_id: int, log: Log) -> Job:
        from tidemark.driver.watch import Progress
        from tidemark.engine.writer import RESULT_SCHEMA, make_task

        df = laid_out(batch, layout)
        progress = Progress(self.spark, run_id, layout.tasks, log)
        progress.start()
        try:
            rows = df.mapInArrow(make_task(spec), RESULT_SCHEMA).collect()
        except Terminated:
            self.spark.sparkContext.cancelAllJobs()
            raise
        # Blind on purpose: the job fails as Py4J, PySpark or a lost JVM connection says; each
        # is the job failing after its retries, and the run rolls back.
        except Exception as exc:  # noqa: BLE001
            term = terminated_in(exc)  # SIGTERM inside the Py4J call, wrapped by Py4J
            if term is not None:
                raise term from exc
            return Job([], f"Spark job failed: {_spark_error(exc)}")
        finally:
            progress.stop()
        return Job([TaskResult.model_validate_json(r["result"]) for r in rows])


def laid_out(df: DataFrame, layout: Layout) -> DataFrame:
    """The batch as the layout spreads it over the write tasks (classic Spark and Connect)."""
    if layout.kind is LayoutKind.SPREAD:
        return df.repartition(layout.tasks, *(layout.by or []))
    if layout.kind is LayoutKind.TOGETHER:
        return df.coalesce(1)
    return df


# -- Spark Connect ---------------------------------------------------------------------------
# The same DataFrames and task code as SparkRunner, run by a Spark Connect server's Python
# workers, which import tidemark from the session's artifact (tidemark/engine/connect_session.py).
# What a Connect session lacks, it does without: no SparkContext (the server's parallelism,
# its job interrupted by tag on SIGTERM, progress lines from the server's progress reports:
# tidemark/driver/connect_progress.py) and no accumulators (the reader's own time per phase
# is not reported; the write tasks' phases come back in their results as on Spark).
# docs/production.md, "Spark Connect".


class ConnectRunner(SparkRunner):
    """The write tasks on the Connect server at ``remote``: the given session, or the one
    the runs of this package share there (connect_session.remote_session), opened on first
    use. Its jobs carry a tag of this process: SIGTERM interrupts them, not other runs'."""

    engine = Engine.CONNECT

    def __init__(
        self,
        remote: str,
        spark: SparkSession | None,
        settings: Settings,
        app: str,
        conf: dict[str, str] | None = None,
    ) -> None:
        super().__init__(spark, settings, app, conf)
        self.remote = remote
        self._parallelism: int | None = None

    def refusal(self, mode: Mode, pipeline: Pipeline) -> str | None:
        self.spark  # noqa: B018 - the session now, before the claim: unreachable is BadInput
        return None

    @property
    def spark(self) -> SparkSession:
        if self._spark is None:
            from tidemark.engine.connect_session import remote_session

            self._spark = remote_session(self.remote, self.app, self.conf)
        return self._spark

    def parallelism(self) -> int:
        if self._parallelism is None:
            from tidemark.engine import connect_session

            self._parallelism = connect_session.parallelism(self.spark)
        return self._parallelism

    def reader_clock(self) -> Callable[[], dict[str, float]]:
        return dict  # no accumulators through Connect: the reader's phases stay unreported

    def run(self, batch: Batch, spec: TaskSpec, layout: Layout, run_id: int, log: Log) -> Job:
        from tidemark.driver.connect_progress import ConnectProgress
        from tidemark.engine.writer import make_task

        df = laid_out(batch, layout)
        tag = f"tidemark-run-{run_id}-{os.getpid()}"
        self.spark.addTag(tag)
        progress = ConnectProgress(self.spark, run_id, log)
        progress.start()
        try:
            rows = df.mapInArrow(make_task(spec), _result_struct()).collect()
        except Terminated:
            # The server runs a query on after its client stops waiting: stop it now. A task
            # inside a PostgreSQL statement finishes it first and may still PREPARE after the
            # run rolled back: recovery rolls that back (docs/design.md, "Recovery").
            self.spark.interruptTag(tag)
            raise
        # Blind on purpose, as SparkRunner: gRPC, PySpark or the server's error all say the
        # job failed after its retries; the run rolls back.
        except Exception as exc:  # noqa: BLE001
            return Job([], f"Spark Connect job failed: {_spark_error(exc)}")
        finally:
            progress.stop()
            self.spark.removeTag(tag)
        return Job([TaskResult.model_validate_json(r["result"]) for r in rows])


@dataclass(frozen=True)
class LocalBatch:
    """The local runner's batch: what to read, read by each task as it runs (as Spark's
    tasks read theirs), and the schema of its transformed records."""

    mode: Mode
    pipeline: Pipeline
    read: list[Range]
    schema: pa.Schema


Records = Callable[[], Iterator[pa.RecordBatch]]  # a task's records, read afresh per try


class LocalRunner(TaskRunner):
    """The write tasks in this process, one after the other, without Spark."""

    engine = Engine.LOCAL

    def __init__(self) -> None:
        self.phases = Phases()  # the reader's time, every read of the runner
        # One reader connection for all the tasks of a job (run), opened at the first read:
        # an ADBC connection costs 0.2 to 0.4 s to open (its driver loads PostgreSQL's types),
        # a connection per range was most of a 1,000-record run's read.
        self.reader: Any = None
        self.sharing = False
        self._next: Ahead[pa.RecordBatch] | None = None  # the next task's, read ahead
        self._reads: list[Ahead[pa.RecordBatch]] = []  # started in this job, maybe running

    def refusal(self, mode: Mode, pipeline: Pipeline) -> str | None:
        from tidemark.engine import local_records

        why = local_records.refusal(pipeline)
        if why is None and mode.quality(pipeline).has_quality():
            why = "it has data-quality checks (Great Expectations runs on Spark)"
        if why is None and mode.falls_back:
            why = f"a {mode.name}'s fallback versions are found by Spark"
        return why

    def parallelism(self) -> int:
        return 2  # as the tests' Spark master local[2,4]: a small batch still spreads

    def reader_clock(self) -> Callable[[], dict[str, float]]:
        before = dict(self.phases.seconds)
        return lambda: {k: round(v - before.get(k, 0.0), 3) for k, v in self.phases.seconds.items()}

    def read(self, mode: Mode, pipeline: Pipeline, read: list[Range]) -> Batch:
        from tidemark import sources
        from tidemark.engine import local_records

        empty = pa.RecordBatch.from_pylist([], schema=sources.SCHEMA)
        return LocalBatch(mode, pipeline, read, local_records.rows(empty, pipeline).schema)

    def columns(self, batch: Batch) -> list[tuple[str, str]]:
        from tidemark.engine import local_records

        return local_records.output_columns(batch.schema)

    def count(self, batch: Batch) -> int:
        return sum(b.num_rows for b in self._rows(batch, batch.read))

    def choose(
        self,
        path: QualityPath,
        checks: Pipeline,
        batch: Batch,
        run_id: int,
        may_check_while_writing: Callable[[], bool],
    ) -> Strategy:
        assert not checks.has_quality()  # refusal() said so before the claim
        return NoChecks()

    def run(self, batch: Batch, spec: TaskSpec, layout: Layout, run_id: int, log: Log) -> Job:
        self.sharing = True
        try:
            return self._run(batch, spec, layout, run_id, log)
        finally:
            self._stop_reads()
            self.sharing = False
            self._close_reader()

    def _run(self, batch: Batch, spec: TaskSpec, layout: Layout, run_id: int, log: Log) -> Job:
        from tidemark.engine.writer import run_task

        results = []
        tasks = self._tasks(batch, layout)
        for task in range(len(tasks)):
            failure: BaseException | None = None
            for attempt in range(TASK_TRIES):
                # Read, decode and transform ahead in a thread of their own while this one
                # encodes and COPYs; stopped and waited for before anything else touches the
                # reader connection (a retry, the job's end). A first try's records were
                # read ahead already from the end of the previous task's.
                ahead, self._next = self._next, None
                if ahead is None:
                    ahead = self._ahead(tasks, task)
                ahead.then = partial(self._read_next, tasks, task + 1)
                try:
                    with ahead as batches:
                        result = run_task(spec, task, attempt, iter(batches))
                    self._reads.remove(ahead)  # closed, ended
                except Terminated:
                    raise
                # Blind as Spark is: a task that raises is tried again, then fails the job.
                except Exception as exc:  # noqa: BLE001
                    failure = exc
                    self._stop_reads()  # the next task's too: read again when its turn comes
                    self._close_reader()  # the next try connects afresh
                    log(f"run {run_id}: write task {task} attempt {attempt} failed: {exc}")
                    continue
                results.append(result)
                break
            else:
                assert failure is not None
                why = mask(f"{type(failure).__name__}: {one_line(failure)}")
                return Job([], f"write task {task} failed {TASK_TRIES} times: {why}")
        return Job(results)

    def _ahead(self, tasks: list[Records], task: int) -> Ahead[pa.RecordBatch]:
        ahead: Ahead[pa.RecordBatch] = Ahead(tasks[task], READ_AHEAD, f"tidemark-read-task-{task}")
        self._reads.append(ahead)  # before it starts: a SIGTERM from here on still stops it
        return ahead.start()

    def _read_next(self, tasks: list[Records], task: int) -> None:
        """At the end of a task's records (its reads done): the next task's first try starts
        reading, while this one writes its last rows and prepares."""
        if task < len(tasks):
            self._next = self._ahead(tasks, task)

    def _stop_reads(self) -> None:
        """Every read-ahead stopped and ended: nothing uses the reader connection now."""
        self._next = None
        while self._reads:
            self._reads[-1].close()
            self._reads.pop()

    def _reader_for(self, pipeline: Pipeline) -> Any:
        """The job's reader connection, opened now if need be; None outside a job (each
        read then has its own) or for a source other than postgres_log."""
        from tidemark import sources
        from tidemark.config import PostgresLogSource
        from tidemark.sources import postgres_log

        source = sources.reader_source(pipeline)
        if not self.sharing or not isinstance(source, PostgresLogSource):
            return None
        if self.reader is None:
            with self.phases("read"):
                self.reader = postgres_log.connect_reader(source)
        return self.reader

    def _close_reader(self) -> None:
        reader, self.reader = self.reader, None
        if reader is not None:
            from tidemark.sources import postgres_log

            with contextlib.suppress(postgres_log.adbc_error()):
                reader.close()

    def _rows(self, batch: LocalBatch, read: list[Range]) -> Iterator[pa.RecordBatch]:
        from tidemark.engine import local_records

        reader = partial(self._reader_for, batch.pipeline)
        for b in batch.mode.arrow(batch.pipeline, read, self.phases, reader):
            with self.phases("transform"):
                rows = local_records.rows(b, batch.pipeline)
            yield rows

    def _tasks(self, batch: LocalBatch, layout: Layout) -> list[Records]:
        """Each task's records, as Spark hands them to the layout's tasks."""
        if layout.kind is LayoutKind.RANGES:
            assert len(batch.read) == layout.tasks, (len(batch.read), layout.tasks)
            return [partial(self._rows, batch, [r]) for r in batch.read]
        if layout.kind in (LayoutKind.TOGETHER, LayoutKind.RECORDS):
            return [partial(self._rows, batch, batch.read)]
        # spread: every record with the same values of the key columns in one task
        whole = pa.Table.from_batches(list(self._rows(batch, batch.read)), schema=batch.schema)
        keys = [whole.column(c).to_pylist() for c in layout.by or []]
        bucket = pa.array(
            [zlib.crc32(repr(k).encode()) % layout.tasks for k in zip(*keys, strict=True)],
            pa.int32(),
        )
        parts = [whole.filter(pc.equal(bucket, t)) for t in range(layout.tasks)]
        return [partial(_batches, t) for t in parts]


def _batches(table: pa.Table) -> Iterator[pa.RecordBatch]:
    return iter(table.to_batches())


def runner_for(
    settings: Settings,
    spark: SparkSession | None,
    app: str,
    conf: dict[str, str] | None = None,
) -> TaskRunner:
    """The run's runner: Spark with the given session (else one started with the pipeline's
    ``conf``), or as ``settings.engine`` says; a Spark Connect endpoint (the pipeline's
    ``spark.remote``, else ``settings.spark_remote``) makes Spark Connect's unless the engine
    is local (:class:`ConnectRunner`)."""
    from tidemark.engine.connect_session import REMOTE, is_connect

    remote = (conf or {}).get(REMOTE) or settings.spark_remote
    if spark is not None and is_connect(spark):
        return ConnectRunner(remote or "", spark, settings, app, conf)
    if spark is not None:
        return SparkRunner(spark, settings, app, conf)
    if settings.engine is Engine.CONNECT or (remote and settings.engine is Engine.SPARK):
        if not remote:
            raise BadInput(
                "engine connect needs a Spark Connect endpoint: set TIDEMARK_SPARK_REMOTE "
                "(sc://host:port) or spark.remote in the pipeline's spark: block"
            )
        return ConnectRunner(remote, None, settings, app, conf)
    if settings.engine is Engine.SPARK:
        from tidemark.engine.session import connect_mode_refusal

        refusal = connect_mode_refusal()  # now, before the claim: the session starts later
        if refusal is not None:
            raise BadInput(refusal)
        return SparkRunner(spark, settings, app, conf)
    return LocalRunner()


def _result_struct() -> Any:
    """writer.RESULT_SCHEMA as a StructType: a DDL string costs a Spark Connect client a round
    trip to the server to parse it."""
    from pyspark.sql.types import IntegerType, StringType, StructField, StructType

    from tidemark.engine.writer import RESULT_SCHEMA

    fields = [f.split() for f in RESULT_SCHEMA.split(",")]
    types = {"int": IntegerType(), "string": StringType()}
    return StructType([StructField(n, types[t]) for n, t in fields])


_EXC_LINE = re.compile(r"^([\w.]+(Error|Exception|Terminated|Held|Fenced)): (.*)$")


def _spark_error(exc: BaseException) -> str:
    """The Python exception a failed task raised, as one line, out of Spark's wrapping."""
    found = None
    for line in str(exc).splitlines():
        m = _EXC_LINE.match(line.strip())
        if m and not m.group(1).startswith(("org.apache", "java.", "py4j")):
            found = f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(3)}"
    return mask(found) if found else one_line(exc)
