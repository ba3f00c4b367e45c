"""The operations of a chaos run, and the plan that picks them.

Every step draws from its own ``random.Random(f"{seed}:{step}")``, and everything that
decides *what* a step does (operation, records appended, pipeline edits, fault kind and
point) depends only on the seed and on earlier steps' draws, never on outcomes: the sequence
is a pure function of the seed, and ``--steps K`` runs exactly the first K steps of any
longer run. Only choices that must fit the state (a backfill range below the checkpoint,
dead-letter ids) look at the databases, as a fraction drawn in advance.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import psycopg

from tidemark.core.faults import POINTS
from tidemark.core.text import clamp
from tidemark.devstack.chaos import world as w
from tidemark.devstack.chaos.adapter import InProcess, Outcome, Subprocess
from tidemark.devstack.chaos.faults import KINDS, Job, terminate_backends
from tidemark.ledger import checkpoints, dlq

OPS = {"append": 14, "append_poison": 10, "run": 18, "run_sink": 10, "backfill": 8,
       "redrive": 8, "discard": 6, "edit": 14}
POISON = ("not_json", "bad_utf8", "wrong_type", "null_id", "empty", "out_of_range")
JOB_OPS = {"run": 60, "run_sink": 15, "backfill": 15, "redrive": 10}
STOP_TTL = 10           # lease TTL of a job that gets SIGSTOPped (the settings' minimum)
JOB_TIMEOUT = 300       # a job that outlives this after its fault is hung (a problem)


@dataclass
class Step:
    n: int
    op: str
    fault: str | None
    rng: random.Random


def step_rng(seed: int, n: int) -> random.Random:
    return random.Random(f"tidemark-chaos:{seed}:{n}")


def fault_order(seed: int) -> list[str]:
    """The first faults of every run cover each kind once, in a seeded order."""
    kinds = list(KINDS)
    random.Random(f"tidemark-chaos:{seed}:faults").shuffle(kinds)
    return kinds


def plan(seed: int, n: int, fault_every: int) -> Step:
    rng = step_rng(seed, n)
    if n == 1:
        return Step(n, "append", None, rng)  # something to replay from the start
    if n % fault_every == 0:
        k = sum(1 for m in range(2, n + 1) if m % fault_every == 0) - 1  # slots before n
        order = fault_order(seed)
        kind = order[k] if k < len(order) else rng.choice(KINDS)
        return Step(n, "fault", kind, rng)
    op = rng.choices(list(OPS), weights=list(OPS.values()))[0]
    return Step(n, op, None, rng)


@dataclass
class Result:
    desc: str
    outcome: str
    problems: list[str] = field(default_factory=list)   # operation-level findings


class Chaos:
    """Performs steps against a world; keeps the model of what was appended."""

    def __init__(self, world: w.World, inproc: InProcess, sub: Subprocess):
        self.world = world
        self.inproc = inproc
        self.sub = sub
        self.P = world.partitions
        self.next_id = 1
        self.ids: list[int] = []
        self.versions: dict[int, int] = {}
        self.ops: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.appended: Counter[str] = Counter()
        self.jobs: list[Job] = []

    # -- records ------------------------------------------------------------------------------
    def _new_version(self, rng: random.Random) -> tuple[int, int]:
        if self.ids and rng.random() < 0.15:
            i = self.ids[rng.randrange(len(self.ids))]
            self.versions[i] += 1
        else:
            i, self.next_id = self.next_id, self.next_id + 1
            self.ids.append(i)
            self.versions[i] = 1
        return i, self.versions[i]

    def _order(self, i: int, v: int, amount: float) -> tuple:
        body = {"id": i, "name": f"order-{i}-v{v}", "amount": amount, "version": v}
        return (i % self.P, str(i).encode(), json.dumps(body).encode(), json.dumps({"v": v}))

    def clean(self, rng: random.Random) -> tuple:
        i, v = self._new_version(rng)
        self.appended["clean"] += 1
        return self._order(i, v, round(rng.uniform(0, w.CLEAN_MAX), 2))

    def poison(self, rng: random.Random) -> tuple:
        kind = rng.choice(POISON)
        self.appended["poison"] += 1
        self.appended[f"poison:{kind}"] += 1
        p = rng.randrange(self.P)
        tag = rng.randrange(10**6)
        if kind == "out_of_range":  # a real order (new id or new version) failing row checks
            i, v = self._new_version(rng)
            return self._order(i, v, round(rng.uniform(*w.OUT_OF_RANGE), 2))
        if kind == "wrong_type":
            if rng.random() < 0.5:
                payload = json.dumps({"id": f"order-{tag}", "name": "x", "amount": 1.0,
                                      "version": 1}).encode()
            else:  # a readable id of its own, an amount that is not a number
                i, self.next_id = self.next_id, self.next_id + 1
                p = i % self.P
                payload = json.dumps({"id": i, "name": "x", "amount": "lots",
                                      "version": 1}).encode()
        elif kind == "not_json":
            payload = b'{"id": %d, "name": not json' % tag
        elif kind == "bad_utf8":
            payload = b'{"id": 7, "name": "\xff\xfe\xfa", "amount": 1.0, "version": 1}'
        elif kind == "null_id":
            payload = json.dumps({"id": None, "name": "no id", "amount": 2.0,
                                  "version": 1}).encode()
        else:  # empty: no bytes at all, or no payload
            payload = b"" if rng.random() < 0.5 else None
        return (p, f"poison-{kind}-{tag}".encode(), payload, None)

    def append(self, rng: random.Random, clean: int, poison: int = 0) -> str:
        recs = [self.clean(rng) for _ in range(clean)] + [self.poison(rng) for _ in range(poison)]
        rng.shuffle(recs)
        spans = self.world.append(recs)
        where = " ".join(f"p{p}:{a}-{b}" for p, (a, b) in sorted(spans.items()))
        return f"appended {clean} clean + {poison} poison ({where})"

    # -- state the choices must fit -------------------------------------------------------
    def _ledger(self) -> psycopg.Connection:
        return psycopg.connect(self.world.ledger_dsn, autocommit=True, application_name="chaos")

    def _q(self, sql: str, params=()) -> list[tuple]:
        with self._ledger() as conn:
            return conn.execute(sql, params).fetchall()

    def checkpoints(self) -> dict[tuple[str, int], int]:
        with self._ledger() as conn:
            at = checkpoints.positions(conn, w.PIPELINE)
        return {(s, p): n for s, parts in at.items() for p, n in parts.items()}

    def quarantined(self) -> list[int]:
        with self._ledger() as conn:
            return dlq.matching_ids(conn, dlq.Filters.parse(pipeline=w.PIPELINE,
                                                             status="quarantined"))

    def _backfill_args(self, rng: random.Random):
        sinks = rng.choice([None, None, ["a"], ["b"]])
        p = rng.randrange(self.P)
        u1, u2 = rng.random(), rng.random()
        cps = self.checkpoints()
        m = min(cps.get((s, p), 0) for s in (sinks or w.SINKS))
        if m == 0:
            return None
        start = int(u1 * m)
        end = start + 1 + int(u2 * (m - start - 1))
        return p, start, end, sinks

    def _letters(self, rng: random.Random, most: int) -> list[int]:
        k, u = rng.randint(1, most), rng.random()
        have = self.quarantined()
        if not have:
            return []
        r = random.Random(f"{u}")  # a fixed draw, whatever the list's length
        return sorted(r.sample(have, min(k, len(have))))

    # -- operations -----------------------------------------------------------------------------
    def perform(self, step: Step) -> Result:
        rng = step.rng
        self.ops[step.op if not step.fault else f"fault:{step.fault}"] += 1
        if step.op == "append" and step.n == 1:  # a first batch, with some poison
            return Result("append", self.append(rng, rng.randint(60, 120), rng.randint(3, 8)))
        if step.op == "append":
            return Result("append", self.append(rng, rng.randint(5, 40)))
        if step.op == "append_poison":
            return Result("append poison", self.append(rng, rng.randint(0, 10),
                                                       rng.randint(1, 6)))
        if step.op == "run":
            return self._inproc("run", self.inproc.run())
        if step.op == "run_sink":
            sink = rng.choice(w.SINKS)
            return self._inproc(f"run --sink {sink}", self.inproc.run([sink]))
        if step.op == "backfill":
            args = self._backfill_args(rng)
            if args is None:
                return Result("backfill", "skipped: nothing committed there yet")
            p, a, b, sinks = args
            return self._inproc(f"backfill p{p} [{a},{b}){_sinks(sinks)}",
                                self.inproc.backfill(p, a, b, sinks))
        if step.op == "redrive":
            ids = self._letters(rng, 8)
            if not ids:
                return Result("redrive", "skipped: no quarantined letters")
            return self._inproc(f"redrive {_short(ids)}", self.inproc.redrive(ids))
        if step.op == "discard":
            ids = self._letters(rng, 3)
            if not ids:
                return Result("discard", "skipped: no quarantined letters")
            return self._inproc(f"discard {_short(ids)}", self.inproc.discard(ids))
        if step.op == "edit":
            return Result("edit", self.edit(rng))
        if step.op == "fault":
            return self.fault(step.fault, rng)
        raise AssertionError(step.op)

    def _inproc(self, desc: str, out: Outcome) -> Result:
        res = Result(desc, str(out).splitlines()[0])
        if out.internal_error:
            res.problems.append(f"`{desc}` (no fault) failed with an internal error: {out.text}")
        return res

    def edit(self, rng: random.Random) -> str:
        k = self.world.knobs
        what = rng.choices(["gate", "policy", "rows", "b_rows", "transform", "spread",
                            "b_checks"], weights=[35, 15, 20, 15, 15, 15, 15])[0]
        if what == "gate":
            k = replace(k, gate_fails=not k.gate_fails)
        elif what == "policy":
            k = replace(k, on_gate_failure="quarantine_batch" if k.on_gate_failure == "halt"
                        else "halt")
        elif what == "rows":
            k = replace(k, rows_max=rng.choice([m for m in w.ROWS_MAX if m != k.rows_max]))
        elif what == "b_rows":
            k = replace(k, b_rows_max=rng.choice([m for m in w.B_ROWS_MAX if m != k.b_rows_max]))
        elif what == "spread":
            k = replace(k, spread=not k.spread)
        elif what == "b_checks":
            k = replace(k, b_checks=not k.b_checks)
        else:
            k = replace(k, upper_name=not k.upper_name)
        if k.b_rows_max > k.rows_max:  # sink b checks at least as much as the pipeline
            k = replace(k, b_rows_max=max(m for m in w.B_ROWS_MAX if m <= k.rows_max))
        self.world.write_pipeline(k)
        return f"{what}: {k.short()}"

    # -- faults -------------------------------------------------------------------------------
    def fault(self, kind: str, rng: random.Random) -> Result:
        self.faults[kind] += 1
        op = rng.choices(list(JOB_OPS), weights=list(JOB_OPS.values()))[0]
        point = rng.choice(POINTS)
        crash = rng.random() < 0.5          # kill: TIDEMARK_CRASH_AT, else pause + kill
        run_meanwhile = rng.random() < 0.6  # sigstop: a run while the job is stopped
        sink_u, backfill_rng, letters_rng = rng.random(), random.Random(rng.random()), \
            random.Random(rng.random())
        appended = self.append(rng, rng.randint(5, 20))
        env = {"TIDEMARK_LEASE_TTL_SECONDS": STOP_TTL} if kind == "sigstop" else {}
        how = {"env": env}
        if kind == "kill" and crash:
            how["crash_at"] = point
        else:
            how["pause_at"] = point
        # The faulted job: a run, one sink's run, a backfill or a redrive.
        job, what = None, op
        if op == "backfill":
            args = self._backfill_args(backfill_rng)
            if args:
                p, a, b, sinks = args
                job, what = self.sub.backfill(p, a, b, sinks, **how), \
                    f"backfill p{p} [{a},{b}){_sinks(sinks)}"
        elif op == "redrive":
            ids = self._letters(letters_rng, 8)
            if ids:
                job, what = self.sub.redrive(ids, **how), f"redrive {_short(ids)}"
        elif op == "run_sink":
            sink = w.SINKS[int(sink_u * len(w.SINKS))]
            job, what = self.sub.run([sink], **how), f"run --sink {sink}"
        if job is None:
            job, what = self.sub.run(**how), "run"
        self.jobs.append(job)
        mech = f"crash_at={point}" if "crash_at" in how else f"pause_at={point}"
        desc = f"FAULT {kind} {what} {mech}"
        res = Result(desc, "")
        notes = [appended.split(" (")[0]]
        try:
            if "crash_at" in how:
                notes.append(self._finish(job, res))
            elif not job.wait_reached(timeout=240):
                if job.alive():
                    job.kill()
                    notes.append("point not reached in 240s, killed")
                else:
                    notes.append("point not reached")
                notes.append(self._finish(job, res))
            else:
                notes.append(self._inject(kind, job, run_meanwhile, res))
        finally:
            if job.alive():
                job.kill()
                job.wait(30)
        res.outcome = "; ".join(n for n in notes if n)
        res.outcome += f" [log {job.log_path.name}]"
        return res

    def _finish(self, job: Job, res: Result) -> str:
        code, sig = job.wait(JOB_TIMEOUT)
        if job.timed_out:
            res.problems.append(f"job {job.log_path.name} hung: still running {JOB_TIMEOUT}s "
                                f"after its fault (killed); last output: "
                                + " | ".join(job.tail(5).splitlines()))
        return f"job killed (signal {sig})" if code is None else f"job exit {code}"

    def _inject(self, kind: str, job: Job, run_meanwhile: bool, res: Result) -> str:
        if kind == "kill":
            job.kill()
            return self._finish(job, res)
        if kind == "backends":
            gone = terminate_backends(self.world.ledger_dsn)
            job.resume()
            return f"terminated {len(gone)} backend(s); " + self._finish(job, res)
        if kind == "pg_restart":
            self.world.restart_postgres()
            job.resume()
            return "postgres restarted (immediate); " + self._finish(job, res)
        if kind == "sigstop":
            job.stop()
            time.sleep(STOP_TTL + 2)  # past the lease: heartbeats stopped with the job
            notes = ["stopped past its lease"]
            rec = self.inproc.recover()
            notes.append(f"recover {'ok' if rec.ok else rec}")
            if rec.internal_error:
                res.problems.append(f"recover during SIGSTOP: internal error: {rec.text}")
            if run_meanwhile:
                out = self.inproc.run()
                notes.append(f"run meanwhile: {str(out).splitlines()[0]}")
                if out.internal_error:
                    res.problems.append(f"run while a job was stopped: internal error: "
                                        f"{out.text}")
            job.cont()
            job.resume()
            notes.append("continued: " + self._finish(job, res))
            return "; ".join(notes)
        raise AssertionError(kind)

    def kill_all(self) -> None:
        for job in self.jobs:
            if job.alive() or job.stopped:
                job.kill()
            job.reap()


def _sinks(sinks: list[str] | None) -> str:
    return "".join(f" --sink {s}" for s in sinks or [])


def _short(ids: list[int]) -> str:
    return clamp(",".join(map(str, ids)), 40)
