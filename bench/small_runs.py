"""The small-run figure of `make bench` (issue 50), for bench/replay_bench.py: a fresh
`tidemark run` process, as Airflow starts one, of 1,000 and of 10,000 new records, on each
engine by name, back to back (the engines rotate within each repetition, so each ratio pairs
neighbours on a shared, noisy machine).

Every engine runs the same pipeline, one the local engine can run too: the demo's flights with
their columns as they are (no transform expressions, no data-quality checks), keyed as the
demo's table. An engine is a name and the environment its `tidemark run` gets: adding one
(Spark Connect, say) is one entry in ENGINES.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

# engine -> what its `tidemark run` process gets in its environment, over the bench's own.
# "connect" also needs TIDEMARK_SPARK_REMOTE: the bench's own server when none is set (below).
ENGINES: dict[str, dict[str, str]] = {
    "local": {"TIDEMARK_ENGINE": "local"},
    "spark": {"TIDEMARK_ENGINE": "spark"},
    "connect": {"TIDEMARK_ENGINE": "connect"},
}
# size -> records per partition of the bench's 4-partition log (the run reads from offset 0).
SIZES = {"1k": 250, "10k": 2_500, "100k": 25_000, "2m": 600_000}
DEFAULT_SIZES = ["1k", "10k"]
KEY = ["year", "month", "day", "carrier", "flight", "origin", "copy"]
VALUES = ["dest", "tailnum", "sched_dep_time", "dep_time", "dep_delay", "arr_delay", "distance"]


@contextmanager
def connect_endpoint(engines: list[str], env: dict[str, str], state: Path) -> Iterator[None]:
    """For the connect engine, ``env`` names a Spark Connect endpoint: the one set
    (TIDEMARK_SPARK_REMOTE) or a local server started here (as `make connect` does) and stopped
    after. Its first run starts the server's Python workers; measure's untimed round pays it."""
    if "connect" not in engines or env.get("TIDEMARK_SPARK_REMOTE"):
        yield
        return
    from tidemark.devstack.connect_server import ConnectServer

    server = ConnectServer(state)
    env["TIDEMARK_SPARK_REMOTE"] = server.start()
    try:
        yield
    finally:
        server.stop()


def engine_env(env: dict[str, str], engine: str) -> dict[str, str]:
    """``env`` for a run on ``engine``: a Connect endpoint only for the connect engine (with
    TIDEMARK_SPARK_REMOTE set, the spark engine runs on Connect too: runners.runner_for)."""
    out = {**env, **ENGINES[engine]}
    if engine != "connect":
        out.pop("TIDEMARK_SPARK_REMOTE", None)
    return out


def name(engine: str, size: str) -> str:
    return f"bench_small_{engine}_{size}"


def pipeline_doc(pipeline: str, limit: int, flights: dict, source_dsn: str, sink_dsn: str):
    """``flights`` (dags/pipelines/flights.yaml, parsed) reduced to plain columns."""
    doc = {k: v for k, v in flights.items() if k not in ("quality", "transform", "limits")}
    doc.update(name=pipeline, delivery="exactly_once", schedule=None)
    doc["transform"] = {"select": {c: c for c in KEY + VALUES}, "required": KEY}
    doc["source"] = {**doc["source"], "table": "bench.flights_log", "dsn": source_dsn}
    sink = {**doc["sinks"][0], "dsn": sink_dsn, "table": f"bench.{pipeline}", "key": KEY}
    doc["sinks"] = [sink]
    doc["limits"] = {"max_records_per_partition": limit}
    return doc


def write_pipelines(folder: Path, engines, sizes, flights: dict, source: str, sink: str) -> None:
    for engine in engines:
        for size in sizes:
            n = name(engine, size)
            doc = pipeline_doc(n, SIZES[size], flights, source, sink)
            (folder / f"{n}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


def measure(
    engines: list[str],
    sizes: list[str],
    reps: int,
    env: dict[str, str],
    run: Callable[[str, dict[str, str]], dict],
    reset: Callable[[str], None],
) -> dict[tuple[str, str], list[dict]]:
    """``reps`` fresh runs per engine and size (``run(pipeline, env)``: bench's fresh_run),
    each into its emptied table with its checkpoints gone: every run delivers its records
    anew. One untimed run of each first: the table exists, as an hourly pipeline's does,
    and the OS has the engine's files in its cache."""
    out: dict[tuple[str, str], list[dict]] = {}
    for rep in range(-1, reps):
        order = engines[rep % len(engines) :] + engines[: rep % len(engines)]
        for size in sizes:
            for engine in order:
                n = name(engine, size)
                reset(n)
                r = run(n, engine_env(env, engine))
                if rep >= 0:
                    out.setdefault((engine, size), []).append(r)
    return out


def print_small(results: dict[tuple[str, str], list[dict]], load: tuple[float, ...]) -> None:
    engines = list(dict.fromkeys(e for e, _ in results))
    sizes = list(dict.fromkeys(s for _, s in results))
    reps = len(next(iter(results.values())))
    print(
        f"\nsmall runs: a fresh `tidemark run` process (exactly-once, into an emptied table), "
        f"median of {reps} per engine, engines back to back; load average "
        f"{', '.join(f'{x:.1f}' for x in load)} (1, 5, 15 min) when it ended"
    )
    steps = ["claim_seconds", "write_seconds", "decide_seconds", "commit_seconds"]
    print(
        "| engine | records | wall (s) | runs (s) | outside the run: start-up, exit (s) | "
        + " | ".join(s.removesuffix("_seconds") for s in steps)
        + " | peak RSS of the run's process (MiB) |"
    )
    print("|---|---:|---:|---|---:|" + "---:|" * (len(steps) + 1))
    for (engine, _size), runs in results.items():
        wall = statistics.median(r["wall"] for r in runs)
        inside = [sum(r["phases"].get(s, 0.0) for s in steps) for r in runs]
        outside = statistics.median(r["wall"] - i for r, i in zip(runs, inside, strict=True))
        cells = [statistics.median(r["phases"].get(s, 0.0) for r in runs) for s in steps]
        print(
            f"| {engine} | {runs[0]['records']:,} | {wall:.1f} | "
            + ", ".join(f"{r['wall']:.1f}" for r in runs)
            + f" | {outside:.1f} | "
            + " | ".join(f"{c:.1f}" for c in cells)
            + f" | {max(r['py'] for r in runs):,.0f} |"
        )
    for size in sizes:
        base = results.get((engines[0], size))
        for other in engines[1:]:
            runs = results.get((other, size))
            if base and runs:
                ratio = statistics.median(
                    o["wall"] / b["wall"] for b, o in zip(base, runs, strict=True)
                )
                print(
                    f"{size}: {other} takes {ratio:.1f}x {engines[0]}'s wall time, paired "
                    f"per repetition"
                )
