"""DAG integrity: the repo's DAG folder and generated DAGs parse with Airflow's own DagBag."""

from __future__ import annotations

import copy
import shutil
import sys

import pytest

from tests.conftest import REPO
from tidemark.core.errors import BadInput


@pytest.fixture(scope="module")
def airflow_home(tmp_path_factory, monkeypatch_module):
    home = tmp_path_factory.mktemp("airflow-home")
    monkeypatch_module.setenv("AIRFLOW_HOME", str(home))
    monkeypatch_module.setenv("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
    monkeypatch_module.setenv("TIDEMARK_DEMO_SOURCE_DSN", "postgresql://u:p@127.0.0.1:1/x")
    monkeypatch_module.setenv("TIDEMARK_DEMO_SINK_DSN", "postgresql://u:p@127.0.0.1:1/y")
    return home


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


# The task try a replay's context below renders (--airflow-run: tidemark.ledger.state.AirflowRun).
AIRFLOW_RUN_JSON = '{"dag_id": "d", "run_id": "r1", "task_id": "replay", "try_number": 1}'


def _context(xcom=None, params=None, run_type="manual", interval=None, user="erin"):
    """What Airflow hands a replay task's execute: its try (XComs by task id), the DAG run,
    the trigger form's params."""
    from types import SimpleNamespace

    pulls = dict(xcom or {})

    def xcom_pull(task_ids):
        return pulls[task_ids]

    ti = SimpleNamespace(dag_id="d", task_id="replay", try_number=1, xcom_pull=xcom_pull)
    ctx = {
        "ti": ti,
        "run_id": "r1",
        "dag": SimpleNamespace(dag_id="d"),
        "dag_run": SimpleNamespace(run_type=run_type, triggering_user_name=user),
        "params": dict(params or {}),
    }
    if interval:
        ctx["data_interval_start"], ctx["data_interval_end"] = interval
    return ctx


def _bag(folder):
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(folder))


def test_repo_dags_import_without_errors(airflow_home):
    bag = _bag(REPO / "dags")
    assert bag.import_errors == {}
    assert {
        "tidemark_flights",
        "tidemark_flights_backfill",
        "tidemark_flights_redrive",
        "tidemark_maintenance",
    } <= set(bag.dags)
    flights = bag.dags["tidemark_flights"]
    assert [t.task_id for t in flights.topological_sort()] == [
        "recover",
        "replay",
        "report",
        "announce",
    ]
    assert flights.max_active_runs == 1 and "demo" in flights.tags
    replay = flights.get_task("replay")
    assert replay.pool == "tidemark_spark" and replay.retries == 2
    assert replay.retry_exponential_backoff == 2.0
    assert flights.timetable.expression in ("@hourly", "0 * * * *")
    for dag in bag.dags.values():
        dag.validate()
        assert len(dag.topological_sort()) == len(dag.tasks)  # no cycle


def test_replay_dag_skips_spark_when_idle_and_announces_sink_assets(airflow_home):
    from airflow.providers.standard.operators.python import ShortCircuitOperator
    from airflow.sdk import AssetAlias

    bag = _bag(REPO / "dags")
    flights = bag.dags["tidemark_flights"]
    assert isinstance(flights.get_task("recover"), ShortCircuitOperator)
    for dag_id in ("tidemark_flights", "tidemark_flights_backfill", "tidemark_flights_redrive"):
        announce = bag.dags[dag_id].get_task("announce")
        assert announce.outlets == [AssetAlias("tidemark_flights_sinks")]
        # It runs whatever replay did: a sink that committed is announced when another failed.
        assert announce.trigger_rule == "all_done"
        assert announce.upstream_task_ids == {"replay"}
        assert bag.dags[dag_id].get_task("report").outlets == []


def test_sink_asset_uri_is_the_postgres_providers():
    from urllib.parse import urlsplit

    from airflow.providers.postgres.assets.postgres import sanitize_uri

    from tidemark.airflow.assets import table_uri

    cases = {
        (
            "postgresql://u:secret@db.example:6543/wh",
            "public.flights",
        ): "postgres://db.example:6543/wh/public/flights",
        (
            "host=db.example dbname=wh user=u password=secret",
            "flights",
        ): "postgres://db.example:5432/wh/public/flights",
        ("postgresql:///wh?host=/var/run/postgresql", "s.t"): "postgres://localhost:5432/wh/s/t",
    }
    for (dsn, table), uri in cases.items():
        got = table_uri(dsn, table)
        assert got == uri
        assert sanitize_uri(urlsplit(got)).geturl() == got  # already the provider's canonical form
    # a raw '@' would make part of the password the asset's host, in every lineage event
    for raw in ("Ab@Secret9", "Ab%zzSecret9", "Ab/Secret9"):
        with pytest.raises(ValueError, match="does not parse") as bad:
            table_uri(f"postgresql://u:{raw}@db.example/wh", "t")
        assert "Secret9" not in str(bad.value)


def test_backfill_params_validate(airflow_home):
    from airflow.sdk.exceptions import ParamValidationError

    dag = _bag(REPO / "dags").dags["tidemark_flights_backfill"]
    assert [t.task_id for t in dag.topological_sort()] == [
        "recover",
        "check",
        "replay",
        "report",
        "announce",
    ]
    params = dag.params
    ok = copy.deepcopy(params)
    ok.update({"partition": 2, "from_offset": 0, "to_offset": 100, "sinks": ["warehouse"]})
    assert ok.validate()["to_offset"] == 100
    assert ok.validate()["dry_run"] is False  # a preview only when asked
    for bad in (
        {"partition": -1},
        {"from_offset": "ten"},
        {"sinks": []},
        {"sinks": ["nowhere"]},
        {"dry_run": "yes"},
    ):
        p = copy.deepcopy(params)
        with pytest.raises(ParamValidationError):
            p.update(bad)
            p.validate()


def test_redrive_dag_params_validate(airflow_home):
    from airflow.sdk.exceptions import ParamValidationError

    dag = _bag(REPO / "dags").dags["tidemark_flights_redrive"]
    assert [t.task_id for t in dag.topological_sort()] == [
        "recover",
        "select",
        "replay",
        "report",
        "announce",
    ]
    assert dag.max_active_runs == 1 and dag.get_task("replay").pool == "tidemark_spark"
    ok = copy.deepcopy(dag.params)
    ok.update({"ids": [3, 4], "requested_by": "alice"})
    assert ok.validate()["ids"] == [3, 4]
    ok.update({"request": 12})
    assert ok.validate()["request"] == 12
    # The job gets a ledger request's id, never the ids: a list of 100,000 would not fit
    # spark-submit's command line.
    args = dag.get_task("replay").application_args
    at = args.index("--request")
    assert args[at + 1] == "{{ ti.xcom_pull(task_ids='select') }}"
    assert not any("join" in a for a in args)
    # The form's dry_run previews the redrive (--dry-run after the pipeline's name).
    assert ok.validate()["dry_run"] is False
    replay = dag.get_task("replay")
    select = {"select": 12}
    assert replay.command(_context(select, params={**ok, "dry_run": True})).dry_run
    assert "--dry-run" not in replay.command(_context(select, params=dict(ok))).argv()
    for bad in (
        {"dry_run": 1},
        {"ids": ["x"]},
        {"ids": [0]},
        {"error_class": "nope"},
        {"sink": "nowhere"},
        {"request": 0},
        {"request": "x"},
    ):
        p = copy.deepcopy(dag.params)
        with pytest.raises(ParamValidationError):
            p.update(bad)
            p.validate()


def test_broken_yaml_is_one_import_error_others_load(airflow_home, tmp_path):
    """A YAML dropped into pipelines/ is enough for its DAGs; broken ones are the import error
    of a DAG file that defines no DAG, one line each (file, field, problem), so they never
    hide the others (Airflow marks every DAG of a file with an import error stale)."""
    dags = tmp_path / "dags"
    shutil.copytree(REPO / "dags", dags)
    pipes = dags / "pipelines"
    (pipes / "broken.yaml").write_text("name: broken\nsinks: nope\n")
    (pipes / "bad_key.yml").write_text(
        (pipes / "flights.yaml").read_text().replace("key: [", "keyz: [")
    )
    shutil.copy(pipes / "flights.yaml", pipes / "mine.yaml")
    bag = _bag(dags)
    assert [k.rsplit("/", 1)[-1] for k in bag.import_errors] == ["tidemark_pipeline_files.py"]
    (trace,) = bag.import_errors.values()
    lines = trace.splitlines()
    assert any("broken.yaml: source: Field required" in line for line in lines), trace
    assert any("bad_key.yml: sinks[0].key: Field required" in line for line in lines), trace
    # Every problem of a file, not the first only: "(and 2 more)", then each on its line.
    assert any(
        line.startswith("  ") and "broken.yaml: decode: Field required" in line for line in lines
    ), trace
    assert {
        "tidemark_flights",
        "tidemark_flights_backfill",
        "tidemark_mine",
        "tidemark_mine_redrive",
        "tidemark_maintenance",
    } <= set(bag.dags)
    assert not any("broken" in d for d in bag.dags)


def test_maintenance_dag_prunes_beside_the_check(airflow_home):
    """prune and check run after recover whatever its outcome, side by side: a failing prune
    neither stops the check nor hides behind it (it fails the DAG run itself)."""
    from airflow.sdk import TriggerRule

    dag = _bag(REPO / "dags").dags["tidemark_maintenance"]
    assert {t.task_id for t in dag.tasks} == {"recover", "check", "prune"}
    prune, check = dag.get_task("prune"), dag.get_task("check")
    assert prune.upstream_task_ids == {"recover"} and not prune.downstream_task_ids
    assert check.upstream_task_ids == {"recover"} and not check.downstream_task_ids
    assert prune.trigger_rule == TriggerRule.ALL_DONE
    assert check.trigger_rule == TriggerRule.ALL_DONE
    assert prune.python_callable.__module__ == "tidemark.airflow.tasks"


def test_the_backfill_form_takes_a_time_window_or_every_partition(airflow_home):
    from tidemark.airflow.tasks import check_backfill

    dag = _bag(REPO / "dags").dags["tidemark_flights_backfill"]
    window = {
        "partition": None,
        "since": "2026-05-01T10:00:00",
        "until": "2026-05-01T12:00:00+02:00",
        "sinks": ["warehouse"],
    }
    p = copy.deepcopy(dag.params)
    p.update(window)
    assert p.validate()["since"] == "2026-05-01T10:00:00"
    path = str(REPO / "dags/pipelines/flights.yaml")
    # Naive is UTC; the window's end, 10:00 UTC, is not after its start: refused.
    with pytest.raises(BadInput, match="must be after since"):
        check_backfill(path, window)
    window["until"] = "2026-05-01T14:00:00+02:00"
    assert check_backfill(path, window)["args"] == [
        "--sink",
        "warehouse",
        "--since",
        "2026-05-01T10:00:00+0000",
        "--until",
        "2026-05-01T14:00:00+0200",
    ]
    # A form left as it is names nothing: refused, never everything (nor partition 0).
    untouched = {k: v for k, v in copy.deepcopy(dag.params).validate().items()}
    with pytest.raises(BadInput, match="say what to re-deliver"):
        check_backfill(path, untouched)
    assert check_backfill(path, {**untouched, **window})["args"][2:3] == ["--since"]
    every = {"partition": None, "from_offset": 0, "to_offset": None, "sinks": ["warehouse"]}
    assert check_backfill(path, every)["args"] == [
        "--sink",
        "warehouse",
        "--partition",
        "all",
        "--from",
        "0",
    ]
    with pytest.raises(BadInput, match="give both since and until"):
        check_backfill(path, {**every, "since": "2026-05-01"})
    # The form may accept what the source no longer holds (docs/operations.md).
    assert untouched["accept_pruned"] is False
    assert check_backfill(path, {**every, "accept_pruned": True})["args"][-1] == "--accept-pruned"

    # The command replay runs: the check's arguments after the pipeline's name.
    replay = dag.get_task("replay")
    xcom = {"check": {"args": ["--partition", "all"]}}
    head = ["--pipelines-dir", str(REPO / "dags/pipelines"), "backfill", "flights"]
    assert replay.command(_context(xcom)).argv() == [
        *head, "--partition", "all", "--airflow-run", AIRFLOW_RUN_JSON,
    ]  # fmt: skip
    assert replay.command(_context(xcom, params={"dry_run": True})).argv() == [
        *head, "--partition", "all", "--dry-run", "--airflow-run", AIRFLOW_RUN_JSON,
    ]  # fmt: skip


def test_airflows_backfill_of_a_scheduled_run_re_delivers_its_data_interval_when_opted_in(
    airflow_home,
):
    from datetime import UTC, datetime

    from tidemark.airflow.dags import ReplayOperator
    from tidemark.airflow.job_command import JobAction, JobCommand

    job = JobCommand("d", JobAction.RUN, "flights")
    op = ReplayOperator(
        task_id="replay", job=job, pipeline_file="f", application="a", by_interval=True
    )
    interval = (datetime(2026, 1, 1, 0, tzinfo=UTC), datetime(2026, 1, 1, 1, tzinfo=UTC))
    ctx = _context(run_type="backfill", interval=interval)
    assert op.command(ctx).argv() == [
        "--pipelines-dir", "d", "backfill", "flights",
        "--since", "2026-01-01T00:00:00+0000", "--until", "2026-01-01T01:00:00+0000",
        "--airflow-run", AIRFLOW_RUN_JSON,
    ]  # fmt: skip
    ctx = _context(run_type="scheduled", interval=interval)
    assert op.command(ctx).argv() == [
        "--pipelines-dir", "d", "run", "flights", "--airflow-run", AIRFLOW_RUN_JSON
    ]  # fmt: skip


@pytest.mark.parametrize("kind", ["backfill", "redrive", "rebuild"])
def test_a_form_left_as_it_is_can_be_triggered(airflow_home, kind):
    """Airflow's Trigger form holds back a run until every field whose type lacks null is
    filled in: an optional field defaults to null and allows it (the redrive form's error
    class, sink and requested-by once defaulted to "", so nothing could be triggered)."""
    dag = _bag(REPO / "dags").dags[f"tidemark_flights_{kind}"]
    for name, param in dag.params.items():
        types = param.schema.get("type")
        types = types if isinstance(types, list) else [types]
        if param.value is None:
            assert "null" in types, f"{kind} form: {name} defaults to null but refuses it"
        assert param.value != "", f"{kind} form: {name} defaults to an empty string"
    assert copy.deepcopy(dag.params).validate()  # the defaults are a valid form


@pytest.mark.parametrize("master", ["yarn", "local[2]"])
def test_no_connection_reaches_spark_submits_command_line(
    airflow_home, tmp_path, monkeypatch, master
):
    """On YARN and Kubernetes the provider puts a task's env_vars on spark-submit's command
    line (``spark.yarn.appMasterEnv.*``, ``spark.kubernetes.driverEnv.*``): the replay task
    hands the job only the path of a file its user alone can read, which goes when the task
    ends; the job reads its connections from it and deletes it."""
    import json
    import os
    import stat

    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

    from tidemark.airflow.dags import pipeline_dags
    from tidemark.core import job_secrets

    ledger = "postgresql://tm:Ledger%2FSecret9@127.0.0.1:1/ledger"
    sink = "postgresql://tm:Sink%40Secret9@127.0.0.1:1/warehouse"
    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": master})
    )
    monkeypatch.setenv("AIRFLOW_CONN_TIDEMARK_LEDGER", ledger)
    monkeypatch.setenv("AIRFLOW_CONN_WAREHOUSE", sink)
    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "orders.yaml").write_text(
        "name: orders\n"
        "source: {type: postgres_log, conn_id: warehouse, table: src.log}\n"
        "decode: {schema: {id: int}}\n"
        "transform: {select: {id: id}, required: [id]}\n"
        "sinks: [{name: main, conn_id: warehouse, table: public.orders, key: [id]}]\n"
    )
    replay = pipeline_dags(folder)["tidemark_orders"].get_task("replay")
    seen: dict = {}

    def submit(self, context):
        hook = self._get_hook()
        seen["cmd"] = " ".join(hook._build_spark_submit_command(self.application))
        seen["env"] = dict(self.env_vars)
        path = self.env_vars[job_secrets.VAR]
        seen["path"], seen["mode"] = path, stat.S_IMODE(os.stat(path).st_mode)
        seen["folder_mode"] = stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)
        monkeypatch.setenv(job_secrets.VAR, path)
        job_secrets.load_into_environ()  # what the job does first
        seen["job"] = {
            k: os.environ.get(k) for k in ("TIDEMARK_LEDGER_DSN", "AIRFLOW_CONN_WAREHOUSE")
        }
        seen["left"] = os.path.exists(path)

    monkeypatch.setattr(SparkSubmitOperator, "execute", submit)
    replay.execute(_context())
    assert "Secret9" not in seen["cmd"] + json.dumps(seen["env"])
    assert seen["env"].keys() == {job_secrets.VAR}
    assert (seen["mode"], seen["folder_mode"]) == (0o600, 0o700)
    assert seen["job"] == {"TIDEMARK_LEDGER_DSN": ledger, "AIRFLOW_CONN_WAREHOUSE": sink}
    assert not seen["left"] and not os.path.exists(os.path.dirname(seen["path"]))


def test_a_cluster_deploy_mode_is_refused_with_what_to_set(airflow_home, tmp_path, monkeypatch):
    import json

    from airflow.sdk.exceptions import AirflowFailException

    from tidemark.airflow.dags import pipeline_dags

    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_DEFAULT",
        json.dumps({"conn_type": "spark", "host": "yarn", "extra": {"deploy-mode": "cluster"}}),
    )
    folder = tmp_path / "pipelines"
    folder.mkdir()
    shutil.copy(REPO / "dags" / "pipelines" / "flights.yaml", folder)
    replay = pipeline_dags(folder)["tidemark_flights"].get_task("replay")
    with pytest.raises(AirflowFailException, match="client mode"):
        replay.execute({"params": {}, "dag_run": None})


@pytest.mark.parametrize("paused", [None, False, True])
def test_the_scheduled_dag_starts_paused_or_not_as_the_pipeline_says(
    airflow_home, tmp_path, paused
):
    """``airflow: {paused_on_creation: false}`` starts a new pipeline's scheduled DAG
    unpaused; unset, Airflow's own default ([core] dags_are_paused_at_creation) decides."""
    dags = tmp_path / "dags"
    shutil.copytree(REPO / "dags", dags)
    yaml = (dags / "pipelines" / "flights.yaml").read_text()
    if paused is not None:
        yaml += f"\nairflow:\n  paused_on_creation: {str(paused).lower()}\n"
    (dags / "pipelines" / "flights.yaml").write_text(yaml)
    bag = _bag(dags)
    assert bag.import_errors == {}
    assert bag.dags["tidemark_flights"].is_paused_upon_creation is paused
    # The triggered ones never start paused: a trigger would wait for an unpause.
    assert bag.dags["tidemark_flights_backfill"].is_paused_upon_creation is False


def test_rebuild_dag_form_previews_first_and_builds_the_rebuild_command(airflow_home):
    """tidemark_<name>_rebuild (issue 48): triggered by hand, its form asks for the sink,
    the staged version, accept pruned and dry run, ticked by default (preview first); the
    check's arguments complete `sink rebuild NAME`."""
    from airflow.sdk.exceptions import ParamValidationError

    from tidemark.airflow.tasks import check_rebuild

    dag = _bag(REPO / "dags").dags["tidemark_flights_rebuild"]
    assert type(dag.timetable).__name__ == "NullTimetable"  # no schedule: only triggered
    assert "rebuild" in dag.tags and dag.max_active_runs == 1
    assert [t.task_id for t in dag.topological_sort()] == [
        "recover",
        "check",
        "replay",
        "report",
        "announce",
    ]
    form = copy.deepcopy(dag.params).validate()
    assert form == {"sink": "warehouse", "staged": False, "accept_pruned": False, "dry_run": True}
    for bad in ({"sink": "nowhere"}, {"dry_run": "yes"}, {"staged": None}):
        p = copy.deepcopy(dag.params)
        with pytest.raises(ParamValidationError):
            p.update(bad)
            p.validate()
    path = str(REPO / "dags/pipelines/flights.yaml")
    assert check_rebuild(path, form)["args"] == ["warehouse"]
    assert check_rebuild(path, {**form, "accept_pruned": True})["args"] == [
        "warehouse",
        "--accept-pruned",
    ]
    with pytest.raises(BadInput, match="sink must be one of warehouse"):
        check_rebuild(path, {**form, "sink": "nope"})
    # No staged file: refused here, in one line, before Spark starts.
    with pytest.raises(BadInput, match="no staged file for pipeline flights"):
        check_rebuild(path, {**form, "staged": True})

    replay = dag.get_task("replay")
    ctx = _context(xcom={"check": {"args": ["warehouse", "--staged"]}}, params={"dry_run": True})
    assert replay.command(ctx).argv()[2:] == [
        "sink", "rebuild", "flights", "warehouse", "--staged",
        "--dry-run", "--airflow-run", AIRFLOW_RUN_JSON,
    ]  # fmt: skip


def test_a_staged_key_change_leaves_the_live_dags_alone(airflow_home, tmp_path):
    """A key change waiting in flights.next.yaml: the live pipeline keeps its DAGs and its
    version, the rebuild form offers the staged version, and a broken staged file is one
    line of the pipeline files' import error, never a broken DAG."""
    from tidemark import config
    from tidemark.airflow.tasks import check_rebuild

    dags = tmp_path / "dags"
    shutil.copytree(REPO / "dags", dags)
    pipes = dags / "pipelines"
    live = (pipes / "flights.yaml").read_text()
    (pipes / "flights.next.yaml").write_text(
        live.replace("key: [flight_date, carrier, flight, origin, copy]", "key: [flight_date]")
    )
    bag = _bag(dags)
    assert bag.import_errors == {}
    assert {"tidemark_flights", "tidemark_flights_rebuild"} <= set(bag.dags)
    assert not any("next" in d for d in bag.dags)
    assert [p.name for p in config.pipeline_files(pipes)] == ["flights.yaml"]
    assert config.load(pipes / "flights.yaml", deep=False).sinks[0].key[0] == "flight_date"
    assert len(config.load(pipes / "flights.yaml", deep=False).sinks[0].key) == 5
    form = copy.deepcopy(bag.dags["tidemark_flights_rebuild"].params).validate()
    assert form["staged"] is True  # the staged file exists: the form offers it
    assert check_rebuild(str(pipes / "flights.yaml"), form)["args"] == ["warehouse", "--staged"]

    # A staged version must keep the live source and sinks' tables.
    (pipes / "flights.next.yaml").write_text(
        live.replace("table: public.flights", "table: public.flights2")
    )
    bag = _bag(dags)
    (trace,) = bag.import_errors.values()
    assert "staged version:" in trace and "flights.next.yaml" in trace
    assert "sinks[0].table" in trace and "must keep the live table" in trace
    assert {"tidemark_flights", "tidemark_flights_rebuild", "tidemark_maintenance"} <= set(bag.dags)


# A spark-submit that records the command it was given and exits as told: the provider's own
# operator and hook run for real, up to the process they start.
FAKE_SPARK_SUBMIT = """#!{python}
import json, os, sys
with open(os.environ["FAKE_SPARK_SUBMIT_ARGV"], "w") as f:
    json.dump(sys.argv[1:], f)
sys.exit(int(os.environ["FAKE_SPARK_SUBMIT_EXIT"]))
"""


@pytest.fixture
def fake_spark_submit(tmp_path, monkeypatch):
    """Run a replay task through the provider against a stand-in spark-submit; returns
    ``submit(task, context, exit_code) -> the job's arguments`` (after the application)."""
    import json
    import os
    import sys

    from tidemark.airflow import tasks as airflow_tasks

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    binary = bin_dir / "spark-submit"
    binary.write_text(FAKE_SPARK_SUBMIT.format(python=sys.executable))
    binary.chmod(0o755)
    argv_file = tmp_path / "argv.json"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SPARK_SUBMIT_ARGV", str(argv_file))
    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[2]"})
    )
    monkeypatch.setenv("AIRFLOW_CONN_TIDEMARK_LEDGER", "postgresql://tm:pw@127.0.0.1:1/ledger")
    monkeypatch.setenv("AIRFLOW_CONN_WAREHOUSE", "postgresql://tm:pw@127.0.0.1:1/warehouse")
    # No ledger here to say why the job failed: the failure is the provider's own.
    monkeypatch.setattr(airflow_tasks, "failure", lambda *a, **k: None)

    def submit(task, context, exit_code=0):
        monkeypatch.setenv("FAKE_SPARK_SUBMIT_EXIT", str(exit_code))
        argv_file.unlink(missing_ok=True)
        # A copy: the provider keeps the hook of an operator's first execute (each try of a
        # real task is a fresh process).
        task = copy.deepcopy(task)
        try:
            task.render_template_fields(context)  # as Airflow's task runner does first
            task.execute(context)
        finally:
            if argv_file.exists():
                argv = json.loads(argv_file.read_text())
                submit.argv = argv[argv.index(task.application) + 1 :]
        return submit.argv

    return submit


def _pipeline_named(folder, name):
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.yaml").write_text(
        f"name: {name}\n"
        "source: {type: postgres_log, conn_id: warehouse, table: src.log}\n"
        "decode: {schema: {id: int}}\n"
        "transform: {select: {id: id}, required: [id]}\n"
        "sinks: [{name: main, conn_id: warehouse, table: public.orders, key: [id]}]\n"
        "schedule: '@hourly'\nairflow: {backfill_by_interval: true}\n"
    )


def _as_the_job_reads_it(argv):
    """The command words and parameters the job's CLI (click) makes of ``argv``."""
    import click

    from tidemark.cli.main import cli

    ctx = cli.make_context("tidemark", list(argv))
    words, command, args = [], cli, [*ctx.protected_args, *ctx.args]
    while isinstance(command, click.Group):
        name, command, args = command.resolve_command(ctx, args)
        words.append(name)
        ctx = command.make_context(name, args, parent=ctx)
        args = [*ctx.protected_args, *ctx.args]
    return words, ctx.params


@pytest.mark.parametrize("name", ["run", "backfill", "dlq", "redrive", "pipelines_dir"])
def test_the_job_gets_its_command_whatever_the_pipeline_is_called(
    airflow_home, tmp_path, fake_spark_submit, name
):
    """The job's arguments as spark-submit receives them, through the provider's operator:
    a pipeline named like a command or an option is still the pipeline, and what a task adds
    at run time (the backfill form's arguments, the dry run, an Airflow backfill's data
    interval) lands after the pipeline's name, whatever it is."""
    from datetime import UTC, datetime

    from tidemark.airflow.dags import pipeline_dags

    folder = tmp_path / "pipelines"
    _pipeline_named(folder, name)
    dags = pipeline_dags(folder)
    head = ["--pipelines-dir", str(folder)]
    tail = ["--airflow-run", AIRFLOW_RUN_JSON]

    def submitted(dag, context, words, **params):
        argv = fake_spark_submit(dags[dag].get_task("replay"), context)
        got_words, got = _as_the_job_reads_it(argv)
        assert (got_words, {k: got[k] for k in params}) == (words, params), argv
        return argv

    interval = (datetime(2026, 1, 1, 0, tzinfo=UTC), datetime(2026, 1, 1, 1, tzinfo=UTC))
    dag = f"tidemark_{name}"
    assert submitted(dag, _context(run_type="scheduled"), ["run"], pipeline=name) == [
        *head, "run", name, *tail,
    ]  # fmt: skip
    assert submitted(
        dag, _context(run_type="backfill", interval=interval), ["backfill"], pipeline=name
    ) == [
        *head, "backfill", name,
        "--since", "2026-01-01T00:00:00+0000", "--until", "2026-01-01T01:00:00+0000", *tail,
    ]  # fmt: skip

    form = {"check": {"args": ["--sink", "main", "--partition", "all", "--from", "0"]}}
    context = _context(form, params={"dry_run": True})
    assert submitted(
        f"{dag}_backfill", context, ["backfill"], pipeline=name, dry_run=True, sinks=("main",)
    ) == [
        *head, "backfill", name, "--sink", "main", "--partition", "all", "--from", "0",
        "--dry-run", *tail,
    ]  # fmt: skip

    context = _context({"select": 12}, params={"dry_run": True})
    assert submitted(
        f"{dag}_redrive", context, ["dlq", "redrive"], pipeline=name, dry_run=True, request=12
    ) == [
        *head, "dlq", "redrive", name, "--request", "12", "--by", "erin", "--dry-run", *tail,
    ]  # fmt: skip


@pytest.mark.parametrize("code,retried", [(2, False), (5, False), (1, True), (70, True)])
def test_the_jobs_exit_code_comes_from_the_providers_failure(
    airflow_home, tmp_path, fake_spark_submit, code, retried
):
    """Exit 2 (bad input) and 5 (halted) fail the task without retries; any other exit
    retries. The code comes from what the provider's operator raises, not its internals."""
    from airflow.sdk.exceptions import AirflowFailException

    from tidemark.airflow.dags import pipeline_dags

    folder = tmp_path / "pipelines"
    _pipeline_named(folder, "orders")
    replay = pipeline_dags(folder)["tidemark_orders"].get_task("replay")
    with pytest.raises(Exception) as failed:
        fake_spark_submit(replay, _context(), exit_code=code)
    assert isinstance(failed.value, AirflowFailException) is not retried, failed.value
    if not retried:
        assert f"(exit {code}: not retried)" in str(failed.value)


PIPELINE_WITH_SPARK = (
    "name: orders\n"
    "source: {type: postgres_log, conn_id: warehouse, table: src.log}\n"
    "decode: {schema: {id: int}}\n"
    "transform: {select: {id: id}, required: [id]}\n"
    "sinks: [{name: main, conn_id: warehouse, table: public.orders, key: [id]}]\n"
    "spark:\n"
    "  spark.executor.memory: 6g\n"
    "  spark.archives: hdfs:///envs/tidemark.tar.gz#environment\n"
    "  spark.pyspark.python: ./environment/bin/python\n"
)


def _submitted_command(airflow_home, tmp_path, monkeypatch, extra: dict) -> str:
    """The spark-submit command the provider's hook builds for the replay task, given the
    Spark connection's extra and a pipeline with a ``spark:`` block."""
    import json

    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

    from tidemark.airflow.dags import pipeline_dags

    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_DEFAULT",
        json.dumps({"conn_type": "spark", "host": "spark://cluster", "port": 7077, "extra": extra}),
    )
    monkeypatch.setenv("AIRFLOW_CONN_TIDEMARK_LEDGER", "postgresql://tm:x@127.0.0.1:1/ledger")
    monkeypatch.setenv("AIRFLOW_CONN_WAREHOUSE", "postgresql://tm:x@127.0.0.1:1/warehouse")
    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "orders.yaml").write_text(PIPELINE_WITH_SPARK)
    replay = pipeline_dags(folder)["tidemark_orders"].get_task("replay")
    seen: dict = {}

    def submit(self, context):
        seen["cmd"] = self._get_hook()._build_spark_submit_command(self.application)

    monkeypatch.setattr(SparkSubmitOperator, "execute", submit)
    replay.execute(_context())
    return " ".join(seen["cmd"])


def test_spark_settings_from_the_connection_and_the_pipeline_reach_spark_submit(
    airflow_home, tmp_path, monkeypatch
):
    """The connection's extra ``conf`` is the cluster's default, the pipeline's ``spark:``
    block wins over it; Tidemark's driver options stay."""
    conf = {
        "spark.executor.memory": "4g",
        "spark.executor.cores": 1,
        "spark.pyspark.python": "/opt/tidemark/bin/python",
        "spark.driver.host": "10.0.0.5",
    }
    cmd = _submitted_command(airflow_home, tmp_path, monkeypatch, {"conf": conf})
    assert cmd.startswith("spark-submit --master spark://cluster:7077 ")
    for setting in (
        "spark.executor.memory=6g",
        "spark.executor.cores=1",
        "spark.archives=hdfs:///envs/tidemark.tar.gz#environment",
        "spark.pyspark.python=./environment/bin/python",
        "spark.driver.host=10.0.0.5",
        "spark.executor.extraJavaOptions=-Dlog4j2",
        # The driver runs the task's Python, not the executors' (./environment/bin/python).
        f"spark.pyspark.driver.python={sys.executable}",
    ):
        assert f"--conf {setting}" in cmd, cmd
    assert "spark.executor.memory=4g" not in cmd


def test_a_secret_in_the_spark_connections_conf_fails_the_task_in_one_line(
    airflow_home, tmp_path, monkeypatch
):
    from airflow.sdk.exceptions import AirflowFailException

    extra = {"conf": {"spark.hadoop.fs.s3a.secret.key": "Hunter2Secret"}}
    with pytest.raises(AirflowFailException) as e:
        _submitted_command(airflow_home, tmp_path, monkeypatch, extra)
    message = str(e.value)
    assert message.startswith(
        "Spark connection 'spark_default': extra conf: spark.hadoop.fs.s3a.secret.key: "
    )
    assert "Hunter2Secret" not in message and "\n" not in message


def test_a_relative_archive_in_the_spark_connections_conf_fails_the_task_in_one_line(
    airflow_home, tmp_path, monkeypatch
):
    """Spark would resolve it against the Airflow worker's folder and fail in its start-up
    with a Java stack trace, retried (docs/production.md, the packed environment)."""
    from airflow.sdk.exceptions import AirflowFailException

    extra = {"conf": {"spark.archives": "tidemark-env.tar.gz#env"}}
    with pytest.raises(AirflowFailException) as e:
        _submitted_command(airflow_home, tmp_path, monkeypatch, extra)
    assert str(e.value) == (
        "Spark connection 'spark_default': extra conf: spark.archives: tidemark-env.tar.gz "
        "is a relative path, which Spark resolves against the driver's working folder "
        "(under Airflow, the worker's): give an absolute path or a URL (hdfs://, s3a://, "
        "local:) (docs/production.md)"
    )


def test_a_kubernetes_master_without_its_provider_fails_the_task_saying_what_to_install(
    airflow_home, tmp_path, monkeypatch
):
    import json

    from airflow.sdk.exceptions import AirflowFailException

    from tidemark.airflow import spark_conf

    if spark_conf._kubernetes_provider():
        pytest.skip("the cncf-kubernetes provider is installed")

    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_DEFAULT",
        json.dumps({"conn_type": "spark", "host": "k8s://https://api.example", "port": 6443}),
    )
    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "orders.yaml").write_text(PIPELINE_WITH_SPARK)
    with pytest.raises(
        AirflowFailException, match="install apache-airflow-providers-cncf-kubernetes"
    ):
        spark_conf.job_conf({}, "spark_default", str(folder / "orders.yaml"))
