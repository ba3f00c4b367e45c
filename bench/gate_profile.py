"""Where a gated run's gate step spends its time, Spark job by Spark job, when the run checks
its batch before writing it (docs/quality.md): a backfill, a sink with checks of its own, a
suite GX must compute itself, or a one-pass write undone. (A run that checks while writing
has no such step: `make bench` shows what its checks add to the write.)

Runs the bench's gated exactly-once pipeline (the demo suite over 2,020,656 records) twice in
one warm SparkSession (Tidemark's own), then prints every Spark job of the second run's gate:
its wall time, its stages' task time and the Python line that started it (a GX metric, the
cache fill, ...), grouped by that line. Spark's status store keeps the job list whether or not
the UI runs, so nothing here changes the session's settings.

The batch cache is filled by a count of its own just before the gate (in a gated run the gate's
first job fills it), so that the cache fill, the gate's jobs and the driver's share (the gate
step's time outside any Spark job: GX in Python, Spark planning, the ledger) show apart.

    .venv/bin/python bench/gate_profile.py
"""

from __future__ import annotations

import collections
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from dotenv import load_dotenv  # noqa: E402
from replay_bench import (  # noqa: E402
    REPEAT,
    TABLE,
    noop_seconds,
    pipeline_doc,
    reset,
    whole_table,
)

from tidemark import config  # noqa: E402
from tidemark.core.settings import Settings  # noqa: E402
from tidemark.devstack import demo  # noqa: E402
from tidemark.driver import gate  # noqa: E402
from tidemark.driver.run import QualityPath, Run  # noqa: E402
from tidemark.engine import records  # noqa: E402
from tidemark.engine.session import session  # noqa: E402
from tidemark.ledger import migrations  # noqa: E402
from tidemark.sources import dataframe  # noqa: E402


def _seq(scala_seq) -> list:
    return [scala_seq.apply(i) for i in range(scala_seq.size())]


def jobs(spark) -> list[dict]:
    """Every job Spark's status store holds: id, name (call site), wall and task seconds."""
    store = spark.sparkContext._jsc.sc().statusStore()
    out = []
    for j in _seq(store.jobsList(None)):
        sub, done = j.submissionTime(), j.completionTime()
        if sub.isEmpty() or done.isEmpty():
            continue
        task_ms = 0
        for sid in _seq(j.stageIds()):
            for attempt in _seq(store.stageData(int(sid), False, None, False, None)):
                task_ms += attempt.executorRunTime()
        out.append(
            {
                "id": j.jobId(),
                "name": j.name(),
                "wall": (done.get().getTime() - sub.get().getTime()) / 1000,
                "task": task_ms / 1000,
            }
        )
    return sorted(out, key=lambda j: j["id"])


def main() -> None:
    load_dotenv(REPO / ".tidemark/env", override=False)
    ledger = os.environ["TIDEMARK_LEDGER_DSN"]
    source = os.environ.get("TIDEMARK_DEMO_SOURCE_DSN", ledger)
    sink = os.environ.get("TIDEMARK_DEMO_SINK_DSN", ledger)
    migrations.upgrade(ledger)
    demo.load(source, TABLE, repeat=REPEAT, partitions=4)
    folder = Path(tempfile.mkdtemp(prefix="tidemark-gate-profile-"))
    (folder / "bench_gate.yaml").write_text(
        yaml.safe_dump(
            pipeline_doc("bench_gate", "exactly_once", 600_000, source, sink, True, TABLE),
            sort_keys=False,
        )
    )
    settings = Settings(ledger_dsn=ledger, pipelines_dir=folder, spark_master="local[2,4]")
    spark = session("local[2,4]", "tidemark-gate-profile")
    evaluate = gate.evaluate
    fill: dict[str, float] = {}

    def filled_first(pipeline, df, *args, **kwargs):
        t = time.perf_counter()
        df.count()  # fills the batch cache the run persisted: its own job
        fill["seconds"] = time.perf_counter() - t
        return evaluate(pipeline, df, *args, **kwargs)

    gate.evaluate = filled_first
    for _pass in ("warm-up", "measured"):
        reset(ledger, sink, "bench_gate")
        before = {j["id"] for j in jobs(spark)}
        t = time.perf_counter()
        report = Run(
            config.load(folder / "bench_gate.yaml"),
            settings,
            ledger_dsn=ledger,
            spark=spark,
            log=lambda m: None,
            quality=QualityPath.FIRST,  # the checking-first way, which this profiles
        ).execute()
        wall = time.perf_counter() - t
        if not report.ok:
            raise SystemExit(f"gated run failed: {report.summary()}")
    gate_s = report.phases.get("gate_seconds", 0)
    print(
        f"run {wall:.1f} s wall: gate {gate_s:.1f} s, write {report.phases['write_seconds']:.1f} s"
    )
    new = [j for j in jobs(spark) if j["id"] not in before]
    write_job = max(new, key=lambda j: j["id"])  # the run's last job: its write tasks
    gx_jobs = sum(
        j["wall"] for j in new if j is not write_job and not j["name"].startswith("count at")
    )
    pipeline, parts = config.load(folder / "bench_gate.yaml"), whole_table(source)
    noop = noop_seconds(lambda: records.rows(dataframe(spark, pipeline, parts), pipeline))
    print(
        f"gate {gate_s:.1f} s = batch cache fill (read, decode, transform, cache) "
        f"{fill['seconds']:.1f} s + the checks' Spark jobs {gx_jobs:.1f} s + outside any job "
        f"(GX in Python, Spark planning, ledger) {gate_s - fill['seconds'] - gx_jobs:.1f} s"
    )
    print(
        f"the same read, decode and transform into Spark's no-op sink: {noop:.1f} s "
        f"(the cache itself: {fill['seconds'] - noop:.1f} s)"
    )
    print(f"\n{len(new)} Spark jobs; by call site (wall s, task s, jobs):")
    by: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for j in new:
        b = by[j["name"]]
        b[0] += j["wall"]
        b[1] += j["task"]
        b[2] += 1
    for name, (w, tk, n) in sorted(by.items(), key=lambda kv: -kv[1][0]):
        print(f"{w:7.2f} {tk:7.2f} {n:4d}  {name}")
    print("\neach job (id, wall s, task s, call site):")
    for j in new:
        print(f"{j['id']:5d} {j['wall']:6.2f} {j['task']:6.2f}  {j['name']}")


if __name__ == "__main__":
    main()
