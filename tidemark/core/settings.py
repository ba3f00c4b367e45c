"""Process-wide settings from the environment (TIDEMARK_*)."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from tidemark.core.dsn import remember
from tidemark.core.engines import Engine
from tidemark.core.errors import TidemarkError

# One default for the driver's memory wherever a run starts one (README "Configuration"): in
# local mode the driver JVM also runs the executors and holds the batch the gate caches.
DRIVER_MEMORY = "3g"
MEMORY = r"^\d+[mMgG]$"  # a JVM memory size, as spark-submit --driver-memory takes it
SparkLogLevel = Literal["ALL", "TRACE", "DEBUG", "INFO", "WARN", "ERROR", "FATAL", "OFF"]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TIDEMARK_", extra="ignore")

    ledger_dsn: str | None = Field(None, description="PostgreSQL DSN of the checkpoint ledger")
    ledger_conn_id: str = Field(
        "tidemark_ledger",
        min_length=1,
        description="Airflow connection of the ledger (inside Airflow it wins over ledger_dsn)",
    )
    pipelines_dir: Path = Field(Path("dags/pipelines"), description="folder of pipeline YAML files")
    spark_master: str = Field(
        "local[*,4]",
        description="Spark master for `tidemark run` "
        "(local mode retries a failed task up to 4 times)",
    )
    engine: Engine = Field(
        Engine.SPARK,
        description="where a run's write tasks run: spark, local (in the run's process, "
        "no JVM; no transform expressions, data-quality checks or backfills), or connect "
        "(a Spark Connect server: spark_remote)",
    )
    spark_remote: str | None = Field(
        None,
        pattern=r"^sc://",
        description="a Spark Connect endpoint (sc://host:port): the runs' write tasks run "
        "there (engine connect) unless the engine is local; a pipeline's spark.remote wins",
    )
    gid_prefix: str = Field(
        "tm",
        pattern=r"^[a-z][a-z0-9]{0,7}$",
        description="prefix of every prepared transaction's gid",
    )
    lease_ttl_seconds: int = Field(1800, ge=10, description="lease lifetime without a heartbeat")
    lock_timeout_ms: int = Field(60_000, ge=100, description="sink lock wait before a task fails")
    data_docs_dir: Path = Field(
        Path(".tidemark/data_docs"), description="where Great Expectations Data Docs are rendered"
    )
    prepared_alert_seconds: int = Field(
        900, ge=1, description="age at which a prepared transaction alerts"
    )
    # Retention (`tidemark prune`, the maintenance DAG's prune task; docs/operations.md).
    retention_letters_days: int = Field(
        30,
        ge=0,
        description="days a resolved dead letter "
        "(redriven or discarded) is kept after it was resolved",
    )
    retention_runs_days: int = Field(
        90,
        ge=0,
        description="days a finished run is kept, with "
        "its sinks, ranges, participants, metrics, data-quality "
        "results and Data Docs pages",
    )
    retention_requests_days: int = Field(30, ge=0, description="days a redrive request is kept")
    retention_batch_size: int = Field(
        500, ge=1, description="rows (letters, runs, requests) deleted per ledger transaction"
    )
    # Spark's driver and the class archive (tidemark/engine/session.py, cds.py).
    driver_memory: str = Field(
        DRIVER_MEMORY,
        pattern=MEMORY,
        description="Spark driver memory of every run: `tidemark run`'s session, and the "
        "DAGs' spark-submit unless the pipeline's airflow.driver_memory sets its own",
    )
    spark_log_level: SparkLogLevel = Field(
        "ERROR", description="level of Spark's own log once the session is up"
    )
    spark_cds_dir: Path | None = Field(
        None,
        description="folder of the driver JVM's class archive (default: "
        "$XDG_CACHE_HOME/tidemark, else ~/.cache/tidemark)",
    )
    sql_dir: Path | None = Field(
        None, description="folder of the ledger's migrations (default: the package's own)"
    )
    debug: bool = Field(False, description="an internal error prints its traceback (the CLI)")

    def cds_dir(self) -> Path:
        """Where the driver JVM's class archive is (tidemark/engine/cds.py)."""
        if self.spark_cds_dir is not None:
            return self.spark_cds_dir
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tidemark"

    def docs_dir(self, pipeline: str) -> Path:
        """A pipeline's own Great Expectations project, where its Data Docs are rendered."""
        return self.data_docs_dir / pipeline

    def ledger(self, where: str = "") -> str:
        """The ledger's DSN, or one line saying it is not configured (``where``: whose
        environment lacks it, e.g. "Airflow's API server")."""
        if not self.ledger_dsn:
            hint = (
                f" in the environment of {where}"
                if where
                else " (or run `make up`, which writes .tidemark/env)"
            )
            raise TidemarkError(f"no ledger: set TIDEMARK_LEDGER_DSN{hint}")
        return remember(self.ledger_dsn)

    def airflow_ledger(self, where: str) -> str:
        """The ledger's DSN inside Airflow: the Airflow connection ``ledger_conn_id`` when
        Airflow has it (its password then masked in task logs), else ``ledger_dsn``."""
        from tidemark.core.dsn import connection_if_defined

        uri = connection_if_defined(self.ledger_conn_id)
        if uri:
            return uri
        if not self.ledger_dsn:
            raise TidemarkError(
                f"no ledger: define the Airflow connection "
                f"{self.ledger_conn_id!r} (or set TIDEMARK_LEDGER_DSN in the "
                f"environment of {where})"
            )
        return remember(self.ledger_dsn)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
