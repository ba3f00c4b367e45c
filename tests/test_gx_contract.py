"""The parts of Great Expectations that tidemark/quality/aggregates.py reaches past GX's public
API for: the Spark engine's private methods it replaces on the engine instance, the fields
and names it reads, and how GX calls what it replaced. pyproject.toml pins GX to the minor
release these were read from; a newer GX that moves any of them fails here, by name, before
the one-job first passes silently fall back to GX's own jobs or break a run.

No Spark session and no data: signatures, fields and GX's own source.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re

import pytest

os.environ["GX_ANALYTICS_ENABLED"] = "false"

import great_expectations  # noqa: E402,F401  (registers the core expectations and metrics)
from great_expectations.execution_engine import SparkDFExecutionEngine  # noqa: E402
from great_expectations.execution_engine.execution_engine import (  # noqa: E402
    ExecutionEngine,
    MetricComputationConfiguration,
)
from great_expectations.expectations.expectation import (  # noqa: E402
    ColumnMapExpectation,
    Expectation,
)
from great_expectations.expectations.registry import get_metric_provider  # noqa: E402
from great_expectations.util import convert_to_json_serializable  # noqa: E402
from great_expectations.validator.metric_configuration import (  # noqa: E402
    MetricConfiguration,
    MetricConfigurationID,
)
from great_expectations.validator.validator import ValidationDependencies  # noqa: E402

from tidemark.quality import aggregates  # noqa: E402


def bare(fn) -> str:
    """``fn``'s parameters as aggregates.py calls them: names, kinds and defaults, without
    annotations (GX rewords those freely)."""
    params = inspect.signature(fn).parameters.values()
    return str(inspect.Signature([p.replace(annotation=p.empty) for p in params]))


# (owner, name) -> the parameters aggregates.py passes or replaces them for.
SIGNATURES = {
    # _hooked wraps it and must return its (direct, bundled) pair; GX calls it by keyword.
    (SparkDFExecutionEngine, "_build_direct_and_bundled_metric_computation_configurations"): (
        "(self, metrics_to_resolve, metrics=None, runtime_configuration=None)"
    ),
    # _hooked replaces it with `lambda metric_fn_bundle: ...`, which GX calls by that keyword.
    (SparkDFExecutionEngine, "resolve_metric_bundle"): "(self, metric_fn_bundle)",
    # plan() asks each expectation for its metrics as GX's validator does.
    (Expectation, "get_validation_dependencies"): (
        "(self, execution_engine=None, runtime_configuration=None)"
    ),
    # judge() passes the job's values through it by keyword.
    (None, convert_to_json_serializable): "(data)",
}


@pytest.mark.parametrize("owner,name", list(SIGNATURES), ids=lambda x: getattr(x, "__name__", x))
def test_the_private_methods_aggregates_relies_on_keep_their_signatures(owner, name):
    fn = name if owner is None else getattr(owner, name, None)
    assert fn is not None, f"GX {great_expectations.__version__}: {owner.__name__}.{name} is gone"
    assert bare(fn) == SIGNATURES[owner, name], (
        f"GX {great_expectations.__version__} changed {getattr(fn, '__qualname__', name)}: "
        "check tidemark/quality/aggregates.py against it"
    )


def test_gx_calls_the_replaced_methods_through_the_instance_by_keyword():
    # _hooked sets both as attributes of the engine instance: they take effect only while GX
    # looks them up on self. _no_values replaces a metric function: GX must pass keywords.
    calls = inspect.getsource(ExecutionEngine.resolve_metrics) + inspect.getsource(
        ExecutionEngine._process_direct_and_bundled_metric_computation_configurations
    )
    for pattern in (
        r"self\._build_direct_and_bundled_metric_computation_configurations\(\s*metrics_to_resolve=",
        r"self\.resolve_metric_bundle\(\s*metric_fn_bundle=",
        r"\.metric_fn\((?:\s*#[^\n]*)?\s*\*\*metric_computation_configuration\.metric_provider_kwargs",
    ):
        assert re.search(pattern, calls), f"GX {great_expectations.__version__}: no {pattern}"
    assert "__slots__" not in vars(SparkDFExecutionEngine)


def test_the_fields_aggregates_reads_are_there():
    # dataclasses.replace(c, metric_fn=...) and the attributes plan() and _aggregate() read.
    assert dataclasses.is_dataclass(MetricComputationConfiguration)
    assert {f.name for f in dataclasses.fields(MetricComputationConfiguration)} >= {
        "metric_configuration",
        "metric_fn",
        "metric_provider_kwargs",
        "compute_domain_kwargs",
        "accessor_domain_kwargs",
    }
    for attr in ("id", "metric_name", "metric_dependencies", "metric_domain_kwargs"):
        assert isinstance(getattr(MetricConfiguration, attr, None), property), attr
    assert "metric_value_kwargs_id" in MetricConfigurationID._fields
    assert "metric_configurations" in {f.name for f in dataclasses.fields(ValidationDependencies)}
    assert "map_metric" in vars(ColumnMapExpectation)


def test_the_sample_values_function_has_the_name_aggregates_skips():
    # _hooked recognizes a column map check's sample values (a query each) by this name.
    engine = SparkDFExecutionEngine.__new__(SparkDFExecutionEngine)  # its type is all GX reads
    _, fn = get_metric_provider("column_values.nonnull.unexpected_values", engine)
    assert fn.__name__ == aggregates._VALUES


def test_the_signature_check_can_fail():
    def renamed(self, metric_fns):
        pass

    assert bare(renamed) != SIGNATURES[SparkDFExecutionEngine, "resolve_metric_bundle"]
