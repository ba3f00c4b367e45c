"""The command line of the Spark job a replay task submits: a typed value rendered to argv once.

The job (tidemark/cli/spark_job.py) takes the ``tidemark`` CLI's arguments. A DAG builds the
command it always runs; at run time the task completes it (a backfill form's arguments, a
dry run, an Airflow backfill's data interval) by replacing fields, never by searching the
argument list for a word: a pipeline may well be named ``run``, ``backfill`` or ``dlq``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import datetime
from enum import StrEnum

# The task try starting a run (tidemark.ledger.state.AirflowRun), stored as run columns.
AIRFLOW_RUN = (
    '{{ {"dag_id": ti.dag_id, "run_id": run_id, "task_id": ti.task_id, '
    '"try_number": ti.try_number} | tojson }}'
)
TIME_FORMAT = "%Y-%m-%dT%H:%M:%S%z"


class JobAction(StrEnum):
    """What the job does: the CLI command that makes a run."""

    RUN = "run"
    BACKFILL = "backfill"
    REDRIVE = "redrive"
    REBUILD = "rebuild"

    @property
    def words(self) -> tuple[str, ...]:
        """The command's words before the pipeline's name."""
        return _WORDS.get(self, (self.value,))


_WORDS = {JobAction.REDRIVE: ("dlq", "redrive"), JobAction.REBUILD: ("sink", "rebuild")}


@dataclasses.dataclass(frozen=True)
class JobCommand:
    """``--pipelines-dir DIR <action> PIPELINE [options] [--dry-run] --airflow-run JSON``.

    ``options`` and ``airflow_run`` may hold Jinja templates (an XCom, the task try): they are
    rendered by :meth:`rendered`, before the task adds what it learnt at run time (never
    rendered: a form's values are data, not templates)."""

    pipelines_dir: str
    action: JobAction
    pipeline: str
    options: tuple[str, ...] = ()
    dry_run: bool = False
    airflow_run: str = AIRFLOW_RUN

    def argv(self) -> list[str]:
        return [
            "--pipelines-dir",
            self.pipelines_dir,
            *self.action.words,
            self.pipeline,
            *self.options,
            *(["--dry-run"] if self.dry_run else []),
            "--airflow-run",
            self.airflow_run,
        ]

    def rendered(self, render: Callable[[str], str]) -> JobCommand:
        """This command with its templated fields passed through ``render``."""
        return dataclasses.replace(
            self,
            options=tuple(str(render(o)) for o in self.options),
            airflow_run=str(render(self.airflow_run)),
        )

    def with_options(self, *options: str) -> JobCommand:
        return dataclasses.replace(self, options=(*self.options, *options))

    def previewed(self) -> JobCommand:
        return dataclasses.replace(self, dry_run=True)

    def backfill_of(self, since: datetime, until: datetime) -> JobCommand:
        """This run as a backfill of the records of [since, until) (an Airflow backfill's
        data interval)."""
        return dataclasses.replace(
            self,
            action=JobAction.BACKFILL,
            options=(
                "--since",
                since.strftime(TIME_FORMAT),
                "--until",
                until.strftime(TIME_FORMAT),
            ),
        )
