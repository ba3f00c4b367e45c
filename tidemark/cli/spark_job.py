"""Spark entry point: ``spark-submit <this file> run PIPELINE`` (or backfill, recover ...).

The application file the Airflow DAGs submit (``tidemark.airflow.dags.JOB``); in a checkout
it is also ``jobs/replay.py``. The same commands as the ``tidemark`` CLI; the Spark master and
resources come from spark-submit (or the Airflow ``spark_default`` connection), not from
TIDEMARK_SPARK_MASTER.
"""

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    # Run as a script, its folder heads sys.path: drop it so cli's modules stay in the package.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != here]
    os.environ["TIDEMARK_SPARK_MASTER"] = ""  # let spark-submit's --master stand
    from tidemark.engine.pythonpath import installed_first

    sys.path[:] = installed_first(sys.path)  # spark-submit put its zip of PySpark first
    from tidemark.cli.main import main

    main(sys.argv[1:])
