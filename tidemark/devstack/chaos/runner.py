"""The chaos run: the seeded sequence, recovery and the checker after every step, the final
catch-up, the report. ``tidemark chaos --seed N --steps K [--keep-dir]``."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Iterable

from tidemark.devstack.chaos.adapter import InProcess, Subprocess, spark_session
from tidemark.devstack.chaos.checker import Checker, Problem, Snapshot, Target
from tidemark.devstack.chaos.ops import GID_ACTS, Chaos, plan
from tidemark.devstack.chaos.oracle import Oracle
from tidemark.devstack.chaos.world import (
    KEY_SHIFT,
    ON,
    OPTIONAL,
    PIPELINE,
    SINK_TABLE,
    SINKS,
    Features,
    World,
)

MAX_SHOWN = 60  # problems printed in full
CATCH_UP_RUNS = 60  # final runs allowed to bring every sink up to date
FAULT_EVERY = 3  # every 3rd step is a fault (the first four cover every kind)


def echo(line: str = "") -> None:
    print(line, flush=True)


def target(world: World) -> Target:
    return Target(
        ledger_dsn=world.ledger_dsn,
        pipeline=PIPELINE,
        source=world.source,
        sinks={s: (dsn, SINK_TABLE) for s, dsn in world.sink_dsns.items()},
        databases=world.databases,
        key_shift=KEY_SHIFT,
        versioned=world.features.versioned,
        key_from_key=world.features.tombstones,
    )


ZONES = ("db:Asia/Kathmandu", "role:America/St_Johns", "db:Pacific/Chatham", "role:Europe/Berlin")


def world_params(seed: int, force: Iterable[str] = ()) -> tuple[int, int, Features]:
    """The world a seed draws. Every draw is made whatever is switched on (so a seed's world
    and sequence do not change when a feature is), then the optional features (world.OPTIONAL)
    are kept where world.ON or ``force`` has them; ``force`` turns its features on outright."""
    r = random.Random(f"tidemark-chaos:{seed}:world")
    partitions, limit = r.choice([1, 2, 3]), r.randint(25, 60)
    # A version column needs two partitions to order anything across them.
    versioned = partitions > 1 and r.random() < 0.3
    meta = r.random() < 0.3
    # A file_archive source; tombstones (only without a version column: world.Features).
    archive, tombs = r.random() < 0.4, r.random() < 0.5
    forced = set(force)
    unknown = forced - set(OPTIONAL)
    if unknown:
        raise ValueError(f"no such chaos feature: {', '.join(sorted(unknown))}")
    drawn = {name: r.random() for name in OPTIONAL}
    zone = r.choice(ZONES)

    def on(name: str, chance: float) -> bool:
        return name in forced or (name in ON and drawn[name] < chance)

    late = on("late", 0.5)
    # Drawn after every other draw, so that the worlds of earlier seeds stay as they were:
    # a start at an offset (every partition's, or partition 0's alone) where the seed drew
    # neither latest nor earliest.
    how, offset, mapped = r.random(), r.randint(3, 40), r.random()
    at: int | dict[int, int] = {0: offset} if partitions > 1 and mapped < 0.5 else offset
    start: str | int | dict[int, int] = "earliest"
    if "start" in forced:
        start = "latest" if how < 0.5 else at
    elif "start" in ON and drawn["start"] < 0.4:
        start = "latest"
    elif "start" in ON and drawn["start"] < 0.7:
        start = at
    return (
        partitions,
        limit,
        Features(
            versioned=versioned,
            meta=meta,
            archive=archive or late,  # late segments are segments
            tombstones=tombs and not versioned,
            start=start,
            tz=zone if on("tz", 0.5) else None,
            gids=on("gids", 0.5),
            trim=on("trim", 0.4),
            late=late,
            split=on("split", 0.4),
            prune=on("prune", 0.5),
        ),
    )


class _Interrupted(BaseException):
    pass


def _sigterm(signum, frame):
    raise _Interrupted()


def run(
    seed: int | None,
    steps: int,
    keep_dir: bool = False,
    fault_every: int = FAULT_EVERY,
    out: Callable[[str], None] = echo,
    force: Iterable[str] = (),
) -> int:
    if seed is None:
        seed = random.SystemRandom().randrange(1, 10**9)
    force = tuple(force)
    partitions, limit, features = world_params(seed, force)
    out(
        f"chaos: seed {seed}, {steps} steps, a fault every {fault_every} steps, "
        f"{partitions} partitions, max {limit} records per partition and run, "
        f"pipeline: {features.short()}"
    )
    started = time.monotonic()
    previous = signal.signal(signal.SIGTERM, _sigterm)
    world = World.create(partitions, limit, features=features)
    out(f"world: {world.root} (PostgreSQL on 127.0.0.1:{world.cluster.port})")
    chaos: Chaos | None = None
    spark = None
    problems: list[Problem] = []
    oracle: Oracle | None = None
    failed_at: str | None = None
    snap = Snapshot()
    done = 0
    try:
        # Spark's scratch in the world's folder, removed with it.
        os.environ.setdefault("SPARK_LOCAL_DIRS", str(world.scratch_dir))
        spark = spark_session()
        inproc, sub = InProcess(world, spark), Subprocess(world)
        chaos = Chaos(world, inproc, sub)
        checker = Checker(target(world))
        oracle = Oracle(target(world), features)
        chaos.oracle = oracle
        for n in range(1, steps + 1):
            t0 = time.monotonic()
            step = plan(seed, n, fault_every, chaos.op_weights)
            res = chaos.perform(step)
            problems, snap = settle_and_check(inproc, checker, res.problems)
            problems += content(oracle, chaos, world)
            if not step.fault and not res.faulted:  # chaos asks what a healthy pipeline can do
                problems += oracle.aborted
            done = n
            verdict = "ok" if not problems else f"{len(problems)} PROBLEM(S)"
            out(
                f"step {n:>4}  {res.desc:<52} {res.outcome}  [{verdict}] "
                f"{time.monotonic() - t0:.1f}s"
            )
            if problems:
                for a in oracle.last:
                    out(f"  model applied: run {a.run_id} sink {a.sink} {a.mode} {a.what}")
                failed_at = str(n)
                if (step.fault or res.faulted) and chaos.jobs:
                    out(f"  last output of {chaos.jobs[-1].log_path.name}:")
                    for line in chaos.jobs[-1].tail(15).splitlines():
                        out(f"    {line}")
                break
        if failed_at is None:
            problems, snap = final(world, inproc, checker, chaos, out)
            problems += content(oracle, chaos, world)
            if problems:
                failed_at = f"final (after step {steps})"
    except (KeyboardInterrupt, _Interrupted):
        out("chaos: interrupted")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        if chaos is not None:
            chaos.kill_all()
        if spark is not None:
            with contextlib.suppress(Exception):
                spark.stop()
        if keep_dir:
            with contextlib.suppress(Exception):
                world.stop()
            out(
                f"kept: {world.root} (cluster data in {world.cluster.data}, job logs in "
                f"{world.logs_dir}, pipeline in {world.pipelines_dir}); start it with "
                f"`python -m tidemark.devstack.localpg start --dir {world.cluster.root} --port "
                f"{world.cluster.port}`"
            )
        else:
            world.destroy()
    summary(
        seed,
        done,
        chaos,
        snap,
        problems,
        failed_at,
        time.monotonic() - started,
        out,
        keep_dir,
        fault_every,
        world,
        oracle,
        force,
    )
    return 1 if problems else 0


def content(oracle: Oracle, chaos: Chaos, world: World) -> list[Problem]:
    """The oracle learns what this step committed, then compares every sink and the DLQ."""
    asked = set(chaos.redrive_ids) | set(chaos.discard_ids)
    letters = oracle.letters(asked) if asked else {}
    oracle.sync(
        world.knobs,
        {i: letters[i] for i in chaos.redrive_ids if i in letters},
        {i: letters[i] for i in chaos.discard_ids if i in letters},
        trimmed=chaos.trimmed,
        reread=chaos.reread,
        accept_pruned=chaos.accept_pruned,
    )
    return oracle.compare()


def settle_and_check(
    inproc: InProcess, checker: Checker, found: list[str]
) -> tuple[list[Problem], Snapshot]:
    """Recovery (as after every step), then the independent checker."""
    problems = [Problem("-", "-", "-", f) for f in found]
    rec = inproc.recover()
    if not rec.ok:
        problems.append(Problem("-", "-", "-", f"recovery failed: {rec}"))
    checked, snap = checker.check()
    return problems + checked, snap


def _behind(chaos: Chaos) -> list[str]:
    ends = chaos.world.source.ends()
    cps = chaos.checkpoints()

    def waits(p: int, end: int) -> bool:  # a sink that begins at an offset not reached yet
        at = chaos.world.features.start_at(p)
        return isinstance(at, int) and end < at

    return [
        f"{s}/p{p} at {cps.get((s, p), 0)} of {end}"
        for s in SINKS
        for p, end in sorted(ends.items())
        if cps.get((s, p), 0) < end and not ((s, p) not in cps and waits(p, end))
    ]


def final(
    world: World, inproc: InProcess, checker: Checker, chaos: Chaos, out: Callable[[str], None]
) -> tuple[list[Problem], Snapshot]:
    """A passing pipeline (gate passes, loosest row checks), then runs until every sink is
    up to date, then the checks once more."""
    knobs = world.knobs.loosest()
    world.write_pipeline(knobs)
    out(f"final: pipeline restored ({knobs.short()}); running until every sink is up to date")
    found: list[str] = []
    failures = 0
    for i in range(1, CATCH_UP_RUNS + 1):
        behind = _behind(chaos)
        if not behind:
            break
        t0 = time.monotonic()
        res = inproc.run()
        out(
            f"final {i:>3}  run ({', '.join(behind)}): {str(res).splitlines()[0]}  "
            f"{time.monotonic() - t0:.1f}s"
        )
        if res.internal_error:
            found.append(f"final run failed with an internal error: {res.text}")
            break
        failures = 0 if res.ok else failures + 1
        if failures >= 3:
            found.append(
                f"sinks cannot catch up with a passing pipeline: 3 runs in a row "
                f"failed, last: {res}"
            )
            break
    else:
        found.append(f"sinks still behind after {CATCH_UP_RUNS} runs: {', '.join(_behind(chaos))}")
    if not found and (behind := _behind(chaos)):
        found.append(f"sinks behind at the end: {', '.join(behind)}")
    return settle_and_check(inproc, checker, found)


def summary(
    seed: int,
    done: int,
    chaos: Chaos | None,
    snap: Snapshot,
    problems: list[Problem],
    failed_at: str | None,
    seconds: float,
    out: Callable[[str], None],
    keep_dir: bool,
    fault_every: int,
    world: World | None = None,
    oracle: Oracle | None = None,
    force: tuple[str, ...] = (),
) -> None:
    out("")
    out(f"steps: {done} in {seconds:.0f}s")
    if chaos is not None:
        out("operations: " + _counts(chaos.ops))
        out("faults: " + (_counts(chaos.faults) or "none"))
        if chaos.gid_acts:
            out("operator gids: " + _counts(chaos.gid_acts))
        for what, c in chaos.coverage().items():
            out(f"{what} (runs, from their logs): " + (_counts(c) or "none"))
        life(chaos, world, oracle, out)
        kinds = {k.split(":", 1)[1]: v for k, v in chaos.appended.items() if ":" in k}
        out(
            f"records appended: {chaos.appended['clean']} clean, "
            f"{chaos.appended['poison']} poison ({_counts(kinds) or '-'}), "
            f"{chaos.appended['tombstone']} tombstone(s)"
        )
    if world is not None:
        src = world.source
        seg = src.segments
        out(
            f"source: {src.kind}"
            + (
                f" ({seg['parquet']} parquet + {seg['jsonl']} jsonl segments, {seg['gaps']} gap(s)"
                f", {seg.get('late', 0)} late, {seg.get('trimmed', 0)} trimmed)"
                if src.kind == "file_archive"
                else ""
            )
        )
    if world is not None and world.features.tombstones and oracle is not None:
        out(
            "tombstones (model, per sink and delivery): "
            + (_counts(oracle.tombstone_counts) or "none reached")
        )
    if oracle is not None and oracle.refusals:
        out("re-deliveries refused as they should be: " + _counts(oracle.refusals))
    if snap.tombs:
        out(
            "tombstones that delete, at the end: "
            + ", ".join(f"{s} {n}" for s, n in snap.tombs.items())
        )
    out("final rows per sink: " + (", ".join(f"{s} {n}" for s, n in snap.rows.items()) or "-"))
    out(
        "live dead letters per sink: "
        + (", ".join(f"{s} {n}" for s, n in snap.live.items()) or "-")
    )
    out(f"problems found: {len(problems)}")
    if problems:
        out("")
        for p in problems[:MAX_SHOWN]:
            out(f"  PROBLEM {p}")
        if len(problems) > MAX_SHOWN:
            out(f"  ... and {len(problems) - MAX_SHOWN} more")
        out("")
        step = failed_at.split()[0] if failed_at else str(done)
        k = done if not step.isdigit() else int(step)
        out(f"seed {seed}, first failing step {failed_at}")
        extra = f" --fault-every {fault_every}" if fault_every != FAULT_EVERY else ""
        extra += "".join(f" --feature {f}" for f in force)
        out(
            f"reproduce: tidemark chaos --seed {seed} --steps {k}{extra}"
            + ("" if keep_dir else "   (add --keep-dir to keep the databases and job logs)")
        )
        out(
            f"chaos seed={seed} steps={done}: FAILED at step {failed_at}, "
            f"{len(problems)} problem(s)"
        )
    else:
        out(f"chaos seed={seed} steps={done}: PASSED, no problems")


def life(
    chaos: Chaos, world: World | None, oracle: Oracle | None, out: Callable[[str], None]
) -> None:
    """The issue 45 life operations, each with the times it was reached (did something: a
    skipped operation does not count); the world's own (start, TimeZone) as drawn."""
    r, e, g = chaos.reached, chaos.edits, chaos.gid_acts
    f = world.features if world is not None else None
    seg = world.source.segments if world is not None else {}
    rows = [
        ("start (world)", str(f.start) if f else "-"),
        ("session TimeZone (world)", (f.tz or "UTC (none set)") if f else "-"),
        ("backfill below where a sink began", r["backfill_low"]),
        ("backfill --partition all", r["backfill_all"]),
        ("backfill --since/--until", r["backfill_time"]),
        ("trim (incl. tombstones)", r["trim"]),
        ("  segments trimmed", seg.get("trimmed", 0)),
        ("late segment", r["late_segment"]),
        ("  late segments placed", seg.get("late", 0)),
        ("key split (edit to split)", sum(v for k, v in e.items() if k.endswith("->split"))),
        ("key merge (edit to merge)", sum(v for k, v in e.items() if k.endswith("->merge"))),
        ("  version column", "yes" if f and f.versioned else "no"),
        ("  tombstones", "yes" if f and f.tombstones else "no"),
        *((f"gids {act}", g[act]) for act in sorted(GID_ACTS)),
        ("discard", r["discard"]),
        ("prune", r["prune"]),
        ("backfill over discarded records", r["backfill_discarded"]),
        ("redrive", r["redrive"]),
        ("rebuild", r["rebuild"]),
    ]
    if oracle is not None and world is not None and world.features.tombstones:
        rows.append(("tombstones modelled", sum(oracle.tombstone_counts.values())))
    out("life operations (issue 45), times reached:")
    for name, n in rows:
        out(f"  {name:<36} {n}")


def _counts(c) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items()))


def main(
    seed: int | None, steps: int, keep_dir: bool, fault_every: int, force: Iterable[str] = ()
) -> None:
    sys.exit(run(seed, steps, keep_dir, fault_every, force=force))
