"""The row checks' and the gate's first passes from one Spark job (tidemark/quality/aggregates.py)
give what Great Expectations gives computing each suite itself: the same failing rows with the
same reasons, the same verdicts, the same observed values. Real local Spark and real GX."""

from __future__ import annotations

import os

import pytest

os.environ["GX_ANALYTICS_ENABLED"] = "false"

from tidemark.config import Quality  # noqa: E402
from tidemark.core.errors import TidemarkError  # noqa: E402
from tidemark.driver import gate  # noqa: E402
from tidemark.quality import checks as quality  # noqa: E402
from tidemark.quality import expectations  # noqa: E402

ORIGINS = ["EWR", "JFK", "LGA"]
N = 200  # rows per partition


@pytest.fixture(scope="module")
def batch(spark):
    """Two partitions with NULLs, unknown origins and one huge distance."""
    rows = []
    for p in (0, 1):
        for o in range(N):
            origin = (
                None if o % 50 == 3 else ("XXX" if (p, o) in {(0, 7), (1, 42)} else ORIGINS[o % 3])
            )
            distance = None if o % 40 == 5 else (9999 if (p, o) == (1, 99) else 100 + o)
            speed = None if o % 25 == 1 else 300.0 + o / 4
            rows.append((p, o, origin, distance, speed))
    df = spark.createDataFrame(
        rows, "_tm_partition int, _tm_offset bigint, origin string, distance int, speed double"
    ).cache()
    assert df.count() == 2 * N
    yield df
    df.unpersist()


ROWS = [
    {"expect_column_values_to_be_in_set": {"column": "origin", "value_set": ORIGINS}},
    {
        "expect_column_values_to_be_between": {
            "column": "distance",
            "min_value": 1,
            "max_value": 5000,
        }
    },
    {"expect_column_values_to_not_be_in_set": {"column": "origin", "value_set": ["BOS"]}},
]
GATE = [
    {"expect_table_row_count_to_be_between": {"min_value": 1, "max_value": 10_000}},
    {"expect_column_values_to_not_be_null": {"column": "origin", "mostly": 0.9}},
    {
        "expect_column_mean_to_be_between": {
            "column": "distance",
            "min_value": 100,
            "max_value": 400,
        }
    },
    {"expect_column_min_to_be_between": {"column": "speed", "min_value": 300}},
    {"expect_column_max_to_be_between": {"column": "speed", "max_value": 400}},
    {"expect_column_sum_to_be_between": {"column": "distance", "min_value": 0}},
    {"expect_column_values_to_be_between": {"column": "speed", "max_value": 340, "mostly": 0.5}},
]
FAILING_GATE = [
    {"expect_column_mean_to_be_between": {"column": "distance", "max_value": 50}},
    {"expect_column_values_to_not_be_null": {"column": "speed"}},
    {"expect_table_row_count_to_be_between": {"max_value": 10}},
]


def _jobs(spark, run) -> tuple[object, int]:
    sc = spark.sparkContext
    group = f"tidemark-test-{os.urandom(4).hex()}"
    sc.setJobGroup(group, "count the jobs")
    try:
        with gate._many_small_queries(spark):  # as gate.evaluate runs them
            out = run()
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    return out, len(sc.statusTracker().getJobIdsForGroup(group))


def _results(outcome: quality.GateOutcome) -> list:
    return [
        (r["expectation_config"]["type"], r["success"], r["result"])
        for r in outcome.raw.get("results", [])
    ]


def _both(df, rows, batch, monkeypatch):
    """``gate._check`` from one job, then with GX computing every suite itself."""
    q = Quality(rows=rows, batch=batch)
    one = gate._check(df, q, "aggregates", None)
    with monkeypatch.context() as m:
        m.setattr(quality, "first_passes", lambda *a, **k: None)
        gx = gate._check(df, q, "aggregates", None)
    return one, gx


@pytest.mark.parametrize(
    "rows, checks",
    [(ROWS, GATE), (ROWS, FAILING_GATE), ([], GATE), (ROWS, [])],
    ids=["passes", "fails", "gate", "rows"],
)
def test_one_job_gives_what_gx_gives(batch, rows, checks, monkeypatch):
    (failures, outcome), (gx_failures, gx_outcome) = _both(batch, rows, checks, monkeypatch)
    assert failures == gx_failures
    if rows:
        assert set((p, o) for p, offs in failures.items() for o in offs) == {
            (0, 7),
            (1, 42),
            (1, 99),
        }
        assert failures[1][99] == (
            "expect_column_values_to_be_between(column=distance): unexpected value 9999"
        )
        assert (
            failures[0][7] == "expect_column_values_to_be_in_set(column=origin): 'XXX' not in set"
        )
    assert outcome.success == gx_outcome.success == (checks is not FAILING_GATE)
    assert outcome.results == gx_outcome.results
    assert _results(outcome) == _results(gx_outcome)


def test_the_first_passes_take_one_spark_job(spark, batch):
    parse = expectations.parse_expectations
    rows, checks = parse(ROWS, "w", "quality.rows"), parse(GATE, "w", "quality.batch")
    first, jobs = _jobs(spark, lambda: quality.first_passes(batch, rows, checks, "one-job"))
    assert first is not None and jobs == 1
    # ...and listing the 3 failing rows of 2 failing expectations takes one more.
    failures, jobs = _jobs(spark, lambda: quality.row_failures(batch, rows, first=first))
    assert len(failures) == 3 and jobs == 1
    outcome, jobs = _jobs(
        spark, lambda: quality.gate(batch, checks, None, "one-job", first=first.gate)
    )
    assert outcome.success and jobs == 0


def test_rows_a_passing_row_check_finds_unexpected_stay_in_the_gate(batch, monkeypatch):
    # `mostly`: the 2 unknown origins pass the row check, so they are not quarantined, and the
    # gate counts them; it cannot reuse the counts of the job, which left them out.
    tolerant = [
        {
            "expect_column_values_to_be_in_set": {
                "column": "origin",
                "value_set": ORIGINS,
                "mostly": 0.9,
            }
        }
    ]
    count = [{"expect_table_row_count_to_be_between": {"min_value": 2 * N, "max_value": 2 * N}}]
    (failures, outcome), (gx_failures, gx_outcome) = _both(batch, tolerant, count, monkeypatch)
    assert failures == gx_failures == {}
    assert outcome.success and gx_outcome.success
    assert outcome.results == gx_outcome.results


def test_a_metric_not_known_as_an_aggregate_is_left_to_gx(batch, monkeypatch):
    parse = expectations.parse_expectations
    median = [{"expect_column_median_to_be_between": {"column": "distance", "min_value": 1}}]
    assert quality.first_passes(batch, [], parse(median, "w", "quality.batch"), "x") is None
    unique = [{"expect_column_values_to_be_unique": {"column": "origin"}}]
    assert quality.first_passes(batch, parse(unique, "w", "quality.rows"), [], "x") is None
    (failures, outcome), (gx_failures, gx_outcome) = _both(batch, unique, median, monkeypatch)
    # every origin but the 8 NULLs repeats (even the two XXX)
    assert failures == gx_failures and sum(len(f) for f in failures.values()) == 2 * N - 8
    assert outcome.results == gx_outcome.results and outcome.success


def test_more_failing_rows_than_allowed_stops_before_listing_them_all(batch):
    parse = expectations.parse_expectations
    # 38 and 76 rows fail, each within 100; together 114 do, and the listing stops at 101.
    rows = parse(
        [
            {"expect_column_values_to_be_between": {"column": "distance", "min_value": 120}},
            {"expect_column_values_to_be_between": {"column": "speed", "max_value": 340}},
        ],
        "w",
        "quality.rows",
    )
    first = quality.first_passes(batch, rows, [], "x")
    assert [r.result["unexpected_count"] for r in first.rows.results] == [38, 76]
    with pytest.raises(TidemarkError) as err:
        quality.row_failures(batch, rows, max_failures=100, first=first)
    assert str(err.value) == (
        "101+ rows fail row-level expectations, more than the 100 allowed for quarantine"
    )
    with pytest.raises(TidemarkError, match="114 rows fail row-level expectations"):
        quality.row_failures(batch, rows, max_failures=100)  # GX's own lists: all of them


def test_a_sigterm_during_the_one_job_stops_the_run(batch, monkeypatch):
    from pyspark.sql.classic.dataframe import DataFrame

    from tidemark.core.errors import Terminated

    checks = expectations.parse_expectations(GATE, "w", "quality.batch")
    for exc, stops in (
        (Terminated("SIGTERM before the decision"), True),
        (RuntimeError("executor lost"), False),
    ):

        def fail(self, exc=exc):
            raise exc

        with monkeypatch.context() as m:
            m.setattr(DataFrame, "first", fail)
            if stops:
                with pytest.raises(Terminated):
                    quality.first_passes(batch, [], checks, "x")
            else:  # GX computes the suite itself, and says what fails
                assert quality.first_passes(batch, [], checks, "x") is None
