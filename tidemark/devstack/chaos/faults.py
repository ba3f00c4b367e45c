"""Fault injection: a job process to pause at a protocol point (tidemark/core/faults.py's FIFOs),
kill, stop and continue; database backends to terminate; the server to crash-restart.

A job runs in its own session (``start_new_session``): the driver, its JVM and the PySpark
workers (whose daemon moves to a process group of its own) all keep that session id, so
signals go to every process of the session, and nothing is left behind.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import subprocess
import threading
import time
from pathlib import Path

import psycopg

from tidemark.core.faults import armed

KINDS = ("kill", "backends", "pg_restart", "sigstop")


def session_pids(sid: int) -> list[int]:
    """Every live process whose session id is ``sid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
        except OSError:
            continue
        # pid (comm) state ppid pgrp session ...; comm may hold spaces and parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 3 and int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def signal_session(sid: int, sig: int) -> int:
    sent = 0
    for _ in range(2):  # a second pass for anything forked during the first
        for pid in session_pids(sid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
                sent += 1
    return sent


class Job:
    """One `tidemark` process, optionally paused at a protocol point or crashing at one."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        *,
        cwd: Path,
        log_path: Path,
        pause_dir: Path,
        pause_at: str | None = None,
        crash_at: str | None = None,
    ):
        env = armed(env, pause_dir, pause_at, crash_at)
        self.pause_dir = pause_dir
        self.pause_at = pause_at
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in wait()/kill()
        self._log.write("$ " + " ".join(argv[1:]) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.pid = self.proc.pid
        self.stopped = False
        self.timed_out = False
        self._answering: threading.Thread | None = None
        self._done = threading.Event()

    # -- pause points -------------------------------------------------------------------------
    def wait_reached(self, timeout: float = 300) -> bool:
        """Block until the job writes its pause point into the FIFO; False if it exited
        (or the time ran out) without reaching it."""
        fd = os.open(self.pause_dir / "reached", os.O_RDONLY | os.O_NONBLOCK)
        try:
            data, end = b"", time.monotonic() + timeout
            while b"\n" not in data:
                if self.proc.poll() is not None or time.monotonic() > end:
                    return False
                ready, _, _ = select.select([fd], [], [], 0.5)
                if ready:
                    chunk = os.read(fd, 100)
                    if not chunk:
                        time.sleep(0.05)  # a writer closed: EOF until the next one opens
                    data += chunk
            return True
        finally:
            os.close(fd)

    def resume(self) -> None:
        """Let the paused job go on, and keep answering later pauses of the same point (a
        point inside Spark tasks pauses once per worker process) until the job exits."""
        if self._answering is not None or not self.pause_at:
            return
        self._answering = threading.Thread(
            target=self._answer, daemon=True, name=f"chaos-resume-{self.pid}"
        )
        self._answering.start()

    def _answer(self) -> None:
        reached = os.open(self.pause_dir / "reached", os.O_RDONLY | os.O_NONBLOCK)
        try:
            while not self._done.is_set() and self.proc.poll() is None:
                with contextlib.suppress(BlockingIOError):
                    os.read(reached, 4096)  # drain: later pausers never block on it
                try:
                    fd = os.open(self.pause_dir / "resume", os.O_WRONLY | os.O_NONBLOCK)
                except OSError as exc:
                    if exc.errno not in (errno.ENXIO, errno.ENOENT):
                        raise
                else:
                    try:
                        os.write(fd, b"go\n")
                    except OSError:
                        pass
                    finally:
                        os.close(fd)
                time.sleep(0.05)
        finally:
            os.close(reached)

    # -- signals ------------------------------------------------------------------------------
    def stop(self) -> None:
        self.stopped = True
        signal_session(self.pid, signal.SIGSTOP)

    def cont(self) -> None:
        signal_session(self.pid, signal.SIGCONT)
        self.stopped = False

    def kill(self) -> None:
        """SIGKILL the job's process group and everything else in its session."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        signal_session(self.pid, signal.SIGKILL)
        if self.stopped:
            signal_session(self.pid, signal.SIGCONT)
            self.stopped = False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float = 600) -> tuple[int | None, int | None]:
        """(exit code, None) or (None, signal). Kills the job if it outlives ``timeout``."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.timed_out = True
            self.kill()
            code = self.proc.wait(30)
        self.reap()
        return (None, -code) if code < 0 else (code, None)

    def reap(self) -> None:
        """The job is gone: stop answering, close its log, kill whatever of it is left."""
        self._done.set()
        signal_session(self.pid, signal.SIGKILL)
        if not self._log.closed:
            self._log.close()

    def tail(self, lines: int = 12) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])


def terminate_backends(dsn: str) -> list[str]:
    """pg_terminate_backend every backend whose application_name starts with 'tidemark'
    (all of them: the job's driver, heartbeat, tasks' and commit connections)."""
    with psycopg.connect(dsn, autocommit=True, application_name="chaos-fault") as conn:
        rows = conn.execute(
            """SELECT pid, datname, application_name, pg_terminate_backend(pid)
               FROM pg_stat_activity WHERE application_name LIKE 'tidemark%%'
               AND pid <> pg_backend_pid()"""
        ).fetchall()
    return [f"{app}@{db}" for _pid, db, app, ok in rows if ok]
