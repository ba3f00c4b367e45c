"""Tidemark: exactly-once replay of offset-addressed logs into PostgreSQL, orchestrated by
Airflow. The protocol is docs/design.md.

The package is layered; a module imports only from its own layer and the layers below it
(tests/test_layers.py checks this). Bottom first:

    core       errors, settings, DSN masking and resolution, PostgreSQL connections, fault points
    quality    Great Expectations: expectation parsing, row checks, batch gates, Data Docs
    config     the pipeline file model (validates expectations through quality)
    ledger     every statement against the tidemark.* tables: migrations, the run state
               machine, checkpoints, dead letters, status
    protocol   gids, two-phase commit, sink databases, the driver/task contract, recovery
    sources    planning and reading source logs (one Spark input partition per range)
    engine     Spark: the session, decode and transform, the task writer
    driver     one run end to end (deliver, backfill, redrive) and its quality gate
    render     a dead letter's payload as people read it (JSON, text, hexdump, previews): the
               web app's and the CLI's, kept out of the ledger
    airflow    the Airflow adapter: the DAG factory, tasks, health checks, notifiers
    web        the dead-letter web app, served as an Airflow plugin, and its Airflow REST
               client (airflow and web are siblings: neither imports the other)
    devstack   local PostgreSQL, local Airflow, demo data, the chaos checker: for `make up`
               and the tests, never imported by the runtime
    cli        the `tidemark` command and the spark-submit entry point
"""

# Bottom first; a tuple holds sibling layers, which may not import each other.
LAYERS = (
    ("core",),
    ("quality",),
    ("config",),
    ("ledger",),
    ("protocol",),
    ("sources",),
    ("engine",),
    ("driver",),
    ("render",),
    ("airflow", "web"),
    ("devstack",),
    ("cli",),
)
