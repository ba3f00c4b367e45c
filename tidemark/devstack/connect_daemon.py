"""PySpark's worker daemon for the local Spark Connect server (connect_server.py), with what
every Tidemark task imports from outside tidemark imported once, before the first fork.

Spark kills a Python worker idle for a minute (PythonWorkerFactory: a constant, no setting),
so an hourly run on a warm server finds none and forks new ones from its session's daemon;
each imported pyarrow, ADBC, psycopg and pydantic again, and PySpark from Spark's zip of it
(compiled from source: the zip has no bytecode), seconds of a 1,000-record run. Forked from
this daemon a worker has them already.

Not imported from the tidemark package: the server copies this file into a folder of its own
on its workers' path (``spark.python.daemon.module``). A worker imports tidemark from what its
session shipped (connect_session.py), so this daemon never imports tidemark: a forked worker
would keep the daemon's copy, not the run's.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys

# A task's imports outside tidemark: the reader (pyarrow's JSON, ADBC), the writer (pyarrow,
# psycopg), the protocol's models (pydantic), and PySpark's worker itself.
TASK_MODULES = (
    "pyspark.worker",
    "pyarrow",
    "pyarrow.compute",
    "pyarrow.json",
    "pyarrow.csv",
    "adbc_driver_postgresql.dbapi",
    "psycopg",
    "pydantic",
)


def installed_first(path: list[str]) -> list[str]:
    """``path`` less Spark's pyspark zip (and py4j's) where pip's pyspark is installed on it:
    the same modules, with bytecode (as tidemark/engine/pythonpath.py, which this file may
    not import)."""
    out = list(path)
    on_path = {os.path.realpath(p) for p in path}
    for zipped in path:
        lib = os.path.dirname(zipped)
        home = os.path.dirname(os.path.dirname(lib))
        if (
            os.path.basename(zipped) != "pyspark.zip"
            or os.path.basename(home) != "pyspark"
            or os.path.realpath(os.path.dirname(home)) not in on_path
            or not os.path.isfile(os.path.join(home, "__init__.py"))
        ):
            continue
        out.remove(zipped)
        site = os.path.dirname(home)
        for other in path:
            if (
                os.path.dirname(other) == lib
                and os.path.basename(other).startswith("py4j")
                and os.path.isdir(os.path.join(site, "py4j"))
            ):
                out.remove(other)
    return out


if __name__ == "__main__":
    sys.path[:] = installed_first(sys.path)
    from pyspark.daemon import manager

    for module in TASK_MODULES:
        # Only a head start: a module failing here fails again, with its error, in the task.
        with contextlib.suppress(Exception):
            importlib.import_module(module)
    manager()
