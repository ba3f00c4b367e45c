"""`tidemark source create`: make the `postgres_log` table a pipeline reads, with the columns
its file names (docs/pipelines.md, "Sources")."""

from __future__ import annotations

import click

from tidemark import config as cfg
from tidemark.cli.app import Ctx, cli, pass_ctx
from tidemark.core.db import connect
from tidemark.core.dsn import mask
from tidemark.core.errors import BadInput
from tidemark.sources import log_table


@cli.group()
def source() -> None:
    """Source logs: create a pipeline's postgres_log table, or prune it."""


@source.command("create")
@click.argument("pipeline")
@click.option("--print", "print_only", is_flag=True, help="Print the DDL; connect to nothing.")
@pass_ctx
def source_create(ctx: Ctx, pipeline: str, print_only: bool) -> None:
    """Create PIPELINE's postgres_log table (and its <table>_heads table, which
    tidemark.sources.postgres_log.append uses) with the column names of its file. Idempotent:
    a table that exists with the columns and types the reader needs is left as it is; one
    that lacks them is refused (exit 2), naming what differs."""
    p = cfg.find(ctx.folder, pipeline, deep=False)
    src = p.source
    if not isinstance(src, cfg.PostgresLogSource):
        raise BadInput(
            f"pipeline {p.name}: its source is {src.type}, not postgres_log: there is no "
            "table to create (docs/pipelines.md, 'Sources', shows the archive layout)"
        )
    if print_only:
        click.echo(log_table.ddl(src.table, src.columns))
        return
    dsn = p.source_dsn()
    with connect(dsn, autocommit=True, what="source database") as conn:
        created = log_table.create(conn, src.table, src.columns)
        found = None if created else log_table.shape(conn, src.table, src.columns)
    where = f"{src.table} in {mask(dsn)}"
    if created:
        click.echo(f"created source table {where} (and {src.table}_heads)")
        return
    if found is not None and found.problems:
        raise BadInput(
            f"pipeline {p.name}: source table {where} exists with another shape: "
            f"{'; '.join(found.problems)} (`tidemark source create {p.name} --print` shows "
            "the DDL it needs)"
        )
    click.echo(f"source table {where} exists with the columns the reader needs: left as it is")
