"""The chaos world: a scratch PostgreSQL cluster, a ledger, a source log (the table ``src.log``
in the ledger, or a ``file_archive`` folder: source.py), two sink databases and one pipeline
file, all in one temporary folder."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import psycopg
import yaml
from psycopg import sql

from tidemark.devstack.airflow_stack import free_port
from tidemark.devstack.chaos.source import FileArchive, PostgresLog
from tidemark.devstack.localpg import Cluster
from tidemark.ledger import migrations

PIPELINE = "chaos"
SOURCE_TABLE = "src.log"
SINK_TABLE = "public.orders"
SINKS = ("a", "b")

# Row checks (amount <= max): clean records have amounts below CLEAN_MAX, out-of-range ones
# between OUT_OF_RANGE. Sink b always checks at most as much as the pipeline does.
CLEAN_MAX = 400.0
OUT_OF_RANGE = (450.0, 2500.0)
ROWS_MAX = (1000.0, 3000.0)  # the pipeline's row check: tight, loose
# Its lower bound: off, failing small clean amounts, or every clean one. With both bounds
# moving, a record that failed may pass while a newer version that passed fails (a backfill
# must then place the older one, or fall back).
ROWS_MIN = (0.0, 100.0, 500.0)
B_ROWS_MAX = (300.0, 700.0, 2000.0)  # sink b's stricter row check

# Transform variants an edit switches between. Every variant has the same output columns and
# types (the sink table is created once, by the first run), keeps the key NOT NULL and only
# changes expressions: ``rekey`` maps each id to another key, so a re-delivery must replace by
# position (docs/design.md, "Re-delivery"). The chaos oracle (oracle.py) applies the same
# mapping in plain Python: keep ``KEY_SHIFT`` and these expressions in step with it.
KEY_SHIFT = 1_000_000
# Key splits and merges (Features.split): ``split`` moves the versions of an id whose amount
# is above SPLIT_AT to a second key (one key becomes two); ``merge`` maps ids i and i + 6
# (i mod 12 below 6) to one key, both in one partition whatever the world's 1, 2 or 3.
SPLIT_SHIFT = 2_000_000
SPLIT_AT = 200.0
MERGE = 6
VARIANTS: dict[str, dict[str, str]] = {
    "plain": {"id": "id", "name": "name"},
    "upper": {"id": "id", "name": "upper(name)"},
    "rekey": {"id": f"id + {KEY_SHIFT}", "name": "name"},
    "split": {
        "id": f"id + (CASE WHEN amount > {SPLIT_AT} THEN {SPLIT_SHIFT} ELSE 0 END)",
        "name": "name",
    },
    "merge": {"id": f"id - pmod(id, {2 * MERGE}) + pmod(id, {MERGE})", "name": "name"},
}
SPLITS = ("split", "merge")  # only in worlds with Features.split
# Worlds with tombstones derive the sink key from the source key (a tombstone has no payload;
# every order's key is its id's decimal text, a poison record's key is not a number: NULL).
KEY_ID = "cast(cast(_tm_key as string) as bigint)"
TOMBSTONES = ("quarantine", "delete")


@dataclass(frozen=True)
class Knobs:
    """What a pipeline edit changes."""

    gate_fails: bool = False  # the batch gate's mean bound fails every real batch
    on_gate_failure: str = "halt"  # or quarantine_batch
    rows_max: float = ROWS_MAX[0]
    rows_min: float = ROWS_MIN[0]
    b_rows_max: float = B_ROWS_MAX[0]
    # Off (at first): sink b has no checks of its own, so that runs check their batch while
    # writing it (docs/quality.md, "One pass"); on, they check first.
    b_checks: bool = False
    variant: str = "plain"  # a transform of VARIANTS
    spread: bool = False  # split_min_records 1: spread runs over tasks by key
    tombstones: str = "quarantine"  # the pipeline's tombstones: (worlds with tombstones)
    b_tombstones: str | None = None  # sink b's own, or None: the pipeline's

    def tombstones_of(self, sink: str) -> str:
        return (self.b_tombstones or self.tombstones) if sink == "b" else self.tombstones

    def loosest(self) -> Knobs:
        """A passing gate and the loosest row checks (the end of a chaos run)."""
        return replace(
            self,
            gate_fails=False,
            rows_max=ROWS_MAX[-1],
            rows_min=ROWS_MIN[0],
            b_rows_max=B_ROWS_MAX[-1],
        )

    def short(self) -> str:
        return (
            f"gate={'FAIL' if self.gate_fails else 'pass'}/{self.on_gate_failure} "
            f"rows{f'>={self.rows_min:g},' if self.rows_min else ''}<={self.rows_max:g} "
            f"{f'b<={self.b_rows_max:g}' if self.b_checks else 'b unchecked'} "
            f"transform={self.variant}"
            f"{' spread' if self.spread else ''}"
            f"{f' tombstones={self.tombstones}' if self.tombstones != 'quarantine' else ''}"
            f"{f' b_tombstones={self.b_tombstones}' if self.b_tombstones else ''}"
        )


def _between(column: str, max_value: float, min_value: float = 0.0) -> dict:
    bounds = {"min_value": min_value} if min_value else {}
    return {
        "expect_column_values_to_be_between": {"column": column, **bounds, "max_value": max_value}
    }


@dataclass(frozen=True)
class Features:
    """What a world's pipeline declares for its whole life (its sink table never changes)."""

    # The sinks order versions by the payload's ``version`` column; versions of one id may
    # then sit in several partitions, with equal versions across partitions (ties).
    versioned: bool = False
    # The transform reads the source's metadata into columns: seen_at (``_tm_ts``) and hdr
    # (``_tm_headers``), which a redrive must hand over as the source had them.
    meta: bool = False
    # The source is a file_archive folder (segments of both formats, gaps) instead of a table.
    archive: bool = False
    # Tombstones are appended and the transform keys rows by ``_tm_key`` (KEY_ID); edits flip
    # ``tombstones: delete | quarantine`` (and sink b's own). Only in worlds without a version
    # column: a tombstone's version would be NULL there (it orders by offset only).
    tombstones: bool = False
    # Where a sink starts in a partition it never read (the pipeline's ``start``): ``latest``
    # begins each sink at the end of the source when its first run claims (docs/pipelines.md),
    # an offset (or {partition: offset}) there once the source has reached it; no re-delivery
    # may reach below that.
    start: str | int | dict[int, int] = "earliest"
    # The ledger database's (the postgres_log source's) TimeZone, and its role's: time-window
    # backfills must map to the same offsets whatever a session reads times in.
    tz: str | None = None
    # Operator COMMIT PREPARED / ROLLBACK PREPARED of a run's gids while it is stopped
    # between its decision and its finish (ops.py, "gids").
    gids: bool = False
    # Old records (and segments) trimmed from the source, tombstones included (retention).
    trim: bool = False
    # file_archive: a segment that appears late, inside a gap below a checkpoint.
    late: bool = False
    # Transform edits that split one key into two and merge two into one (world.VARIANTS).
    split: bool = False
    # Discards followed by `tidemark prune` (and backfills over discarded records).
    prune: bool = False

    def start_at(self, partition: int) -> str | int:
        """earliest, latest or an offset: where a sink begins in ``partition``."""
        if isinstance(self.start, dict):
            return self.start.get(partition, "earliest")
        return self.start

    def short(self) -> str:
        on = [
            n
            for n, v in (
                ("versioned", self.versioned),
                ("ts+headers", self.meta),
                ("file_archive", self.archive),
                ("tombstones", self.tombstones),
                (f"start: {self.start}", self.start != "earliest"),
                (f"TimeZone {self.tz}", self.tz is not None),
                ("operator gids", self.gids),
                ("trimmed source", self.trim),
                ("late segments", self.late),
                ("key splits", self.split),
                ("discard+prune", self.prune),
            )
            if v
        ]
        return ", ".join(on) or "plain"


# The features of issue 45, point 8, each switchable on its own (``tidemark chaos --feature``);
# those in ON are drawn by the seed, the others only when asked for. A feature whose product
# side is not merged stays out of ON (see docs/operations.md, "The model-based checker").
OPTIONAL = ("start", "tz", "gids", "trim", "late", "split", "prune")
ON: tuple[str, ...] = OPTIONAL


class World:
    def __init__(
        self,
        root: Path,
        partitions: int,
        limit: int,
        port: int | None = None,
        features: Features = Features(),
        cluster: Cluster | None = None,
    ):
        self.root = root
        self.partitions = partitions
        self.limit = limit
        self.features = features
        # On a cluster of its own (the chaos command), or on a running one it shares (the
        # tests': a cluster's start and stop cost more than the world's databases).
        self.shared = cluster is not None
        # fsync off: the faults are crashes of processes (jobs, backends, the server), whose
        # writes the kernel keeps either way; with it on, every PREPARE and COMMIT PREPARED
        # waited for the disk.
        self.cluster = cluster or Cluster(
            root / "pg", port or free_port(), overrides={"fsync": "off"}
        )
        self.pipelines_dir = root / "pipelines"
        self.docs_dir = root / "data_docs"
        self.logs_dir = root / "logs"
        self.scratch_dir = root / "tmp"  # Spark and temp files of the jobs
        tag = f"_{uuid.uuid4().hex[:8]}" if self.shared else ""
        self.names = {
            "ledger": f"chaos_ledger{tag}",
            "a": f"chaos_sink_a{tag}",
            "b": f"chaos_sink_b{tag}",
        }
        # Spread needs fewer partitions than cores; a world with tombstones starts deleting.
        self.knobs = Knobs(
            spread=partitions == 1, tombstones="delete" if features.tombstones else "quarantine"
        )
        self.source = (
            FileArchive(root / "archive")
            if features.archive
            else PostgresLog(self.ledger_dsn, SOURCE_TABLE)
        )

    # -- life cycle -----------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        partitions: int = 2,
        limit: int = 40,
        root: Path | None = None,
        features: Features = Features(),
        cluster: Cluster | None = None,
    ) -> World:
        """A world on a cluster of its own under ``root``, or with its databases on
        ``cluster`` (running), which outlives it."""
        if root is None:
            root = Path(tempfile.mkdtemp(prefix="tidemark-chaos-"))
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o755)  # the server runs as postgres when we are root
        world = cls(root, partitions, limit, features=features, cluster=cluster)
        for d in (world.pipelines_dir, world.docs_dir, world.logs_dir, world.scratch_dir):
            d.mkdir(exist_ok=True)
        try:
            if not world.shared:
                world.cluster.start()
            for db in world.names.values():
                world.cluster.create_database(db)
            migrations.upgrade(world.ledger_dsn)
            world.set_time_zone()
            world.source.create()
            world.write_pipeline()
        except BaseException:
            world.destroy()
            raise
        return world

    def set_time_zone(self) -> None:
        """Features.tz ``db:<zone>`` sets the ledger database's TimeZone (where the
        postgres_log source is), ``role:<zone>`` the role's (every database): sessions that do
        not pin their own read and compare times in it."""
        if not self.features.tz:
            return
        scope, zone = self.features.tz.split(":", 1)
        if scope != "db" and self.shared:
            raise ValueError(
                f"{self.features.tz}: a role's TimeZone is not a shared cluster's to set"
            )
        with psycopg.connect(self.ledger_dsn, autocommit=True) as conn:
            if scope == "db":
                conn.execute(
                    sql.SQL("ALTER DATABASE {} SET TimeZone = {}").format(
                        sql.Identifier(self.names["ledger"]), sql.Literal(zone)
                    )
                )
            else:
                conn.execute(
                    sql.SQL("ALTER ROLE CURRENT_USER SET TimeZone = {}").format(sql.Literal(zone))
                )

    def destroy(self) -> None:
        try:
            if self.shared:
                self._drop_databases()
            else:
                self.cluster.destroy()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def _drop_databases(self) -> None:
        """A shared cluster's: the world's databases, their prepared transactions first (they
        would keep a database from being dropped)."""
        with psycopg.connect(self.cluster.dsn("postgres"), autocommit=True) as admin:
            for db in self.databases:
                prepared = admin.execute(
                    "SELECT gid FROM pg_prepared_xacts WHERE database = %s", (db,)
                ).fetchall()
                if prepared:
                    with psycopg.connect(self.cluster.dsn(db), autocommit=True) as conn:
                        for (gid,) in prepared:
                            conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
                admin.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db))
                )

    def stop(self) -> None:
        """Stop the server and keep the folder (--keep-dir)."""
        self.cluster.stop()

    def restart_postgres(self) -> None:
        """An immediate (crash) restart: no checkpoint, crash recovery on start."""
        if self.shared:
            raise ValueError("a world does not restart a cluster it shares")
        c = self.cluster
        c._run(
            "pg_ctl",
            "restart",
            "-w",
            "-t",
            "120",
            "-m",
            "immediate",
            "-D",
            str(c.data),
            "-l",
            str(c.logfile),
            "-o",
            f"-p {c.port}",
        )

    # -- addresses ------------------------------------------------------------------------
    @property
    def ledger_dsn(self) -> str:
        return self.cluster.dsn(self.names["ledger"])

    @property
    def sink_dsns(self) -> dict[str, str]:
        return {s: self.cluster.dsn(self.names[s]) for s in SINKS}

    @property
    def databases(self) -> list[str]:
        return list(self.names.values())

    # -- the pipeline ---------------------------------------------------------------------
    def pipeline_doc(self, knobs: Knobs | None = None) -> dict:
        k = knobs or self.knobs
        batch: list[dict[str, dict[str, Any]]] = [
            {"expect_table_row_count_to_be_between": {"min_value": 0, "max_value": 1_000_000}}
        ]
        if k.gate_fails:  # every batch of clean records has a mean amount far above 5
            batch.append({"expect_column_mean_to_be_between": {"column": "amount", "max_value": 5}})
        sink = {
            "dsn": None,
            "table": SINK_TABLE,
            "key": ["id"],
            **({"version": "version"} if self.features.versioned else {}),
        }
        select = {**VARIANTS[k.variant], "amount": "amount", "version": "version"}
        if self.features.tombstones:  # the same expressions of the source key's number
            select["id"] = VARIANTS[k.variant]["id"].replace("id", f"({KEY_ID})")
        if self.features.meta:
            select.update({"seen_at": "_tm_ts", "hdr": "_tm_headers"})
        return {
            "name": PIPELINE,
            "description": "tidemark chaos: " + k.short(),
            "source": self.source.spec(),
            **({"start": self.features.start} if self.features.start != "earliest" else {}),
            **({"tombstones": k.tombstones} if self.features.tombstones else {}),
            "decode": {
                "schema": {"id": "bigint", "name": "string", "amount": "double", "version": "int"}
            },
            "transform": {"select": select, "required": ["id"]},
            "sinks": [
                {**sink, "name": "a", "dsn": self.sink_dsns["a"]},
                {
                    **sink,
                    "name": "b",
                    "dsn": self.sink_dsns["b"],
                    **(
                        {"tombstones": k.b_tombstones}
                        if self.features.tombstones and k.b_tombstones
                        else {}
                    ),
                    **(
                        {"quality": {"rows": [_between("amount", k.b_rows_max)]}}
                        if k.b_checks
                        else {}
                    ),
                },
            ],
            # Spread needs fewer partitions than cores (local[2]): a 1-partition world.
            "limits": {
                "max_records_per_partition": self.limit,
                "split_min_records": 1 if k.spread else 50_000,
            },
            "quality": {
                "on_gate_failure": k.on_gate_failure,
                "rows": [_between("amount", k.rows_max, k.rows_min)],
                "batch": batch,
            },
        }

    def write_pipeline(self, knobs: Knobs | None = None) -> Path:
        if knobs is not None:
            self.knobs = knobs
        path = self.pipelines_dir / f"{PIPELINE}.yaml"
        tmp = path.with_suffix(".yaml.tmp")
        tmp.write_text(yaml.safe_dump(self.pipeline_doc(), sort_keys=False))
        tmp.replace(path)  # a job starting now reads the old or the new file, never half
        return path

    def knobs_dict(self) -> dict:
        return asdict(self.knobs)

    # -- the source -----------------------------------------------------------------------
    def append(
        self, records: list[tuple[int, bytes | None, bytes | None, str | None]], rng=None
    ) -> dict[int, tuple[int, int]]:
        """Append (partition, key, payload, headers JSON) records (a file archive draws its
        segments' formats and gaps from ``rng``)."""
        return self.source.append(records, rng)
