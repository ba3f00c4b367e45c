"""`tidemark prune` and `tidemark pipelines retire`: retention of the ledger and Data Docs
(docs/operations.md, "Retention")."""

from __future__ import annotations

import json
import re
from typing import overload

import click

from tidemark import config as cfg
from tidemark.cli.app import Ctx, cli, pass_ctx, pipelines
from tidemark.cli.source import source
from tidemark.core.errors import BadInput


@overload
def _pipeline_name(name: str) -> str: ...
@overload
def _pipeline_name(name: None) -> None: ...
def _pipeline_name(name: str | None) -> str | None:
    """A pipeline name as given, checked: it names a folder under the Data Docs folder, so
    never a path."""
    if name is not None and not re.fullmatch(cfg.IDENT, name):
        raise BadInput(f"pipeline {name!r}: not a pipeline name")
    return name


def _progress(line: str) -> None:
    click.echo(line, err=True)


@cli.command("prune")
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@click.option("--pipeline", help="Only this pipeline's letters, runs and requests.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@pass_ctx
def prune_cmd(ctx: Ctx, dry_run: bool, pipeline: str | None, as_json: bool) -> None:
    """Delete redriven dead letters, finished runs (with their metrics, data-quality results
    and Data Docs pages) and redrive requests older than the retention settings, and drop
    retired tables past their pipeline's retired_tables_days. A pipeline's own `retention:`
    overrides the settings for it. A discarded dead letter loses its payload, headers and
    detail; its row stays (its record's place)."""
    from tidemark.protocol.prune import Policy, prune

    policy = Policy.of(ctx.settings)
    summary = prune(
        ctx.ledger_dsn,
        policy,
        ctx.settings.data_docs_dir,
        pipeline=_pipeline_name(pipeline),
        dry_run=dry_run,
        progress=_progress,
        pipelines=ctx.pipelines(deep=False),
    )
    if as_json:
        click.echo(json.dumps(summary.to_dict()))
        return
    click.echo(
        f"retention: {policy.describe()}"
        + (f"; pipeline {pipeline} only" if pipeline else "")
        + ("; dry run, nothing deleted" if dry_run else "")
    )
    for line in summary.lines():
        click.echo(line)


@pipelines.command("retire")
@click.argument("name")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@pass_ctx
def pipelines_retire(ctx: Ctx, name: str, yes: bool) -> None:
    """Delete every ledger row of pipeline NAME (checkpoints, leases, runs, dead letters of
    every status, metrics, data-quality results, redrive requests) and its Data Docs. Its sink
    tables are left as they are."""
    from tidemark.protocol.prune_summary import LABELS, human_bytes
    from tidemark.protocol.retire import plan, retire

    s = ctx.settings
    all_p = ctx.pipelines(deep=False)
    found = plan(ctx.ledger_dsn, _pipeline_name(name), all_p, s.gid_prefix, s.data_docs_dir)
    rows = dict(found.rows)
    letters = {k.removeprefix("dlq_"): rows.pop(k) for k in list(rows) if k.startswith("dlq_")}
    click.echo(f"retiring pipeline {name} deletes from the ledger:")
    for k, label in LABELS.items():
        if k == "dlq":
            by = ", ".join(f"{n:,} {st}" for st, n in sorted(letters.items()))
            click.echo(f"  {label:<24} {sum(letters.values()):>10,}" + (f"  ({by})" if by else ""))
        elif k in rows:
            click.echo(f"  {label:<24} {rows[k]:>10,}")
    click.echo(
        f"and its Data Docs: {found.docs_files:,} files, {human_bytes(found.docs_bytes)} "
        f"({found.docs_dir})"
    )
    sinks = all_p[name].sinks if name in all_p else []
    click.echo(
        "Its sink tables are left as they are"
        + (f" ({', '.join(f'{x.name}: {x.table}' for x in sinks)})." if sinks else ".")
    )
    for line in found.unchecked:
        click.echo(f"  warning: not checked for its prepared transactions: {line}", err=True)
    if not yes:
        click.confirm(f"Retire pipeline {name}?", abort=True)
    summary = retire(
        ctx.ledger_dsn,
        name,
        all_p,
        s.gid_prefix,
        s.data_docs_dir,
        s.retention_batch_size,
        progress=_progress,
    )
    for line in summary.lines():
        click.echo(line)
    click.echo(f"pipeline {name} retired")
    if name in all_p:
        click.echo(
            f"note: its pipeline file {cfg.file_of(ctx.folder, name)} still exists: "
            f"remove it (and so its DAGs), or its next run starts it again from its "
            f"source's start"
        )


@source.command("prune")
@click.argument("pipeline")
@click.option(
    "--keep-days",
    type=click.IntRange(min=0),
    help="Days of records kept for rebuilds and backfills (default: the pipeline's "
    "retention.source_keep_days).",
)
@click.option("--dry-run", is_flag=True, help="Say what would be deleted; delete nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@pass_ctx
def source_prune_cmd(
    ctx: Ctx, pipeline: str, keep_days: int | None, dry_run: bool, as_json: bool
) -> None:
    """Delete the rows of PIPELINE's postgres_log source that nothing may read again: below
    every sink's checkpoint (of every pipeline reading the table), its quarantined dead
    letters, open gaps and unsettled runs, and older than --keep-days. Says per partition
    what it deletes and what keeps the rest."""
    from tidemark.sources.prune import prune_source

    all_p = ctx.pipelines(deep=False)
    p = all_p.get(pipeline) or cfg.find(ctx.folder, pipeline, deep=False)
    days = keep_days if keep_days is not None else p.retention.source_keep_days
    if days is None:
        raise BadInput(
            f"pipeline {pipeline}: say how many days of source records rebuilds and backfills "
            f"may still read: --keep-days N, or retention.source_keep_days in its file"
        )
    out = prune_source(ctx.ledger_dsn, p, all_p, days, dry_run=dry_run)
    if as_json:
        click.echo(json.dumps(out.to_dict()))
        return
    for line in out.lines():
        click.echo(line)
