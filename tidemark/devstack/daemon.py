"""What the devstack's daemons (tidemark/devstack/airflow_stack.py, spark_cluster.py,
connect_server.py) share: each runs in a process group (a session) of its own, recorded by
pid, stopped by signalling its group; and a command line that runs one action of them."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

Signal = Callable[[int, int], None]


def alive(pid: int) -> bool:
    """``pid`` runs: it exists (perhaps as another user's) and is no zombie (a child of
    ours that exited stays one until reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] != "Z"
    except OSError:
        return False


def recorded(pidfile: Path) -> int | None:
    """The pid in ``pidfile`` while it runs; None if there is none or it has exited."""
    try:
        pid = int(pidfile.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return pid if alive(pid) else None


def signal_group(pid: int, sig: int) -> None:
    """``sig`` to the process group ``pid`` leads (gone or not ours: nothing to do)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def wait_exit(pid: int, timeout: float) -> None:
    """Until ``pid`` exits (reaped if it is our child), at most ``timeout`` seconds."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        select.select([fd], [], [], max(timeout, 0.0))
    finally:
        os.close(fd)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def stop_groups(pids: Iterable[int], timeout: float, send: Signal = signal_group) -> None:
    """SIGTERM each daemon's group, await the daemons' exit for at most ``timeout`` seconds,
    then SIGKILL each group (what its daemon started may outlive it) and await that."""
    pids = list(pids)
    for pid in pids:
        send(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for pid in pids:
        wait_exit(pid, deadline - time.monotonic())
    for pid in pids:
        send(pid, signal.SIGKILL)
    for pid in pids:
        wait_exit(pid, 10.0)


def run_action(prog: str, action: str, act: Callable[[], int], errors: type[Exception]) -> int:
    """A devstack command's ``action``: its exit code, or 1 with one line on stderr when it
    fails with one of ``errors`` (or OSError)."""
    try:
        return act()
    except (errors, OSError) as exc:
        print(f"{prog}: {action} failed: {exc}", file=sys.stderr)
        return 1
