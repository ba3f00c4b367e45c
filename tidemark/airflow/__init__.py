"""The Airflow adapter: the DAG factory, the tasks it runs, the maintenance DAG's health
checks (health.py), failure notifiers.

Thin over the layers below (driver, protocol, ledger): DAG files call the factory, tasks call
library functions. Importing this package does not import Airflow; its modules do.
May import: driver, engine, sources, protocol, ledger, config, quality, core.
"""

from tidemark.airflow import connection_lookup

# A process using the Airflow layer (a DAG file, a task) resolves connection ids through
# Airflow, as the CLI does (cli/main.py); this imports no Airflow until one is looked up.
connection_lookup.register()

POOL = "tidemark_spark"  # caps concurrent Spark jobs; one fits 2 cores
