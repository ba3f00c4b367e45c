"""PySpark's worker daemon, importing PySpark from the installed package (local masters).

Spark started its daemon and workers with its zip of PySpark first on their path, so the
daemon compiled PySpark from source at every start and each worker compiled whatever else of
PySpark it imported (tidemark/engine/pythonpath.py): 0.5 s of every fresh run
(``bench/replay_bench.py``, fresh runs).

Started by Spark as ``python -m tidemark.engine.worker_daemon pyspark.worker`` (the session's
``spark.python.daemon.module``, local masters only: a cluster's executors may lack tidemark
until its zip is shipped).

Before it forks its first worker, the daemon imports what every Tidemark task imports (the
reader, the writer, Arrow, psycopg, ADBC): each worker then starts with them loaded instead
of importing them again, once per worker of every run.
"""

from __future__ import annotations

import sys

from tidemark.engine.pythonpath import installed_first

# What a task's Python imports: the source reader (sources, json_arrow, ADBC) and the
# writer (engine.writer and what it imports: pyarrow, psycopg, the protocol's models).
TASK_MODULES = (
    "pyspark.worker",
    "pyarrow.json",
    "adbc_driver_postgresql.dbapi",
    "tidemark.sources",
    "tidemark.sources.json_arrow",
    "tidemark.sources.postgres_log",
    "tidemark.engine.writer",
)

if __name__ == "__main__":
    sys.path[:] = installed_first(sys.path)
    import contextlib
    import importlib

    from pyspark.daemon import manager

    for module in TASK_MODULES:
        # Only a head start: a module that fails here fails again, with its own error, in
        # the task that imports it.
        with contextlib.suppress(Exception):
            importlib.import_module(module)

    manager()
