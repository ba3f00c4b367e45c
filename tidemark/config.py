"""Pipeline files: one YAML file per pipeline, validated into typed models.

Every error names the file, the field (as a dotted path) and the problem.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tidemark.core import dsn as dsnmod
from tidemark.core import spark_settings
from tidemark.core.errors import ConfigError
from tidemark.core.settings import MEMORY

IDENT = r"^[a-z_][a-z0-9_]{0,39}$"
TABLE = r"^([a-z_][a-z0-9_]*\.)?[a-z_][a-z0-9_]*$"
META_PREFIX = "_tm_"


def is_meta(name: str) -> bool:
    """A Tidemark column (``_tm_*``) in any case: Spark resolves names case-insensitively
    (spark.sql.caseSensitive is off), so ``_TM_TS`` is ``_tm_ts`` to it."""
    return name.lower().startswith(META_PREFIX)


MAINTENANCE_DAG = "tidemark_maintenance"


def dag_id(pipeline: str, kind: str | None = None) -> str:
    """The Airflow DAG of a pipeline (``kind``: backfill, redrive, rebuild); its permissions guard the
    pipeline's dead letters too."""
    return f"tidemark_{pipeline}" + (f"_{kind}" if kind else "")


# Spark type -> PostgreSQL type for sink columns. The same names are accepted in decode schemas.
PG_TYPES = {
    "string": "text",
    "int": "integer",
    "integer": "integer",
    "bigint": "bigint",
    "long": "bigint",
    "smallint": "smallint",
    "short": "smallint",
    "double": "double precision",
    "float": "real",
    "boolean": "boolean",
    "date": "date",
    "timestamp": "timestamptz",
    "timestamp_ntz": "timestamp",
    "binary": "bytea",
}
_DECIMAL = re.compile(r"^decimal\((\d{1,2}),\s*(\d{1,2})\)$")


def pg_type(spark_type: str) -> str:
    t = spark_type.strip().lower()
    if t in PG_TYPES:
        return PG_TYPES[t]
    m = _DECIMAL.match(t)
    if m:
        return f"numeric({m[1]},{m[2]})"
    raise ValueError(
        f"unsupported type {spark_type!r}; use one of {', '.join(sorted(PG_TYPES))} or decimal(p,s)"
    )


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Connection(_Model):
    dsn: str | None = None
    conn_id: str | None = None

    @model_validator(mode="after")
    def _one(self):
        if bool(self.dsn) == bool(self.conn_id):
            raise ValueError("give exactly one of dsn or conn_id")
        return self

    def resolve(self, where: str) -> str:
        return dsnmod.resolve(self.dsn, self.conn_id, where)


class LogColumns(_Model):
    partition: str = "partition"
    offset: str = "offset"
    key: str = "key"
    payload: str = "payload"
    headers: str = "headers"
    ts: str = "ts"
    xid: str = "xid"


class PostgresLogSource(Connection):
    type: Literal["postgres_log"]
    table: Annotated[str, Field(pattern=TABLE)]
    columns: LogColumns = LogColumns()
    partitions: list[Annotated[int, Field(ge=0)]] | None = None


class FileArchiveSource(_Model):
    type: Literal["file_archive"]
    uri: str
    # Accepted for compatibility, read by nothing: each segment is read by its extension, and
    # a folder may mix formats (tidemark/sources/file_archive.py).
    format: Literal["parquet", "jsonl"] | None = None


Source = Annotated[PostgresLogSource | FileArchiveSource, Field(discriminator="type")]


class Decode(_Model):
    format: Literal["json"] = "json"
    schema_: dict[str, str] = Field(alias="schema")

    @field_validator("schema_")
    def _types(cls, v: dict[str, str]):
        if not v:
            raise ValueError("declare at least one field")
        for name, t in v.items():
            if not isinstance(name, str) or not name or is_meta(name):
                raise ValueError(f"bad field name {name!r}")
            try:
                pg_type(t)
            except ValueError as exc:
                raise ValueError(f"field {name}: {exc}") from None
        return v


class Transform(_Model):
    # Output column -> Spark SQL expression over the decoded fields (and _tm_* metadata).
    select: dict[str, str] | None = None
    # Output columns that must not be NULL: a row where one is NULL is quarantined (transform).
    required: list[str] = []
    # Alternatively "package.module:function", a function DataFrame -> DataFrame.
    python: Annotated[str, Field(pattern=r"^[\w.]+:\w+$")] | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.select is not None and self.python is not None:
            raise ValueError("give select or python, not both")
        if self.select is not None:
            for col in self.select:
                if not re.match(IDENT, col):
                    raise ValueError(f"output column {col!r} must match {IDENT}")
            unknown = [c for c in self.required if c not in self.select]
            if unknown:
                raise ValueError(f"required columns not in select: {', '.join(unknown)}")
        return self


class Correction(_Model):
    """Values to correct in a window of records (docs/pipelines.md, "Corrections"): after
    the transform, in every run, backfill, rebuild, redrive and fallback that reads them, each
    column of ``set`` in a passing row of the window takes its expression's value. The window
    is every condition given: ``partitions`` (default: all), ``offsets`` [from, to) in each of
    them, ``since``/``until`` the record time [since, until) (UTC; a time without a zone is
    UTC). A correction changes what the current pipeline makes of those records, as a
    transform change does: rows already delivered change when the window is re-delivered
    (`tidemark backfill`)."""

    name: Annotated[str, Field(pattern=IDENT)]
    note: str = ""
    partitions: list[Annotated[int, Field(ge=0)]] | None = None
    offsets: tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=0)]] | None = None
    since: datetime | None = None
    until: datetime | None = None
    # Output column -> Spark SQL expression over the transform's output columns (and _tm_*
    # metadata); the result is cast to the column's type, so the sink's table never changes.
    set_: dict[str, str] = Field(alias="set")

    @field_validator("set_", mode="before")
    def _literals(cls, v):
        # YAML reads `temp: 20` or `flag: null` as a number or None: as SQL they are literals.
        if not isinstance(v, dict):
            return v
        sql = {None: "NULL", True: "true", False: "false"}
        return {
            k: sql[e]
            if e is None or isinstance(e, bool)
            else str(e)
            if isinstance(e, int | float)
            else e
            for k, e in v.items()
        }

    @field_validator("since", "until")
    def _utc(cls, v: datetime | None):
        if v is None:
            return v
        return v.replace(tzinfo=UTC) if v.tzinfo is None else v.astimezone(UTC)

    @model_validator(mode="after")
    def _window(self):
        if not self.set_:
            raise ValueError("set: name at least one column to correct")
        for col, expr in self.set_.items():
            if not re.match(IDENT, col) or not isinstance(expr, str) or not expr.strip():
                raise ValueError(f"set: {col!r} must be an output column with an expression")
        if (self.since is None) != (self.until is None):
            raise ValueError("give since and until together (the window [since, until))")
        if self.since is not None and self.until is not None and self.until <= self.since:
            raise ValueError(
                f"until ({self.until.isoformat()}) must be after since ({self.since.isoformat()})"
            )
        if self.offsets is not None:
            if self.offsets[1] <= self.offsets[0]:
                raise ValueError(f"offsets [{self.offsets[0]}, {self.offsets[1]}) is empty")
            if not self.partitions:
                raise ValueError("offsets need partitions: offsets are per partition")
        if self.offsets is None and self.since is None:
            # Without one it would correct every record: that is a transform change.
            raise ValueError("give a window: offsets (with partitions) or since and until")
        return self


class Quality(_Model):
    """Great Expectations checks: ``rows`` quarantine each failing row (class validation);
    ``batch`` is the gate: if it fails nothing is written (or, with on_gate_failure
    quarantine_batch, the whole batch goes to the DLQ as dq_gate)."""

    rows: list[dict] = []
    batch: list[dict] = []

    @property
    def empty(self) -> bool:
        return not self.rows and not self.batch


class PipelineQuality(Quality):
    on_gate_failure: Literal["halt", "quarantine_batch"] = "halt"
    # The share of a sink's records a run may quarantine (decode, transform, validation,
    # sink write) before it halts with nothing committed: past it, a deploy or a table is
    # more likely broken than the data (a key change sending every second version to the
    # DLQ). 1 turns the ceiling off.
    max_quarantined: Annotated[float, Field(gt=0, le=1)] = 0.5
    # Fewer quarantined records than this never halt a run: one bad record in a small batch
    # must not stop a pipeline (its next run would read it again).
    max_quarantined_min: Annotated[int, Field(ge=1)] = 100


# What a tombstone (a record with a key and no payload: how a compacted Kafka topic deletes
# a key) does to a sink: ``delete`` removes the key's row, ``quarantine`` keeps it as a dead
# letter.
Tombstones = Literal["quarantine", "delete"]


class Sink(Connection):
    name: Annotated[str, Field(pattern=IDENT)]
    table: Annotated[str, Field(pattern=TABLE)]
    key: Annotated[list[Annotated[str, Field(pattern=IDENT)]], Field(min_length=1)]
    create_table: bool = True
    # A column ordering a key's versions across partitions (for example an event version or
    # timestamp). Without one, (partition, offset) orders versions within a partition only,
    # and a key whose versions come from two partitions fails the sink with a clear message.
    version: Annotated[str, Field(pattern=IDENT)] | None = None
    quality: Quality = Quality()  # stricter checks for this sink only
    tombstones: Tombstones | None = None  # None: the pipeline's
    # evolve: a column the transform newly produces is added to the table (nullable) before
    # the write; strict: any difference between table and output refuses the sink.
    schema_: Literal["evolve", "strict"] = Field("evolve", alias="schema")

    @property
    def not_null(self) -> list[str]:
        """Columns every row must have (NULL in one quarantines the row): key and version."""
        return [*self.key, *([self.version] if self.version else [])]


class Limits(_Model):
    max_records_per_partition: Annotated[int, Field(gt=0)] = 100_000
    # A run of at least this many records from fewer partitions than Spark has cores spreads
    # them over one write task per core (docs/pipelines.md, "Parallelism").
    split_min_records: Annotated[int, Field(gt=0)] = 50_000


class Alerts(_Model):
    """Where failed tasks and maintenance findings are reported (see tidemark/airflow/alerts.py)."""

    email: list[str] = []  # addresses; empty = no e-mail
    smtp_conn_id: Annotated[str, Field(min_length=1)] = "smtp_default"
    webhook_conn_id: Annotated[str, Field(min_length=1)] | None = None  # holds the webhook URL
    dlq_max: Annotated[int, Field(ge=0)] = 10_000  # quarantined DLQ rows before an alert
    prepared_max_age_minutes: Annotated[int, Field(gt=0)] = 30
    # Lag alert (maintenance), per sink and partition, once per episode; none by default.
    lag_max_records: Annotated[int, Field(gt=0)] | None = None  # checkpoint behind the source
    lag_max_minutes: Annotated[float, Field(gt=0)] | None = None  # oldest undelivered record

    @field_validator("email", mode="before")
    def _one_address(cls, v):
        return [v] if isinstance(v, str) else v

    @field_validator("email")
    def _addresses(cls, v: list[str]):
        out = []
        for addr in v:
            a = addr.strip()
            local, _, domain = a.partition("@")
            if a.count("@") != 1 or not local or not domain or any(c.isspace() for c in a):
                raise ValueError(f"{addr!r} is not an e-mail address (expected name@domain)")
            out.append(a)
        return out


class Orchestration(_Model):
    """How Airflow runs the pipeline's tasks (tidemark/airflow/dags.py)."""

    retries: Annotated[int, Field(ge=0, le=20)] = 2
    retry_delay_seconds: Annotated[int, Field(ge=1)] = 60
    max_retry_delay_seconds: Annotated[int, Field(ge=1)] = 900  # exponential backoff cap
    # spark-submit --driver-memory; None: TIDEMARK_DRIVER_MEMORY (Settings.driver_memory, 3g)
    driver_memory: Annotated[str | None, Field(pattern=MEMORY)] = None
    # Airflow's own Backfill of the scheduled DAG re-delivers each run's data interval (its
    # records by time: `tidemark backfill --since --until`); off, such runs are refused.
    backfill_by_interval: bool = False
    # The Airflow connection the replay task runs the job with: a ``spark`` one spark-submits,
    # a ``spark_connect`` one runs it on that Spark Connect service (docs/airflow.md).
    spark_conn_id: Annotated[str, Field(min_length=1)] = "spark_default"
    # Whether the scheduled DAG starts paused when Airflow first sees it; unset, Airflow's
    # own default ([core] dags_are_paused_at_creation: paused). Only the first parse
    # counts: afterwards the DAG keeps whatever pause state it has (the toggle in the UI).
    paused_on_creation: bool | None = None


class Retention(_Model):
    """How long this pipeline's history is kept (docs/operations.md, "Retention"); read by
    `tidemark prune` and the maintenance DAG on every run. A field left out takes the
    maintenance workers' TIDEMARK_RETENTION_* variable (or its default)."""

    letters_days: Annotated[int, Field(ge=0)] | None = None  # redriven / discarded letters
    runs_days: Annotated[int, Field(ge=0)] | None = None  # finished runs and their Data Docs
    requests_days: Annotated[int, Field(ge=0)] | None = None  # redrive requests
    # A table a rebuild retired (``<table>_<YYYYMMDD>_run<N>``), counted from its date; None
    # (the default): kept until dropped by hand.
    retired_tables_days: Annotated[int, Field(ge=0)] | None = None
    # postgres_log only: `tidemark source prune` (and, with ``source_prune``, the
    # maintenance DAG) deletes source rows below where every sink and re-delivery still
    # needs them, keeping at least this many days of records for rebuilds and backfills.
    source_keep_days: Annotated[int, Field(ge=0)] | None = None
    source_prune: bool = False


# `start`: earliest, latest, an offset for every partition, or {partition: offset}.
Start = Literal["earliest", "latest"] | int | dict[int, int]


class Pipeline(_Model):
    name: Annotated[str, Field(pattern=IDENT)]
    description: str = ""
    schedule: str | None = None
    tags: list[str] = []
    delivery: Literal["exactly_once", "at_least_once"] = "exactly_once"
    # Where a sink with no checkpoint in a partition starts: the first settled offset of the
    # source (earliest), the end of what is settled now (latest: skip the history), an offset
    # (every partition) or {partition: offset} (partitions not named start at earliest).
    start: Start = "earliest"
    source: Source
    decode: Decode
    transform: Transform = Transform()
    corrections: list[Correction] = []
    sinks: Annotated[list[Sink], Field(min_length=1)]
    tombstones: Tombstones = "quarantine"
    limits: Limits = Limits()
    quality: PipelineQuality = PipelineQuality()
    alerts: Alerts = Alerts()
    airflow: Orchestration = Orchestration()
    retention: Retention = Retention()
    # Spark conf for this pipeline's job (spark.executor.memory, spark.pyspark.python,
    # spark.archives, ...): over the Spark connection's extra conf (docs/production.md).
    spark: dict[str, Any] = {}  # checked by spark_settings: one message per bad key

    @field_validator("spark")
    def _spark_conf(cls, v: dict[str, Any]) -> dict[str, str]:
        return spark_settings.checked(v)

    @field_validator("start", mode="before")
    @classmethod
    def _start(cls, v: object) -> object:
        # One line for any wrong shape (a union's errors would list one per member).
        def offset(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool) and x >= 0

        if v in ("earliest", "latest") or offset(v):
            return v
        if isinstance(v, dict) and v:
            # A partition written as text ('0': 1200, or a JSON dump of the file) is its number.
            parts = {int(p) if isinstance(p, str) and p.isdigit() else p: o for p, o in v.items()}
            if len(parts) == len(v) and all(offset(p) and offset(o) for p, o in parts.items()):
                return parts
        raise ValueError(
            f"must be earliest, latest, an offset (an integer >= 0) or a mapping of partition "
            f"to offset (e.g. {{0: 1200, 1: 800}}), not {v!r}"
        )

    def start_at(self, partition: int) -> int | Literal["earliest", "latest"]:
        """Where a sink starts in ``partition`` it has no checkpoint in: earliest, latest or
        an offset."""
        if isinstance(self.start, dict):
            return self.start.get(partition, "earliest")
        return self.start

    def cross_check(self, where: str, deep: bool = True) -> None:
        """Checks across sections, reported with the exact field path. ``deep`` also builds
        every expectation (imports Great Expectations: seconds, too slow for DAG parsing)."""
        names = [s.name for s in self.sinks]
        for i, name in enumerate(names):
            if names.index(name) != i:
                raise ConfigError(where, f"sink name {name!r} is used twice", f"sinks[{i}].name")
        if self.airflow.backfill_by_interval and not self.schedule:
            raise ConfigError(
                where,
                "backfill_by_interval needs a schedule (each run's data interval is the "
                "time between two of its ticks)",
                "airflow.backfill_by_interval",
            )
        if self.retention.source_prune and self.source.type != "postgres_log":
            raise ConfigError(
                where,
                "source_prune deletes rows of a postgres_log source; this source is "
                f"{self.source.type}",
                "retention.source_prune",
            )
        if self.retention.source_prune and self.retention.source_keep_days is None:
            raise ConfigError(
                where,
                "source_prune needs source_keep_days (how many days of records rebuilds and "
                "backfills may still read)",
                "retention.source_keep_days",
            )
        if deep:
            self.check_expectations(where)
        self.check_corrections(where)
        outputs = self.output_columns()
        if outputs is not None:
            for i, sink in enumerate(self.sinks):
                missing = [k for k in sink.key if k not in outputs]
                if missing:
                    raise ConfigError(
                        where,
                        f"key columns not produced by the transform: {', '.join(missing)}",
                        f"sinks[{i}].key",
                    )
                if sink.version and sink.version not in outputs:
                    raise ConfigError(
                        where,
                        f"version column {sink.version} is not produced by the transform",
                        f"sinks[{i}].version",
                    )

    def check_corrections(self, where: str) -> None:
        """A correction names each output column once per name, never a sink key column
        (which would move its records to other keys: a key change, rebuilt, not corrected),
        and, where the file tells them, only columns the transform produces."""
        names = [c.name for c in self.corrections]
        keys = {k for s in self.sinks for k in s.key}
        outputs = self.output_columns()
        for i, c in enumerate(self.corrections):
            if names.index(c.name) != i:
                raise ConfigError(where, f"name {c.name!r} is used twice", f"corrections[{i}].name")
            for col in c.set_:
                if col in keys:
                    raise ConfigError(
                        where,
                        f"{col} is a sink key column: a correction cannot change a record's "
                        "key (change the transform and rebuild the sink)",
                        f"corrections[{i}].set.{col}",
                    )
                if outputs is not None and col not in outputs:
                    raise ConfigError(
                        where,
                        f"the transform produces no column {col} (it produces "
                        f"{', '.join(outputs)})",
                        f"corrections[{i}].set.{col}",
                    )

    def check_expectations(self, where: str) -> None:
        """Build every declared expectation now, so a bad name or argument is reported by
        `pipelines validate`, never in the middle of a run."""
        scopes = [("quality", self.quality)] + [
            (f"sinks[{i}].quality", s.quality) for i, s in enumerate(self.sinks)
        ]
        if all(q.empty for _, q in scopes):
            return
        from tidemark.quality import expectations as gx

        for prefix, q in scopes:
            for i, exp in enumerate(gx.parse_expectations(q.rows, where, f"{prefix}.rows")):
                if not gx.is_row_level(exp):
                    raise ConfigError(
                        where,
                        f"{exp.expectation_type} checks the batch as a "
                        f"whole, not each row: list it under batch",
                        f"{prefix}.rows[{i}]",
                    )
            gx.parse_expectations(q.batch, where, f"{prefix}.batch")

    def has_quality(self) -> bool:
        return not (self.quality.empty and all(s.quality.empty for s in self.sinks))

    def sink_dsn(self, sink: Sink) -> str:
        """The DSN of ``sink``'s database: its ``dsn`` (environment expanded) or its Airflow
        connection; the one way every layer finds a sink."""
        return sink.resolve(f"pipeline {self.name}: sink {sink.name}")

    def source_dsn(self) -> str:
        """The DSN of a ``postgres_log`` source's database."""
        assert isinstance(self.source, PostgresLogSource)
        return self.source.resolve(f"pipeline {self.name}: source")

    def conn_ids(self) -> list[tuple[str, str]]:
        """(where, Airflow connection id) of every database the pipeline names by
        ``conn_id``: its source and its sinks."""
        named = [("source", self.source)] + [(f"sink {s.name}", s) for s in self.sinks]
        return [(where, conn_id) for where, c in named if (conn_id := getattr(c, "conn_id", None))]

    def output_columns(self) -> list[str] | None:
        """Columns the transform produces, when knowable without running it."""
        if self.transform.python:
            return None
        if self.transform.select is not None:
            return list(self.transform.select)
        return list(self.decode.schema_)

    def tombstones_of(self, sink: Sink) -> Tombstones:
        return sink.tombstones or self.tombstones

    def sink(self, name: str) -> Sink:
        for s in self.sinks:
            if s.name == name:
                return s
        raise ConfigError(
            f"pipeline {self.name}",
            f"has no sink named {name!r} (sinks: {', '.join(s.name for s in self.sinks)})",
        )


def _field_path(loc: tuple) -> str:
    parts = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif p in ("postgres_log", "file_archive", "function-after"):
            continue
        else:
            parts.append(("." if parts else "") + str(p))
    return "".join(parts)


def parse(text: str, where: str, default_name: str | None = None, deep: bool = True) -> Pipeline:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f"line {mark.line + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(where, f"{line}not valid YAML: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(where, "must be a mapping of pipeline settings")
    if default_name and "name" not in data:
        data["name"] = default_name
    try:
        pipeline = Pipeline.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
        msg = err["msg"].removeprefix("Value error, ")
        field = _field_path(err["loc"]) or None
        others = [
            f"{_field_path(e['loc']) or '(file)'}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors()[1:]
        ]
        raise ConfigError(where, msg + more, field, others) from None
    pipeline.cross_check(where, deep)
    return pipeline


def load(path: Path, deep: bool = True) -> Pipeline:
    if path.stem.endswith(STAGED):  # a staged next version: checked against its live file
        return load_staged(path.parent, path.stem.removesuffix(STAGED), deep)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read: {exc.strerror}") from None
    pipeline = parse(text, str(path), default_name=path.stem, deep=deep)
    if pipeline.name != path.stem:
        raise ConfigError(
            str(path), f"name {pipeline.name!r} must match the file name {path.stem!r}", "name"
        )
    return pipeline


def _yaml_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise ConfigError(
            str(folder),
            "pipelines folder does not exist (set TIDEMARK_PIPELINES_DIR or --pipelines-dir)",
        )
    return sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")])


def pipeline_files(folder: Path) -> list[Path]:
    """The live pipeline files of ``folder``: every YAML file but the staged ones."""
    return [p for p in _yaml_files(folder) if not p.stem.endswith(STAGED)]


# -- a staged change (docs/operations.md, "Change a key: stage, rebuild, promote") ---------
# ``<name>.next.yaml`` beside ``<name>.yaml``: the pipeline's next version, waiting for the
# rebuild that makes its tables fit it. Runs, backfills, redrives and the DAGs ignore it; a
# rebuild with --staged writes with it and, once every sink's table fits it, promotes it (it
# becomes ``<name>.yaml``; the file it replaces is kept as ``<name>.yaml.before-run<N>``).
STAGED = ".next"


def staged_files(folder: Path) -> list[Path]:
    return [p for p in _yaml_files(folder) if p.stem.endswith(STAGED)]


def staged_file(folder: Path, name: str) -> Path:
    """The staged file of pipeline ``name`` (``.next.yaml`` when neither exists)."""
    return file_of(folder, name + STAGED)


def load_staged(folder: Path, name: str, deep: bool = True) -> Pipeline:
    """The staged version of pipeline ``name``, checked against its live file: the same
    source and the same sinks (names, tables, databases); keys, columns, transform and
    checks may differ."""
    path = staged_file(folder, name)
    if not path.exists():
        raise ConfigError(
            str(path), f"no staged file for pipeline {name} (write its next version there)"
        )
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read: {exc.strerror}") from None
    staged = parse(text, str(path), default_name=name, deep=deep)
    if staged.name != name:
        raise ConfigError(
            str(path), f"name {staged.name!r} must be the live pipeline's, {name!r}", "name"
        )
    live_path = file_of(folder, name)
    if live_path.exists():
        staged_fits(load(live_path, deep=False), staged, str(path))
    return staged


def staged_fits(live: Pipeline, staged: Pipeline, where: str) -> None:
    """A staged version may change how records become rows, not where they come from or go:
    the checkpoints, letters and tables it inherits are the live pipeline's."""
    if staged.source != live.source:
        raise ConfigError(where, "a staged version must read the live pipeline's source", "source")
    have = {s.name: s for s in live.sinks}
    names = [s.name for s in staged.sinks]
    if sorted(names) != sorted(have):
        raise ConfigError(
            where,
            f"a staged version must have the live pipeline's sinks ({', '.join(sorted(have))}), "
            f"not {', '.join(sorted(names))}; add or remove a sink in the live file",
            "sinks",
        )
    for i, s in enumerate(staged.sinks):
        old = have[s.name]
        for attr in ("table", "dsn", "conn_id"):
            if getattr(s, attr) != getattr(old, attr):
                raise ConfigError(
                    where,
                    f"sink {s.name}: a staged version must keep the live {attr} "
                    f"(a rebuild swaps the table under its name)",
                    f"sinks[{i}].{attr}",
                )


def fingerprint(p: Pipeline) -> str:
    """A short digest of a pipeline's settings: a version's identity in the ledger."""
    return digest(p.model_dump(mode="json"))


def digest(settings: dict) -> str:
    """:func:`fingerprint` of a pipeline's settings as a run's claim carries them."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def load_all(folder: Path, deep: bool = True) -> tuple[dict[str, Pipeline], list[ConfigError]]:
    """Every pipeline in the folder; a broken file is reported and never hides the others."""
    good: dict[str, Pipeline] = {}
    bad: list[ConfigError] = []
    for path in pipeline_files(folder):
        try:
            p = load(path, deep)
        except ConfigError as exc:
            bad.append(exc)
            continue
        good[p.name] = p
    return good, bad


def file_of(folder: Path, name: str) -> Path:
    """The file of pipeline ``name`` in ``folder`` (``.yaml`` when neither exists)."""
    return next(
        (p for p in (folder / f"{name}.yaml", folder / f"{name}.yml") if p.exists()),
        folder / f"{name}.yaml",
    )


def find(folder: Path, name: str, deep: bool = True) -> Pipeline:
    path = file_of(folder, name)
    if path.exists():
        return load(path, deep)
    known = ", ".join(p.stem for p in pipeline_files(folder)) or "none"
    raise ConfigError(str(folder), f"no pipeline named {name!r} (known: {known})")
