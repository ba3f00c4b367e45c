"""Spark entry point: `spark-submit jobs/replay.py run PIPELINE` (or backfill/recover ...).

The same commands as the `tidemark` CLI; the Spark master and resources come from
spark-submit (or the Airflow `spark_default` connection), not from TIDEMARK_SPARK_MASTER.
"""

import os
import sys

if __name__ == "__main__":
    os.environ["TIDEMARK_SPARK_MASTER"] = ""  # let spark-submit's --master stand
    from tidemark.cli import main

    main(sys.argv[1:])
