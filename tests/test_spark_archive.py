"""The Spark driver's class archive (tidemark/engine/cds.py): built once, atomically, and
mapped by the JVM of every fresh run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.test_cli import tm

# A fresh process starts Tidemark's session and says whether its JVM maps the archive.
PROBE = """
import sys
from pyspark import SparkContext
from tidemark.engine.session import session
spark = session("local[1]", "tidemark-cds-probe")
pid = SparkContext._gateway.proc.pid  # spark-submit execs the JVM
with open(f"/proc/{pid}/maps") as maps:
    print("mapped" if sys.argv[1] in maps.read() else "unmapped")
with open(f"/proc/{pid}/cmdline") as cmdline:
    print("serial" if "-XX:+UseSerialGC" in cmdline.read().split(chr(0)) else "default-gc")
print(spark.range(3).count())
"""
GC = "serial" if (os.cpu_count() or 1) <= 2 else "default-gc"


def _probe(env, jsa: Path) -> subprocess.CompletedProcess:
    """PROBE in a fresh Python: whether its session mapped the class archive ``jsa``."""
    return subprocess.run(
        [sys.executable, "-c", PROBE, str(jsa)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.spark  # a JVM of its own
def test_the_class_archive_is_built_once_and_mapped_by_a_fresh_session(tmp_path):
    env = {**os.environ, "TIDEMARK_SPARK_CDS_DIR": str(tmp_path)}
    code, out, err = tm(env, "spark", "archive", cwd=REPO, timeout=600)
    assert code == 0, err
    archives = list(tmp_path.iterdir())
    assert len(archives) == 1 and archives[0].suffix == ".jsa"  # no temporary file left
    jsa = archives[0]
    assert out.strip().startswith(f"{jsa}: built in")
    built = jsa.stat().st_mtime_ns

    code, out, _ = tm(env, "spark", "archive", cwd=REPO, timeout=600)
    assert code == 0 and out.strip() == f"{jsa}: up to date"
    assert jsa.stat().st_mtime_ns == built

    probe = _probe(env, jsa)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["mapped", GC, "3"]  # and no JVM line on stdout
    assert "log level" not in probe.stderr  # Spark's shell greeting (engine/log4j2.properties)

    jsa.unlink()  # without it, a session starts as before
    probe = _probe(env, jsa)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["unmapped", GC, "3"]


def test_airflow_hands_spark_submit_the_sessions_jvm_options(tmp_path, monkeypatch, request):
    from tidemark.airflow.dags import _driver_conf
    from tidemark.engine import cds

    def options():
        return _driver_conf().get("spark.driver.extraJavaOptions", "").split()

    from tidemark.core.settings import get_settings
    from tidemark.engine.session import LOG4J

    monkeypatch.setenv("TIDEMARK_SPARK_CDS_DIR", str(tmp_path))
    get_settings.cache_clear()  # settings are read once per process
    request.addfinalizer(get_settings.cache_clear)  # after monkeypatch's undo
    from tidemark.engine.session import jit_options

    # On 2 cores: the serial collector and C2's raised thresholds (session.jit_options)
    few_cores = ["-XX:+UseSerialGC", *jit_options()] if GC == "serial" else []
    assert bool(jit_options()) == (GC == "serial")
    log4j = f"-Dlog4j2.configurationFile=file:{LOG4J}"
    assert options() == [log4j, *few_cores]
    assert _driver_conf()["spark.executor.extraJavaOptions"] == log4j
    cds.archive().write_bytes(b"")  # only its presence matters here
    assert options() == [
        log4j,
        f"-XX:SharedArchiveFile={cds.archive()}",
        "-Xlog:disable",
        "-Xlog:all=warning:stderr",
        *few_cores,
    ]


FAILING_JOB = """
from tidemark.engine.session import session
print("tidemark: starting", flush=True)
spark = session(None, "tidemark-log-probe")
spark.range(3).count()
raise SystemExit("tidemark: error: the job's own error line")
"""


@pytest.mark.spark  # a JVM of its own
def test_a_submitted_jobs_error_is_not_buried_in_spark_info_lines(tmp_path):
    """Under spark-submit (as Airflow runs the job) the driver's JVM starts before the job's
    Python: Spark's log level must come from spark-submit's command line, or Spark's INFO
    start-up and shutdown lines bury the job's error in the task log."""
    from tidemark.airflow.dags import _driver_conf

    job = tmp_path / "job.py"
    job.write_text(FAILING_JOB)
    conf = [a for k, v in _driver_conf().items() for a in ("--conf", f"{k}={v}")]
    submit = Path(sys.executable).with_name("spark-submit")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    # One stream, as Airflow's Spark hook reads it (spark-submit hands the Python process's
    # stderr on as its stdout).
    res = subprocess.run(
        [str(submit), "--master", "local[1]", *conf, str(job)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert res.returncode == 1, res.stdout[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert not [ln for ln in lines if " INFO " in ln or " WARN " in ln], res.stdout[:3000]
    # the job's lines, and at most the JVM's own start-up notice
    assert [ln for ln in lines if not ln.startswith("WARNING: Using incubator modules")] == [
        "tidemark: starting",
        "tidemark: error: the job's own error line",
    ], res.stdout[-3000:]
