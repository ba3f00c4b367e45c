"""PySpark's worker daemon, importing PySpark from the installed package (local masters).

Spark started its daemon and workers with its zip of PySpark first on their path, so the
daemon compiled PySpark from source at every start and each worker compiled whatever else of
PySpark it imported (tidemark/engine/pythonpath.py): 0.5 s of every fresh run
(``bench/replay_bench.py``, fresh runs).

Started by Spark as ``python -m tidemark.engine.worker_daemon pyspark.worker`` (the session's
``spark.python.daemon.module``, local masters only: a cluster's executors may lack tidemark
until its zip is shipped).
"""

from __future__ import annotations

import sys

from tidemark.engine.pythonpath import installed_first

if __name__ == "__main__":
    sys.path[:] = installed_first(sys.path)
    from pyspark.daemon import manager

    manager()
