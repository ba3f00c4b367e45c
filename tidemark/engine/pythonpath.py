"""The installed PySpark before Spark's zip of it, on a Python path Spark made.

Spark puts ``$SPARK_HOME/python/lib/pyspark.zip`` and py4j's zip first on the Python path of
its workers and of a spark-submit'd driver. With pip's pyspark, SPARK_HOME is the installed
package itself, so the zip holds the very modules site-packages has, only without bytecode
caches: every process that imported PySpark from it compiled PySpark from source (0.5 s for
``pyspark.sql`` alone, against 0.1 s from the package). Where SPARK_HOME is a Spark distribution
of its own, its zips stay first, as Spark means them to: they match its JVM.
"""

from __future__ import annotations

import os


def installed_first(path: list[str]) -> list[str]:
    """``path`` less Spark's pyspark zip where it lies inside a pyspark package whose parent
    folder is on ``path`` (pip's pyspark: the same modules, with bytecode), and less py4j's zip
    beside it where py4j is installed there too."""
    out = list(path)
    on_path = {os.path.realpath(p) for p in path}
    for zipped in path:
        lib = os.path.dirname(zipped)
        home = os.path.dirname(os.path.dirname(lib))  # <site-packages>/pyspark
        if (
            os.path.basename(zipped) != "pyspark.zip"
            or os.path.basename(home) != "pyspark"
            or os.path.realpath(os.path.dirname(home)) not in on_path
            or not os.path.isfile(os.path.join(home, "__init__.py"))
        ):
            continue
        out.remove(zipped)
        site = os.path.dirname(home)
        for other in path:  # py4j's zip, if py4j is installed beside pyspark
            if (
                os.path.dirname(other) == lib
                and os.path.basename(other).startswith("py4j")
                and os.path.isdir(os.path.join(site, "py4j"))
            ):
                out.remove(other)
    return out
