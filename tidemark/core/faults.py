"""Named points in the protocol where tests kill or pause the job process.

``TIDEMARK_CRASH_AT=<point>`` sends SIGKILL to the job's whole process group (driver, JVM,
Python workers) at that point, as a machine crash would. ``TIDEMARK_PAUSE_AT=<point>`` with
``TIDEMARK_PAUSE_DIR=<dir>`` writes the point's name into the FIFO ``<dir>/reached`` and
blocks until a line arrives on the FIFO ``<dir>/resume``. ``TIDEMARK_FAIL_AT=<point>`` raises
in the first attempt of a Spark task there (the retry must clean up after it). Unset, each
costs one dict lookup.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

POINTS = (
    "after_claim",  # run planned, lease taken
    "task_after_prepare",  # inside a Spark task, after its first PREPARE TRANSACTION
    "before_verdict",  # a run checked while writing: every task prepared, not yet judged
    "after_prepare",  # every task prepared, before the decision
    "after_decide",  # decision committed, nothing committed on the sinks yet
    "before_commit_prepared",
    "mid_finish",  # after each COMMIT PREPARED of a chosen gid
    "after_finish",  # all chosen gids committed, checkpoints not yet advanced
    "after_advance",
)


def armed(
    env: dict[str, str],
    pause_dir: Path | None = None,
    pause_at: str | None = None,
    crash_at: str | None = None,
) -> dict[str, str]:
    """``env`` for a job process that pauses at ``pause_at`` (the FIFOs are made in
    ``pause_dir``) or crashes at ``crash_at``: the other half of :func:`point`."""
    env = dict(env)
    if pause_at:
        assert pause_at in POINTS, pause_at
        assert pause_dir is not None, "pausing needs a folder for the FIFOs"
        pause_dir.mkdir(parents=True, exist_ok=True)
        for name in ("reached", "resume"):
            os.mkfifo(pause_dir / name)
        env.update(TIDEMARK_PAUSE_AT=pause_at, TIDEMARK_PAUSE_DIR=str(pause_dir))
    if crash_at:
        assert crash_at in POINTS, crash_at
        env["TIDEMARK_CRASH_AT"] = crash_at
    return env


JOB_PGID = "TIDEMARK_JOB_PGID"
_paused: set[str] = set()


def mark_job_process_group() -> None:
    """Called by the driver before Spark starts, so its workers inherit it."""
    os.environ.setdefault(JOB_PGID, str(os.getpgrp()))


class InjectedFailure(RuntimeError):
    pass


def point(name: str, attempt: int | None = None) -> None:
    if os.environ.get("TIDEMARK_FAIL_AT") == name and attempt == 0:
        raise InjectedFailure(f"injected failure at {name}")
    if os.environ.get("TIDEMARK_CRASH_AT") == name:
        # PySpark's worker daemon has a process group of its own: kill the job's, then (in a
        # Spark task) the daemon's, which holds this worker and its siblings. A worker left
        # alive would go on preparing after the crash, perhaps after recovery ran.
        os.killpg(int(os.environ.get(JOB_PGID, os.getpgrp())), signal.SIGKILL)
        os.killpg(os.getpgrp(), signal.SIGKILL)
    if os.environ.get("TIDEMARK_PAUSE_AT") == name and name not in _paused:
        _paused.add(name)
        folder = os.environ["TIDEMARK_PAUSE_DIR"]
        with open(os.path.join(folder, "reached"), "w") as fh:
            fh.write(name + "\n")
        with open(os.path.join(folder, "resume")) as fh:
            fh.readline()
