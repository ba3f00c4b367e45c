"""Airflow DAGs generated from pipeline YAML files: dags/tidemark_pipelines.py makes every
pipeline file's DAGs, dags/tidemark_maintenance.py the maintenance DAG (one-liners both).

Per pipeline ``<name>``:

* ``tidemark_<name>``: recover -> replay (``SparkSubmitOperator`` on jobs/replay.py, connection
  ``airflow.spark_conn_id``, ``spark_default``; a ``spark_connect`` one runs the job here on that
  Spark Connect service: tidemark/airflow/connect_job.py) -> report (the run's state and counts as the task's XCom), on the YAML's
  schedule, one active run at a time;
* ``tidemark_<name>_backfill``: the same job in backfill mode for an offset range chosen in the
  Trigger form (partition, from/to offset, sinks);
* ``tidemark_<name>_rebuild``: a sink's table made again from the source, with the live
  file or the staged next version (rebuild_dag below);
* ``tidemark_<name>_redrive``: quarantined records (ids, or a class/sink) replayed through the
  current pipeline code (tidemark/driver/redrive.py); the Dead letters page triggers it with
  a redrive request it made in the ledger. The select task turns the form into such a
  request; the Spark job gets only its id.

Plus ``tidemark_maintenance``: a recovery sweep, then health alerts and retention (prune)
side by side, every few minutes.

Spark jobs share the pool ``tidemark_spark``; failed tasks alert through the pipeline's
``alerts`` (tidemark/airflow/alerts.py).  Parsing stays cheap: the YAML is validated without building
its Great Expectations suite (the job does that before it writes anything).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.providers.standard.operators.python import PythonOperator, ShortCircuitOperator
from airflow.sdk import DAG, AssetAlias, Param, TriggerRule

from tidemark import config
from tidemark.airflow import POOL, assets, connect_job, spark_conf
from tidemark.airflow import tasks as airflow_tasks
from tidemark.airflow.job_command import JobAction, JobCommand
from tidemark.core import job_secrets
from tidemark.core.errors import BadInput, Halted
from tidemark.core.settings import get_settings
from tidemark.core.text import clamp
from tidemark.engine.session import driver_java_options, log4j_option


def _job() -> Path:
    """The spark-submit application, found in the installed package (not imported: it is
    the job)."""
    spec = importlib.util.find_spec("tidemark.cli.spark_job")
    if spec is None or spec.origin is None:
        raise ImportError("tidemark.cli.spark_job is missing from the installed package")
    return Path(spec.origin)


JOB = _job()
START = datetime(2026, 1, 1, tzinfo=UTC)
MAINTENANCE_SCHEDULE = "*/5 * * * *"


def pipeline_dags(folder: str | Path) -> dict[str, DAG]:
    """The DAGs of every pipeline file in ``folder`` that loads (dags/tidemark_pipelines.py):
    a pipeline file dropped into the folder is enough. Broken ones are left out here and
    reported by :func:`check_pipeline_files`: Airflow marks every DAG of a file with an import
    error stale, so one broken file must not be this file's error."""
    dags: dict[str, DAG] = {}
    for path in config.pipeline_files(Path(folder)):
        try:
            p = config.load(path, deep=False)
        except BadInput:
            continue  # check_pipeline_files says what is wrong
        dags.update((d.dag_id, d) for d in _dags_of(p, path))
    return dags


def _dags_of(p: config.Pipeline, path: Path) -> list[DAG]:

    return [replay_dag(p, path), backfill_dag(p, path), redrive_dag(p, path), rebuild_dag(p, path)]


def check_pipeline_files(folder: str | Path) -> None:
    """Raise one error with a line per broken pipeline file in ``folder`` (the file, the field,
    the problem): dags/tidemark_pipeline_files.py, which defines no DAG, so that Airflow shows
    it as that file's import error and every other pipeline keeps its DAGs."""
    broken = []
    for path in config.pipeline_files(Path(folder)):
        try:
            config.load(path, deep=False)
        except BadInput as exc:
            broken.append(
                str(exc) + "".join(f"\n  {path}: {o}" for o in getattr(exc, "others", []))
            )
    # A staged next version (<name>.next.yaml) is no pipeline's DAG: a broken one is said
    # here and breaks nothing that runs.
    for path in config.staged_files(Path(folder)):
        try:
            config.load_staged(path.parent, path.stem.removesuffix(config.STAGED), deep=False)
        except BadInput as exc:
            broken.append(f"staged version: {exc}")
    if broken:
        raise BadInput(f"{len(broken)} broken pipeline file(s):\n" + "\n".join(broken))


def _default_args(p: config.Pipeline) -> dict:
    from tidemark.airflow import alerts

    a = p.airflow
    return {
        "owner": "tidemark",
        "retries": a.retries,
        "retry_delay": timedelta(seconds=a.retry_delay_seconds),
        "retry_exponential_backoff": 2.0,
        "max_retry_delay": timedelta(seconds=a.max_retry_delay_seconds),
        "on_failure_callback": alerts.failure_notifiers(p),
    }


def _doc(p: config.Pipeline, path: Path, what: str) -> str:
    sinks = "\n".join(f"- `{s.name}`: table `{s.table}`, key ({', '.join(s.key)})" for s in p.sinks)
    return (
        f"### {p.name}: {what}\n\n{p.description}\n\n"
        f"**Source:** `{p.source.type}` `{getattr(p.source, 'table', '')}`  \n"
        f"**Delivery:** {p.delivery}  \n**Pipeline file:** `{path}`\n\n**Sinks:**\n{sinks}\n\n"
        f"CLI: `tidemark status {p.name}`, `tidemark dq show RUN_ID`."
    )


# The job's exit codes (README "Exit codes") that no retry can cure: bad input (2) and a halted
# pipeline (5). The task fails at once instead of retrying; anything else retries with backoff.
NO_RETRY_EXIT_CODES = frozenset({BadInput.exit_code, Halted.exit_code})
# How the provider's AirflowException for a failed spark-submit says its exit code (the
# operator's public outcome; tests/test_dags.py runs the provider against a stand-in binary).
_EXIT_CODE = re.compile(r"Error code is: (-?\d+)")


def job_exit_code(exc: BaseException) -> int | None:
    """spark-submit's exit code, from the error SparkSubmitOperator raised (None: it failed
    otherwise, e.g. before the process started)."""
    m = _EXIT_CODE.search(str(exc))
    return int(m.group(1)) if m else None


class ReplayOperator(SparkSubmitOperator):
    """SparkSubmitOperator on jobs/replay.py running ``job`` (its command, completed at run
    time), whose failure says what the ledger recorded (e.g. the sink that failed and why)
    instead of the spark-submit command line, and fails without retries when the job exits 2
    (bad input) or 5 (halted). With a ``spark_connect`` connection the same job runs as a
    ``tidemark`` process against that endpoint instead (tidemark/airflow/connect_job.py)."""

    def __init__(
        self,
        *,
        job: JobCommand,
        pipeline_file: str,
        args_from: str | None = None,
        by_interval: bool = False,
        previews: bool = False,
        conn_id: str = "spark_default",
        **kwargs,
    ):
        # application_args, templated by Airflow as usual, show the command in the UI and the
        # task's rendered fields; execute replaces them with the completed command.
        super().__init__(application_args=job.argv(), conn_id=conn_id, **kwargs)
        self.job = job
        self.spark_conn_id = conn_id
        self.pipeline_file = pipeline_file
        # The task whose return value's ``args`` complete the command (check_backfill).
        self.args_from = args_from
        # A run of Airflow's own Backfill re-delivers its data interval (backfill by time).
        self.by_interval = by_interval
        # The trigger's form has a dry_run param: set, the job previews (--dry-run).
        self.previews = previews

    @property
    def pipeline(self) -> str:
        return self.job.pipeline

    def execute(self, context):
        # The job's process cannot ask Airflow for connections: it gets the ledger this task
        # resolved (connection tidemark_ledger, password masked in logs by Airflow) and every
        # connection the pipeline names (tidemark/airflow/connections.py), in a file only
        # this user can read: on YARN and Kubernetes the provider puts env_vars on
        # spark-submit's command line (tidemark/core/job_secrets.py). So only that file's
        # path is an env var, set after templating: nothing secret among the rendered fields,
        # the logged command, or what OpenLineage sends of the task.
        remote = connect_job.endpoint(self.spark_conn_id)
        if remote is None:
            self._refuse_cluster_mode()
            self.conf = spark_conf.job_conf(self.conf, self.spark_conn_id, self.pipeline_file)
        named = airflow_tasks.connections_exist(config.load(Path(self.pipeline_file), deep=False))
        self.application_args = self.command(context).argv()
        secrets = {**named, "TIDEMARK_LEDGER_DSN": airflow_tasks.ledger_dsn()}
        if remote is not None:  # a spark_connect connection: the job runs here, Spark there
            return self._submit(
                context,
                lambda: connect_job.run(
                    self.application_args, remote, secrets, self.log.info, self._started
                ),
            )
        with job_secrets.written(secrets) as path:
            self.env_vars = {**(self.env_vars or {}), job_secrets.VAR: path}
            return self._submit(context, lambda: super(ReplayOperator, self).execute(context))

    def _started(self, proc) -> None:
        self._connect_proc = proc

    def on_kill(self) -> None:
        proc = getattr(self, "_connect_proc", None)
        if proc is not None:
            connect_job.stop(proc)
        else:
            super().on_kill()

    def _refuse_cluster_mode(self) -> None:
        from airflow.sdk import BaseHook
        from airflow.sdk.exceptions import AirflowFailException

        conn = BaseHook.get_connection(self.spark_conn_id)
        if (conn.extra_dejson or {}).get("deploy-mode") == "cluster":
            raise AirflowFailException(
                f"Spark connection {self.spark_conn_id!r} has deploy-mode cluster: Tidemark's job "
                "runs its driver where the task runs (client mode), which is where it reads "
                "its connections; remove deploy-mode from the connection's extra "
                "(docs/production.md)"
            )

    def _submit(self, context, job: Callable[[], object]):
        try:
            return job()
        except Exception as exc:
            code = job_exit_code(exc)
            why = airflow_tasks.failure(
                self.pipeline,
                context["dag"].dag_id,
                context["run_id"],
                getattr(context.get("ti"), "try_number", None),
            )
            if code in NO_RETRY_EXIT_CODES:
                from airflow.sdk.exceptions import AirflowFailException

                from tidemark.airflow.alerts import error_line

                raise AirflowFailException(
                    f"{why or error_line(exc)} (exit {code}: not retried)"
                ) from exc
            if why is None:
                raise
            raise RuntimeError(why) from exc

    def command(self, context) -> JobCommand:
        """The job's command for this try: the DAG's, its templates rendered, completed by
        the check task's arguments, an Airflow backfill's data interval, the form's dry run."""
        job = self.job.rendered(lambda text: self.render_template(text, context))
        if self.args_from:
            job = job.with_options(*context["ti"].xcom_pull(task_ids=self.args_from)["args"])
        elif self.by_interval and getattr(context.get("dag_run"), "run_type", None) == "backfill":
            job = job.backfill_of(context["data_interval_start"], context["data_interval_end"])
        if self.previews and (context.get("params") or {}).get("dry_run"):
            job = job.previewed()
        return job

    # The OpenLineage provider's listener calls these (tidemark/airflow/lineage.py): the
    # source log in, the sink tables out, rows and the data-quality outcome as facets.
    def get_openlineage_facets_on_complete(self, task_instance):
        from tidemark.airflow.lineage import replay_lineage

        return replay_lineage(self.pipeline_file, task_instance.dag_id, task_instance.run_id)

    def get_openlineage_facets_on_failure(self, task_instance):
        return self.get_openlineage_facets_on_complete(task_instance)


def _spark(
    p: config.Pipeline,
    path: Path,
    action: JobAction,
    options: tuple[str, ...] = (),
    **kw,
) -> SparkSubmitOperator:
    return ReplayOperator(
        job=JobCommand(str(path.parent), action, p.name, options),
        pipeline_file=str(path),
        **kw,
        task_id="replay",
        application=str(JOB),
        conn_id=p.airflow.spark_conn_id,
        name=f"tidemark-{p.name}",
        driver_memory=p.airflow.driver_memory or get_settings().driver_memory,
        conf=_driver_conf(),
        pool=POOL,
    )


def _driver_conf() -> dict[str, str]:
    # spark-submit starts the driver's JVM before the job's Python, so the JVM options the
    # session would give it (Spark's logging, the class archive if built on this machine, the
    # collector) go on spark-submit's command line. Without the logging, Spark logs at INFO
    # until the session sets its level, and again while it shuts down: hundreds of lines
    # around the job's error in the task log.
    log4j = log4j_option()
    return {
        "spark.driver.extraJavaOptions": " ".join([log4j, *driver_java_options()]),
        "spark.executor.extraJavaOptions": log4j,
    }


def _recover(p: config.Pipeline, path: Path) -> PythonOperator:
    return PythonOperator(
        task_id="recover",
        python_callable=airflow_tasks.recover,
        op_kwargs={"pipelines_dir": str(path.parent), "pipeline": p.name},
    )


def _report(p: config.Pipeline, path: Path) -> list[PythonOperator]:
    """report (the run's state and counts) and announce (its asset events). announce runs
    whatever replay did: a run that committed one sink and failed another still announces
    the one it committed. It is a task of its own because Airflow keeps a task's asset events
    only when the task succeeds, and report, after a failed replay, must not."""
    kwargs = {
        "pipeline": p.name,
        "dag_id": "{{ dag.dag_id }}",
        "run_id": "{{ run_id }}",
        "pipeline_file": str(path),
    }
    # The events (one per committed sink table) go through the pipeline's alias: which sinks
    # a run committed is known only once it has run (tidemark/airflow/assets.py).
    return [
        PythonOperator(task_id="report", python_callable=airflow_tasks.report, op_kwargs=kwargs),
        PythonOperator(
            task_id="announce",
            python_callable=airflow_tasks.announce,
            op_kwargs=kwargs,
            trigger_rule=TriggerRule.ALL_DONE,
            outlets=[AssetAlias(assets.alias_name(p.name))],
        ),
    ]


def _schedule(p: config.Pipeline):
    """The pipeline's schedule; with ``backfill_by_interval`` a data-interval timetable, so
    each run (of Airflow's Backfill too) covers [previous tick, this tick) instead of the
    zero-length interval Airflow 3 gives a cron string."""
    if p.airflow.backfill_by_interval and p.schedule:
        from airflow.sdk import CronDataIntervalTimetable

        return CronDataIntervalTimetable(p.schedule, timezone="UTC")
    return p.schedule


def replay_dag(p: config.Pipeline, path: Path) -> DAG:
    with DAG(
        dag_id=config.dag_id(p.name),
        description=(p.description or f"Replay {p.name}")[:200],
        doc_md=_doc(p, path, "scheduled replay"),
        schedule=_schedule(p),
        start_date=START,
        catchup=False,
        max_active_runs=1,
        tags=["tidemark", *p.tags],
        default_args=_default_args(p),
        is_paused_upon_creation=p.airflow.paused_on_creation,
    ) as dag:
        # recover also asks whether anything is new: if not, replay and report are skipped
        # (no JVM, no Great Expectations; the DAG run ends in seconds).
        first = ShortCircuitOperator(
            task_id="recover",
            python_callable=airflow_tasks.pending,
            op_kwargs={"pipelines_dir": str(path.parent), "pipeline": p.name},
        )
        replay = _spark(p, path, JobAction.RUN, by_interval=p.airflow.backfill_by_interval)
        first >> replay >> _report(p, path)
    return dag


def _triggered(
    p: config.Pipeline, kind: str, description: str, doc: str, params: dict, **extra
) -> DAG:
    """A DAG ``tidemark_<name>_<kind>`` that runs only when triggered, with a params form."""
    return DAG(
        dag_id=config.dag_id(p.name, kind),
        description=clamp(description, 200),
        doc_md=doc,
        schedule=None,
        start_date=START,
        catchup=False,
        max_active_runs=1,
        tags=["tidemark", kind, *p.tags],
        params=params,
        default_args=_default_args(p),
        **extra,
    )


def _dry_run_param() -> Param:
    """The triggered re-deliveries' preview (docs/operations.md, "Preview: --dry-run")."""
    return Param(
        False,
        type="boolean",
        title="Dry run",
        description="Preview: run up to PREPARE, report, roll back (nothing committed).",
    )


def backfill_dag(p: config.Pipeline, path: Path) -> DAG:
    names = [s.name for s in p.sinks]
    params = {
        # Empty by default: a form left as it is names nothing, and is refused; a default
        # partition once narrowed a time window to partition 0 without a word.
        "partition": Param(
            None,
            type=["integer", "null"],
            minimum=0,
            title="Partition",
            description="Source partition to re-deliver, by offsets or by time window; empty: "
            "every partition.",
        ),
        "from_offset": Param(
            None,
            type=["integer", "null"],
            minimum=0,
            title="From offset",
            description="First offset, inclusive. With every partition: 0 re-delivers "
            "everything committed.",
        ),
        "to_offset": Param(
            None,
            type=["integer", "null"],
            minimum=1,
            title="To offset",
            description="End offset, exclusive; at most the sink's checkpoint (empty with "
            "every partition: the checkpoint).",
        ),
        "since": Param(
            None,
            type=["null", "string"],
            format="date-time",
            title="Since (time window)",
            description="Re-deliver the records of a time window instead of offsets: from "
            "this time (inclusive, UTC unless it says), with Until.",
        ),
        "until": Param(
            None,
            type=["null", "string"],
            format="date-time",
            title="Until (time window)",
            description="End of the time window, exclusive.",
        ),
        "sinks": Param(
            names,
            type="array",
            minItems=1,
            uniqueItems=True,
            items={"type": "string", "enum": names},
            title="Sinks",
            description="Sinks to re-deliver to.",
        ),
        "accept_pruned": Param(
            False,
            type="boolean",
            title="Accept pruned",
            description="Backfill although the source no longer holds records the sinks hold "
            "in the range (they stay as they are; docs/operations.md).",
        ),
        "dry_run": _dry_run_param(),
    }
    # Runs only when triggered: paused, its first trigger would wait for an unpause.
    with _triggered(
        p,
        "backfill",
        f"Re-deliver an offset range or a time window of {p.name}",
        _doc(p, path, "backfill an offset range or a time window")
        + (
            "\n\nTrigger with a configuration: the form asks for the partition (empty: "
            "all) and the offset range [from, to), or a time window [since, until) mapped "
            "to each partition's offsets from the records' times, and the sinks. "
            "Re-delivery is idempotent and never moves checkpoints; a newer version of a "
            "key is never overwritten."
        ),
        params,
        is_paused_upon_creation=False,
    ) as dag:
        _checked_replay(
            p,
            path,
            "check",
            airflow_tasks.check_backfill,
            JobAction.BACKFILL,
            args_from="check",
        )
    return dag


def _checked_replay(
    p: config.Pipeline,
    path: Path,
    task_id: str,
    check,
    action: JobAction,
    options: tuple[str, ...] = (),
    args_from: str | None = None,
    **kwargs,
):
    """recover -> a check of the trigger's params (no retries: bad input stays bad) ->
    replay (its command completed by the check's ``args`` with ``args_from``, and
    ``--dry-run`` when the form's dry_run is set) -> report."""
    first = PythonOperator(
        task_id=task_id,
        python_callable=check,
        retries=0,
        op_kwargs={"pipeline_file": str(path), **kwargs},
    )
    replay = _spark(p, path, action, options, args_from=args_from, previews=True)
    _recover(p, path) >> first >> replay >> _report(p, path)


def rebuild_dag(p: config.Pipeline, path: Path) -> DAG:
    """``tidemark_<name>_rebuild``: `tidemark sink rebuild` triggered by hand
    (docs/operations.md, "Rebuild a sink" and "Change a key: stage, rebuild, promote").
    Dry run is ticked by default: trigger once to preview, then again unticked. With Staged,
    the rebuild writes with ``<name>.next.yaml`` and, once every sink it changes is rebuilt,
    the job makes it the live file (the report says so)."""
    names = [s.name for s in p.sinks]
    staged = config.staged_file(path.parent, p.name)
    params = {
        "sink": Param(
            names[0],
            type="string",
            enum=names,
            title="Sink",
            description="The sink whose table is made again from the source.",
        ),
        "staged": Param(
            staged.exists(),
            type="boolean",
            title="Staged version",
            description=f"Rebuild with the staged next version ({staged.name}) instead of "
            f"the live file; it goes live once every sink it changes is rebuilt.",
        ),
        "accept_pruned": Param(
            False,
            type="boolean",
            title="Accept pruned",
            description="Rebuild although the source no longer holds records whose rows the "
            "table has (they are left out of the new table; the old table keeps them).",
        ),
        "dry_run": Param(
            True,
            type="boolean",
            title="Dry run",
            description="Preview (the default): run up to PREPARE, report what the new table "
            "would hold, roll back. Untick to rebuild.",
        ),
    }
    with _triggered(
        p,
        "rebuild",
        f"Rebuild a sink table of {p.name} from its source (a key change)",
        _doc(p, path, "rebuild a sink table")
        + (
            "\n\nRe-delivers every record the sink has received into a new table made from "
            "the pipeline (its key and columns) and swaps it in for the old one in the same "
            "two-phase commit; the old table is kept as `<table>_<YYYYMMDD>_run<N>`. Trigger "
            "with Dry run ticked first (the default) and read the report; then trigger again "
            f"unticked. A key change waits in `{staged.name}` beside the pipeline file (the "
            "live pipeline runs on meanwhile): tick Staged version to rebuild with it."
        ),
        params,
        is_paused_upon_creation=False,
    ) as dag:
        _checked_replay(
            p, path, "check", airflow_tasks.check_rebuild, JobAction.REBUILD, args_from="check"
        )
    return dag


def redrive_dag(p: config.Pipeline, path: Path) -> DAG:
    from tidemark.ledger.dlq import ERROR_CLASSES

    params = {
        "request": Param(
            None,
            type=["null", "integer"],
            minimum=1,
            title="Redrive request",
            description="A redrive request the Dead letters page made (its "
            "letters are in the ledger); the fields below are then "
            "ignored.",
        ),
        "ids": Param(
            [],
            type="array",
            items={"type": "integer", "minimum": 1},
            title="Dead-letter ids",
            description="Quarantined records to redrive.",
        ),
        # Optional fields take null: Airflow's form holds back Trigger until every field
        # whose type lacks null is filled in.
        "error_class": Param(
            None,
            type=["null", "string"],
            enum=[None, *ERROR_CLASSES],
            title="Error class",
            description="Or: every quarantined record of this class.",
        ),
        "sink": Param(
            None,
            type=["null", "string"],
            enum=[None, *(s.name for s in p.sinks)],
            title="Sink",
            description="Or: of this sink.",
        ),
        "all_quarantined": Param(
            False,
            type="boolean",
            title="All quarantined",
            description="Redrive every quarantined record of the pipeline.",
        ),
        "requested_by": Param(
            None,
            type=["null", "string"],
            title="Requested by",
            description="Recorded when the trigger names no user.",
        ),
        "dry_run": _dry_run_param(),
    }
    # Runs only when triggered; paused, a redrive asked for in the UI would never start.
    with _triggered(
        p,
        "redrive",
        f"Redrive quarantined records of {p.name}",
        _doc(p, path, "redrive dead letters")
        + (
            "\n\nReplays the selected quarantined records' stored bytes through "
            "the current pipeline code into the sinks, exactly once: records that "
            "pass are written and marked redriven in the same two-phase commit; "
            "records that fail again stay quarantined with attempts + 1 and the new "
            "reason. Batch-level expectations do not apply to a redrive. The Dead "
            "letters page triggers this DAG."
        ),
        params,
        is_paused_upon_creation=False,
    ) as dag:
        by = "{{ dag_run.triggering_user_name or params.requested_by or 'airflow' }}"
        # The selection goes to the job as a ledger request's id: a list of ids on spark-
        # submit's command line fails past ~18,000 (the kernel's 128 KiB per argument).
        _checked_replay(
            p,
            path,
            "select",
            airflow_tasks.select_redrive,
            JobAction.REDRIVE,
            ("--request", "{{ ti.xcom_pull(task_ids='select') }}", "--by", by),
            by=by,
        )
    return dag


def maintenance_dag(pipelines_dir: str | Path) -> DAG:
    folder = Path(pipelines_dir)
    with DAG(
        dag_id=config.MAINTENANCE_DAG,
        description="Recovery sweep; alerts on halts, old prepared transactions, leases, DLQ "
        "growth; retention",
        doc_md=(
            "### Tidemark maintenance\n\nEvery few minutes: settles in-doubt runs and rolls "
            "back orphan prepared transactions (`tidemark recover`), then alerts through "
            "each pipeline's `alerts` channels when a pipeline is halted (the alert says why "
            "and how back: a chosen transaction someone else rolled back names `tidemark "
            "settle RUN`), when a prepared transaction or a lease is "
            "older than `alerts.prepared_max_age_minutes` or the DLQ holds more than "
            "`alerts.dlq_max` quarantined records. The check task fails while a problem "
            "lasts. Beside the check, the prune task deletes what has outlived the "
            'retention settings (`tidemark prune`, docs/operations.md "Retention").'
        ),
        schedule=MAINTENANCE_SCHEDULE,
        start_date=START,
        catchup=False,
        max_active_runs=1,
        tags=["tidemark", "maintenance"],
        default_args={"owner": "tidemark", "retries": 0},
    ) as dag:
        sweep = PythonOperator(
            task_id="recover",
            python_callable=airflow_tasks.recover,
            op_kwargs={"pipelines_dir": str(folder)},
        )
        # The check runs whatever recover did: one pipeline's failed recovery must not
        # silence every pipeline's health alerts.
        check = PythonOperator(
            task_id="check",
            python_callable=airflow_tasks.maintenance,
            op_kwargs={"pipelines_dir": str(folder)},
            trigger_rule=TriggerRule.ALL_DONE,
        )
        # Beside the check, not before it: a prune that fails never holds back the alerts,
        # and fails the DAG run on its own. It runs whatever recovery's outcome: it never
        # deletes what recovery has still to settle.
        prune = PythonOperator(
            task_id="prune",
            python_callable=airflow_tasks.prune,
            op_kwargs={"pipelines_dir": str(folder)},
            trigger_rule=TriggerRule.ALL_DONE,
        )
        sweep >> [check, prune]
    return dag
