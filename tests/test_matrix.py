"""Every combination a run can take, run once (issue 35): mode (delivery, backfill, redrive,
rebuild) x layout (tidemark/driver/modes.py, Layout.kind) x quality path (the checking
strategies of tidemark/driver/checking.py, write by write: a one-pass write judged Redo is
written again, checking first) x the sinks' delivery guarantee (exactly once, at least once;
a mode that needs PREPARE, exactly once only).

``derived_matrix`` reads the combinations from the code: the modes are Mode's subclasses, the
layouts what each mode's ``layout`` returns over the shapes of read it can be handed, the
quality paths what ``checking.choose`` returns for each mode and guarantee (asking the run
itself whether it may check while writing) and what those strategies' judgements write next,
the guarantees ``Pipeline.delivery``'s values. ``MATRIX`` must equal it: a layout, strategy,
mode or guarantee added without a run here fails ``test_the_matrix_is_every_combination``.

Each combination's test sets up a few records, runs the combination once and checks the
invariants, every sink's rows and dead letters against what the pipeline should have made of
the source, and that the combination was the one taken. RunReport does not say which layout
or strategies a run took; the test watches ``Mode.layout`` and each strategy's ``check`` (one
call per write), and the ledger's gids say how many tasks wrote and which write stood."""

from __future__ import annotations

import functools
import inspect
import json
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from unittest import mock

import pytest

from tests.invariants import assert_at_least_once, assert_exactly_once
from tidemark import config
from tidemark.config import Pipeline
from tidemark.core.claims import Claim, SinkClaim
from tidemark.core.ranges import Range
from tidemark.driver import checking, gate
from tidemark.driver.checking import Job, QualityPath, Redo, Strategy
from tidemark.driver.modes import Backfill, Delivery, LayoutKind, Mode, Rebuild
from tidemark.driver.redrive import RedriveMode
from tidemark.driver.run import RunReport
from tidemark.driver.writing import may_check_while_writing
from tidemark.protocol import gids, sinks

Path = tuple[str, ...]  # the strategy of each write, in order
Made = tuple[dict[int, tuple], dict[tuple[int, int], str]]  # rows by id, live letters' classes

NONE: Path = ("NoChecks",)
FIRST: Path = ("CheckFirst",)
WHILE_WRITING: Path = ("CheckWhileWriting",)
REDO: Path = ("CheckWhileWriting", "CheckFirst")  # the one-pass write undone, written again
GUARANTEES = ("exactly_once", "at_least_once")


@dataclass(frozen=True)
class Combo:
    mode: str  # Mode.name
    layout: str  # Layout.kind
    delivery: str  # Pipeline.delivery
    quality: Path

    def __str__(self) -> str:
        return f"{self.mode}-{self.layout}-{self.delivery}-{'+'.join(self.quality)}"


MATRIX = [
    *(
        Combo("run", layout, "exactly_once", path)
        for layout in ("ranges", "together", "spread")
        for path in (NONE, FIRST, WHILE_WRITING, REDO)
    ),
    *(
        Combo("run", layout, "at_least_once", path)
        for layout in ("ranges", "together", "spread")
        for path in (NONE, FIRST)
    ),
    *(
        Combo(mode, layout, delivery, path)
        for mode, layout in (
            ("backfill", "ranges"),
            ("backfill", "together"),
            ("redrive", "records"),
        )
        for delivery in GUARANTEES
        for path in (NONE, FIRST)
    ),
    # A rebuild swaps its table in the two-phase commit: exactly once only.
    *(
        Combo("rebuild", layout, "exactly_once", path)
        for layout in ("ranges", "together")
        for path in (NONE, FIRST)
    ),
]

# -- the combinations the code can take -------------------------------------------------------
STRICT = {"expect_column_values_to_be_between": {"column": "amount", "max_value": 100}}
# Tolerates the rows over 100 that it finds: checking while writing cannot tell this from a
# failing row check, so that write is undone and the batch checked first (docs/quality.md).
MOSTLY = {
    "expect_column_values_to_be_between": {"column": "amount", "max_value": 100, "mostly": 0.5}
}


def _concrete(base: type) -> list[type]:
    """``base``'s subclasses in the tidemark package that can be instantiated (a test's own
    subclass is not the code's)."""
    out, todo = [], [base]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if not inspect.isabstract(cls) and cls.__module__.startswith("tidemark."):
            out.append(cls)
    return out


def _pipeline(delivery: str, quality: dict | None = None, version: bool = False) -> Pipeline:
    sink = {"name": "a", "dsn": "postgresql:///unused", "table": "t", "key": ["id"]}
    return Pipeline.model_validate(
        {
            "name": "p",
            "delivery": delivery,
            "source": {"type": "postgres_log", "dsn": "postgresql:///unused", "table": "src.log"},
            "decode": {"schema": {"id": "int", "amount": "double", "version": "int"}},
            "sinks": [{**sink, "version": "version"} if version else sink],
            "quality": quality or {},
        }
    )


def _modes(pipeline: Pipeline) -> list[Mode]:
    """One instance of every mode; a mode without one here fails the matrix's test."""
    made: dict[type, Callable[[], Mode]] = {
        Delivery: Delivery,
        Backfill: lambda: Backfill([Range(0, 0, 4)]),
        RedriveMode: lambda: RedriveMode(pipeline, "postgresql:///unused", None),
        Rebuild: lambda: Rebuild("a"),
    }
    classes = _concrete(Mode)
    assert set(classes) == set(made), f"modes without a case here: {set(classes) - set(made)}"
    return [made[cls]() for cls in classes]


def _reads(mode: Mode, pipeline: Pipeline) -> list[list[Range]]:
    """The reads a claim of ``mode`` can hand its layout. A backfill plans without the
    source: its plan says (its ranges, however many sinks): one partition's, or several
    (--partition all, a time window). A delivery's (and a redrive's) depend on the source
    (the letters): one partition or several."""
    if isinstance(mode, Backfill):
        reads = []
        for ranges in (mode.ranges, [Range(0, 0, 4), Range(1, 0, 4)]):
            plan, _ = Backfill(ranges).planner(pipeline)
            planned = plan({"a": {0: 10, 1: 10}, "b": {0: 10, 1: 10}}, {})
            claim = Claim(0, pipeline.name, mode.name)
            claim.sinks = {s: SinkClaim(s, 1, r) for s, r in planned.items()}
            reads.append(claim.read_ranges())
        return reads
    return [[Range(0, 0, 10)], [Range(0, 0, 10), Range(1, 0, 10)]]


def _layouts(mode: Mode) -> set[str]:
    """The kinds ``mode.layout`` returns over every read it can get and every input its
    choice reads: sinks with or without a version column, a dense source or not, few records
    or many."""
    kinds = set()
    for version in (False, True):
        p = _pipeline("exactly_once", version=version)
        for read in _reads(mode, p):
            for dense in (False, True):
                for split_min in (1, 10**9):
                    layout = mode.layout(
                        read, p.sinks, dense=dense, parallelism=2, split_min=split_min
                    )
                    kinds.add(layout.kind)
    return kinds


def _written(strategy: Strategy) -> set[Path]:
    """The paths a run that chose ``strategy`` can take: its write stands, or its judgement
    says Redo and the batch is written again as the next strategy says."""
    name = type(strategy).__name__
    # A failed Spark job: the one judgement every strategy gives without the job's results.
    judged = strategy.judge(Job([], failure="the job failed"), None)  # type: ignore[arg-type]
    if not isinstance(judged, Redo):
        return {(name,)}
    return {(name,)} | {(name, *rest) for rest in _written(judged.then)}


def _quality_paths(mode: Mode, delivery: str) -> set[Path]:
    """What ``checking.choose`` returns for a run of ``mode`` under ``delivery``, for a
    pipeline with and without checks, as each QualityPath asks; the run itself says whether
    it may check while writing."""
    paths: set[Path] = set()
    for quality in ({}, {"rows": [STRICT]}):
        p = _pipeline(delivery, quality)
        may = functools.partial(may_check_while_writing, p, mode, [])
        # speculate plans the checks on a Spark DataFrame; which strategy choose returns
        # depends only on whether a plan exists, and these checks have one.
        with mock.patch.object(gate, "speculate", lambda *_: object()):
            for path in QualityPath:
                chosen = checking.choose(path, mode.quality(p), None, 0, may)  # type: ignore[arg-type]
                paths |= _written(chosen)
    return paths


def derived_matrix() -> set[Combo]:
    guarantees = typing.get_args(Pipeline.model_fields["delivery"].annotation)
    out = set()
    for mode in _modes(_pipeline("exactly_once")):
        for delivery in guarantees:
            if mode.needs_prepare and delivery != "exactly_once":
                continue
            for layout in _layouts(mode):
                for path in _quality_paths(mode, delivery):
                    out.add(Combo(mode.name, layout, delivery, path))
    return out


def test_the_matrix_is_every_combination():
    assert len(MATRIX) == len(set(MATRIX))
    derived = derived_matrix()
    assert set(MATRIX) == derived, (
        f"not run here: {sorted(map(str, derived - set(MATRIX)))}; "
        f"not taken by the code: {sorted(map(str, set(MATRIX) - derived))}"
    )
    # Every layout and strategy the code declares is taken by some combination.
    assert {c.layout for c in MATRIX} == set(LayoutKind)
    strategies = {cls.__name__ for cls in _concrete(Strategy)}
    assert {s for c in MATRIX for s in c.quality} == strategies


# -- one run of each ----------------------------------------------------------------------------
@dataclass
class Taken:
    """What the runs took: each layout chosen, each write's strategy."""

    layouts: list[str] = field(default_factory=list)
    writes: list[str] = field(default_factory=list)

    def clear(self) -> None:
        self.layouts.clear()
        self.writes.clear()


@pytest.fixture
def taken(monkeypatch) -> Taken:
    """Watches the real ``Mode.layout`` and ``Strategy.check`` (called once per write): the
    run does what it always does, and the test learns which path it took."""
    seen = Taken()
    for cls in [Mode, *_concrete(Mode)]:
        if "layout" in vars(cls):
            monkeypatch.setattr(cls, "layout", _watch_layout(vars(cls)["layout"], seen))
    for cls in _concrete(Strategy):
        if "check" in vars(cls):
            monkeypatch.setattr(cls, "check", _watch_check(vars(cls)["check"], seen))
    return seen


def _watch_layout(layout: Callable, seen: Taken) -> Callable:
    def watched(self, *args, **kw):
        out = layout(self, *args, **kw)
        seen.layouts.append(out.kind)
        return out

    return watched


def _watch_check(check: Callable, seen: Taken) -> Callable:
    def watched(self, df, ctx):
        seen.writes.append(type(self).__name__)
        return check(self, df, ctx)

    return watched


COLUMNS = [
    ("id", "integer"),
    ("name", "text"),
    ("amount", "double precision"),
    ("version", "integer"),
]
SELECT = {"id": "id", "name": "name", "amount": "amount", "version": "version"}
HOW = {  # quality path -> (the pipeline's checks, the QualityPath the run is given)
    NONE: ({}, QualityPath.WHILE_WRITING),
    FIRST: ({"rows": [STRICT]}, QualityPath.FIRST),
    WHILE_WRITING: ({"rows": [STRICT]}, QualityPath.WHILE_WRITING),
    REDO: ({"rows": [MOSTLY]}, QualityPath.WHILE_WRITING),
}
# Each layout's records: (partition, id, amount, version); amounts over 100 fail STRICT.
RECORDS = {
    # Two partitions, keys in one each: a task per range.
    "ranges": [(i % 2, i, 500.0 if i in (3, 6) else 10.0, 1) for i in range(8)],
    # Versions of ids 0..2 in both partitions, ordered by the version column: one task.
    "together": [
        *[(0, i, 500.0 if i == 4 else 10.0, 1) for i in range(6)],
        *[(1, i, 500.0 if i == 6 else 20.0, 2) for i in (0, 1, 2, 6)],
    ],
    # One partition, id 1 twice (the later offset wins): spread by key over two tasks.
    "spread": [(0, i, 500.0 if i in (3, 6) else 10.0, 1) for i in range(8)] + [(0, 1, 30.0, 2)],
}
TASKS = {"ranges": 2, "together": 1, "spread": 2}  # a delivery's write tasks, as set up here
SINKS = ("main", "second")


def _sinks(env) -> dict[str, str]:
    return dict(zip(SINKS, (env.sink_dsn, env.sink2_dsn), strict=True))


@dataclass
class Outcome:
    report: RunReport
    made: Made  # what each sink should hold
    tasks: int  # how many write tasks the run should have had


def _append(env, records) -> None:
    env.append(
        [
            (
                p,
                str(i).encode(),
                json.dumps(
                    {"id": i, "name": f"order-{i}-v{v}", "amount": a, "version": v}
                ).encode(),
                None,
                None,
            )
            for p, i, a, v in records
        ]
    )


def _write_pipeline(env, combo: Combo, quality: dict, version: bool, **kw) -> None:
    targets = [
        {"name": name, "dsn": dsn, "table": "public.orders", "key": ["id"]}
        for name, dsn in _sinks(env).items()
    ]
    env.pipeline(
        delivery=combo.delivery,
        sinks=[{**t, "version": "version"} if version else t for t in targets],
        quality=quality,
        limits={
            "max_records_per_partition": 1000,
            "split_min_records": 1 if combo.layout == "spread" else 10**6,
        },
        **kw,
    )


def _run(env, spark, path: QualityPath, mode: Mode | None = None) -> RunReport:
    return env.run(spark, mode=mode, quality=path)


def _source(env) -> list[tuple[int, int, dict]]:
    return [
        (p, o, json.loads(bytes(v)))
        for p, o, v in env.ledger(
            'SELECT "partition", "offset", payload FROM src.log ORDER BY 1, 2'
        )
    ]


def _expected(
    env, place: Callable[[int, dict], tuple[dict | None, str | None]], version: bool
) -> Made:
    """What each sink should hold: ``place(partition, record)`` says what a record becomes (its
    row's values, or the class of its dead letter); of a key's rows the newest stays (by the
    version column, else by offset)."""
    rows: dict[int, tuple] = {}
    order: dict[int, tuple] = {}
    letters = {}
    for p, o, rec in _source(env):
        row, letter = place(p, rec)
        if letter is not None:
            letters[(p, o)] = letter
        if row is None:
            continue
        rank = (row["version"], p, o) if version else (p, o)
        if row["id"] not in order or rank > order[row["id"]]:
            order[row["id"]] = rank
            rows[row["id"]] = (row["name"], row["amount"], p, o)
    return rows, letters


def _held(env, sink: str, dsn: str) -> Made:
    rows = {
        i: (n, a, p, o)
        for i, n, a, p, o in env.q(
            dsn, "SELECT id, name, amount, _tm_partition, _tm_offset FROM public.orders"
        )
    }
    letters = dict(
        ((p, o), c)
        for p, o, c in env.ledger(
            "SELECT source_partition, source_offset, error_class::text FROM tidemark.dlq "
            "WHERE sink = %s AND status = 'quarantined'",
            (sink,),
        )
    )
    return rows, letters


def _strict(quality: dict) -> bool:
    """Whether the pipeline's checks fail the rows over 100 (MOSTLY tolerates them)."""
    return quality == {"rows": [STRICT]}


def _checked(strict: bool) -> Callable[[int, dict], tuple[dict | None, str | None]]:
    def place(p: int, rec: dict) -> tuple[dict | None, str | None]:
        if strict and rec["amount"] > 100:
            return None, "validation"
        return rec, None

    return place


def _deliver(env, spark, combo: Combo, taken: Taken) -> Outcome:
    quality, path = HOW[combo.quality]
    version = combo.layout == "together"
    _append(env, RECORDS[combo.layout])
    _write_pipeline(env, combo, quality, version)
    report = _run(env, spark, path)
    made = _expected(env, _checked(_strict(quality)), version)
    return Outcome(report, made, TASKS[combo.layout])


def _backfill(env, spark, combo: Combo, taken: Taken) -> Outcome:
    """Delivered without checks, then partition 0 (layout ranges) or every partition (layout
    together) backfilled with names upper-cased and (FIRST) the row check: the backfilled
    rows as the current pipeline makes them, the others as they were."""
    _append(env, RECORDS["ranges"])
    _write_pipeline(env, combo, {}, False)
    assert _run(env, spark, QualityPath.FIRST).ok
    quality, path = HOW[combo.quality]
    _write_pipeline(
        env, combo, quality, False, transform={"select": {**SELECT, "name": "upper(name)"}}
    )
    taken.clear()
    # ranges: partition 0's range; together: every partition's (--partition all)
    parts = [0] if combo.layout == "ranges" else sorted(env.checkpoints(sink="main"))
    ranges = [Range(p, 0, env.checkpoints(sink="main")[p]) for p in parts]
    report = _run(env, spark, path, Backfill(ranges))

    def place(p: int, rec: dict) -> tuple[dict | None, str | None]:
        if p not in parts:
            return rec, None
        return _checked(_strict(quality))(p, {**rec, "name": rec["name"].upper()})

    return Outcome(report, _expected(env, place, False), 1)  # a backfill writes in one task


def _redrive(env, spark, combo: Combo, taken: Taken) -> Outcome:
    """Two records without an id are quarantined (transform: id is required); the pipeline
    then gives them one and (FIRST) checks their rows: the one over 100 fails again."""
    _append(env, RECORDS["ranges"])
    late = [
        {"id": None, "name": f"late-{v}", "amount": a, "version": v}
        for v, a in ((1, 10.0), (2, 500.0))
    ]
    env.append([(0, b"late", json.dumps(r).encode(), None, None) for r in late])
    _write_pipeline(env, combo, {}, False)
    assert _run(env, spark, QualityPath.FIRST).ok
    letters = env.ledger("SELECT id, error_class::text FROM tidemark.dlq ORDER BY id")
    assert [c for _, c in letters] == ["transform"] * 2 * len(SINKS)
    ids = [i for i, _ in letters]
    quality, path = HOW[combo.quality]
    _write_pipeline(
        env,
        combo,
        quality,
        False,
        transform={"select": {**SELECT, "id": "coalesce(id, 100 + version)"}, "required": ["id"]},
    )
    taken.clear()
    report = env.redrive(spark, ids=ids, by="matrix", quality=path)
    strict = _strict(quality)
    assert report.redrive is not None
    assert report.redrive["redriven"] == (1 if strict else 2) * len(SINKS), report.summary()

    def place(p: int, rec: dict) -> tuple[dict | None, str | None]:
        if rec["id"] is None:
            rec = {**rec, "id": 100 + rec["version"]}
            return _checked(strict)(p, rec)
        return rec, None

    return Outcome(report, _expected(env, place, False), 1)  # Layout "records": one task


def _rebuild(env, spark, combo: Combo, taken: Taken) -> Outcome:
    """Delivered without checks from one partition (layout ranges) or two (together); then
    the pipeline upper-cases names and (FIRST) checks rows, and each sink is rebuilt: every
    record as the current pipeline makes it, in a new table."""
    records = RECORDS["ranges"]
    _append(env, [r for r in records if r[0] == 0] if combo.layout == "ranges" else records)
    _write_pipeline(env, combo, {}, False)
    assert _run(env, spark, QualityPath.FIRST).ok
    quality, path = HOW[combo.quality]
    _write_pipeline(
        env, combo, quality, False, transform={"select": {**SELECT, "name": "upper(name)"}}
    )
    assert env.run(spark, mode=Rebuild("second"), sink_names=["second"], quality=path).ok
    taken.clear()
    report = env.run(spark, mode=Rebuild("main"), sink_names=["main"], quality=path)

    def place(p: int, rec: dict) -> tuple[dict | None, str | None]:
        return _checked(_strict(quality))(p, {**rec, "name": rec["name"].upper()})

    return Outcome(report, _expected(env, place, False), 1)  # a rebuild writes in one task


SETUP = {
    "run": _deliver,
    "backfill": _backfill,
    "redrive": _redrive,
    "rebuild": _rebuild,
}


@pytest.mark.parametrize("combo", MATRIX, ids=str)
def test_each_combination_places_every_record_as_the_pipeline_says(env, spark, taken, combo):
    for dsn in _sinks(env).values():  # a one-pass write needs the tables to exist
        table = config.Sink(name="t", dsn=dsn, table="public.orders", key=["id"])
        sinks.ensure_table(sinks.ResolvedSink(table, dsn), COLUMNS, "sink")
    out = SETUP[combo.mode](env, spark, combo, taken)
    report = out.report
    assert report.ok, report.summary()

    # The combination taken is the one named: the layout chosen and each write's strategy,
    # and in the ledger the tasks that wrote and the write that stood (a gid's write number).
    assert report.mode == combo.mode
    assert (taken.layouts, tuple(taken.writes)) == ([combo.layout], combo.quality)
    chosen = [
        gids.parse(g, "tm")
        for (g,) in env.ledger(
            "SELECT gid FROM tidemark.participants WHERE run_id = %s", (report.run_id,)
        )
    ]
    assert {(g.task, g.write) for g in chosen if g} == {
        (t, len(combo.quality) - 1) for t in range(out.tasks)
    }

    # What each sink holds is what the pipeline makes of the source, and the invariants hold.
    assert {s: _held(env, s, dsn) for s, dsn in _sinks(env).items()} == dict.fromkeys(
        SINKS, out.made
    )
    check = assert_exactly_once if combo.delivery == "exactly_once" else assert_at_least_once
    check(env, sinks=_sinks(env))
