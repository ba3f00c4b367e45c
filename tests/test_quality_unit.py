"""Unit tests of tidemark.quality.checks against a real local SparkSession and real Great Expectations."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tidemark.core.errors import ConfigError, TidemarkError

os.environ["GX_ANALYTICS_ENABLED"] = "false"

from tidemark.quality import checks as quality  # noqa: E402
from tidemark.quality import docs as gx_docs  # noqa: E402
from tidemark.quality import expectations  # noqa: E402

ORIGINS = ["EWR", "JFK", "LGA"]
PER_PARTITION = 150
BAD_ORIGIN = {(0, 7): "XXX", (1, 42): "BOS"}
BAD_DISTANCE = {(1, 99): 9999}


@pytest.fixture(scope="module")
def local_spark(spark):
    # The suite's one SparkSession, configured as Tidemark's jobs are (tests/conftest.py).
    return spark


@pytest.fixture(scope="module")
def flights(local_spark):
    rows = []
    for p in (0, 1):
        for o in range(PER_PARTITION):
            origin = BAD_ORIGIN.get((p, o), ORIGINS[o % 3])
            distance = BAD_DISTANCE.get((p, o), 100 + o)
            rows.append((p, o, origin, distance))
    df = local_spark.createDataFrame(
        rows, "_tm_partition int, _tm_offset bigint, origin string, distance int"
    ).cache()
    assert df.count() == 2 * PER_PARTITION
    yield df
    df.unpersist()


def _parse(items):
    return expectations.parse_expectations(items, "pipelines/flights.yml", "quality.rows")


IN_SET = {"expect_column_values_to_be_in_set": {"column": "origin", "value_set": ORIGINS}}
DIST = {
    "expect_column_values_to_be_between": {"column": "distance", "min_value": 0, "max_value": 5000}
}


# --- parsing ---------------------------------------------------------------------------------


def test_parse_builds_gx_expectations():
    import great_expectations.expectations as gxe

    exps = _parse([IN_SET, {"expect_table_row_count_to_be_between": {"min_value": 1}}])
    assert isinstance(exps[0], gxe.ExpectColumnValuesToBeInSet)
    assert exps[0].column == "origin" and list(exps[0].value_set) == ORIGINS
    assert isinstance(exps[1], gxe.ExpectTableRowCountToBeBetween)
    assert [expectations.is_row_level(e) for e in exps] == [True, False]
    assert expectations.parse_expectations([], "f.yml", "quality") == []


def test_is_row_level_classifies_aggregates_and_maps():
    exps = _parse(
        [
            {"expect_column_values_to_be_unique": {"column": "origin"}},
            {"expect_column_values_to_not_be_null": {"column": "origin"}},
            {"expect_column_mean_to_be_between": {"column": "distance", "min_value": 0}},
            {"expect_column_proportion_of_unique_values_to_be_between": {"column": "origin"}},
            {
                "expect_column_pair_values_a_to_be_greater_than_b": {
                    "column_A": "distance",
                    "column_B": "_tm_offset",
                }
            },
        ]
    )
    assert [expectations.is_row_level(e) for e in exps] == [True, True, False, False, True]


def test_parse_unknown_name_suggests_closest():
    with pytest.raises(ConfigError) as ei:
        _parse([IN_SET, {"expect_column_values_to_be_in_sett": {"column": "origin"}}])
    msg = str(ei.value)
    assert msg.startswith("pipelines/flights.yml: quality.rows[1]: ")
    assert "unknown expectation 'expect_column_values_to_be_in_sett'" in msg
    assert "did you mean expect_column_values_to_be_in_set" in msg
    assert ei.value.field == "quality.rows[1]"


def test_parse_bad_argument_names_the_argument():
    with pytest.raises(ConfigError) as ei:
        _parse([{"expect_column_values_to_be_in_set": {"column": "origin", "valueset": ["A"]}}])
    msg = str(ei.value)
    assert ei.value.field == "quality.rows[0]"
    assert "valueset: unknown argument" in msg
    assert "value_set: missing required argument" in msg
    assert "\n" not in msg

    with pytest.raises(ConfigError) as ei:
        _parse([DIST, {"expect_table_row_count_to_be_between": {"min_value": "lots"}}])
    assert ei.value.field == "quality.rows[1]"
    assert "min_value:" in str(ei.value)


@pytest.mark.parametrize(
    "item, needle",
    [
        ("expect_column_values_to_be_unique", "one-key mapping"),
        ({"a": {}, "b": {}}, "one-key mapping"),
        ({"expect_column_values_to_be_unique": ["origin"]}, "arguments must be a mapping"),
    ],
)
def test_parse_not_a_mapping(item, needle):
    with pytest.raises(ConfigError) as ei:
        _parse([IN_SET, DIST, item])
    assert ei.value.field == "quality.rows[2]"
    assert needle in str(ei.value)


# --- row failures ----------------------------------------------------------------------------


def test_row_failures_finds_exactly_the_bad_rows(flights):
    exps = _parse(
        [
            IN_SET,
            {
                "expect_column_values_to_be_between": {
                    "column": "distance",
                    "min_value": 0,
                    "max_value": 1000,
                }
            },
            # aggregate expectations are ignored by row_failures
            {"expect_table_row_count_to_be_between": {"max_value": 1}},
        ]
    )
    got = quality.row_failures(flights, exps)
    assert set(got) == set(BAD_ORIGIN) | set(BAD_DISTANCE)
    assert got[(0, 7)] == "expect_column_values_to_be_in_set(column=origin): 'XXX' not in set"
    assert got[(1, 42)] == "expect_column_values_to_be_in_set(column=origin): 'BOS' not in set"
    assert got[(1, 99)] == (
        "expect_column_values_to_be_between(column=distance): unexpected value 9999"
    )
    assert all(isinstance(p, int) and isinstance(o, int) for p, o in got)


def test_row_failures_keeps_first_reason_and_clean_data(flights):
    exps = _parse(
        [
            {"expect_column_values_to_not_be_in_set": {"column": "origin", "value_set": ["XXX"]}},
            IN_SET,
        ]
    )
    got = quality.row_failures(flights, exps)
    assert set(got) == set(BAD_ORIGIN)
    assert got[(0, 7)].startswith("expect_column_values_to_not_be_in_set(column=origin)")
    assert got[(1, 42)].startswith("expect_column_values_to_be_in_set(column=origin)")
    assert (1, 99) in quality.row_failures(flights, _parse([DIST]))
    wide = {"expect_column_values_to_be_between": {"column": "distance", "max_value": 10_000}}
    assert quality.row_failures(flights, _parse([wide])) == {}


def test_row_failures_over_limit_raises(flights):
    exps = _parse([{"expect_column_values_to_be_in_set": {"column": "origin", "value_set": []}}])
    with pytest.raises(TidemarkError, match="more than the 10 allowed"):
        quality.row_failures(flights, exps, max_failures=10)


CANNOT_RUN = [
    (
        {"expect_column_values_to_match_regex": {"column": "origin", "regex": "("}},
        "expect_column_values_to_match_regex(column=origin): GX could not evaluate it: "
        "PatternSyntaxException: Unclosed group near index 1",
    ),
    (
        {"expect_column_values_to_be_in_set": {"column": "nope", "value_set": ORIGINS}},
        "expect_column_values_to_be_in_set(column=nope): GX could not evaluate it: The column "
        '"nope" in BatchData does not exist.',
    ),
    (
        {"expect_column_values_to_be_between": {"column": "origin", "min_value": 1}},
        "expect_column_values_to_be_between(column=origin): GX could not evaluate it: "
        "ColumnValuesBetween metrics cannot be computed on column of type StringType().",
    ),
]


@pytest.mark.parametrize("item, message", CANNOT_RUN)
def test_an_expectation_gx_cannot_evaluate_is_an_error_not_a_verdict(flights, item, message):
    # GX reports a failed metric (a bad regex, a missing column, a type it cannot compare)
    # under the metric's id: a row check that could not run must not pass every row, and a
    # gate must say why rather than fail with "observed null".
    exps = _parse([IN_SET, item])
    with pytest.raises(TidemarkError) as rows:
        quality.row_failures(flights, exps)
    assert str(rows.value) == message
    with pytest.raises(TidemarkError) as batch:
        quality.gate(flights, exps, None, "cannot-run")
    assert str(batch.value) == message
    # As a run checks: the one job of tidemark/quality/aggregates.py fails or is never
    # planned, and GX, computing the suite itself, says why.
    from tidemark.config import Quality
    from tidemark.driver import gate

    with pytest.raises(TidemarkError) as run:
        gate._check(flights, Quality(rows=[IN_SET, item], batch=[DIST]), "cannot-run", None)
    assert str(run.value) == message


# --- gate ------------------------------------------------------------------------------------


def test_gate_success_with_observed_values(flights, tmp_path):
    exps = _parse(
        [
            {"expect_table_row_count_to_be_between": {"min_value": 300, "max_value": 300}},
            {"expect_column_mean_to_be_between": {"column": "distance", "min_value": 100}},
        ]
    )
    out = quality.gate(flights, exps, None, "flights-run-1-warehouse")
    assert out.success and out.failed() == []
    assert out.docs_path is None
    by = {r["expectation"]: r for r in out.results}
    assert by["expect_table_row_count_to_be_between"]["observed_value"] == 300
    assert by["expect_table_row_count_to_be_between"]["kwargs"]["min_value"] == 300
    expected_mean = (sum(100 + o for o in range(PER_PARTITION)) * 2 - (100 + 99) + 9999) / 300
    mean = by["expect_column_mean_to_be_between"]["observed_value"]
    assert mean == pytest.approx(expected_mean)
    assert out.raw["success"] is True and len(out.raw["results"]) == 2


def test_gate_failure_reports_failing_expectations(flights):
    exps = _parse(
        [
            {"expect_table_row_count_to_be_between": {"max_value": 10}},
            {"expect_column_values_to_be_unique": {"column": "origin"}},
            {"expect_column_mean_to_be_between": {"column": "distance", "max_value": 50}},
            {"expect_column_values_to_not_be_null": {"column": "_tm_offset"}},
        ]
    )
    out = quality.gate(flights, exps, None, "flights-run-2-warehouse")
    assert out.success is False
    failed = {r["expectation"]: r for r in out.failed()}
    assert set(failed) == {
        "expect_table_row_count_to_be_between",
        "expect_column_values_to_be_unique",
        "expect_column_mean_to_be_between",
    }
    assert failed["expect_table_row_count_to_be_between"]["observed_value"] == 300
    # every row but the two with a one-off origin ('XXX', 'BOS') repeats a value
    assert failed["expect_column_values_to_be_unique"]["unexpected_count"] == 298
    unique_pct = failed["expect_column_values_to_be_unique"]["unexpected_percent"]
    assert unique_pct == pytest.approx(298 / 3)
    assert failed["expect_column_mean_to_be_between"]["observed_value"] > 50
    ok = [r for r in out.results if r["success"]]
    assert ok and ok[0]["kwargs"]["column"] == "_tm_offset"
    assert ok[0]["unexpected_count"] == 0
    assert out.raw["success"] is False
    # A failed gate is read by people: its result lists GX's sample values, which a passing
    # gate does not spend Spark jobs on.
    unique = next(
        r["result"]
        for r in out.raw["results"]
        if r["expectation_config"]["type"] == "expect_column_values_to_be_unique"
    )
    assert set(unique["partial_unexpected_list"]) <= set(ORIGINS)
    assert len(unique["partial_unexpected_list"]) == 20


def test_a_passing_gate_lists_no_sample_values(flights):
    mostly = {
        "expect_column_values_to_be_in_set": {
            "column": "origin",
            "value_set": ORIGINS,
            "mostly": 0.9,
        }
    }
    out = quality.gate(flights, _parse([mostly]), None, "flights-run-3-warehouse")
    assert out.success is True
    (result,) = [r["result"] for r in out.raw["results"]]
    assert result["unexpected_count"] == 2
    assert result.get("partial_unexpected_list", []) == []


def test_gate_empty_does_not_start_gx(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("GX started")

    monkeypatch.setattr(quality, "validate", boom)
    out = quality.gate(None, [], "/nonexistent/never", "x")
    assert out.success is True and out.results == [] and out.docs_path is None


def test_gate_renders_data_docs(flights, tmp_path: Path):
    docs = tmp_path / "docs"
    exps = _parse(
        [
            {"expect_column_mean_to_be_between": {"column": "distance", "max_value": 50}},
            {"expect_table_row_count_to_be_between": {"min_value": 1}},
        ]
    )
    out = quality.gate(flights, exps, str(docs), "flights-run-12-warehouse")
    assert out.docs_path is not None
    page = Path(out.docs_path)
    assert page.is_file() and page.suffix == ".html"
    assert docs.resolve() in page.resolve().parents
    assert "flights-run-12-warehouse" in str(page)
    html = page.read_text()
    assert "distance" in html and "mean" in html.lower()
    # A run writes only its own page; the index (which lists every run) is rebuilt on demand.
    index = docs / "gx" / "uncommitted" / "data_docs" / "local_site" / "index.html"
    assert not index.exists()
    second = quality.gate(flights, exps, str(docs), "flights-run-13-warehouse")
    path, count = gx_docs.build_docs_index(str(docs))
    assert Path(path) == index.resolve() and count == 2
    listed = index.read_text()
    assert "flights-run-12-warehouse" in listed and "flights-run-13-warehouse" in listed
    assert Path(second.docs_path).is_file()

    out2 = quality.gate(flights, exps[1:], str(docs), "flights-run-13-warehouse")
    assert out2.success and out2.docs_path != out.docs_path
    assert page.is_file(), "an earlier run's page must survive a later build"
    assert "flights-run-13-warehouse" in index.read_text()
    assert "flights-run-12-warehouse" in index.read_text()


def test_columns_read_names_what_the_expectations_read():
    exps = expectations.parse_expectations(
        [
            {"expect_column_values_to_be_in_set": {"column": "origin", "value_set": ORIGINS}},
            {"expect_column_mean_to_be_between": {"column": "distance", "min_value": 1}},
            {
                "expect_column_pair_values_a_to_be_greater_than_b": {
                    "column_A": "arr",
                    "column_B": "dep",
                }
            },
            {"expect_compound_columns_to_be_unique": {"column_list": ["carrier", "flight"]}},
            {"expect_table_row_count_to_be_between": {"min_value": 1}},
        ],
        "w",
        "f",
    )
    assert expectations.columns_read(exps) == {
        "origin",
        "distance",
        "arr",
        "dep",
        "carrier",
        "flight",
    }


@pytest.mark.parametrize(
    "item",
    [
        {"expect_table_columns_to_match_set": {"column_set": ["origin"]}},
        {"expect_table_column_count_to_equal": {"value": 4}},
        {"expect_column_to_exist": {"column": "origin"}},
        {
            "expect_column_values_to_not_be_null": {
                "column": "origin",
                "row_condition": 'col("distance") > 0',
                "condition_parser": "spark",
            }
        },
    ],
)
def test_columns_read_is_everything_for_table_checks_and_row_conditions(item):
    exps = expectations.parse_expectations(
        [{"expect_column_values_to_be_in_set": {"column": "origin", "value_set": ORIGINS}}, item],
        "w",
        "f",
    )
    assert expectations.columns_read(exps) is None


def test_the_gate_reads_only_the_columns_its_expectations_need(local_spark, flights):
    from pyspark.sql import functions as F

    from tidemark.config import Quality
    from tidemark.driver import gate

    df = flights.withColumn("_tm_error_class", F.lit(None).cast("string")).withColumn(
        "unused", F.col("distance")
    )
    narrow = Quality(
        rows=[{"expect_column_values_to_be_between": {"column": "distance", "min_value": 0}}]
    )
    good = gate._for_gx(df, [narrow], "w")
    assert good.columns == ["_tm_partition", "_tm_offset", "distance"]
    table = Quality(batch=[{"expect_table_column_count_to_equal": {"value": 4}}])
    good = gate._for_gx(df, [narrow, table], "w")
    assert good.columns == ["_tm_partition", "_tm_offset", "origin", "distance", "unused"]
    missing = Quality(rows=[{"expect_column_values_to_not_be_null": {"column": "nope"}}])
    good = gate._for_gx(df, [missing], "w")
    assert good.columns == ["_tm_partition", "_tm_offset", "origin", "distance", "unused"]


def test_the_batch_gate_reads_the_batch_less_exactly_its_failing_rows(flights, monkeypatch):
    from tidemark.driver import gate

    failures = {0: {7: "origin"}, 1: {42: "origin", 99: "distance"}}
    every = {(r[0], r[1]) for r in flights.select("_tm_partition", "_tm_offset").collect()}
    for limit in (gate.FILTER_MAX, 2):  # named in a filter; past the limit, an anti-join
        monkeypatch.setattr(gate, "FILTER_MAX", limit)
        left = gate._without(flights, failures)
        plan = left._jdf.queryExecution().executedPlan().toString()
        assert ("Broadcast" in plan) == (limit == 2)
        kept = {(r[0], r[1]) for r in left.select("_tm_partition", "_tm_offset").collect()}
        assert kept == every - {(0, 7), (1, 42), (1, 99)}
    assert gate._without(flights, {}) is flights


def test_a_failed_in_set_gate_says_how_many_values_and_which(flights):
    """A column map expectation's result has counts and sample values, not an observed value:
    the gate's stored result keeps them and its line says them (not `observed null`)."""
    from tidemark.driver.gate import _summary
    from tidemark.quality.outcomes import observed

    in_set = {"expect_column_values_to_be_in_set": {"column": "origin", "value_set": ORIGINS}}
    out = quality.gate(flights, _parse([in_set]), None, "flights-run-4-warehouse")
    assert out.success is False
    (failed,) = out.failed()
    assert failed["element_count"] == 300 and failed["unexpected_count"] == 2
    assert sorted(failed["partial_unexpected_list"]) == ["BOS", "XXX"]
    assert observed(failed) in (
        "2 of 300 values (0.667%) not in the set; e.g. 'XXX', 'BOS'",
        "2 of 300 values (0.667%) not in the set; e.g. 'BOS', 'XXX'",
    )
    assert _summary(out) == (
        "data-quality gate failed: expect_column_values_to_be_in_set("
        f"column=origin, value_set={ORIGINS}) {observed(failed)}"
    )


SHOTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "browser"


def test_data_docs_are_styled_with_no_network(flights, tmp_path: Path):
    """Issue 48: GX's pages load Bootstrap, Font Awesome, jQuery and the rest from CDNs, so
    offline they were unstyled. The pages Tidemark renders point at the site's own copies:
    opened from a file with every network request refused, a page loads each of its CSS and
    scripts, Bootstrap styles it and the status icons' font is there."""
    from playwright.sync_api import sync_playwright

    from tidemark.quality import offline

    docs = tmp_path / "docs"
    out = quality.gate(flights, _parse([DIST, IN_SET]), str(docs), "flights-run-7-warehouse")
    index, _ = gx_docs.build_docs_index(str(docs))
    pages = [Path(out.docs_path), Path(index)]
    for p in pages:
        html = p.read_text()
        assert not [u for u in offline.CDN if u in html], p
        assert "static/vendor/css/bootstrap.min.css" in html
        assert offline.GX_ASSETS not in html  # GX's logo, with a tracking id
    styles = docs / "gx" / "uncommitted" / "data_docs" / "local_site" / "static" / "styles"
    assert offline.GX_ASSETS not in (styles / "data_docs_default_styles.css").read_text()
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", headless=True)
        try:
            for p, shot in zip(pages, ("data-docs-page.png", "data-docs-index.png"), strict=True):
                page = browser.new_page(viewport={"width": 1200, "height": 900})
                asked: list[str] = []
                failed: list[str] = []
                page.on("request", lambda r, asked=asked: asked.append(r.url))
                page.on("requestfailed", lambda r, failed=failed: failed.append(r.url))
                page.route(
                    "**/*",
                    lambda route: (
                        route.continue_()
                        if route.request.url.startswith("file:")
                        else route.abort()
                    ),
                )
                page.goto(p.resolve().as_uri(), wait_until="load")
                page.evaluate("document.fonts.ready")
                vendored = [u for u in asked if "/static/vendor/" in u]
                assert len(vendored) >= 10, asked
                assert not [u for u in failed if "/static/vendor/" in u], failed
                assert [u for u in asked if not u.startswith("file:")] == []
                assert page.evaluate("typeof window.jQuery") == "function"
                assert page.evaluate("typeof $.fn.bootstrapTable") == "function"
                font = page.evaluate("getComputedStyle(document.body).fontFamily")
                assert "-apple-system" in font, font  # Bootstrap's, not the browser's serif
                assert page.evaluate("""document.fonts.check('900 16px "Font Awesome 6 Free"')""")
                page.screenshot(path=str(SHOTS / shot), full_page=True)
                page.close()
        finally:
            browser.close()
