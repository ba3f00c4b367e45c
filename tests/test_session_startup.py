"""What a fresh run's session saves at start-up: PySpark's workers and a spark-submit'd driver
import PySpark from the installed package, with its bytecode, not from Spark's zip of it
(tidemark/engine/pythonpath.py); building a Column costs no call-site round trips."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tidemark.engine.pythonpath import installed_first


def _zips(home: Path) -> list[str]:
    lib = home / "python" / "lib"
    lib.mkdir(parents=True)
    zips = [lib / "pyspark.zip", lib / "py4j-0.10.9.9-src.zip"]
    for z in zips:
        z.write_bytes(b"")
    return [str(z) for z in zips]


def test_the_zips_inside_the_installed_pyspark_leave_the_path(tmp_path):
    site = tmp_path / "site-packages"
    (site / "py4j").mkdir(parents=True)
    home = site / "pyspark"
    zips = _zips(home)
    (home / "__init__.py").write_text("")
    path = [*zips, "/somewhere/else", str(site)]
    assert installed_first(path) == ["/somewhere/else", str(site)]


def test_a_spark_distribution_keeps_its_zips_first(tmp_path):
    site = tmp_path / "site-packages"
    (site / "pyspark").mkdir(parents=True)
    (site / "pyspark" / "__init__.py").write_text("")
    zips = _zips(tmp_path / "spark-4.0.1-bin-hadoop3")  # SPARK_HOME: a distribution
    path = [*zips, str(site)]
    assert installed_first(path) == path


def test_py4j_keeps_its_zip_when_it_is_not_installed(tmp_path):
    site = tmp_path / "site-packages"
    home = site / "pyspark"
    zips = _zips(home)
    (home / "__init__.py").write_text("")
    assert installed_first([*zips, str(site)]) == [zips[1], str(site)]


def _where_pyspark_comes_from(_):
    import sys

    import pyspark

    return [pyspark.__file__, *(p for p in sys.path if p.endswith(".zip"))]


def test_a_local_sessions_workers_import_the_installed_pyspark(spark):
    import pyspark

    (seen,) = spark.sparkContext.parallelize([0], 1).map(_where_pyspark_comes_from).collect()
    assert seen[0] == pyspark.__file__  # the driver's: site-packages, not the zip
    assert not [p for p in seen[1:] if p.endswith("pyspark.zip")]


def test_building_a_column_sends_no_call_site_to_the_jvm(spark):
    from pyspark.errors.utils import is_debugging_enabled

    assert spark.conf.get("spark.python.sql.dataFrameDebugging.enabled") == "false"
    assert not is_debugging_enabled()


def test_the_heavy_imports_of_a_run_find_their_bytecode():
    # `make` compiles the venv at install: with PYTHONDONTWRITEBYTECODE set (CI, container
    # images) nothing else would, and every fresh run compiled these from source (GX: 3.3 s).
    import great_expectations
    import pandas
    import pyarrow
    import pyspark.sql

    for module in (great_expectations, pandas, pyarrow, pyspark.sql):
        assert Path(importlib.util.cache_from_source(module.__file__)).is_file(), module.__name__


@pytest.mark.spark  # a Spark driver JVM of its own: not for make test-fast
def test_a_session_reads_times_in_utc_whatever_the_machines_zone():
    """spark.sql.session.timeZone is pinned to UTC: in a JVM whose default zone is
    Asia/Kathmandu (TZ), 23:30 UTC is still 23:30 on 1 March, not 05:15 on the 2nd."""
    import os
    import subprocess
    import sys

    code = (
        "from datetime import UTC, datetime\n"
        "from pyspark.sql import functions as F\n"
        "from tidemark.engine.session import session\n"
        "s = session('local[1]', 'tidemark-tz')\n"
        "t = F.lit(datetime(2026, 3, 1, 23, 30, tzinfo=UTC))\n"
        "got = s.range(1).select(F.date_format(t, 'yyyy-MM-dd HH:mm')).first()[0]\n"
        "print('GOT', s.conf.get('spark.sql.session.timeZone'), got)\n"
        "s.stop()\n"
    )
    env = {**os.environ, "TZ": "Asia/Kathmandu", "TIDEMARK_DRIVER_MEMORY": "512m"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = [ln for ln in done.stdout.splitlines() if ln.startswith("GOT ")]
    assert got == ["GOT UTC 2026-03-01 23:30"], done.stdout
