"""The ``tidemark`` command (main.py, dlq.py) and the spark-submit entry point
(spark_job.py), which runs the same commands.

May import: every layer; devstack only inside dev commands (airflow, demo, chaos).
"""
