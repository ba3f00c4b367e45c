"""A Spark standalone cluster on this machine: one master and N workers (JVMs of the PySpark
in the venv), for `make cluster` and the suite's cluster tests.

The pip PySpark ships no start-master.sh / start-worker.sh, so the daemons are started with
``spark-class`` (which execs the JVM: the recorded pid is the daemon's own). Each runs in a
session of its own, so it outlives the command that started it, and its process group holds
the executor JVMs a worker forks. State (pids, ports) and logs stay in one folder; ``up`` is
idempotent: it starts only what is not running.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyspark

from tidemark.devstack import daemon

SPARK_HOME = Path(pyspark.__file__).resolve().parent
MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
EXECUTOR_CLASS = "org.apache.spark.executor.CoarseGrainedExecutorBackend"
DEFAULT_PORT = 7077
DEFAULT_UI_PORT = 8091  # Spark's 8080 is Airflow's (make up)


@dataclass
class Layout:
    """What `up` was asked for and what it started (saved as state.json)."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    ui_port: int = DEFAULT_UI_PORT
    workers: int = 2
    cores: int = 1
    memory: str = "1g"
    master_pid: int | None = None
    worker_pids: dict[str, int] = field(default_factory=dict)


class SparkCluster:
    def __init__(self, root: Path, layout: Layout | None = None):
        self.root = root
        saved = self._load()
        self.layout = layout or saved or Layout()
        if saved is not None and layout is not None:
            # Running daemons keep their pids; the ports are the running master's.
            self.layout.master_pid = saved.master_pid
            self.layout.worker_pids = saved.worker_pids

    # -- where things are -----------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"spark://{self.layout.host}:{self.layout.port}"

    @property
    def ui_url(self) -> str:
        return f"http://{self.layout.host}:{self.layout.ui_port}"

    @property
    def conf_dir(self) -> Path:
        """An empty SPARK_CONF_DIR: no spark-defaults.conf from elsewhere."""
        return self.root / "conf"

    def work_dir(self, worker: int) -> Path:
        return self.root / f"work-{worker}"

    def _state_file(self) -> Path:
        return self.root / "state.json"

    def _load(self) -> Layout | None:
        try:
            return Layout(**json.loads(self._state_file().read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def _save(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._state_file().write_text(json.dumps(asdict(self.layout), indent=1))

    def daemon_env(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SPARK_", "PYSPARK_", "TIDEMARK_"))
        }
        env.update(
            SPARK_HOME=str(SPARK_HOME),
            SPARK_CONF_DIR=str(self.conf_dir),
            SPARK_LOCAL_IP=self.layout.host,
            SPARK_LOG_DIR=str(self.root),
            # Marks the daemons' command lines as this cluster's (see _alive).
            SPARK_DAEMON_JAVA_OPTS=f"-Dtidemark.cluster={self.root}",
        )
        return env

    # -- process control ------------------------------------------------------------------
    def _alive(self, pid: int | None, cls: str) -> bool:
        """pid runs cls for this cluster (a pid recorded before a reboot may be anyone's)."""
        if not pid:
            return False
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        # Until spark-class execs the JVM, the pid runs the script (no marker yet).
        ours = f"-Dtidemark.cluster={self.root}".encode() in cmd or any(
            a.endswith(b"/spark-class") for a in cmd
        )
        return cls.encode() in cmd and ours

    def _start(self, name: str, cls: str, *args: str) -> int:
        with open(self.root / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                [str(SPARK_HOME / "bin" / "spark-class"), cls, *args],
                env=self.daemon_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return proc.pid

    def up(self, timeout: float = 120) -> None:
        """Start the master and the workers that are not running; wait until all are ALIVE."""
        lay = self.layout
        self.root.mkdir(parents=True, exist_ok=True)
        self.conf_dir.mkdir(exist_ok=True)
        if not self._alive(lay.master_pid, MASTER_CLASS):
            lay.master_pid = self._start(
                "master",
                MASTER_CLASS,
                "--host",
                lay.host,
                "--port",
                str(lay.port),
                "--webui-port",
                str(lay.ui_port),
            )
            self._save()
        for i in range(1, lay.workers + 1):
            if self._alive(lay.worker_pids.get(str(i)), WORKER_CLASS):
                continue
            self.work_dir(i).mkdir(exist_ok=True)
            lay.worker_pids[str(i)] = self._start(
                f"worker-{i}",
                WORKER_CLASS,
                self.url,
                "--host",
                lay.host,
                "--cores",
                str(lay.cores),
                "--memory",
                lay.memory,
                "--work-dir",
                str(self.work_dir(i)),
                "--webui-port",
                "0",  # any free port
            )
            self._save()
        self.wait_for(
            f"{lay.workers} ALIVE workers",
            lambda s: (
                sum(w["state"] == "ALIVE" for w in s["workers"]) >= lay.workers
                and s["aliveworkers"] >= lay.workers
            ),
            timeout,
        )

    def down(self, timeout: float = 20) -> None:
        """Stop every daemon (a worker's group holds its executors) and forget the pids."""
        lay = self.layout
        pids: list[tuple[int | None, str]] = [(p, WORKER_CLASS) for p in lay.worker_pids.values()]
        pids.append((lay.master_pid, MASTER_CLASS))
        daemon.stop_groups([p for p, cls in pids if p and self._alive(p, cls)], timeout)
        lay.master_pid, lay.worker_pids = None, {}
        self._save()

    def worker_pid(self, worker: int) -> int:
        return self.layout.worker_pids[str(worker)]

    # -- what the master says -------------------------------------------------------------
    def state(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"{self.ui_url}/json/", timeout=5) as r:
                state: dict[str, Any] = json.load(r)
                return state
        except (OSError, urllib.error.URLError, ValueError):
            return None  # not listening yet

    def wait_for(
        self, what: str, ok: Callable[[dict[str, Any]], bool], timeout: float = 120
    ) -> dict[str, Any]:
        """Poll the master's status until ok(state) holds."""
        end = time.monotonic() + timeout
        while True:
            if not self._alive(self.layout.master_pid, MASTER_CLASS):
                raise RuntimeError(f"the Spark master is not running (see {self.root}/master.log)")
            state = self.state()
            if state is not None and ok(state):
                return state
            if time.monotonic() > end:
                raise RuntimeError(f"timed out waiting for {what} (logs in {self.root})")
            time.sleep(0.5)

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}"
            for p in sorted(self.root.glob("*.log"))
        )


def executor_pids(app_id: str) -> dict[str, int]:
    """The executor JVMs of an application on this machine: executor id -> pid."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = [a.decode() for a in (proc / "cmdline").read_bytes().split(b"\0")]
        except OSError:
            continue
        if EXECUTOR_CLASS in cmd and app_id in cmd:
            found[cmd[cmd.index("--executor-id") + 1]] = int(proc.name)
    return found


def descendants(pid: int) -> list[int]:
    """Every process below pid (children first found, then theirs)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(proc.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tidemark.devstack.spark_cluster",
        description="A Spark standalone cluster on this machine (master + workers).",
    )
    ap.add_argument("action", choices=["up", "down", "status"])
    ap.add_argument(
        "--dir", default=".tidemark/spark", help="state and logs (default: %(default)s)"
    )
    ap.add_argument("--host", default="127.0.0.1", help="address the daemons bind to")
    ap.add_argument("--port", type=int, default=DEFAULT_PORT, help="the master's port")
    ap.add_argument("--ui-port", type=int, default=DEFAULT_UI_PORT, help="the master's web UI")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--cores", type=int, default=1, help="cores per worker")
    ap.add_argument("--memory", default="1g", help="memory per worker")
    args = ap.parse_args(argv)
    root = Path(args.dir).resolve()
    if args.action == "up":
        wanted = Layout(args.host, args.port, args.ui_port, args.workers, args.cores, args.memory)
        saved = SparkCluster(root)._load()
        running = saved is not None and SparkCluster(root)._alive(saved.master_pid, MASTER_CLASS)
        cluster = SparkCluster(root, None if running else wanted)
    else:
        cluster = SparkCluster(root)
    return daemon.run_action(
        "tidemark.devstack.spark_cluster",
        args.action,
        lambda: _act(cluster, args.action, root),
        RuntimeError,
    )


def _act(cluster: SparkCluster, action: str, root: Path) -> int:
    if action == "up":
        cluster.up()
        print(f"Spark master: {cluster.url}")
        print(f"web UI:       {cluster.ui_url}")
        print(f"logs:         {root}")
    elif action == "down":
        cluster.down()
        print("Spark cluster stopped")
    else:
        state = cluster.state()
        if state is None:
            print("stopped")
            return 3
        print(f"{cluster.url}: {state['aliveworkers']} alive workers, {state['cores']} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
