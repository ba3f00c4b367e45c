"""`tidemark sink rebuild`: make a sink's table again from its source with the current
pipeline and swap it in, exactly once (docs/operations.md, "Rebuild a sink")."""

from __future__ import annotations

import click

from tidemark.cli.app import (
    Ctx,
    cli,
    dry_run_option,
    pass_ctx,
    pipelines,
    run_and_report,
    run_options,
)
from tidemark.core.errors import BadInput, TidemarkError
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
@click.option(
    "--staged",
    is_flag=True,
    help="Rebuild with the pipeline's staged next version (PIPELINE.next.yaml) instead of "
    "its live file; once every sink that version changes is rebuilt, it becomes the live "
    'file (docs/operations.md, "Change a key: stage, rebuild, promote").',
)
@dry_run_option
@run_options
@pass_ctx
def rebuild_cmd(
    ctx: Ctx,
    pipeline: str,
    sink_name: str,
    accept_pruned: bool,
    staged: bool,
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
    if staged:
        _rebuild_staged(
            ctx,
            found,
            sink_name,
            Rebuild(sink_name, accept_pruned=accept_pruned),
            dry_run=dry_run,
            external_id=external_id,
            airflow=airflow,
            as_json=as_json,
        )
        return
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


def _rebuild_staged(
    ctx: Ctx, live, sink_name: str, mode, *, dry_run: bool, external_id, airflow, as_json: bool
) -> None:
    """A rebuild with the staged version: held for it first (not a preview, which commits
    nothing), released if it does not commit, promoted once every changed sink is rebuilt."""
    import json
    import sys

    from tidemark import config as cfg
    from tidemark.driver.run import Run
    from tidemark.protocol import staging

    staged = cfg.load_staged(ctx.folder, live.name, deep=False)
    if sink_name not in [s.name for s in staged.sinks]:
        raise BadInput(f"pipeline {live.name} has no sink {sink_name!r}")
    changed = staging.changed_sinks(live, staged)
    click.echo(
        f"rebuild of {live.name} sink {sink_name} with its staged version "
        f"({cfg.staged_file(ctx.folder, live.name)}; it changes "
        f"{', '.join(changed) or 'no sink'}){' (dry run)' if dry_run else ''}",
        err=True,
    )
    if not dry_run:
        staging.held_for(ctx.ledger_dsn, live, staged, sink_name)
    report = None
    try:
        report = Run(
            staged,
            ctx.settings,
            ledger_dsn=ctx.ledger_dsn,
            all_pipelines={**ctx.pipelines(deep=False), live.name: staged},
            where=str(cfg.staged_file(ctx.folder, live.name)),
            mode=mode,
            sink_names=[sink_name],
            external_id=external_id,
            airflow=airflow,
            dry_run=dry_run,
        ).execute()
    except TidemarkError as exc:
        if dry_run:
            exc.args = (f"dry run, nothing committed: {exc}", *exc.args[1:])
        raise
    finally:
        failed = not dry_run and (report is None or not report.ok)
        if failed and staging.release_unless_rebuilt(ctx.ledger_dsn, live.name, sink_name):
            click.echo(
                f"sink {sink_name}: not rebuilt, so it takes runs of the live file again",
                err=True,
            )
    click.echo(json.dumps(report.to_dict()) if as_json else report.summary())
    if not report.ok:
        sys.exit(1)
    if dry_run:
        return
    r = staging.readiness(ctx.ledger_dsn, ctx.folder, live.name)
    if not r.ready:
        click.echo(
            f"the staged version of {live.name} stays staged; sink {sink_name} takes runs of "
            f"it only. It waits for:\n" + "\n".join(f"  {w}" for w in r.waiting),
            err=True,
        )
        return
    _say_promoted(staging.promote(ctx.ledger_dsn, ctx.folder, live.name))


def _say_promoted(done) -> None:
    if done.already:
        click.echo(f"pipeline {done.pipeline}: the staged version was live already ({done.live})")
    else:
        click.echo(
            f"pipeline {done.pipeline}: the staged version is live ({done.live}); the file it "
            f"replaced is kept as {done.kept}"
        )


@pipelines.command("promote")
@click.argument("name")
@click.option(
    "--check", is_flag=True, help="Only say whether it can go live, and what it waits for."
)
@pass_ctx
def pipelines_promote(ctx: Ctx, name: str, check: bool) -> None:
    """Make the staged version of pipeline NAME (NAME.next.yaml) its live file, once every
    sink it changes was rebuilt for it (`tidemark sink rebuild NAME SINK --staged` does this
    by itself after the last one)."""
    from tidemark.protocol import staging

    if check:
        r = staging.readiness(ctx.ledger_dsn, ctx.folder, name)
        click.echo(
            f"staged version of {name}: changes {', '.join(r.changed) or 'no sink'}; "
            + ("ready to go live" if r.ready else "waits for:")
        )
        for w in r.waiting:
            click.echo(f"  {w}")
        if not r.ready:
            raise SystemExit(1)
        return
    _say_promoted(staging.promote(ctx.ledger_dsn, ctx.folder, name))


@pipelines.command("unstage")
@click.argument("name")
@click.option("--sink", "sinks", multiple=True, help="Only these sinks (default: every one held).")
@pass_ctx
def pipelines_unstage(ctx: Ctx, name: str, sinks: tuple[str, ...]) -> None:
    """Let sinks held for the staged version of NAME take runs of the live file again, after
    a staged rebuild that did not commit (refused for one whose rebuild committed). The
    staged file is left where it is."""
    from tidemark.protocol import staging

    done = staging.unstage(ctx.ledger_dsn, name, list(sinks) or None)
    click.echo(f"pipeline {name}: released {', '.join(done)}: they take runs of the live file")
