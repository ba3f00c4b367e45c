"""The wheel as a user gets it: `python -m build` of the repository (an sdist, then the wheel
built from it), installed with its dependencies into a fresh venv outside the repository, and
used from a folder that is not the checkout: `tidemark db upgrade` applies the migrations the
wheel carries, `pipelines validate` and `run` work, and the spark-submit entry point is found
in the installed package and runs a replay under the venv's `spark-submit`.

The venv gets the base dependencies only (no `airflow` extra), so this also shows that these
commands work without Airflow. The repository's pinned lock is the constraints file: uv's cache
serves the same versions the repository runs with.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
import zipfile
from pathlib import Path

import psycopg
import pytest

from tests.conftest import REPO
from tidemark.core.dsn import mask
from tidemark.protocol import twopc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LOCK = REPO / "requirements.txt"


@contextlib.contextmanager
def timed(what: str):
    start = time.monotonic()
    try:
        yield
    finally:
        print(f"[test_wheel] {what}: {time.monotonic() - start:.1f}s", flush=True)


def run(argv: list, timeout: float, **kw) -> subprocess.CompletedProcess:
    """Run argv (stdout and stderr together); fail with its masked output unless it exits 0."""
    res = subprocess.run(
        [str(a) for a in argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        **kw,
    )
    code = res.returncode  # not res itself in the assertion: its repr has the unmasked output
    assert code == 0, (
        f"{' '.join(Path(str(a)).name for a in argv[:3])} ... exited {code}:\n"
        f"{mask(res.stdout)[-6000:]}"
    )
    return res


def uv() -> str:
    found = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    assert found, "uv is not installed (make venv installs it into .venv)"
    return found


def checkout(dest: Path) -> Path:
    """The repository as a fresh clone with the uncommitted work would have it: the files git
    tracks or would track (not ignored). No build leftovers: setuptools puts every file an
    existing tidemark.egg-info/SOURCES.txt lists into the sdist, declared or not."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, map(os.fsdecode, names)):
        src, dst = REPO / name, dest / name
        if src.is_symlink():
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(src), dst)
        elif src.is_file():  # not deleted in the work tree
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    return dest


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return checkout(tmp_path_factory.mktemp("checkout") / "tidemark")


@pytest.fixture(scope="module")
def wheel(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    with timed("python -m build (sdist, then the wheel from it)"):
        run([sys.executable, "-m", "build", "--outdir", out, source], timeout=300, cwd=source)
    wheels = list(out.glob("tidemark-*-py3-none-any.whl"))
    assert len(wheels) == 1 and list(out.glob("tidemark-*.tar.gz")), sorted(out.iterdir())
    return wheels[0]


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv outside the repository with the wheel and its dependencies (no extras)."""
    home = tmp_path_factory.mktemp("wheel-venv") / "venv"
    assert not home.resolve().is_relative_to(REPO)
    with timed("uv venv"):
        run([uv(), "venv", "-q", "--python", sys.executable, home], timeout=60)
    install = [uv(), "pip", "install", "-q", "--python", home / "bin" / "python", "-c", LOCK, wheel]
    with timed("uv pip install --offline <wheel> -c requirements.txt"):
        # From uv's cache alone when it has every locked version (make venv filled it): the
        # index round trips of an online resolution take half a minute.
        offline = subprocess.run(
            [str(a) for a in install] + ["--offline"], capture_output=True, text=True, timeout=400
        )
    if offline.returncode != 0:
        with timed("uv pip install <wheel> -c requirements.txt (not all in the cache)"):
            run(install, timeout=400)
    return home


def user_env(venv: Path, **extra) -> dict[str, str]:
    """The environment of a user of the installed wheel: nothing that points into the
    repository (PYTHONPATH, its venv on PATH), no Spark or Tidemark settings from this run."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "SPARK_HOME", "SPARK_CONF_DIR")
        and not k.startswith(("TIDEMARK_", "PYSPARK_"))
    }
    path = [
        p
        for p in env.get("PATH", "/usr/bin:/bin").split(os.pathsep)
        if p and not Path(p).resolve().is_relative_to(REPO)
    ]
    env.update(
        PATH=os.pathsep.join([str(venv / "bin"), *path]),
        VIRTUAL_ENV=str(venv),
        PYTHONUNBUFFERED="1",
        TIDEMARK_DRIVER_MEMORY="1g",
        SPARK_LOCAL_IP="127.0.0.1",
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


def test_the_wheel_carries_the_whole_package(source, wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {n for n in names if n.startswith("tidemark/")}
    package = {
        p.relative_to(source).as_posix() for p in (source / "tidemark").rglob("*") if p.is_file()
    }
    missing = package - shipped
    assert not missing, f"files of the package missing from {wheel.name}: {sorted(missing)}"
    for needed in (
        "tidemark/py.typed",
        "tidemark/cli/spark_job.py",
        "tidemark/engine/log4j2.properties",
        "tidemark/web/templates/dlq/list.html",
    ):
        assert needed in shipped
    assert {n for n in shipped if n.startswith("tidemark/ledger/sql/")} == {
        f"tidemark/ledger/sql/{p.name}" for p in (source / "tidemark/ledger/sql").glob("*.sql")
    }
    meta = (
        zipfile.ZipFile(wheel)
        .read(next(n for n in names if n.endswith(".dist-info/entry_points.txt")))
        .decode()
    )
    assert "tidemark = tidemark.cli.main:main" in meta


def test_the_installed_wheel_works_outside_the_repository(source, venv, env, pg, tmp_path):
    py = venv / "bin" / "python"
    work = tmp_path / "elsewhere"  # the user's folder: not the checkout
    work.mkdir()

    # The package, its migrations and the spark-submit entry point come from the new venv.
    probe = run(
        [
            py,
            "-c",
            """if True:
        import importlib.metadata as md, importlib.util, json, sysconfig
        import tidemark, pyspark
        from tidemark.ledger import migrations
        def has(name):
            try:
                md.distribution(name)
                return True
            except md.PackageNotFoundError:
                return False
        print(json.dumps({
            "purelib": sysconfig.get_paths()["purelib"], "tidemark": tidemark.__file__,
            "sql_dir": str(migrations.sql_dir()),
            "job": importlib.util.find_spec("tidemark.cli.spark_job").origin,
            "pyspark": pyspark.__version__, "airflow": importlib.util.find_spec("airflow")
            is not None, "pyspark_client": has("pyspark-client")}))
        """,
        ],
        timeout=60,
        cwd=work,
        env=user_env(venv),
    )
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    purelib = Path(found["purelib"]).resolve()
    assert purelib.is_relative_to(venv.resolve())
    for key in ("tidemark", "sql_dir", "job"):
        path = Path(found[key]).resolve()
        assert path.is_relative_to(purelib) and not path.is_relative_to(REPO), (key, path)
    job = Path(found["job"])
    locked = next(
        line.split("==")[1]
        for line in LOCK.read_text().splitlines()
        if line.startswith("pyspark==")
    )
    assert found["pyspark"] == locked
    assert not found["airflow"], "the base install must not pull in Airflow"
    assert not found["pyspark_client"]

    # db upgrade: every migration of the checkout, applied from the wheel's copy.
    ledger_db = f"whl_{uuid.uuid4().hex[:8]}"
    pg.create_database(ledger_db)
    ledger = pg.dsn(ledger_db)
    try:
        cli_env = user_env(
            venv,
            TIDEMARK_LEDGER_DSN=ledger,
            TIDEMARK_PIPELINES_DIR=env.dir,
            TIDEMARK_SPARK_MASTER="local[2]",
        )
        tidemark = venv / "bin" / "tidemark"
        with timed("tidemark db upgrade"):
            out = run([tidemark, "db", "upgrade"], timeout=120, cwd=work, env=cli_env).stdout
        migrations = sorted(p.name for p in (source / "tidemark/ledger/sql").glob("V*.sql"))
        assert [
            ln.split()[1] for ln in out.splitlines() if ln.startswith("applied ")
        ] == migrations, mask(out)
        assert f"schema version {int(migrations[-1][1:4])}" in out, mask(out)

        # pipelines validate: a pipeline file in a folder of the user's.
        pipeline_file = env.pipeline()
        with timed("tidemark pipelines validate"):
            out = run(
                [tidemark, "pipelines", "validate"], timeout=120, cwd=work, env=cli_env
            ).stdout
        assert f"ok      {pipeline_file}" in out, mask(out)

        # run: a few records of a postgres_log source, exactly once into the sink.
        env.append_orders(range(40))
        with timed("tidemark run orders (40 records)"):
            run([tidemark, "run", "orders"], timeout=300, cwd=work, env=cli_env)
        assert_delivered_once(env, ledger, 40)

        # The spark-submit entry point of the installed package: its --help, then a run of
        # what is new under the venv's spark-submit (the way Airflow's SparkSubmitOperator
        # starts it), with the master from spark-submit.
        with timed("python <spark_job.py> --help"):
            out = run([py, job, "--help"], timeout=60, cwd=work, env=cli_env).stdout
        assert "Exactly-once replay of offset-addressed logs into PostgreSQL." in out, out
        assert "db" in out and "run" in out
        env.append_orders(range(40, 60))
        submit_env = {k: v for k, v in cli_env.items() if k != "TIDEMARK_SPARK_MASTER"}
        with timed("spark-submit --master local[1] <spark_job.py> run orders (20 records)"):
            run(
                [venv / "bin" / "spark-submit", "--master", "local[1]", job, "run", "orders"],
                timeout=300,
                cwd=work,
                env=submit_env,
            )
        assert_delivered_once(env, ledger, 60)
        for dsn in (ledger, env.ledger_dsn, env.sink_dsn):
            assert (
                env.q(dsn, "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()")
                == []
            )
    finally:
        with psycopg.connect(ledger, autocommit=True) as c:
            for gid, _ in twopc.prepared(c, "%"):
                twopc.rollback(c, gid)
        pg.psql(f'DROP DATABASE IF EXISTS "{ledger_db}" WITH (FORCE)')


def assert_delivered_once(env, ledger: str, n: int) -> None:
    """Each of the n source records is in the sink exactly once, and the wheel's ledger has
    the checkpoints just past them."""
    source = set(env.ledger('SELECT "partition", "offset" FROM src.log'))
    assert len(source) == n
    rows = env.q(env.sink_dsn, "SELECT _tm_partition, _tm_offset FROM public.orders")
    assert len(rows) == len(set(rows)) == n and set(rows) == source, (
        f"{len(rows)} rows ({len(set(rows))} distinct) in the sink for {n} records"
    )
    assert env.q(env.sink_dsn, "SELECT count(DISTINCT id) FROM public.orders") == [(n,)]
    with psycopg.connect(ledger, autocommit=True) as c:
        checkpoints = dict(
            c.execute(
                "SELECT partition, next_offset FROM tidemark.checkpoints "
                "WHERE pipeline = 'orders' AND sink = 'main'"
            ).fetchall()
        )
    assert checkpoints == env.source_offsets()
