"""Scale-out by configuration only: the replay job on a real Spark standalone cluster.

A master and two workers (1 core each) run as separate JVMs, started once for the module by
the module `make cluster` uses (tidemark/devstack/spark_cluster.py). The job runs as a user
starts it: spark-submit, `tidemark run` with a master setting, and the Airflow replay task
(the Spark provider's own spark-submit command); an executor and a worker are SIGKILLed
mid-write; the executors run a venv-pack archive. The executors' Python cannot import the
editable `tidemark` install, so the job only succeeds if it ships its own code
(tidemark.engine.session.ship_package). Sinks are checked record by record
(tests/invariants.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyspark
import pytest

from tests.conftest import REPO, free_port
from tests.invariants import assert_exactly_once
from tests.proc import JobProcess
from tidemark.devstack.spark_cluster import (
    Layout,
    SparkCluster,
    descendants,
    executor_pids,
)

pytestmark = [pytest.mark.slow, pytest.mark.spark, pytest.mark.timeout(300)]

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


@pytest.fixture(scope="module")
def _cluster():
    """One master and two workers (1 core each, on loopback) for the module: the same
    daemons `make cluster` starts (tidemark/devstack/spark_cluster.py)."""
    root = Path(tempfile.mkdtemp(prefix="tidemark-test-spark-"))
    cluster = SparkCluster(
        root, Layout(port=free_port(), ui_port=free_port(), workers=2, cores=1, memory="2g")
    )
    try:
        cluster.up()
        yield cluster
    finally:
        cluster.down()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def standalone(_cluster):
    """The module's cluster with both workers ALIVE (a test that lost one has restarted it)
    and no application running."""
    _cluster.up()
    _cluster.wait_for("no running application", lambda s: not s["activeapps"])
    return _cluster


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
        SPARK_HOME=SPARK_HOME, SPARK_CONF_DIR=standalone.conf_dir, SPARK_LOCAL_IP="127.0.0.1"
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
    shipped = sorted(
        p.name for p in standalone.root.glob(f"work-*/{apps[0]['id']}/*/tidemark-*.zip")
    )
    assert len(set(shipped)) == 1, sorted(str(p) for p in standalone.root.rglob("*.zip"))


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
        SPARK_CONF_DIR=standalone.conf_dir,
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


# -- faults on the cluster -------------------------------------------------------------------
# Each task pauses after its first PREPARE TRANSACTION (tidemark/core/faults.py). An executor's
# environment is the worker's plus spark.executorEnv.*, not the driver's: the pause point
# reaches the executors through the job's Spark settings.


def cluster_env(env, cluster: SparkCluster, **extra) -> dict[str, str]:
    """A job process's environment for the cluster: the master and the Pythons come from
    spark-submit or the pipeline, as a user gives them."""
    job_env = env.cli_env(
        SPARK_HOME=SPARK_HOME,
        SPARK_CONF_DIR=cluster.conf_dir,
        SPARK_LOCAL_IP="127.0.0.1",
        **extra,
    )
    for k in [k for k in job_env if k.startswith("PYSPARK_")]:
        del job_env[k]
    if "TIDEMARK_SPARK_MASTER" not in extra:
        del job_env["TIDEMARK_SPARK_MASTER"]
    return job_env


def paused_conf(pause: Path) -> dict[str, str]:
    return {
        "spark.executorEnv.TIDEMARK_PAUSE_AT": "task_after_prepare",
        "spark.executorEnv.TIDEMARK_PAUSE_DIR": str(pause),
    }


def app_id(cluster: SparkCluster) -> str:
    state = cluster.wait_for("the application", lambda s: len(s["activeapps"]) == 1)
    return str(state["activeapps"][0]["id"])


def _waits_on_fifo(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/wchan").read_text() == "wait_for_partner"
    except OSError:
        return False


def paused_executor(app: str, timeout: float = 60) -> tuple[str, int, list[int]]:
    """The executor whose Python worker waits at the pause point (blocked opening the resume
    FIFO): its id, its JVM's pid and the processes below it."""
    deadline = time.monotonic() + timeout
    while True:
        for eid, pid in executor_pids(app).items():
            below = descendants(pid)
            if any(_waits_on_fifo(p) for p in below):
                return eid, pid, below
        assert time.monotonic() < deadline, f"no executor of {app} waits at the pause point"
        time.sleep(0.2)  # the worker is between writing `reached` and opening `resume`


def sink_gids(env) -> list[str]:
    return [
        r[0]
        for r in env.q(
            env.sink_dsn,
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() ORDER BY 1",
        )
    ]


def attempt(gid: str) -> int:
    return int(gid.split(":")[4])


def kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def assert_one_committed_run_retried(env, killed: str) -> None:
    """One run, committed, whose sink participant is the retry's: the killed attempt's gid
    was rolled back by the retry (docs/design.md, "Commit protocol", step 2)."""
    assert env.ledger("SELECT sink, state::text FROM tidemark.run_sinks") == [("main", "committed")]
    chosen = [g for (g,) in env.ledger("SELECT gid FROM tidemark.participants") if ":s." in g]
    assert chosen and killed not in chosen and all(attempt(g) >= 1 for g in chosen), chosen


def await_retry(job: JobProcess, env, first: str) -> None:
    """The killed task's retry pauses where it did: its gid the same but for the attempt."""
    assert job.wait_reached() == "task_after_prepare"
    [second] = sink_gids(env)
    assert attempt(second) >= 1 and second.rsplit(":", 1)[0] == first.rsplit(":", 1)[0]


def assert_retried_run_exact(env, cluster: SparkCluster, code: int, out: str, first: str) -> None:
    """The job ended well, its run committed every record once, its task retried."""
    assert code == 0, f"{out}\n{cluster.logs()}"
    assert env.checkpoints() == {0: 3000}
    assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(3000,)]
    assert env.prepared() == [] and sink_gids(env) == []
    assert_exactly_once(env)
    assert_one_committed_run_retried(env, first)


def test_an_executor_killed_mid_write_its_task_is_retried_and_the_run_ends_exact(
    env, standalone, tmp_path
):
    """The CLI on the cluster; the executor running the only task is SIGKILLed (its JVM and
    its Python workers, as when its host or container dies) after that task prepared its
    sink transaction. Spark retries the task on another executor; the retry rolls back the
    lost attempt's prepared transaction, prepares its own, and the same run commits."""
    env.append_orders(range(3000), partitions=1)
    pause = tmp_path / "pause"
    env.pipeline(
        spark={
            "spark.driver.host": "127.0.0.1",
            "spark.pyspark.python": str(executor_python(tmp_path)),
            **paused_conf(pause),
        }
    )
    with JobProcess(
        env.cli_argv("run", "orders"),
        cluster_env(env, standalone, TIDEMARK_SPARK_MASTER=standalone.url),
        pause_dir=pause,
        pause_at="task_after_prepare",
    ) as job:
        assert job.wait_reached() == "task_after_prepare"
        [first] = sink_gids(env)
        assert attempt(first) == 0
        eid, pid, below = paused_executor(app_id(standalone))
        kill([pid, *below])

        # The retry, on another executor, pauses at the same point: the lost attempt's
        # transaction is gone, its own is prepared.
        await_retry(job, env, first)
        assert paused_executor(app_id(standalone))[0] != eid
        job.resume()
        code = job.wait(240)
    assert_retried_run_exact(env, standalone, code, job.output(), first)


def test_a_worker_lost_mid_write_the_task_moves_to_the_other_worker_and_the_run_ends_exact(
    env, standalone, tmp_path
):
    """spark-submit (as Airflow starts the job); the worker running the only task is SIGKILLed
    with its executor after the task prepared. The master drops the worker, Spark retries the
    task on the other worker, and the same run commits every record once."""
    env.append_orders(range(3000), partitions=1)
    env.pipeline()
    pause = tmp_path / "pause"
    conf = {
        "spark.driver.host": "127.0.0.1",
        "spark.pyspark.driver.python": sys.executable,
        "spark.pyspark.python": str(executor_python(tmp_path)),
        **paused_conf(pause),
    }
    argv = [str(VENV_BIN / "spark-submit"), "--master", standalone.url]
    for k, v in conf.items():
        argv += ["--conf", f"{k}={v}"]
    argv += [str(REPO / "jobs" / "replay.py"), "run", "orders"]
    with JobProcess(
        argv, cluster_env(env, standalone), pause_dir=pause, pause_at="task_after_prepare"
    ) as job:
        assert job.wait_reached() == "task_after_prepare"
        [first] = sink_gids(env)
        app = app_id(standalone)
        eid, pid, below = paused_executor(app)
        worker = next(i for i in (1, 2) if pid in descendants(standalone.worker_pid(i)))
        os.killpg(standalone.worker_pid(worker), signal.SIGKILL)  # the Worker and its executors
        kill(below)  # the executor's Python workers (a process group of their own)
        standalone.wait_for("the lost worker gone", lambda s: s["aliveworkers"] == 1)

        await_retry(job, env, first)
        _, pid2, _ = paused_executor(app)
        assert pid2 in descendants(standalone.worker_pid(3 - worker)), "not on the other worker"
        job.resume()
        code = job.wait(240)
    assert_retried_run_exact(env, standalone, code, job.output(), first)


# -- the Airflow path ------------------------------------------------------------------------
# The DAG's replay task, executed: tidemark's ReplayOperator, the Spark provider's
# SparkSubmitHook building and running spark-submit against the master the Spark connection
# names, with the executors' Python from the connection's extra conf.
REPLAY_TASK = """\
import logging, sys
from pathlib import Path
from types import SimpleNamespace

from tidemark.airflow.dags import pipeline_dags

logging.basicConfig(level=logging.INFO, stream=sys.stdout)
replay = pipeline_dags(Path(sys.argv[1]))["tidemark_orders"].get_task("replay")
ti = SimpleNamespace(dag_id="tidemark_orders", task_id="replay", try_number=1,
                     xcom_pull=lambda task_ids: None)
replay.execute({
    "ti": ti, "run_id": "on-the-cluster", "dag": SimpleNamespace(dag_id="tidemark_orders"),
    "dag_run": SimpleNamespace(run_type="manual", triggering_user_name="erin"), "params": {},
})
"""


def test_the_airflow_replay_task_runs_on_the_cluster_through_the_spark_connection(
    env, standalone, tmp_path
):
    env.append_orders(range(3000))
    env.pipeline()
    ran = tmp_path / "executor-python-ran"
    python = tmp_path / "marked-python"
    python.write_text(f'#!/bin/sh\necho x >> "{ran}"\nexec "{executor_python(tmp_path)}" "$@"\n')
    python.chmod(0o755)
    connection = {
        "conn_type": "spark",
        "host": "spark://127.0.0.1",
        "port": standalone.layout.port,
        "extra": {"conf": {"spark.pyspark.python": str(python), "spark.driver.host": "127.0.0.1"}},
    }
    home = tmp_path / "airflow-home"
    home.mkdir()
    task_env = cluster_env(
        env,
        standalone,
        AIRFLOW_HOME=home,
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW_CONN_SPARK_DEFAULT=json.dumps(connection),
        AIRFLOW_CONN_TIDEMARK_LEDGER=env.ledger_dsn,
        PATH=f"{VENV_BIN}:{os.environ['PATH']}",  # spark-submit, as on an Airflow worker
    )
    del task_env["TIDEMARK_LEDGER_DSN"]  # the task resolves connection tidemark_ledger
    job = JobProcess([sys.executable, "-c", REPLAY_TASK, str(env.dir)], task_env)
    code = job.wait(240)
    out = job.output()
    assert code == 0, f"{out}\n{standalone.logs()}"
    assert f"Spark-Submit cmd: spark-submit --master {standalone.url} " in out, out
    assert ran.exists(), "the executors did not run the connection's Python"
    assert env.checkpoints() == {0: 1500, 1: 1500}
    assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(3000,)]
    assert_exactly_once(env)
    assert env.ledger("SELECT dag_run_id FROM tidemark.runs") == [("on-the-cluster",)]
    state = standalone.wait_for(
        "the application to complete", lambda s: not s["activeapps"] and s["completedapps"]
    )
    assert "tidemark-orders" in [a["name"] for a in state["completedapps"]]


# -- the executors' packed environment -------------------------------------------------------
PY_VERSION = f"python{sys.version_info.major}.{sys.version_info.minor}"
# In the packed environment: hide the editable tidemark (the job ships its own) and say which
# interpreter and environment the executors' Python runs from.
REPORT_PYTHON = (
    HIDE_TIDEMARK
    + """\
sys.path.append(sys_path_deps)
marker = os.environ.get("TIDEMARK_TEST_PYTHON_MARKER")
if marker:
    with open(marker, "a") as fh:
        fh.write(f"{sys.executable} {os.path.realpath(sys.executable)} {sys.prefix}\\n")
"""
)


def copy_interpreter(dest: Path) -> Path:
    """A copy of this Python's installation (its standard library, no site-packages): a
    Python 3.11 at a prefix of our choosing."""
    base = Path(sys.base_prefix)
    (dest / "bin").mkdir(parents=True)
    shutil.copy2(base / "bin" / PY_VERSION, dest / "bin" / PY_VERSION)
    skip = shutil.ignore_patterns(
        "site-packages", "test", "config-*", "__pycache__", "idlelib", "tkinter", "ensurepip"
    )
    shutil.copytree(base / "lib" / PY_VERSION, dest / "lib" / PY_VERSION, ignore=skip)
    (dest / "lib" / PY_VERSION / "site-packages").mkdir()
    return dest


def test_the_executors_run_a_packed_environment_without_the_packing_machines_python(
    env, standalone, tmp_path
):
    """docs/production.md, "The executors' Python": a venv packed with venv-pack
    --python-prefix (the executors' hosts' Python), shipped as spark.archives=env.tar.gz#env
    and run as ./env/bin/python. The Python the venv was made from is removed before the run,
    as it would be missing on another host: the executors run the archive's environment on
    the hosts' interpreter."""
    packer = copy_interpreter(tmp_path / "packing-machine-python")
    hosts = copy_interpreter(tmp_path / "executor-hosts-python")
    venv = tmp_path / "tidemark-env"
    subprocess.run([packer / "bin" / PY_VERSION, "-m", "venv", "--without-pip", venv], check=True)
    site = venv / "lib" / PY_VERSION / "site-packages"
    # Stand-in for `pip install` of what executors need: this host's packages by path (the
    # test is about the interpreter; a real environment holds them). Not a .pth file:
    # venv-pack refuses those as editable installs.
    deps = Path(sys.prefix) / "lib" / PY_VERSION / "site-packages"
    (site / "sitecustomize.py").write_text(f"sys_path_deps = {str(deps)!r}\n" + REPORT_PYTHON)
    # The recipe's link fix: venv-pack rewrites a link to <home>/python only.
    link = venv / "bin" / PY_VERSION
    assert os.readlink(link) == str(packer / "bin" / PY_VERSION)
    link.unlink()
    link.symlink_to(packer / "bin" / "python")
    archive = tmp_path / "tidemark-env.tar.gz"
    subprocess.run(
        [VENV_BIN / "venv-pack", "-p", venv, "-o", archive, "--python-prefix", hosts, "-q"],
        check=True,
    )
    shutil.rmtree(packer)  # not on "the other host"
    shutil.rmtree(venv)

    env.append_orders(range(3000))
    marker = tmp_path / "executors-python"
    env.pipeline(
        spark={
            "spark.driver.host": "127.0.0.1",
            "spark.archives": f"{archive}#env",
            "spark.pyspark.python": "./env/bin/python",
            "spark.executorEnv.TIDEMARK_TEST_PYTHON_MARKER": str(marker),
        }
    )
    job = JobProcess(
        env.cli_argv("run", "orders"),
        cluster_env(env, standalone, TIDEMARK_SPARK_MASTER=standalone.url),
    )
    code = job.wait(240)
    out = job.output()
    assert code == 0, f"{out}\n{standalone.logs()}"
    assert env.q(env.sink_dsn, "SELECT count(*) FROM orders") == [(3000,)]
    assert_exactly_once(env)

    seen = {tuple(line.split()) for line in marker.read_text().splitlines()}
    assert seen, "the executors' Python did not report"
    for executable, real, prefix in seen:
        # ./env/bin/python of an executor's work folder, the archive unpacked there, on the
        # hosts' interpreter.
        assert Path(prefix).name == "env" and Path(prefix).is_relative_to(standalone.root), seen
        assert Path(executable).is_relative_to(prefix), seen
        assert real == str(hosts / "bin" / PY_VERSION), seen
