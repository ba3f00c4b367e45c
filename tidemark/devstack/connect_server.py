"""A local Spark Connect server for users (`make connect`, `make up CONNECT=1`) and the tests.

PySpark ships the server (``jars/spark-connect_*.jar``): started here with ``spark-submit
--class SparkConnectServer`` in a process group of its own, bound to 127.0.0.1, its Python
workers running this venv's interpreter, its log in ``<dir>/connect.log``. A run reaches it
with ``TIDEMARK_SPARK_REMOTE=sc://127.0.0.1:<port>`` (docs/production.md, "Spark Connect").

:meth:`ConnectServer.start` returns once the server accepted a session and ran a query on it:
it awaits the gRPC channel's readiness (and the process's death, which fails the start with
the log's tail), never a fixed sleep.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tidemark.devstack import daemon
from tidemark.devstack.airflow_stack import free_port

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
DEFAULT_PORT = 15002  # Spark Connect's own default
DEFAULT_MASTER = "local[*,4]"  # local mode retries a failed task up to 4 times, as a run's does
SESSION_TIMEOUT = "25h"  # idle sessions outlive a daily schedule
DAEMON_MODULE = "tidemark_connect_daemon"  # connect_daemon.py, copied to <root>/python


class ServerError(RuntimeError):
    """The server did not start or stop as asked: one line, with where its log is."""


@dataclass
class ConnectServer:
    root: Path  # holds connect.pid, connect.port and connect.log
    port: int | None = None  # None: the recorded port if running, else a free one
    master: str = DEFAULT_MASTER
    driver_memory: str = "1g"

    @property
    def logfile(self) -> Path:
        return self.root / "connect.log"

    @property
    def url(self) -> str:
        return f"sc://127.0.0.1:{self._port()}"

    def _port(self) -> int:
        if self.port is None:
            recorded = self.root / "connect.port"
            self.port = int(recorded.read_text()) if recorded.exists() else free_port()
        return self.port

    def pid(self) -> int | None:
        """The server's pid while it runs (the JVM: spark-submit execs it), else None."""
        return daemon.recorded(self.root / "connect.pid")

    def running(self) -> bool:
        return self.pid() is not None

    def command(self) -> list[str]:
        import pyspark

        from tidemark.engine.session import gc_options, jit_options, log4j_option

        home = Path(pyspark.__file__).resolve().parent
        java = " ".join([log4j_option(), *gc_options(), *jit_options()])
        conf = {
            "spark.connect.grpc.binding.address": "127.0.0.1",
            "spark.connect.grpc.binding.port": str(self._port()),
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.driver.host": "127.0.0.1",
            "spark.driver.extraJavaOptions": java,
            "spark.ui.enabled": "false",
            # One attempt per task at a time: each attempt PREPAREs its own gid
            # (docs/design.md, step 2); retries as tidemark/engine/session.py sets them.
            "spark.speculation": "false",
            "spark.task.maxFailures": "4",
            # A query its client left (a client killed mid-run) is interrupted after this
            # long, not Spark's default 5 minutes; its tasks' PREPAREs are rolled back by
            # recovery (docs/production.md, "Spark Connect").
            "spark.connect.execute.manager.detachedTimeout": "60s",
            # A run's session (connect_session.session_url) keeps its artifact and its Python
            # workers' daemon between runs; Spark's default drops it after an hour idle, so
            # an hourly pipeline would set it up anew at every run.
            "spark.connect.session.manager.defaultSessionTimeout": SESSION_TIMEOUT,
            # Its workers fork from a daemon that imported their third-party modules once
            # (connect_daemon.py): Spark kills a worker idle for a minute.
            "spark.python.daemon.module": DAEMON_MODULE,
        }
        argv = [str(home / "bin" / "spark-submit"), "--class", SERVER_CLASS]
        argv += ["--master", self.master, "--driver-memory", self.driver_memory]
        argv += ["--name", "Tidemark Spark Connect server"]
        for key, value in conf.items():
            argv += ["--conf", f"{key}={value}"]
        return [*argv, "spark-internal"]

    def start(self, timeout: float = 300.0) -> str:
        """Start the server unless it runs; its URL once it accepts a session."""
        if self.running():
            self.wait_ready(timeout)
            return self.url
        import pyspark

        self.root.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPARK_HOME")}
        env["SPARK_HOME"] = str(Path(pyspark.__file__).resolve().parent)
        # The server's Python workers run this venv's interpreter; they import tidemark from
        # what each session ships (spark.addArtifacts), not from this checkout.
        env["PYSPARK_PYTHON"] = env["PYSPARK_DRIVER_PYTHON"] = sys.executable
        env["SPARK_LOCAL_IP"] = "127.0.0.1"
        # Only the daemon's own module on the path: not the tidemark package (connect_daemon.py).
        daemon = self.root / "python"
        daemon.mkdir(exist_ok=True)
        shutil.copyfile(
            Path(__file__).with_name("connect_daemon.py"), daemon / f"{DAEMON_MODULE}.py"
        )
        env["PYTHONPATH"] = str(daemon)
        with open(self.logfile, "ab") as log:
            proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: stop() ends its workers too
            )
        (self.root / "connect.pid").write_text(str(proc.pid))
        (self.root / "connect.port").write_text(str(self._port()))
        try:
            self.wait_ready(timeout, proc)
        except BaseException:
            self.stop()
            raise
        return self.url

    def wait_ready(self, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
        """Until the server accepts a session and runs a query on it (the process exiting
        first fails at once, with its log's last lines)."""
        import grpc  # type: ignore[import-untyped]

        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(f"127.0.0.1:{self._port()}") as channel:
            ready = grpc.channel_ready_future(channel)
            while True:
                if (proc is not None and proc.poll() is not None) or not self.running():
                    raise ServerError(f"the Spark Connect server exited: {self._tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ServerError(
                        f"the Spark Connect server did not listen within {timeout:.0f} s "
                        f"(log: {self.logfile})"
                    )
                try:  # awaits the channel; wakes each second to see the process is alive
                    ready.result(timeout=min(1.0, left))
                    break
                except grpc.FutureTimeoutError:
                    continue
        from pyspark.sql import SparkSession

        # A remote session marks its process as Spark Connect's for good; the probe's caller (a
        # test session, the bench, `make up`) goes on to start classic sessions and Spark
        # processes, which would then ask for a remote URL: its environment is put back.
        saved = {var: os.environ.get(var) for var in ("SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE")}
        spark = SparkSession.builder.remote(self.url).create()
        try:
            spark.sql("SELECT 1").collect()
        finally:
            spark.stop()
            for var, value in saved.items():
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM the server's session, SIGKILL it if it outlives ``timeout``."""
        pid = self.pid()
        if pid is not None:
            daemon.stop_groups([pid], timeout, _signal_session)
        for name in ("connect.pid", "connect.port"):
            (self.root / name).unlink(missing_ok=True)

    def kill(self) -> None:
        """SIGKILL the server's session (the tests' crash), leaving its state files."""
        pid = self.pid()
        if pid is not None:
            _signal_session(pid, signal.SIGKILL)
            daemon.wait_exit(pid, 30.0)

    def _tail(self, lines: int = 5) -> str:
        try:
            text = self.logfile.read_text(errors="replace").strip().splitlines()
        except FileNotFoundError:
            return f"no log at {self.logfile}"
        return " | ".join(text[-lines:]) + f" (log: {self.logfile})"


def _signal_session(pid: int, sig: int) -> None:
    """``sig`` to the server's session: the JVM's process group and PySpark's worker daemon's
    (a group of its own), so no Python worker outlives the server."""
    from tidemark.devstack.chaos.faults import signal_session

    daemon.signal_group(pid, sig)
    signal_session(pid, sig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tidemark.devstack.connect_server",
        description="Manage the local Spark Connect server.",
    )
    ap.add_argument("action", choices=["start", "stop", "status", "url"])
    ap.add_argument("--dir", default=".tidemark/connect", help="state folder (%(default)s)")
    ap.add_argument("--port", type=int, default=None, help="default: a free port")
    ap.add_argument("--master", default=DEFAULT_MASTER, help="(%(default)s)")
    ap.add_argument("--driver-memory", default="1g", help="(%(default)s)")
    args = ap.parse_args(argv)
    server = ConnectServer(Path(args.dir).resolve(), args.port, args.master, args.driver_memory)
    return daemon.run_action(
        "tidemark.devstack.connect_server",
        args.action,
        lambda: _act(server, args.action),
        ServerError,
    )


def _act(server: ConnectServer, action: str) -> int:
    if action == "start":
        print(f"Spark Connect server at {server.start()} (log: {server.logfile})")
    elif action == "stop":
        server.stop()
        print("Spark Connect server stopped")
    elif action == "status":
        print(f"running at {server.url}" if server.running() else "stopped")
        return 0 if server.running() else 3
    elif action == "url":
        if not server.running():
            print("tidemark.devstack.connect_server: not running", file=sys.stderr)
            return 3
        print(server.url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
