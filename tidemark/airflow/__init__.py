"""The Airflow adapter: the DAG factory, the tasks it runs, the maintenance DAG's health
checks (health.py), failure notifiers.

Thin over the layers below (driver, protocol, ledger): DAG files call the factory, tasks call
library functions. Importing this package does not import Airflow; its modules do.
May import: driver, engine, sources, protocol, ledger, config, quality, core.
"""

POOL = "tidemark_spark"  # caps concurrent Spark jobs; one fits 2 cores
