"""``tidemark_<name>_rebuild``: `tidemark sink rebuild` from Airflow, triggered by hand
(docs/operations.md, "Rebuild a sink" and "Change a key: stage, rebuild, promote").

recover -> check (the form: sink, staged, accept pruned; no retries) -> replay (the Spark job
``sink rebuild NAME SINK [--staged] [--accept-pruned] [--dry-run]``) -> report. Dry run is
ticked by default: trigger once to preview what the rebuild would write, then again with it
unticked. With Staged, the rebuild writes with ``<name>.next.yaml`` and, once every sink it
changes is rebuilt, the job makes it the live file (the report says so).
"""

from __future__ import annotations

from pathlib import Path

from airflow.sdk import DAG, Param

from tidemark import config
from tidemark.core.errors import BadInput


def rebuild_dag(p: config.Pipeline, path: Path) -> DAG:
    from tidemark.airflow.dags import _checked_replay, _doc, _triggered
    from tidemark.airflow.job_command import JobAction

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
        _checked_replay(p, path, "check", check_rebuild, JobAction.REBUILD, args_from="check")
    return dag


def check_rebuild(pipeline_file: str, params: dict) -> dict:
    """The rebuild form, checked (the staged file too: a broken one fails here, not in
    Spark), as the arguments replay adds after the pipeline's name."""
    path = Path(pipeline_file)
    p = config.load(path, deep=False)
    sink = params.get("sink")
    names = [s.name for s in p.sinks]
    if sink not in names:
        raise BadInput(f"rebuild of {p.name}: sink must be one of {', '.join(names)}; got {sink!r}")
    args = [str(sink)]
    if params.get("staged"):
        from tidemark.protocol.staging import changed_sinks

        staged = config.load_staged(path.parent, p.name)
        changed = changed_sinks(p, staged)
        print(
            f"rebuild of {p.name} sink {sink} with the staged version "
            f"{config.staged_file(path.parent, p.name)} (it changes {', '.join(changed) or 'no sink'})"
        )
        args.append("--staged")
    if params.get("accept_pruned"):
        args.append("--accept-pruned")
    return {"pipeline": p.name, "sinks": [sink], "args": args}
