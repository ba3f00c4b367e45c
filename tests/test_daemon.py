"""The devstack's daemons' shared stop and pid checks (tidemark/devstack/daemon.py), on real
processes in sessions of their own."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tidemark.devstack import daemon

# A daemon that ignores SIGTERM, with a child in its group (as a worker's executors are).
STUBBORN = (
    "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
    "print(c.pid, flush=True); time.sleep(600)"
)


def _start(code: str) -> tuple[subprocess.Popen[str], str]:
    """The daemon, once it says it is ready (its first line)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_a_daemon_that_exits_on_sigterm_is_stopped_without_waiting_out_the_timeout(tmp_path):
    proc, _ = _start("import time; print('ready', flush=True); time.sleep(600)")
    pidfile = tmp_path / "d.pid"
    pidfile.write_text(str(proc.pid))
    assert daemon.recorded(pidfile) == proc.pid
    started = time.monotonic()
    daemon.stop_groups([proc.pid], timeout=60)
    assert time.monotonic() - started < 10
    # Our own child, reaped by the stop: gone, and its pid file names nothing running.
    assert not daemon.alive(proc.pid)
    assert daemon.recorded(pidfile) is None


def test_a_daemon_ignoring_sigterm_and_its_group_are_killed_after_the_timeout():
    proc, said = _start(STUBBORN)
    child = int(said)
    assert os.getpgid(child) == proc.pid
    started = time.monotonic()
    daemon.stop_groups([proc.pid], timeout=1)
    assert 1 <= time.monotonic() - started < 15
    proc.wait(10)  # reaped by the stop already (its status with it)
    assert not daemon.alive(proc.pid)
    daemon.wait_exit(child, 10)  # not ours: reaped by whoever adopted it
    assert not daemon.alive(child)  # the child went with its group


def test_a_zombie_or_garbage_pid_file_is_not_a_running_daemon(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, left unreaped
    assert not daemon.alive(proc.pid)  # exited, not yet reaped
    proc.wait()
    (tmp_path / "bad.pid").write_text("not a pid")
    assert daemon.recorded(tmp_path / "bad.pid") is None
    assert daemon.recorded(tmp_path / "none.pid") is None


def test_a_failed_action_is_one_line_and_exit_1(capsys):
    def fails() -> int:
        raise RuntimeError("port 7077 taken")

    assert daemon.run_action("tidemark.devstack.x", "up", fails, RuntimeError) == 1
    assert capsys.readouterr().err == "tidemark.devstack.x: up failed: port 7077 taken\n"
    assert daemon.run_action("tidemark.devstack.x", "status", lambda: 3, RuntimeError) == 3
