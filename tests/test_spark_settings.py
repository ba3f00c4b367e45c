"""Spark settings reach the job: the executors' Python (spark.pyspark.python), the pipeline's
``spark:`` block and the Spark connection's extra conf (tidemark/core/spark_settings.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

# A fresh process's session, with the executors' Python given as Spark conf: which Python
# its tasks ran, seen from inside a task.
PROBE = """
import os, sys
from tidemark.engine.session import session
spark = session("local[1]", "tidemark-python-probe", conf={"spark.pyspark.python": sys.argv[1]})
seen = spark.sparkContext.parallelize([0], 1).map(lambda _: os.environ.get("PROBE_PYTHON"))
print(seen.collect()[0])
"""


def _wrapper(tmp_path: Path) -> Path:
    """A Python that marks its processes, so a task can tell it ran there."""
    wrapper = tmp_path / "marked-python"
    wrapper.write_text(f'#!/bin/sh\nPROBE_PYTHON=marked exec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


@pytest.mark.spark  # a JVM of its own
def test_the_executors_run_the_python_set_as_spark_conf(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}
    probe = subprocess.run(
        [sys.executable, "-c", PROBE, str(_wrapper(tmp_path))],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["marked"]


def test_the_executors_python_is_the_setting_else_the_drivers_on_a_local_master_only():
    from tidemark.core.errors import BadInput
    from tidemark.engine.session import executors_python

    assert executors_python("spark://m:7077", "/opt/env/bin/python", "/x") == "/opt/env/bin/python"
    assert executors_python("yarn", None, "./environment/bin/python") == "./environment/bin/python"
    assert executors_python("local[*,4]", None, None) == sys.executable
    with pytest.raises(BadInput) as e:
        executors_python("spark://m:7077", None, None)
    assert str(e.value).startswith(
        "the executors' Python is not set for master spark://m:7077: set spark.pyspark.python"
    )


@pytest.mark.parametrize(
    ("spark", "problem"),
    [
        ({"executor.memory": "4g"}, "'executor.memory' is not a Spark setting (spark.*)"),
        ({"spark.master": "yarn"}, "spark.master cannot be set here"),
        ({"spark.speculation": True}, "spark.speculation cannot be set here"),
        ({"spark.ssl.keyStorePassword": "Pw9"}, "spark.ssl.keyStorePassword: Spark settings"),
        ({"spark.executor.memory": ["4g"]}, "spark.executor.memory: expected a string"),
        (
            {"spark.hadoop.javax.jdo.option.ConnectionURL": "postgresql://u:Pw9@db/metastore"},
            "spark.hadoop.javax.jdo.option.ConnectionURL: Spark settings travel in the clear",
        ),
        (
            {"spark.archives": "tidemark-env.tar.gz#env"},
            "spark.archives: tidemark-env.tar.gz is a relative path, which Spark resolves "
            "against the driver's working folder",
        ),
        (
            {"spark.files": "/etc/spark/a.conf, conf/b.conf"},
            "spark.files: conf/b.conf is a relative path",
        ),
    ],
)
def test_a_pipelines_spark_block_is_checked_field_by_field(tmp_path, spark, problem):
    import yaml

    from tidemark import config
    from tidemark.core.errors import ConfigError

    doc = yaml.safe_load((REPO / "dags" / "pipelines" / "flights.yaml").read_text())
    path = tmp_path / "flights.yaml"
    path.write_text(yaml.safe_dump({**doc, "spark": spark}))
    with pytest.raises(ConfigError) as e:
        config.load(path, deep=False)
    assert "spark" in str(e.value) and problem in str(e.value), str(e.value)
    assert "Pw9" not in str(e.value)


def test_a_pipelines_spark_block_becomes_sparks_strings(tmp_path):
    import yaml

    from tidemark import config

    doc = yaml.safe_load((REPO / "dags" / "pipelines" / "flights.yaml").read_text())
    path = tmp_path / "flights.yaml"
    spark = {
        "spark.executor.cores": 2,
        "spark.dynamicAllocation.enabled": False,
        "spark.authenticate.secret.file": "/etc/spark/secret",  # a path, not the secret
        "spark.archives": "/opt/envs/tidemark-env.tar.gz#env,hdfs:///envs/b.tgz#b",
        "spark.jars": "local:/opt/jars/x.jar",
    }
    path.write_text(yaml.safe_dump({**doc, "spark": spark}))
    assert config.load(path, deep=False).spark == {
        "spark.executor.cores": "2",
        "spark.dynamicAllocation.enabled": "false",
        "spark.authenticate.secret.file": "/etc/spark/secret",
        "spark.archives": "/opt/envs/tidemark-env.tar.gz#env,hdfs:///envs/b.tgz#b",
        "spark.jars": "local:/opt/jars/x.jar",
    }


class _Started(Exception):
    pass


@pytest.mark.parametrize(
    ("master", "loopback"), [("local[2]", True), ("spark://10.1.2.3:7077", False)]
)
def test_the_driver_advertises_loopback_only_to_a_local_master(monkeypatch, master, loopback):
    """Executors on other hosts connect back to the driver at the address it advertises:
    SPARK_LOCAL_IP and spark.driver.host stay unset (the host's address) unless local."""
    from pyspark.sql import SparkSession

    from tidemark.engine.session import session

    seen: dict = {}

    def get_or_create(builder):
        seen["options"] = dict(builder._options)
        seen["local_ip"] = os.environ.get("SPARK_LOCAL_IP")
        raise _Started

    monkeypatch.delenv("SPARK_LOCAL_IP", raising=False)
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    monkeypatch.setattr(SparkSession.Builder, "getOrCreate", get_or_create)
    with pytest.raises(_Started):
        session(master, "tidemark-address-probe", conf={"spark.executor.cores": "1"})
    assert seen["options"]["spark.executor.cores"] == "1"
    if loopback:
        assert seen["local_ip"] == "127.0.0.1"
        assert seen["options"]["spark.driver.host"] == "127.0.0.1"
    else:
        assert seen["local_ip"] is None
        assert "spark.driver.host" not in seen["options"]
        assert "spark.driver.bindAddress" not in seen["options"]
