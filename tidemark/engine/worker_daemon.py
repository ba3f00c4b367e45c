"""PySpark's worker daemon, importing PySpark from the installed package (local masters).

Spark puts ``$SPARK_HOME/python/lib/pyspark.zip`` and py4j's zip first on its Python workers'
path. With pip's pyspark, SPARK_HOME is the installed package itself, so the zip holds the very
modules site-packages has, only without bytecode caches: the daemon compiled PySpark from
source at every start (0.5 s), and every new worker re-read the zip's directory once per
package inside it (18 times, 0.3 s) when Spark added its files directory to the path. Dropping
the zips that lie inside the installed package takes 0.7-1.0 s off a fresh run
(``bench/replay_bench.py``, fresh runs). Where SPARK_HOME is a Spark distribution of its own,
its zips stay first, as Spark means them to: they match its JVM.

Started by Spark as ``python -m tidemark.engine.worker_daemon pyspark.worker`` (the session's
``spark.python.daemon.module``, local masters only: a cluster's executors may lack tidemark
until its zip is shipped).
"""

from __future__ import annotations

import os
import sys


def installed_first(path: list[str]) -> list[str]:
    """``path`` less Spark's pyspark and py4j zips where both lie inside a pyspark package
    whose parent folder is on ``path`` (pip's pyspark: the same modules, with bytecode)."""
    out = list(path)
    on_path = {os.path.realpath(p) for p in path}
    for zipped in path:
        lib = os.path.dirname(zipped)
        home = os.path.dirname(os.path.dirname(lib))  # <site-packages>/pyspark
        if (os.path.basename(zipped) != "pyspark.zip" or os.path.basename(home) != "pyspark"
                or os.path.realpath(os.path.dirname(home)) not in on_path
                or not os.path.isfile(os.path.join(home, "__init__.py"))):
            continue
        out.remove(zipped)
        site = os.path.dirname(home)
        for other in path:  # py4j's zip, if py4j is installed beside pyspark
            if (os.path.dirname(other) == lib and os.path.basename(other).startswith("py4j")
                    and os.path.isdir(os.path.join(site, "py4j"))):
                out.remove(other)
    return out


if __name__ == "__main__":
    sys.path[:] = installed_first(sys.path)
    from pyspark.daemon import manager

    manager()
