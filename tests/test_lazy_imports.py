"""A fresh `tidemark run` imports Great Expectations only when its pipeline has expectations
to check (issue 50: GX's import is seconds of every run's fixed cost). Real runs in their own
processes, as Airflow starts them; every Python process they start (the driver, and with
Spark its Python workers, which inherit PYTHONPATH) records, through a sitecustomize on that
path, each watched module it imports."""

from __future__ import annotations

import subprocess
import textwrap

import pytest

from tests.conftest import order_record

# Installed first thing in every process on PYTHONPATH: when one of the watched top-level
# packages is first imported, the process appends "<pid> <package>" to $TM_IMPORT_LOG. A
# forked Spark worker runs no atexit hook, so the record is written at the import itself.
SITECUSTOMIZE = textwrap.dedent(
    """
    import os, sys

    class _Watch:
        names = set(os.environ.get("TM_IMPORT_WATCH", "").split(","))

        def find_spec(self, name, path=None, target=None):
            if name in self.names and name not in sys.modules:
                with open(os.environ["TM_IMPORT_LOG"], "a") as f:
                    f.write(f"{os.getpid()} {name}\\n")
            return None

    if os.environ.get("TM_IMPORT_LOG"):
        sys.meta_path.insert(0, _Watch())
    """
)


def _run(env, tmp_path, engine: str, name: str) -> set[str]:
    """`tidemark run name` in a fresh process on ``engine``: the watched packages any of
    its Python processes imported."""
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / f"imports-{name}-{engine}.log"
    cli = env.cli_env(
        TIDEMARK_ENGINE=engine,
        TM_IMPORT_LOG=log,
        TM_IMPORT_WATCH="great_expectations",
    )
    cli["PYTHONPATH"] = f"{hook}:{cli.get('PYTHONPATH', '')}".rstrip(":")
    proc = subprocess.run(
        env.cli_argv("run", name), env=cli, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "committed" in proc.stdout, proc.stdout
    return {line.split()[1] for line in log.read_text().splitlines()} if log.exists() else set()


@pytest.mark.parametrize(
    "which", ["local", pytest.param("spark", marks=[pytest.mark.slow, pytest.mark.spark])]
)
def test_a_run_without_expectations_never_imports_great_expectations(env, tmp_path, which):
    env.append([order_record(i % 2, i, f"o{i}", 1.0) for i in range(20)])
    env.pipeline()
    assert _run(env, tmp_path, which, "orders") == set()
    assert env.q(env.sink_dsn, "SELECT count(*) FROM public.orders") == [(20,)]


@pytest.mark.slow
@pytest.mark.spark
def test_a_run_with_expectations_imports_it(env, tmp_path):
    # The watch itself can fail: the same run with a row-level expectation imports GX.
    env.append([order_record(i % 2, i, f"o{i}", 1.0) for i in range(20)])
    env.pipeline(
        quality={"rows": [{"expect_column_values_to_not_be_null": {"column": "name"}}]},
    )
    assert _run(env, tmp_path, "spark", "orders") == {"great_expectations"}
