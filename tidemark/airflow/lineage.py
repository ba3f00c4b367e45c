"""OpenLineage for the replay task, through the OpenLineage provider's operator hooks.

``ReplayOperator.get_openlineage_facets_on_complete`` / ``_on_failure`` return what the run the
task started did, read from the ledger: the source log table as input, each sink table as an
output with its rows written (``outputStatistics``), and the data-quality outcome
(``dataQualityAssertions``: every expectation and whether it passed) on the input. The
provider's listener sends them with the task's own START/COMPLETE/FAIL events, which carry the
DAG run as their parent run facet, through whatever transport Airflow's ``[openlineage]``
section configures. Dataset names follow the postgres provider's: namespace
``postgres://host:port``, name ``database.schema.table`` (tidemark/airflow/assets.py).
Imported only by the provider's listener: never at DAG parse time.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from airflow.providers.openlineage.extractors import OperatorLineage
from openlineage.client.event_v2 import InputDataset, OutputDataset
from openlineage.client.generated.base import InputDatasetFacet
from openlineage.client.generated.data_quality_assertions_dataset import (
    Assertion,
    DataQualityAssertionsDatasetFacet,
)
from openlineage.client.generated.output_statistics_output_dataset import (
    OutputStatisticsOutputDatasetFacet,
)

from tidemark import config
from tidemark.airflow import assets
from tidemark.airflow.tasks import ledger_dsn
from tidemark.core.db import connect
from tidemark.ledger import runs
from tidemark.ledger.state import RunState
from tidemark.ledger.status import DqResult, dq_results


def _dataset(uri: str) -> tuple[str, str]:
    """(namespace, name) of an asset URI, as OpenLineage names it."""
    u = urlsplit(uri)
    if u.scheme == "postgres":
        return f"postgres://{u.netloc}", ".".join(u.path.strip("/").split("/"))
    if u.scheme in ("", "file"):
        return "file", u.path
    return f"{u.scheme}://{u.netloc}", u.path.lstrip("/")


def source_dataset(p: config.Pipeline) -> tuple[str, str]:
    if isinstance(p.source, config.PostgresLogSource):
        return _dataset(assets.table_uri(p.source_dsn(), p.source.table))
    return _dataset(p.source.uri)


def _assertions(rows: list[DqResult]) -> list[Assertion]:
    out = []
    for r in rows:
        for res in r.results or []:
            column = (res.get("kwargs") or {}).get("column")
            out.append(
                Assertion(
                    assertion=str(res.get("expectation")),
                    success=bool(res.get("success")),
                    column=column if isinstance(column, str) else None,
                )
            )
    return out


def replay_lineage(pipeline_file: str, dag_id: str, run_id: str) -> OperatorLineage:
    """What the ledger run started by this DAG run read and wrote (empty if it has none)."""
    p = config.load(Path(pipeline_file), deep=False)
    with connect(ledger_dsn(), autocommit=True, what="ledger") as c:
        run, sinks = runs.of_dag_run(c, p.name, dag_id, run_id)
        dq = dq_results(c, run.run_id) if run else []
    if run is None:
        return OperatorLineage()
    namespace, name = source_dataset(p)
    input_facets: dict[str, InputDatasetFacet] = (
        {"dataQualityAssertions": DataQualityAssertionsDatasetFacet(assertions=_assertions(dq))}
        if dq
        else {}
    )
    declared = {s.name: s for s in p.sinks}
    outputs = []
    for s in sinks:
        if s.sink not in declared:
            continue
        o_ns, o_name = _dataset(assets.sink_uri(p, declared[s.sink]))
        written = s.counts.rows if s.state is RunState.COMMITTED else 0
        outputs.append(
            OutputDataset(
                namespace=o_ns,
                name=o_name,
                outputFacets={
                    "outputStatistics": OutputStatisticsOutputDatasetFacet(rowCount=written)
                },
            )
        )
    return OperatorLineage(
        inputs=[InputDataset(namespace=namespace, name=name, inputFacets=input_facets)],
        outputs=outputs,
    )
