"""Scale-out by configuration only: the replay job on a real Spark standalone cluster.

A master and one worker run as separate JVMs; the job is started the way Airflow's
SparkSubmitOperator starts it (`spark-submit --master spark://... jobs/replay.py run ...`). The
executors' Python cannot import the editable `tidemark` install, so the job only succeeds if it
ships its own code (tidemark.engine.session.ship_package).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pyspark
import pytest

from tests.conftest import REPO, free_port
from tests.invariants import assert_exactly_once
from tests.proc import JobProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SPARK_HOME = Path(pyspark.__file__).resolve().parent
VENV_BIN = Path(sys.executable).parent

# Imported by the executors' Python before anything else: forget the editable install of
# tidemark (its meta-path finder) and any sys.path folder holding a `tidemark` package.
HIDE_TIDEMARK = """\
import os, sys
sys.meta_path[:] = [f for f in sys.meta_path
                    if not getattr(f, "__module__", "").startswith("__editable__")]
sys.path[:] = [p for p in sys.path if not os.path.isdir(os.path.join(p or ".", "tidemark"))]
"""


class Standalone:
    """A Spark standalone master and one worker, each in its own process group."""

    def __init__(self, root: Path):
        self.root = root
        self.port, self.ui, worker_ui = free_port(), free_port(), free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.work = root / "work"
        self.work.mkdir()
        (root / "conf").mkdir()  # no spark-defaults.conf from anywhere else
        self.env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SPARK_", "PYSPARK_", "TIDEMARK_"))
        }
        self.env.update(
            SPARK_HOME=str(SPARK_HOME),
            SPARK_CONF_DIR=str(root / "conf"),
            SPARK_LOCAL_IP="127.0.0.1",
            SPARK_WORKER_DIR=str(self.work),
        )
        self.procs: list[subprocess.Popen] = []
        self._start(
            "master",
            "org.apache.spark.deploy.master.Master",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--webui-port",
            str(self.ui),
        )
        self._start(
            "worker",
            "org.apache.spark.deploy.worker.Worker",
            self.url,
            "--host",
            "127.0.0.1",
            "--cores",
            "2",
            "--memory",
            "2g",
            "--webui-port",
            str(worker_ui),
        )

    def _start(self, name: str, cls: str, *args: str) -> None:
        with open(self.root / f"{name}.log", "wb") as log:
            self.procs.append(
                subprocess.Popen(
                    [str(SPARK_HOME / "bin" / "spark-class"), cls, *args],
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    def state(self) -> dict | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ui}/json/", timeout=5) as r:
                return json.load(r)
        except (OSError, urllib.error.URLError, ValueError):
            return None  # not listening yet

    def wait_for(self, what: str, ok, timeout: float = 120) -> dict:
        """Poll the master's status until ok(state) holds; fail fast if a daemon died."""
        end = time.monotonic() + timeout
        while True:
            for p in self.procs:
                if p.poll() is not None:
                    raise AssertionError(
                        f"a Spark daemon exited ({p.returncode}) while "
                        f"waiting for {what}:\n{self.logs()}"
                    )
            state = self.state()
            if state is not None and ok(state):
                return state
            if time.monotonic() > end:
                raise AssertionError(f"timed out waiting for {what}: {state}\n{self.logs()}")
            time.sleep(0.5)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.root.glob("*.log"))
        )

    def stop(self) -> None:
        for p in self.procs:  # the worker's group also holds the executor JVMs it forked
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


@pytest.fixture
def standalone():
    root = Path(tempfile.mkdtemp(prefix="tidemark-test-spark-"))
    cluster = Standalone(root)
    try:
        cluster.wait_for(
            "one ALIVE worker",
            lambda s: s["aliveworkers"] == 1 and any(w["state"] == "ALIVE" for w in s["workers"]),
        )
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def executor_python(tmp_path: Path) -> Path:
    """The venv's Python, except that `tidemark` is not importable from it."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE_TIDEMARK)
    wrapper = tmp_path / "python-without-tidemark"
    wrapper.write_text(
        f'#!/bin/sh\nPYTHONPATH="{hide}${{PYTHONPATH:+:$PYTHONPATH}}" '
        f'exec "{sys.executable}" "$@"\n'
    )
    wrapper.chmod(0o755)
    probe = subprocess.run(
        [str(wrapper), "-c", "import tidemark"], cwd=tmp_path, capture_output=True, text=True
    )
    assert probe.returncode != 0 and "No module named 'tidemark'" in probe.stderr, (
        "the executors' Python must not see tidemark by itself"
    )
    return wrapper


def test_the_replay_job_runs_on_a_standalone_cluster_with_its_code_shipped(
    env, standalone, tmp_path
):
    env.append_orders(range(3000))
    env.pipeline()
    python = executor_python(tmp_path)
    job_env = env.cli_env(
        SPARK_HOME=SPARK_HOME, SPARK_CONF_DIR=standalone.root / "conf", SPARK_LOCAL_IP="127.0.0.1"
    )
    for k in [k for k in job_env if k.startswith("PYSPARK_") or k == "TIDEMARK_SPARK_MASTER"]:
        del job_env[k]  # the master and Pythons come from spark-submit, as under Airflow
    job = JobProcess(
        [
            str(VENV_BIN / "spark-submit"),
            "--master",
            standalone.url,
            "--conf",
            "spark.driver.host=127.0.0.1",
            "--conf",
            f"spark.pyspark.driver.python={sys.executable}",
            "--conf",
            f"spark.pyspark.python={python}",
            str(REPO / "jobs" / "replay.py"),
            "run",
            "orders",
        ],
        job_env,
    )
    code = job.wait(240)
    out = job.output()
    assert code == 0, f"{out}\n{standalone.logs()}"

    assert env.checkpoints() == {0: 1500, 1: 1500}
    assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(3000,)]
    assert env.prepared() == []
    assert_exactly_once(env)

    # It ran on the cluster: the master saw the application finish, and its executor fetched
    # the shipped zip into its work directory.
    state = standalone.wait_for(
        "the application to complete", lambda s: s["completedapps"] and not s["activeapps"]
    )
    apps = state["completedapps"]
    assert [a["name"] for a in apps] == ["tidemark-orders"], apps
    app_dir = standalone.work / apps[0]["id"]
    shipped = sorted(p.name for p in app_dir.glob("*/tidemark-*.zip"))
    assert len(shipped) == 1, sorted(str(p) for p in app_dir.rglob("*"))


def test_the_cli_runs_on_the_cluster_with_the_pipelines_spark_settings(env, standalone, tmp_path):
    """`tidemark run` with a cluster master (no spark-submit): without the executors' Python
    it stops in one line before writing; with it in the pipeline's spark: block, the
    executors run that interpreter and the run delivers every record once."""
    env.append_orders(range(3000))
    ran = tmp_path / "executor-python-ran"
    python = tmp_path / "marked-python"
    python.write_text(f'#!/bin/sh\necho x >> "{ran}"\nexec "{executor_python(tmp_path)}" "$@"\n')
    python.chmod(0o755)
    job_env = env.cli_env(
        SPARK_HOME=SPARK_HOME,
        SPARK_CONF_DIR=standalone.root / "conf",
        SPARK_LOCAL_IP="127.0.0.1",
        TIDEMARK_SPARK_MASTER=standalone.url,
    )
    for k in [k for k in job_env if k.startswith("PYSPARK_")]:
        del job_env[k]

    env.pipeline(spark={"spark.driver.host": "127.0.0.1"})
    job = JobProcess(env.cli_argv("run", "orders"), job_env)
    code = job.wait(240)
    out = job.output()
    assert code == 2, out
    assert f"the executors' Python is not set for master {standalone.url}" in out
    assert "Traceback" not in out and env.prepared() == []

    env.pipeline(spark={"spark.driver.host": "127.0.0.1", "spark.pyspark.python": str(python)})
    job = JobProcess(env.cli_argv("run", "orders"), job_env)
    code = job.wait(240)
    out = job.output()
    assert code == 0, f"{out}\n{standalone.logs()}"
    assert ran.exists(), "the executors did not run the configured Python"
    assert env.checkpoints() == {0: 1500, 1: 1500}
    assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(3000,)]
    assert env.prepared() == []
    assert_exactly_once(env)
