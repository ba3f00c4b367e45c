"""`make cluster`'s module without starting Spark: its command on a folder with no cluster,
and how it finds processes (tests/test_standalone.py runs the daemons)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tidemark.devstack import spark_cluster
from tidemark.devstack.spark_cluster import Layout, SparkCluster


def test_status_and_down_of_no_cluster_say_so(tmp_path, capsys):
    folder = str(tmp_path / "spark")
    assert spark_cluster.main(["status", "--dir", folder]) == 3
    assert capsys.readouterr().out.strip() == "stopped"
    assert spark_cluster.main(["down", "--dir", folder]) == 0
    assert "stopped" in capsys.readouterr().out


def test_a_recorded_pid_that_is_not_this_clusters_daemon_is_not_alive(tmp_path):
    """After a reboot a recorded pid may be anyone's: up must start the daemon again, and
    down must not signal that process."""
    cluster = SparkCluster(tmp_path, Layout(port=1, ui_port=2))
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) as other:
        try:
            assert not cluster._alive(other.pid, spark_cluster.MASTER_CLASS)
            cluster.layout.master_pid = other.pid
            cluster.down(timeout=1)
            assert other.poll() is None, "down signalled a process that is not its daemon"
        finally:
            other.kill()
    assert cluster.layout.master_pid is None
    assert SparkCluster(tmp_path).layout.port == 1  # the state file kept the layout


CHILD = """\
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
print(child.pid, flush=True)
time.sleep(30)
"""


def test_descendants_and_executor_pids():
    with subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True) as p:
        assert p.stdout is not None
        child = int(p.stdout.readline())
        try:
            assert spark_cluster.descendants(p.pid) == [child]
        finally:
            os.kill(child, signal.SIGKILL)
            p.kill()
    assert spark_cluster.executor_pids("app-that-does-not-run") == {}
