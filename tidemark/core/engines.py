"""Which engine runs a run's write tasks (Settings.engine; tidemark/driver/runners.py)."""

from __future__ import annotations

import enum


class Engine(enum.StrEnum):
    SPARK = "spark"  # Spark tasks: the engine for real pipelines
    LOCAL = "local"  # the run's own process, no JVM: tests and small pipelines
    CONNECT = "connect"  # Spark tasks on a Spark Connect server (Settings.spark_remote)
