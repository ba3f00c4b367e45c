"""The local stack for ``make up``, the demo and the tests: a PostgreSQL cluster, an Airflow
instance, demo data, and the chaos checker. The runtime (DAGs, tasks, the job, the web app)
never imports it; only the CLI's dev commands and the tests do.

May import: any layer below cli.
"""
