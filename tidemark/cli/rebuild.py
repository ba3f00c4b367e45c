"""`tidemark sink rebuild`: make a sink's table again from its source with the current
pipeline and swap it in, exactly once (docs/operations.md, "Rebuild a sink")."""

from __future__ import annotations

import click

from tidemark.cli.app import Ctx, cli, dry_run_option, pass_ctx, run_and_report, run_options
from tidemark.core.errors import BadInput
from tidemark.ledger.state import AirflowRun


@cli.group()
def sink() -> None:
    """Sink tables: rebuild one from its source."""


@sink.command("rebuild")
@click.argument("pipeline")
@click.argument("sink_name", metavar="SINK")
@click.option(
    "--accept-pruned",
    is_flag=True,
    help="Rebuild although the source no longer holds records whose rows the table has "
    "(they are left out of the new table; the old table keeps them).",
)
@dry_run_option
@run_options
@pass_ctx
def rebuild_cmd(
    ctx: Ctx,
    pipeline: str,
    sink_name: str,
    accept_pruned: bool,
    dry_run: bool,
    external_id: str | None,
    airflow: AirflowRun | None,
    as_json: bool,
) -> None:
    """Rebuild SINK of PIPELINE: re-deliver every record it has received, from the first one
    the source still holds to its checkpoint, into a new table made from the current pipeline
    (its key and columns), and swap that table in for the old one in the same two-phase
    commit. The old table is kept under a dated name until you drop it; the checkpoints stay
    where they are. This is how a sink takes a new key. --dry-run previews it."""
    from tidemark import config as cfg
    from tidemark.driver.modes import Rebuild

    found = ctx.pipelines(deep=False).get(pipeline) or cfg.find(ctx.folder, pipeline, deep=False)
    names = [s.name for s in found.sinks]
    if sink_name not in names:
        raise BadInput(
            f"pipeline {pipeline} has no sink {sink_name!r} (its sinks: {', '.join(names)})"
        )
    click.echo(
        f"rebuild of {pipeline} sink {sink_name}: every record it has received, into a new "
        f"table{' (dry run)' if dry_run else ''}",
        err=True,
    )
    run_and_report(
        ctx,
        pipeline,
        as_json,
        mode=Rebuild(sink_name, accept_pruned=accept_pruned),
        sink_names=[sink_name],
        external_id=external_id,
        airflow=airflow,
        dry_run=dry_run,
    )
