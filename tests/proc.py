"""Driving a real job process: start it, wait for a fault point, kill or resume it."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import threading
from pathlib import Path

from tidemark.core import faults
from tidemark.devstack.chaos.faults import signal_session


class JobProcess:
    """A `tidemark` CLI process in its own session (a crash kills all of it)."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        pause_dir: Path | None = None,
        pause_at: str | None = None,
        crash_at: str | None = None,
    ):
        env = faults.armed(env, pause_dir, pause_at, crash_at)
        self.pause_dir = pause_dir
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def __enter__(self) -> JobProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        """Nothing left running: a job still running at the block's end is killed."""
        if self.proc.poll() is None:
            self.kill_group()

    def wait_reached(self, timeout: float = 240) -> str:
        """Block until the job writes its pause point into the FIFO (or dies)."""
        fd = os.open(self.pause_dir / "reached", os.O_RDONLY | os.O_NONBLOCK)
        try:
            data = b""
            deadline = _Deadline(timeout)
            while b"\n" not in data:
                if self.proc.poll() is not None:
                    raise AssertionError(
                        f"job exited ({self.proc.returncode}) before its "
                        f"pause point:\n{self.output()}"
                    )
                ready, _, _ = select.select([fd], [], [], min(1.0, deadline.left()))
                if ready:
                    data += os.read(fd, 100)
                deadline.check("pause point")
            return data.decode().strip()
        finally:
            os.close(fd)

    def resume(self, timeout: float = 30) -> None:
        def opener():
            with open(self.pause_dir / "resume", "w") as fh:
                fh.write("go\n")

        t = threading.Thread(target=opener, daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            raise AssertionError("job never opened its resume FIFO")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill_group(self) -> None:
        """SIGKILL the job's session: its process group, and the PySpark worker daemon's
        (a group of its own in the same session), as a machine crash would."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        signal_session(self.proc.pid, signal.SIGKILL)

    def wait(self, timeout: float = 300) -> int:
        return self.proc.wait(timeout)

    def output(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        return self.proc.stdout.read() if self.proc.stdout else ""


def run_orders(env, *args: str, pause_at: str | None = None) -> JobProcess:
    """`tidemark run orders [args]` as a job process against the test's ``env``; with
    ``pause_at``, returned once it has reached that point (its FIFOs in ``env.tmp / "p"``)."""
    job = JobProcess(
        env.cli_argv("run", "orders", *args),
        env.cli_env(),
        pause_dir=env.tmp / "p" if pause_at else None,
        pause_at=pause_at,
    )
    if pause_at:
        job.wait_reached()
    return job


class _Deadline:
    def __init__(self, seconds: float):
        import time

        self._time = time
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - self._time.monotonic())

    def check(self, what: str) -> None:
        if self.left() <= 0:
            raise AssertionError(f"timed out waiting for {what}")
