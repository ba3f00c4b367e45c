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
import re
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg

from tidemark.core.faults import POINTS
from tidemark.core.text import clamp
from tidemark.devstack.chaos import world as w
from tidemark.devstack.chaos.adapter import InProcess, Outcome, Subprocess
from tidemark.devstack.chaos.faults import KINDS, Job, terminate_backends
from tidemark.ledger import checkpoints, dlq

OPS = {
    "append": 12,
    "append_poison": 8,
    "append_chain": 8,
    "run": 18,
    "run_sink": 10,
    "backfill": 10,
    "redrive": 8,
    "rebuild": 3,
    "discard": 5,
    "edit": 14,
}
# Worlds with tombstones also append tombstones of existing keys (Features.tombstones).
TOMBSTONE_OPS = {**OPS, "append_tombstone": 12}
POISON = ("not_json", "bad_utf8", "wrong_type", "null_id", "empty", "out_of_range")
JOB_OPS = {"run": 60, "run_sink": 15, "backfill": 15, "redrive": 10, "rebuild": 6}
STOP_TTL = 10  # lease TTL of a job that gets SIGSTOPped (the settings' minimum)
JOB_TIMEOUT = 300  # a job that outlives this after its fault is hung (a problem)
TIE = 0.3  # versioned worlds: a new version repeats the last one's number

# What a run's log says about how it ran (the messages of tidemark/driver/writing.py): its layout
# (tidemark/driver/modes.py Layout) and its quality path (docs/quality.md, "One pass").
_RUN_LINE = re.compile(r"\brun (\d+)(?: sink \w+)?: (.*)")


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


def plan(seed: int, n: int, fault_every: int, ops: dict[str, int] = OPS) -> Step:
    rng = step_rng(seed, n)
    if n == 1:
        return Step(n, "append", None, rng)  # something to replay from the start
    if n % fault_every == 0:
        k = sum(1 for m in range(2, n + 1) if m % fault_every == 0) - 1  # slots before n
        order = fault_order(seed)
        kind = order[k] if k < len(order) else rng.choice(KINDS)
        return Step(n, "fault", kind, rng)
    op = rng.choices(list(ops), weights=list(ops.values()))[0]
    return Step(n, op, None, rng)


@dataclass
class Result:
    desc: str
    outcome: str
    problems: list[str] = field(default_factory=list)  # operation-level findings


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
        self.versioned = world.features.versioned
        self.tombstones = world.features.tombstones
        self.op_weights = TOMBSTONE_OPS if self.tombstones else OPS
        self.last_part: dict[int, int] = {}
        # What this step asked of dead letters (the oracle's input): ids redriven, discarded.
        self.redrive_ids: list[int] = []
        self.discard_ids: list[int] = []
        # run id -> (layout, quality path) as its log tells them.
        self.paths: dict[int, dict[str, str]] = {}

    # -- records ------------------------------------------------------------------------------
    # An order is drawn as ("order", id, amount, partition) and gets its version number once
    # the batch is shuffled (_versioned), so versions grow with offsets within a partition.
    def _new_id(self, rng: random.Random) -> int:
        if self.ids and rng.random() < 0.15:
            return self.ids[rng.randrange(len(self.ids))]
        i, self.next_id = self.next_id, self.next_id + 1
        self.ids.append(i)
        return i

    def _part(self, i: int, rng: random.Random) -> int:
        """An id's partition: its own; in a versioned world a new version may go anywhere."""
        if self.versioned and i in self.versions and rng.random() < 0.5:
            return rng.randrange(self.P)
        return i % self.P

    def _draft(self, i: int, amount: float, rng: random.Random) -> tuple:
        return ("order", i, amount, self._part(i, rng))

    def _versioned(self, recs: list[tuple], rng: random.Random) -> list[tuple]:
        out: list[tuple] = []
        for r in recs:
            if r[0] == "tomb":  # a key and no payload
                i = r[1]
                out.append(
                    (
                        i % self.P,
                        str(i).encode(),
                        None,
                        f'{{"tombstone": true, "trace": "t-{i}-x"}}',
                    )
                )
                continue
            if r[0] != "order":
                out.append(r)
                continue
            _, i, amount, p = r
            last = self.versions.get(i, 0)
            v = last if last and self.versioned and rng.random() < TIE else last + 1
            self.versions[i] = v
            body = {"id": i, "name": f"order-{i}-v{v}", "amount": amount, "version": v}
            # Headers a round trip through a parser would change: jsonb keeps "1.50" and
            # "Zürich" as written (a Python one gives 1.5 and "Z\u00fcrich").
            headers = f'{{"v": {v}, "trace": "t-{i}-{v}", "zone": "Zürich", "w": 1.50}}'
            out.append((p, str(i).encode(), json.dumps(body).encode(), headers))
        return out

    def clean(self, rng: random.Random) -> tuple:
        self.appended["clean"] += 1
        return self._draft(self._new_id(rng), round(rng.uniform(0, w.CLEAN_MAX), 2), rng)

    def poison(self, rng: random.Random) -> tuple:
        kind = rng.choice(POISON)
        self.appended["poison"] += 1
        self.appended[f"poison:{kind}"] += 1
        p = rng.randrange(self.P)
        tag = rng.randrange(10**6)
        payload: bytes | None
        if kind == "out_of_range":  # a real order (new id or new version) failing row checks
            return self._draft(self._new_id(rng), round(rng.uniform(*w.OUT_OF_RANGE), 2), rng)
        if kind == "wrong_type":
            if rng.random() < 0.5:
                payload = json.dumps(
                    {"id": f"order-{tag}", "name": "x", "amount": 1.0, "version": 1}
                ).encode()
            else:  # a readable id of its own, an amount that is not a number
                i, self.next_id = self.next_id, self.next_id + 1
                p = i % self.P
                payload = json.dumps(
                    {"id": i, "name": "x", "amount": "lots", "version": 1}
                ).encode()
        elif kind == "not_json":
            payload = b'{"id": %d, "name": not json' % tag
        elif kind == "bad_utf8":
            payload = b'{"id": 7, "name": "\xff\xfe\xfa", "amount": 1.0, "version": 1}'
        elif kind == "null_id":
            payload = json.dumps(
                {"id": None, "name": "no id", "amount": 2.0, "version": 1}
            ).encode()
        else:  # empty: no bytes at all, or no payload
            payload = b"" if rng.random() < 0.5 else None
        return (p, f"poison-{kind}-{tag}".encode(), payload, None)

    def chain(self, rng: random.Random) -> list[tuple]:
        """A long version chain: many versions of a few ids, some failing the row checks."""
        ids = [
            self._new_id(rng)
            if not self.ids or rng.random() < 0.3
            else self.ids[rng.randrange(len(self.ids))]
            for _ in range(rng.randint(1, 3))
        ]
        recs = []
        for _ in range(rng.randint(6, 16)):
            bad = rng.random() < 0.3
            amount = rng.uniform(*w.OUT_OF_RANGE) if bad else rng.uniform(0, w.CLEAN_MAX)
            recs.append(self._draft(ids[rng.randrange(len(ids))], round(amount, 2), rng))
            self.appended["chain"] += 1
        return recs

    def tombs(self, rng: random.Random) -> list[tuple]:
        """Tombstones of a few existing keys, often with a newer (or older, by shuffling)
        version of one of them in the same batch."""
        if not self.ids:
            return []
        ids = sorted({self.ids[rng.randrange(len(self.ids))] for _ in range(rng.randint(1, 4))})
        recs = [("tomb", i) for i in ids]
        self.appended["tombstone"] += len(recs)
        if rng.random() < 0.4:
            recs.append(
                self._draft(
                    ids[rng.randrange(len(ids))], round(rng.uniform(0, w.CLEAN_MAX), 2), rng
                )
            )
            self.appended["clean"] += 1
        return recs

    def append(
        self,
        rng: random.Random,
        clean: int,
        poison: int = 0,
        chain: bool = False,
        tombs: bool = False,
    ) -> str:
        recs = [self.clean(rng) for _ in range(clean)] + [self.poison(rng) for _ in range(poison)]
        if chain:
            recs += self.chain(rng)
        n_tombs = 0
        if tombs:
            more = self.tombs(rng)
            n_tombs = sum(1 for r in more if r[0] == "tomb")
            recs += more
        rng.shuffle(recs)
        spans = self.world.append(self._versioned(recs, rng), rng)
        where = " ".join(f"p{p}:{a}-{b}" for p, (a, b) in sorted(spans.items()))
        what = (
            f"{clean} clean + {poison} poison"
            + (" + a version chain" if chain else "")
            + (f" + {n_tombs} tombstone(s)" if tombs else "")
        )
        return f"appended {what} ({where})"

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
            return dlq.matching_ids(
                conn, dlq.Filters.parse(pipeline=w.PIPELINE, status="quarantined")
            )

    def _backfill_args(self, rng: random.Random):
        sinks = rng.choice([None, None, ["a"], ["b"]])
        p = rng.randrange(self.P)
        u1, u2, in_chain, u3 = rng.random(), rng.random(), rng.random() < 0.5, rng.random()
        cps = self.checkpoints()
        m = min(cps.get((s, p), 0) for s in (sinks or w.SINKS))
        if m == 0:
            return None
        if in_chain and (span := self._in_chain(p, m, random.Random(u3))):
            return p, *span, sinks
        start = int(u1 * m)
        end = start + 1 + int(u2 * (m - start - 1))
        return p, start, end, sinks

    def _in_chain(self, p: int, below: int, r: random.Random) -> tuple[int, int] | None:
        """A range that starts or ends between two versions of one key (three or more of
        its versions below ``below``), or None."""
        by_key: dict[bytes | None, list[int]] = {}
        for rec in self.world.source.records():
            if rec.p == p and rec.o < below:
                by_key.setdefault(rec.key, []).append(rec.o)
        chains = [
            (sorted(offs),)
            for key, offs in sorted(by_key.items(), key=lambda kv: (kv[0] is None, kv[0] or b""))
            if len(offs) >= 3
        ]
        if not chains:
            return None
        offs = chains[r.randrange(len(chains))][0]
        i = r.randrange(1, len(offs))  # after the first version
        start = offs[i] if r.random() < 0.5 else r.randint(0, offs[i])
        j = r.randrange(i, len(offs))
        end = offs[j] + (1 if j == i or r.random() < 0.3 else 0)  # before version j, often
        end = end if r.random() < 0.7 else r.randint(end, below)  # or past the chain
        return start, max(end, start + 1)

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
        self.redrive_ids, self.discard_ids = [], []
        if step.op == "append" and step.n == 1:  # a first batch, with some poison
            return Result("append", self.append(rng, rng.randint(60, 120), rng.randint(3, 8)))
        if step.op == "append":
            return Result("append", self.append(rng, rng.randint(5, 40)))
        if step.op == "append_chain":
            return Result("append chain", self.append(rng, rng.randint(0, 5), chain=True))
        if step.op == "append_tombstone":
            return Result("append tombstone", self.append(rng, rng.randint(0, 5), tombs=True))
        if step.op == "append_poison":
            return Result("append poison", self.append(rng, rng.randint(0, 10), rng.randint(1, 6)))
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
            return self._inproc(
                f"backfill p{p} [{a},{b}){_sinks(sinks)}", self.inproc.backfill(p, a, b, sinks)
            )
        if step.op == "rebuild":
            sink = rng.choice(w.SINKS)
            return self._inproc(f"sink rebuild {sink}", self.inproc.rebuild(sink))
        if step.op == "redrive":
            ids = self._letters(rng, 8)
            if not ids:
                return Result("redrive", "skipped: no quarantined letters")
            self.redrive_ids = ids
            return self._inproc(f"redrive {_short(ids)}", self.inproc.redrive(ids))
        if step.op == "discard":
            ids = self._letters(rng, 3)
            if not ids:
                return Result("discard", "skipped: no quarantined letters")
            out = self.inproc.discard(ids)
            if out.ok:  # all or nothing (tidemark/ledger/dlq.py discard)
                self.discard_ids = ids
            return self._inproc(f"discard {_short(ids)}", out)
        if step.op == "edit":
            return Result("edit", self.edit(rng))
        if step.op == "fault" and step.fault is not None:  # a fault step names its kind
            return self.fault(step.fault, rng)
        raise AssertionError(step.op)

    def _inproc(self, desc: str, out: Outcome) -> Result:
        self.seen(self.inproc.log)
        res = Result(desc, str(out).splitlines()[0])
        if out.internal_error:
            res.problems.append(f"`{desc}` (no fault) failed with an internal error: {out.text}")
        return res

    def seen(self, lines: Iterable[str]) -> None:
        """Learn each run's layout and quality path from its log lines."""
        for line in lines:
            m = _RUN_LINE.search(line)
            if not m:
                continue
            run, text = int(m[1]), m[2]
            got = self.paths.setdefault(run, {})
            if "write task(s) over" in text:
                got["layout"] = "spread" if "spread by" in text else "together"
            elif "while writing" in text:
                got["quality"] = "one pass"
            elif "rolled back the write, checking the batch" in text:
                got["quality"] = "fallback"
            elif "checking data quality" in text and got.get("quality") != "fallback":
                got["quality"] = "checking first"

    def coverage(self) -> dict[str, Counter[str]]:
        """How many runs took each layout and quality path (a run that logged a quality
        path but no layout message wrote one task per range)."""
        layouts: Counter[str] = Counter()
        quality: Counter[str] = Counter()
        for got in self.paths.values():
            if "quality" in got:
                quality[got["quality"]] += 1
                layouts[got.get("layout", "ranges")] += 1
        return {"layouts": layouts, "quality paths": quality}

    def edit(self, rng: random.Random) -> str:
        k = self.world.knobs
        # A failing gate blocks every run and backfill: the next edit most often restores it.
        choices = [
            "gate",
            "policy",
            "rows",
            "rows_min",
            "b_rows",
            "transform",
            "spread",
            "b_checks",
        ]
        weights = [90 if k.gate_fails else 25, 15, 20, 15, 15, 20, 15, 15]
        if self.tombstones:
            choices += ["tombstones", "b_tombstones"]
            weights += [25, 10]
        what = rng.choices(choices, weights=weights)[0]
        if what == "gate":
            k = replace(k, gate_fails=not k.gate_fails)
        elif what == "policy":
            k = replace(
                k, on_gate_failure="quarantine_batch" if k.on_gate_failure == "halt" else "halt"
            )
        elif what == "rows":
            k = replace(k, rows_max=rng.choice([m for m in w.ROWS_MAX if m != k.rows_max]))
        elif what == "rows_min":
            k = replace(k, rows_min=rng.choice([m for m in w.ROWS_MIN if m != k.rows_min]))
        elif what == "b_rows":
            k = replace(k, b_rows_max=rng.choice([m for m in w.B_ROWS_MAX if m != k.b_rows_max]))
        elif what == "spread":
            k = replace(k, spread=not k.spread)
        elif what == "b_checks":
            k = replace(k, b_checks=not k.b_checks)
        elif what == "tombstones":
            k = replace(k, tombstones="delete" if k.tombstones == "quarantine" else "quarantine")
        elif what == "b_tombstones":
            k = replace(
                k,
                b_tombstones=rng.choice([t for t in (None, *w.TOMBSTONES) if t != k.b_tombstones]),
            )
        else:
            k = replace(k, variant=rng.choice([v for v in w.VARIANTS if v != k.variant]))
        if k.b_rows_max > k.rows_max:  # sink b checks at least as much as the pipeline
            k = replace(k, b_rows_max=max(m for m in w.B_ROWS_MAX if m <= k.rows_max))
        self.world.write_pipeline(k)
        return f"{what}: {k.short()}"

    # -- faults -------------------------------------------------------------------------------
    def fault(self, kind: str, rng: random.Random) -> Result:
        self.faults[kind] += 1
        op = rng.choices(list(JOB_OPS), weights=list(JOB_OPS.values()))[0]
        point = rng.choice(POINTS)
        crash = rng.random() < 0.5  # kill: TIDEMARK_CRASH_AT, else pause + kill
        run_meanwhile = rng.random() < 0.6  # sigstop: a run while the job is stopped
        sink_u, backfill_rng, letters_rng = (
            rng.random(),
            random.Random(rng.random()),
            random.Random(rng.random()),
        )
        appended = self.append(rng, rng.randint(5, 20))
        env = {"TIDEMARK_LEASE_TTL_SECONDS": STOP_TTL} if kind == "sigstop" else {}
        how: dict[str, Any] = {"env": env}
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
                job, what = (
                    self.sub.backfill(p, a, b, sinks, **how),
                    f"backfill p{p} [{a},{b}){_sinks(sinks)}",
                )
        elif op == "redrive":
            ids = self._letters(letters_rng, 8)
            if ids:
                job, what = self.sub.redrive(ids, **how), f"redrive {_short(ids)}"
                self.redrive_ids = ids
        elif op == "run_sink":
            sink = w.SINKS[int(sink_u * len(w.SINKS))]
            job, what = self.sub.run([sink], **how), f"run --sink {sink}"
        elif op == "rebuild":
            sink = w.SINKS[int(sink_u * len(w.SINKS))]
            job, what = self.sub.rebuild(sink, **how), f"sink rebuild {sink}"
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
            self.seen(job.tail(10_000).splitlines())
        res.outcome = "; ".join(n for n in notes if n)
        res.outcome += f" [log {job.log_path.name}]"
        return res

    def _finish(self, job: Job, res: Result) -> str:
        code, sig = job.wait(JOB_TIMEOUT)
        if job.timed_out:
            res.problems.append(
                f"job {job.log_path.name} hung: still running {JOB_TIMEOUT}s "
                f"after its fault (killed); last output: " + " | ".join(job.tail(5).splitlines())
            )
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
                self.seen(self.inproc.log)
                notes.append(f"run meanwhile: {str(out).splitlines()[0]}")
                if out.internal_error:
                    res.problems.append(f"run while a job was stopped: internal error: {out.text}")
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
