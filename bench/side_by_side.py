"""Issue 50's large-run comparison, for bench/replay_bench.py (`--modes side`): at 2M and 10M
records, in one bench invocation, each a fresh process as Airflow starts one and interleaved
(the order rotates every round, so load drift on a shared machine hits all alike):

- Tidemark on the local engine (TIDEMARK_ENGINE=local: no JVM, tasks in the run's process),
- Tidemark on the Spark engine (local[2,4]),
- the bench's peer job (bench/peer_job.py --plain: PySpark, ADBC reads, from_json, pyarrow CSV
  -> COPY per task, at-least-once),
- and, last in each round, the raw COPY ceiling: the rows just written, as COPY csv, sent by
  plain psycopg over 2 connections into a table like Tidemark's (same primary key), no Spark.

All of them run the same pipeline, one the local engine can run: every payload field as it is
(no transform expressions, which the local engine refuses), keyed as the demo's table. After
each round the three tables must hold the same rows (count, and a hash of every value with
the source record it came from), else the bench fails.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import psycopg
import yaml
from peer_job import PLAIN_KEY, PLAIN_TYPES

ENGINES = {"local": {"TIDEMARK_ENGINE": "local"}, "spark": {"TIDEMARK_ENGINE": "spark"}}
CONTESTANTS = ["local", "spark", "peer"]  # rotated; raw COPY follows them in every round


def name(size: str, who: str) -> str:
    return f"bench_side_{size}_{who}"


def pipeline_doc(pipeline: str, table: str, limit: int, flights: dict, source: str, sink: str):
    """``flights`` (dags/pipelines/flights.yaml, parsed) with every field selected as it is."""
    doc = {k: v for k, v in flights.items() if k not in ("quality", "transform", "limits")}
    doc.update(name=pipeline, delivery="exactly_once", schedule=None)
    doc["decode"] = {**doc["decode"], "schema": dict(PLAIN_TYPES)}
    doc["transform"] = {"select": {c: c for c in PLAIN_TYPES}, "required": PLAIN_KEY}
    doc["source"] = {**doc["source"], "table": table, "dsn": source}
    doc["sinks"] = [{**doc["sinks"][0], "dsn": sink, "table": f"bench.{pipeline}"}]
    doc["sinks"][0]["key"] = PLAIN_KEY
    doc["limits"] = {"max_records_per_partition": limit}
    return doc


def write_pipelines(folder: Path, sizes: dict[str, tuple[str, int]], flights, source, sink):
    for size, (table, limit) in sizes.items():
        for engine in ENGINES:
            n = name(size, engine)
            doc = pipeline_doc(n, table, limit, flights, source, sink)
            (folder / f"{n}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


def fingerprint(sink_dsn: str, table: str, partition: str, offset: str) -> tuple[int, int]:
    """Rows, and a sum of hashes of every row's values and the record it came from: equal
    for two tables holding the same rows."""
    values = ", ".join([*PLAIN_TYPES, partition, offset])
    with psycopg.connect(sink_dsn) as c:
        row = c.execute(
            f"SELECT count(*), coalesce(sum(hashtext(concat_ws('/', {values}))::bigint), 0) "
            f"FROM {table}"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def measure(
    sizes: dict[str, tuple[str, int]],
    rounds: int,
    expected: dict[str, int],
    env: dict[str, str],
    fresh: Callable[[str, dict[str, str]], dict],
    peer: Callable[[str, str], dict],
    raw: Callable[[str, str], tuple[int, float]],
    reset: Callable[[str], None],
    settle: Callable[[str], None],
    sink_dsn: str,
) -> dict[str, dict]:
    """``rounds`` rounds per size: fresh(pipeline, env) runs Tidemark, peer(size, table) the
    peer job, raw(from_table, into) the raw COPY of a table's rows. Each run's table is
    emptied before and vacuumed after (untimed)."""
    import os

    out: dict[str, dict] = {}
    for size in sizes:
        res: dict = {"records": expected[size], "load": [os.getloadavg()], "raw": []}
        for rnd in range(rounds):
            k = rnd % len(CONTESTANTS)
            for who in CONTESTANTS[k:] + CONTESTANTS[:k]:
                table = name(size, who)
                reset(table)
                if who == "peer":
                    run = peer(size, f"bench.{table}")
                else:
                    # Never through a Connect endpoint the environment names.
                    e = {k: v for k, v in env.items() if k != "TIDEMARK_SPARK_REMOTE"}
                    run = fresh(table, {**e, **ENGINES[who]})
                settle(table)
                if run["records"] != expected[size]:
                    raise SystemExit(
                        f"bench: {who} read {run['records']:,} of {expected[size]:,} records"
                    )
                res.setdefault(who, []).append(run)
                _progress(size, rnd, who, expected[size], run["wall"])
            prints = {
                who: fingerprint(
                    sink_dsn,
                    f"bench.{name(size, who)}",
                    *(
                        ("src_partition", "src_offset")
                        if who == "peer"
                        else ("_tm_partition", "_tm_offset")
                    ),
                )
                for who in CONTESTANTS
            }
            if len(set(prints.values())) != 1 or prints["local"][0] != expected[size]:
                raise SystemExit(f"bench: the {size} tables differ (rows, hash): {prints}")
            into = name(size, "raw")
            reset(into)
            res["raw"].append(raw(f"bench.{name(size, 'local')}", into))
            settle(into)
            _progress(size, rnd, "raw COPY", expected[size], res["raw"][-1][1])
        res["load"].append(os.getloadavg())
        out[size] = res
    return out


def _progress(size: str, rnd: int, who: str, n: int, secs: float) -> None:
    print(
        f"side {size} round {rnd + 1} {who:<9} {n:>10,} records {secs:7.1f}s "
        f"{n / secs:>10,.0f} rec/s",
        file=sys.stderr,
        flush=True,
    )


def print_side(results: dict[str, dict]) -> None:
    rounds = len(next(iter(results.values()))["raw"])
    print(
        "\nside by side (issue 50): the same plain-column pipeline, fresh processes interleaved "
        f"(order rotating per round, raw COPY last), wall clock, median of {rounds} rounds; "
        "ratios paired per round"
    )
    print(
        "| records | raw COPY (s) | peer job (s) | Tidemark local (s) | Tidemark Spark (s) | "
        "local vs peer | Spark vs peer | local / raw COPY | Spark / raw COPY | "
        "peer / raw COPY | load avg (1, 5, 15 min) start -> end |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for res in results.values():
        n = res["records"]
        raw = [s for _, s in res["raw"]]
        wall = {w: [r["wall"] for r in res[w]] for w in CONTESTANTS}

        def paired(a: list[float], b: list[float]) -> float:
            return statistics.median(x / y for x, y in zip(a, b, strict=True))

        def cell(xs: list[float]) -> str:
            return f"{statistics.median(xs):.1f} ({', '.join(f'{x:.1f}' for x in xs)})"

        load = " -> ".join(", ".join(f"{x:.1f}" for x in la) for la in res["load"])
        print(
            f"| {n:,} | {cell(raw)} | {cell(wall['peer'])} | {cell(wall['local'])} | "
            f"{cell(wall['spark'])} | {paired(wall['peer'], wall['local']):.2f}x | "
            f"{paired(wall['peer'], wall['spark']):.2f}x | {paired(raw, wall['local']):.1%} | "
            f"{paired(raw, wall['spark']):.1%} | {paired(raw, wall['peer']):.1%} | {load} |"
        )
    print(
        "X vs peer: the peer job's wall time over X's (above 1: X faster; target >= 2x). "
        "X / raw COPY: the raw COPY's time over X's, the share of what PostgreSQL absorbs "
        "(target >= 50% at 10M)."
    )
    for res in results.values():
        for who in ("local", "spark"):
            last = res[who][-1]
            steps = {k: v for k, v in last["phases"].items() if not k.startswith("task_")}
            tasks = {k[5:]: v for k, v in last["phases"].items() if k.startswith("task_")}
            outside = last["wall"] - sum(steps.values())
            print(
                f"  {who} at {res['records']:,} (last round) {last['wall']:.1f} s: outside the "
                f"run {outside:.1f}, "
                + ", ".join(f"{k.removesuffix('_seconds')} {v:.1f}" for k, v in steps.items())
                + "; tasks: "
                + ", ".join(f"{k.removesuffix('_seconds')} {v:.1f}" for k, v in tasks.items())
                + f"; peak RSS Python {last['py']:,.0f} MiB, JVM {last['jvm']:,.0f} MiB"
            )
        job = res["peer"][-1]
        print(
            f"  peer job at {res['records']:,} (last round) {job['wall']:.1f} s: "
            + ", ".join(f"{k} {v:.1f}" for k, v in job["seconds"].items())
            + "; tasks: "
            + ", ".join(f"{k} {v:.1f}" for k, v in job["task_seconds"].items())
        )
