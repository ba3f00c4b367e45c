"""The ``tidemark`` command group and what its command modules share: the context (settings,
pipelines), the options of every command that makes a run, and running one.

Command modules (main.py, dlq.py, rebuild.py, retention.py) register their commands on
:data:`cli`; main.py imports them all, so none of them imports main.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from dotenv import load_dotenv
from pydantic import ValidationError

from tidemark import config as cfg
from tidemark.core.errors import TidemarkError
from tidemark.core.settings import Settings, get_settings
from tidemark.ledger.state import AirflowRun

ENV_FILE = Path(".tidemark/env")


class Ctx:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.warned: set[str] = set()  # a command may load the folder twice: warn once

    @property
    def ledger_dsn(self) -> str:
        return self.settings.ledger()

    @property
    def folder(self) -> Path:
        return self.settings.pipelines_dir

    def pipelines(self, deep: bool = True) -> dict[str, cfg.Pipeline]:
        good, bad = cfg.load_all(self.folder, deep)
        for err in map(str, bad):
            if err not in self.warned:
                self.warned.add(err)
                click.echo(f"warning: skipped {err}", err=True)
        return good


pass_ctx = click.make_pass_decorator(Ctx)


def _airflow_run(ctx: click.Context, param: click.Parameter, value: str | None):
    if value is None:
        return None
    try:
        return AirflowRun.model_validate_json(value)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(map(str, err["loc"])) or "value"
        raise click.BadParameter(f"{where}: {err['msg']}") from None


airflow_run_option = click.option(
    "--airflow-run",
    "airflow",
    callback=_airflow_run,
    metavar="JSON",
    help='The Airflow task try starting this run, as the DAGs pass it: {"dag_id": ..., '
    '"run_id": ..., "task_id": ..., "try_number": ...}.',
)

dry_run_option = click.option(
    "--dry-run",
    is_flag=True,
    help="Preview: run up to PREPARE, report what each sink would get, then roll everything "
    "back (nothing committed; exit 0 when the run would commit).",
)


def run_options(fn):
    """The options of every command that makes a run: --external-id, --airflow-run, --json."""
    fn = click.option("--json", "as_json", is_flag=True, help="Print the run report as JSON.")(fn)
    fn = airflow_run_option(fn)
    return click.option("--external-id", help="Caller's own id for this run.")(fn)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--ledger-dsn", envvar="TIDEMARK_LEDGER_DSN", help="PostgreSQL DSN of the ledger.")
@click.option(
    "--pipelines-dir",
    type=click.Path(path_type=Path),
    envvar="TIDEMARK_PIPELINES_DIR",
    help="Folder of pipeline YAML files.",
)
@click.pass_context
def cli(ctx: click.Context, ledger_dsn: str | None, pipelines_dir: Path | None) -> None:
    """Exactly-once replay of offset-addressed logs into PostgreSQL."""
    # `make up` writes the local stack's settings here; real environment variables win.
    load_dotenv(ENV_FILE, override=False)
    get_settings.cache_clear()
    s = get_settings()
    updates = {
        k: v
        for k, v in {"ledger_dsn": ledger_dsn, "pipelines_dir": pipelines_dir}.items()
        if v is not None
    }
    ctx.obj = Ctx(s.model_copy(update=updates))


@cli.group()
def pipelines() -> None:
    """Pipeline files."""


def _say_connect(run) -> None:
    """One line naming the Spark Connect endpoint (without its parameters) a run's write
    tasks go to: nothing else in a run's output says where it ran."""
    from tidemark.driver.runners import ConnectRunner
    from tidemark.engine.connect_session import masked

    if isinstance(getattr(run, "runner", None), ConnectRunner):
        run.log(f"{run.pipeline.name}: write tasks on Spark Connect at {masked(run.runner.remote)}")


def run_and_report(ctx: Ctx, name: str, as_json: bool, runner=None, **kw) -> None:
    from tidemark.driver.run import Run

    # Expectations are built by the run once it knows it has work (Run.execute): an
    # up-to-date pipeline returns without importing Great Expectations or starting Spark.
    all_p = ctx.pipelines(deep=False)
    pipeline = all_p.get(name) or cfg.find(ctx.folder, name, deep=False)
    try:
        run = (runner or Run)(
            pipeline,
            ctx.settings,
            ledger_dsn=ctx.ledger_dsn,
            all_pipelines=all_p,
            where=str(cfg.file_of(ctx.folder, name)),
            **kw,
        )
        _say_connect(run)
        report = run.execute()
    except TidemarkError as exc:
        if kw.get("dry_run"):  # the run's own error, said as the preview's outcome
            exc.args = (f"dry run, nothing committed: {exc}", *exc.args[1:])
        raise
    click.echo(json.dumps(report.to_dict()) if as_json else report.summary())
    if not report.ok:
        sys.exit(1)
