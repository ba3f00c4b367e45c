"""Every call chaos makes into Tidemark's library or command line, in one place.

``InProcess`` runs operations against one warm SparkSession (a fresh `tidemark run` process
costs 15-25 s of JVM start and Great Expectations import); ``Subprocess`` starts the same
operations as `python -m tidemark ...` processes, which is what a fault needs (a process to
kill, pause or stop). Both have the same methods. The library's Python API may change: adapt
it here, nowhere else.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial

import psycopg

from tidemark.core.ranges import Range
from tidemark.devstack.chaos.faults import Job
from tidemark.devstack.chaos.world import PIPELINE, World
from tidemark.ledger.state import RunState

# Exit codes of the CLI (README "Exit codes"): 0 done, 1 failed, 2 bad input, 3 lease held,
# 4 fenced, 5 halted (an inconsistency, the quarantine ceiling), 143 SIGTERM; 70 an internal error (a bug).
INTERNAL = 70


@dataclass
class Outcome:
    code: int | None  # None: killed by a signal
    text: str
    signal: int | None = None
    # A backfill as the CLI says it (backfill_as_cli): the ranges it chose, what it said.
    ranges: list[Range] = field(default_factory=list)
    said: list[str] = field(default_factory=list)
    late: list[tuple[str, int, int, int, str]] = field(default_factory=list)  # InProcess.late

    @property
    def ok(self) -> bool:
        return self.code == 0

    @property
    def internal_error(self) -> bool:
        return self.code == INTERNAL

    def __str__(self) -> str:
        head = f"killed (signal {self.signal})" if self.code is None else f"exit {self.code}"
        return f"{head}: {self.text}" if self.text else head


def _one_line(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class InProcess:
    """Operations in this process, on a warm SparkSession."""

    def __init__(self, world: World, spark, lock_timeout_ms: int = 10_000):
        self.world = world
        self.spark = spark
        self.lock_timeout_ms = lock_timeout_ms
        self.log: list[str] = []

    def _settings(self):
        from tidemark.core.settings import Settings

        return Settings(
            ledger_dsn=self.world.ledger_dsn,
            pipelines_dir=self.world.pipelines_dir,
            data_docs_dir=self.world.docs_dir,
            spark_master="local[2,4]",
            lock_timeout_ms=self.lock_timeout_ms,
        )

    def _pipelines(self) -> dict:
        from tidemark import config

        good, _bad = config.load_all(self.world.pipelines_dir)
        return good

    def _call(self, fn) -> Outcome:
        import click

        from tidemark.core.errors import TidemarkError

        self.log = []
        try:
            return fn()
        except click.ClickException as exc:  # the CLI's usage errors (exit 2)
            return Outcome(exc.exit_code, _one_line(f"usage: {exc.format_message()}"))
        except TidemarkError as exc:
            return Outcome(exc.exit_code, _one_line(f"{type(exc).__name__}: {exc}"))
        except psycopg.Error as exc:
            return Outcome(1, _one_line(f"database error: {exc}"))
        except Exception as exc:  # noqa: BLE001 - the CLI would exit 70: a bug, reported
            tb = traceback.format_exc(limit=-4)
            return Outcome(
                INTERNAL, _one_line(f"internal error {type(exc).__name__}: {exc}", 400) + "\n" + tb
            )

    def _execute(self, runner) -> Outcome:
        """``runner(pipeline, settings, **common)`` (a Run, or one of its kinds) made with the
        keywords every run takes here, executed: its report as an outcome."""

        def go():
            all_p = self._pipelines()
            report = runner(
                all_p[PIPELINE],
                self._settings(),
                ledger_dsn=self.world.ledger_dsn,
                all_pipelines=all_p,
                spark=self.spark,
                log=self.log.append,
            ).execute()
            return Outcome(0 if report.ok or report.run_id is None else 1, _report(report))

        return self._call(go)

    def run(self, sinks: list[str] | None = None) -> Outcome:
        from tidemark.driver.run import Run

        return self._execute(partial(Run, sink_names=sinks))

    def backfill(
        self,
        partition: int,
        start: int,
        end: int,
        sinks: list[str] | None = None,
        accept_pruned: bool = False,
    ) -> Outcome:
        from tidemark.driver.modes import Backfill
        from tidemark.driver.run import Run

        extra = {"accept_pruned": True} if accept_pruned else {}
        return self._execute(
            partial(Run, mode=Backfill([Range(partition, start, end)], **extra), sink_names=sinks)
        )

    def backfill_as_cli(
        self,
        partition: int | str | None,
        start: int | None = None,
        end: int | None = None,
        since: str | None = None,
        until: str | None = None,
        sinks: list[str] | None = None,
    ) -> Outcome:
        """`tidemark backfill` as its command line says it (``--partition all``, ``--since`` /
        ``--until`` as ISO 8601 text): the CLI's own mapping to ranges, then the run. The
        outcome carries the ranges chosen and what the command said on stderr."""
        from tidemark.driver import windows
        from tidemark.driver.modes import Backfill
        from tidemark.driver.run import Run

        def at(text: str | None) -> datetime | None:  # as the CLI reads --since/--until
            return None if text is None else windows.utc(datetime.fromisoformat(text))

        def go():
            ranges, said = windows.backfill_ranges(
                self._settings().ledger(),
                self._pipelines()[PIPELINE],
                partition,
                start,
                end,
                at(since),
                at(until),
                sinks,
            )
            if not ranges:
                return Outcome(0, "nothing committed in what was asked", said=said)
            out = self._execute(partial(Run, mode=Backfill(ranges), sink_names=sinks))
            out.ranges, out.said = list(ranges), said
            return out

        return self._call(go)

    def rebuild(self, sink: str, accept_pruned: bool = False) -> Outcome:
        from tidemark.driver.modes import Rebuild
        from tidemark.driver.run import Run

        extra = {"accept_pruned": True} if accept_pruned else {}
        return self._execute(partial(Run, mode=Rebuild(sink, **extra), sink_names=[sink]))

    def late(self) -> Outcome:
        """What `tidemark recover` and `status` report as records that appeared below a
        checkpoint (tidemark/driver/late.py): ``late`` holds (sink, partition, from, to,
        command) per report."""

        def go():
            from tidemark.core.db import connect
            from tidemark.driver import late as late_records

            with connect(self.world.ledger_dsn, autocommit=True, what="ledger") as conn:
                found, unknown = late_records.find(conn, self._pipelines())
            out = Outcome(1 if unknown else 0, "; ".join(unknown) or f"{len(found)} report(s)")
            for x in found:
                m = re.search(r"--partition (\d+) --from (\d+) --to (\d+)", x.command)
                sink = re.search(r"--sink (\S+)", x.command)
                if m is None:
                    out.code, out.text = 1, f"a late report without its backfill: {x.line()}"
                    continue
                out.late.append(
                    (sink[1] if sink else "", int(m[1]), int(m[2]), int(m[3]), x.command)
                )
            return out

        return self._call(go)

    def redrive(self, ids: list[int], by: str = "chaos") -> Outcome:
        from tidemark.driver.redrive import redrive_run

        return self._execute(partial(redrive_run, ids=ids, by=by))

    def discard(self, ids: list[int], note: str = "chaos", by: str = "chaos") -> Outcome:
        from tidemark.ledger import dlq

        def go():
            with psycopg.connect(
                self.world.ledger_dsn, autocommit=True, application_name="tidemark-chaos"
            ) as conn:
                res = dlq.discard(conn, ids, note, by)
            text = f"discarded {res.changed or 'none'}"
            if res.skipped:
                text += f", skipped {sorted(res.skipped)}"
            return Outcome(0 if res.changed else 1, text)

        return self._call(go)

    def prune(self, runs: bool = False) -> Outcome:
        """`tidemark prune --pipeline chaos` with no keeping time for letters (and runs)."""
        from tidemark.protocol.prune import Policy, prune

        def go():
            policy = Policy(letters_days=0, runs_days=0 if runs else 36500, requests_days=0)
            summary = prune(self.world.ledger_dsn, policy, self.world.docs_dir, pipeline=PIPELINE)
            return Outcome(0, _one_line("; ".join(summary.lines()), 300))

        return self._call(go)

    def recover(self) -> Outcome:
        from tidemark.protocol.recovery import recover

        def go():
            rep = recover(self.world.ledger_dsn, self._pipelines(), self._settings().gid_prefix)
            text = rep.summary() + "".join(f"; error: {e}" for e in rep.errors)
            return Outcome(0 if rep.ok else 1, _one_line(text, 400))

        return self._call(go)


def _report(report) -> str:
    if report.run_id is None:
        return _one_line(report.message)
    parts = [f"run {report.run_id} {report.mode} {report.records} read"]
    for s in report.sinks.values():
        tail = f" ({_one_line(s.error, 100)})" if s.error and s.state != RunState.COMMITTED else ""
        parts.append(f"{s.sink}={s.state}:{s.counts.rows}+{s.counts.dead}dlq{tail}")
    for s, why in report.skipped.items():
        parts.append(f"{s}=skipped ({_one_line(why, 60)})")
    if report.redrive is not None:
        r = report.redrive
        parts.append(
            f"redriven {r['redriven']}, failed again {len(r['failed_again'])}, "
            f"skipped {len(r['skipped'])}"
        )
    return "; ".join(parts)


class Subprocess:
    """The same operations as `python -m tidemark ...` processes (each its own session)."""

    def __init__(self, world: World, python: str = sys.executable):
        self.world = world
        self.python = python
        self.count = 0

    def env(self, **extra) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEMARK_")}
        env.update(
            {
                "TIDEMARK_LEDGER_DSN": self.world.ledger_dsn,
                "TIDEMARK_PIPELINES_DIR": str(self.world.pipelines_dir),
                "TIDEMARK_DATA_DOCS_DIR": str(self.world.docs_dir),
                "TIDEMARK_SPARK_MASTER": "local[2,4]",
                "TIDEMARK_LOCK_TIMEOUT_MS": "10000",
                "TIDEMARK_DRIVER_MEMORY": "1g",
                "PYTHONUNBUFFERED": "1",
                # A killed job leaves its Spark scratch behind: keep it in the world.
                "SPARK_LOCAL_DIRS": str(self.world.scratch_dir),
                "TMPDIR": str(self.world.scratch_dir),
            }
        )
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def _start(self, args: list[str], **how) -> Job:
        self.count += 1
        log = self.world.logs_dir / f"job-{self.count:04d}-{args[0]}.log"
        pause = self.world.root / "pause" / f"{self.count:04d}"
        return Job(
            [self.python, "-m", "tidemark", *args],
            self.env(**how.pop("env", {})),
            cwd=self.world.root,
            log_path=log,
            pause_dir=pause,
            **how,
        )

    def run(self, sinks: list[str] | None = None, **how) -> Job:
        return self._start(["run", PIPELINE, *_sink_args(sinks)], **how)

    def backfill(
        self, partition: int, start: int, end: int, sinks: list[str] | None = None, **how
    ) -> Job:
        return self._start(
            [
                "backfill",
                PIPELINE,
                "--partition",
                str(partition),
                "--from",
                str(start),
                "--to",
                str(end),
                *_sink_args(sinks),
            ],
            **how,
        )

    def rebuild(self, sink: str, **how) -> Job:
        return self._start(["sink", "rebuild", PIPELINE, sink], **how)

    def redrive(self, ids: list[int], by: str = "chaos", **how) -> Job:
        return self._start(["dlq", "redrive", PIPELINE, *map(str, ids), "--by", by], **how)

    def discard(self, ids: list[int], note: str = "chaos", by: str = "chaos", **how) -> Job:
        return self._start(["dlq", "discard", *map(str, ids), "--note", note, "--by", by], **how)

    def settle(self, run_id: int, **how) -> Job:
        return self._start(["settle", str(run_id)], **how)

    def recover(self, **how) -> Job:
        return self._start(["recover"], **how)


def _sink_args(sinks: list[str] | None) -> list[str]:
    return [a for s in sinks or [] for a in ("--sink", s)]


def spark_session():
    from tidemark.engine.session import session

    return session("local[2,4]", "tidemark-chaos")
