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
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import psycopg
from psycopg import sql

from tidemark.core.faults import POINTS
from tidemark.core.text import clamp
from tidemark.devstack.chaos import world as w
from tidemark.devstack.chaos.adapter import InProcess, Outcome, Subprocess
from tidemark.devstack.chaos.faults import KINDS, Job, terminate_backends
from tidemark.devstack.chaos.source import FileArchive
from tidemark.ledger import checkpoints, dlq, runs, state

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
# The operations each optional feature (world.OPTIONAL) adds to the draw.
FEATURE_OPS: dict[str, dict[str, int]] = {
    # Time-window backfills (--since/--until, as text in several zones) in a world whose
    # source sessions default to another TimeZone; --partition all.
    "tz": {"backfill_time": 10, "backfill_all": 4},
    # A job stopped between its decision and its finish (or before its decision), and an
    # operator committing or rolling back its gids by hand.
    "gids": {"gids": 8},
    # Sinks that begin where the source ended (start: latest): backfills from below where a
    # sink began (cut there, or refused when wholly below), of every partition, of a window.
    "start": {"backfill_low": 8, "backfill_all": 4, "backfill_time": 4},
    # Discards, then `tidemark prune` with no keeping time; backfills over discarded records.
    "prune": {"discard": 8, "prune": 6, "backfill_discarded": 8},
    # Retention of the source: old records and segments deleted (tombstones too); backfills
    # and rebuilds then ask --accept-pruned half the time.
    "trim": {"trim": 6, "backfill": 14, "rebuild": 5},
    # file_archive: a segment that appears in a gap below a checkpoint.
    "late": {"late_segment": 8},
}
# What an operator does to a stopped run's prepared transactions (gids): the point it is
# stopped at, and the act. "rollback_chosen" needs `tidemark settle` (issue 45, case 3).
GID_ACTS = {
    "commit_chosen": ("after_decide", "before_commit_prepared", "mid_finish"),
    "rollback_unchosen": ("after_prepare", "after_decide"),
    "commit_unchosen": ("after_decide",),
    "rollback_chosen": ("after_decide", "before_commit_prepared", "mid_finish"),
}
# A time as an operator may type it: naive (UTC), Z, or another zone's offset.
TIME_ZONES = (None, "UTC", "Asia/Kathmandu", "America/St_Johns")
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
    # A job was interfered with (an operator's hands on its gids): an aborted run is no
    # problem in itself, as after a fault.
    faulted: bool = False


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
        weights = dict(TOMBSTONE_OPS if self.tombstones else OPS)
        for name in w.OPTIONAL:
            if getattr(world.features, name) not in (False, None, "earliest"):
                weights.update(FEATURE_OPS.get(name, {}))
        self.op_weights = weights
        self.oracle: Any = None  # the runner's Oracle (where each sink began)
        self.gid_acts: Counter[str] = Counter()
        # Operations that did something (not "skipped: ..."), and pipeline edits by kind
        # (a key split or merge: "split->merge"): what the summary's table of the issue 45
        # life operations counts.
        self.reached: Counter[str] = Counter()
        self.edits: Counter[str] = Counter()
        self.last_part: dict[int, int] = {}
        # What this step asked of dead letters (the oracle's input): ids redriven, discarded.
        self.redrive_ids: list[int] = []
        self.discard_ids: list[int] = []
        # This step: a re-delivery asked with --accept-pruned; positions trimmed from the
        # source; records that appeared below its end (a late segment: read it all again).
        self.accept_pruned = False
        self.trimmed: list[tuple[int, int]] = []
        self.reread = False
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
        res = self._perform(step)
        if not res.outcome.startswith("skipped"):
            self.reached[step.op if not step.fault else f"fault:{step.fault}"] += 1
        return res

    def _perform(self, step: Step) -> Result:
        rng = step.rng
        self.ops[step.op if not step.fault else f"fault:{step.fault}"] += 1
        self.redrive_ids, self.discard_ids = [], []
        self.accept_pruned, self.trimmed, self.reread = False, [], False
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
            accept = self._accept(rng)
            return self._inproc(
                f"backfill p{p} [{a},{b}){_sinks(sinks)}{' --accept-pruned' if accept else ''}",
                self.inproc.backfill(p, a, b, sinks, accept_pruned=accept),
            )
        if step.op == "rebuild":
            sink = rng.choice(w.SINKS)
            accept = self._accept(rng)
            return self._inproc(
                f"sink rebuild {sink}{' --accept-pruned' if accept else ''}",
                self.inproc.rebuild(sink, accept_pruned=accept),
            )
        if step.op == "trim":
            return self.trim(rng)
        if step.op == "late_segment":
            return self.late_segment(rng)
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
        if step.op == "backfill_time":
            return self.backfill_time(rng)
        if step.op == "backfill_all":
            sinks = rng.choice([None, None, ["a"], ["b"]])
            out = self.inproc.backfill_as_cli("all", sinks=sinks)
            return self._inproc(f"backfill --partition all{_sinks(sinks)}", out)
        if step.op == "prune":
            with_runs = rng.random() < 0.3
            return self._inproc(
                f"prune (letters{' and runs' if with_runs else ''}, 0 days)",
                self.inproc.prune(with_runs),
            )
        if step.op == "backfill_discarded":
            return self.backfill_discarded(rng)
        if step.op == "backfill_low":
            return self.backfill_low(rng)
        if step.op == "gids":
            return self.gids(rng)
        if step.op == "edit":
            return Result("edit", self.edit(rng))
        if step.op == "fault" and step.fault is not None:  # a fault step names its kind
            return self.fault(step.fault, rng)
        raise AssertionError(step.op)

    # -- time windows --------------------------------------------------------------------------
    def backfill_time(self, rng: random.Random) -> Result:
        """A backfill of a time window, typed as an operator would (a naive time is UTC, or a
        zone's offset), checked against the window's offsets as the source's own record times
        give them: per partition, the smallest range below the committed end holding every
        record whose time lies in [since, until) (docs/operations.md, "What to backfill")."""
        sinks = rng.choice([None, None, ["a"], ["b"]])
        u_part, u1, u2 = rng.random(), rng.random(), rng.random()
        edge_since, edge_until = rng.random() < 0.5, rng.random() < 0.5
        zone_s, zone_u = rng.choice(TIME_ZONES), rng.choice(TIME_ZONES)
        one = rng.random() < 0.3  # --partition N
        names = sinks or list(w.SINKS)
        cps = self.checkpoints()
        committed = {p: min(cps.get((s, p), 0) for s in names) for p in range(self.P)}
        recs = [r for r in self.world.source.records() if r.o < committed.get(r.p, 0) and r.ts]
        times: list[datetime] = sorted({r.ts for r in recs if r.ts is not None})
        if not times:
            return Result("backfill --since/--until", "skipped: nothing committed yet")
        i = int(u1 * len(times))
        j = i + int(u2 * (len(times) - i))  # the window's last batch (or the one after)
        # since: a batch's time exactly (inclusive) or just before it; until: a batch's time
        # exactly (exclusive: that batch is out) or just after the last batch in.
        since = times[i] - (timedelta(microseconds=1) if not edge_since else timedelta(0))
        if j >= len(times) or not edge_until:
            until = times[min(j, len(times) - 1)] + timedelta(microseconds=1)
        else:
            until = times[j]
        if until <= since:
            until = since + timedelta(microseconds=1)
        partition: int | str = int(u_part * self.P) if one else "all"
        want: dict[int, list[int]] = {}
        for r in recs:
            if (partition == "all" or r.p == partition) and r.ts and since <= r.ts < until:
                want.setdefault(r.p, []).append(r.o)
        expected = {p: (min(o), max(o) + 1) for p, o in want.items()}
        if self.oracle is not None:  # nothing below where every chosen sink began
            expected = self.oracle.cut_below_start(expected, names)
        s_txt, u_txt = _typed(since, zone_s), _typed(until, zone_u)
        desc = f"backfill --since {s_txt} --until {u_txt} --partition {partition}{_sinks(sinks)}"
        out = self.inproc.backfill_as_cli(partition, since=s_txt, until=u_txt, sinks=sinks)
        res = self._inproc(desc, out)
        got = {r.partition: (r.start, r.end) for r in out.ranges}
        if out.ok and got != expected:
            res.problems.append(
                f"`{desc}` re-delivered {_spans(got) or 'nothing'}, but the source's record "
                f"times put the window at {_spans(expected) or 'nothing'}"
            )
        elif out.code == 2 and expected:  # a run that fails is the oracle's to judge
            res.problems.append(f"`{desc}` refused: {out}; the window holds {_spans(expected)}")
        return res

    def _accept(self, rng: random.Random) -> bool:
        """--accept-pruned, half the time in a world whose source is trimmed (no draw else)."""
        self.accept_pruned = self.world.features.trim and rng.random() < 0.5
        return self.accept_pruned

    # -- the source's own life ------------------------------------------------------------------
    def trim(self, rng: random.Random) -> Result:
        """Retention deletes a partition's oldest records (a file archive: whole segments),
        below what every sink has committed there, tombstones like any other."""
        p, u = rng.randrange(self.P), rng.random()
        cps = self.checkpoints()
        m = min(cps.get((s, p), 0) for s in w.SINKS)
        if m == 0:
            return Result(f"trim p{p}", "skipped: nothing committed there by every sink")
        below = max(1, int(u * m))
        gone = self.world.source.trim(p, below)
        self.trimmed = gone
        tombs = 0
        if self.oracle is not None:
            tombs = sum(1 for pos in gone if self.oracle.source[pos].tombstone)
        return Result(
            f"trim p{p} below {below}",
            f"{len(gone)} record(s) deleted from the source ({tombs} tombstone(s))",
        )

    def late_segment(self, rng: random.Random) -> Result:
        """A segment appears inside a gap below a sink's checkpoint (file_archive). Recovery
        must report it (with the backfill that places it), the backfill it names must place
        it, and then it is reported no more."""
        src = self.world.source
        if not isinstance(src, FileArchive):
            return Result("late segment", "skipped: not a file archive")
        gaps = src.gaps
        u, n_u, old_u = rng.random(), rng.random(), rng.random()
        if self.world.knobs.gate_fails:
            # The named backfill is refused by the gate (rightly: it changes nothing), and
            # the records would stay below the checkpoint unplaced until a later edit mends
            # the gate: an operator's order of work the checker does not model.
            return Result("late segment", "skipped: the gate fails every batch now")
        cps = self.checkpoints()
        below = [
            (p, a, b)
            for p, spans in sorted(gaps.items())
            for a, b in spans
            if any(cps.get((s, p), 0) >= b for s in w.SINKS)
        ]
        if not below:
            return Result("late segment", "skipped: no gap below a checkpoint")
        p, a, b = below[int(u * len(below))]
        n = 1 + int(n_u * (b - a))
        # New orders of this partition, sometimes an older version of an existing id.
        recs: list[tuple] = []
        for k in range(n):
            ours = [i for i in self.ids if i % self.P == p]
            if k == 0 and ours and old_u < 0.4:
                i = ours[int(old_u / 0.4 * len(ours))]
            else:
                i, self.next_id = self.next_id, self.next_id + 1
                while i % self.P != p:
                    i, self.next_id = self.next_id, self.next_id + 1
                self.ids.append(i)
            recs.append(("order", i, round(rng.uniform(0, w.CLEAN_MAX), 2), p))
        self.appended["clean"] += n
        self.appended["late"] += n
        src.write_late(p, a, self._versioned(recs, rng), rng)
        self.reread = True
        desc = f"late segment p{p} [{a},{a + n}) in gap [{a},{b})"
        res = Result(desc, "")
        found = self.inproc.late()
        if not found.ok:
            res.problems.append(f"looking for late records failed: {found}")
            res.outcome = str(found)
            return res
        mine = [x for x in found.late if x[1] == p and x[2] <= a < x[3]]
        expect = {s for s in w.SINKS if cps.get((s, p), 0) >= b and self._stepped_over(s, p, a)}
        if not mine and expect:
            res.problems.append(
                f"{n} record(s) appeared at {p}:{a} below the checkpoint of "
                f"{', '.join(sorted(expect))}, and nothing reports them (recover, status)"
            )
        notes = [f"reported for {', '.join(sorted(x[0] for x in mine)) or 'no sink'}"]
        for sink, q, start, end, command in mine:
            if f"--from {start} --to {end}" not in command or "tidemark backfill" not in command:
                res.problems.append(f"late records reported with an odd command: {command}")
            out = self.inproc.backfill_as_cli(q, start, end, sinks=[sink])
            self.seen(self.inproc.log)
            notes.append(f"backfill {sink} p{q} [{start},{end}): {str(out).splitlines()[0]}")
            if not out.ok:
                res.problems.append(f"the backfill that late records name failed: {out}")
        again = self.inproc.late()
        left = [x for x in again.late if x[1] == p and x[2] <= a < x[3]]
        if left:
            res.problems.append(f"late records still reported after their backfill: {left}")
        res.outcome = "; ".join(notes)
        return res

    def _stepped_over(self, sink: str, p: int, a: int) -> bool:
        """Whether a committed run of ``sink`` read over offset ``a`` of partition ``p`` (it
        then recorded the gap): at or above where the sink began."""
        if self.oracle is None:
            return True
        return a >= self.oracle.began.get((sink, p), 0)

    def backfill_discarded(self, rng: random.Random) -> Result:
        """A backfill of a few offsets around a discarded letter's record, of its sink or all."""
        u, before, after, both = rng.random(), rng.randint(0, 5), rng.randint(0, 5), rng.random()
        with self._ledger() as conn:
            found = dlq.positions(conn, w.PIPELINE, "discarded")
        if not found:
            return Result("backfill (a discarded record)", "skipped: no discarded letter")
        s, p, o = found[int(u * len(found))]
        sinks = None if both < 0.3 else [s]
        cps = self.checkpoints()
        m = min(cps.get((n, p), 0) for n in (sinks or w.SINKS))
        a, b = max(0, o - before), min(m, o + 1 + after)
        if b <= a:
            return Result("backfill (a discarded record)", "skipped: not committed for every sink")
        desc = f"backfill p{p} [{a},{b}){_sinks(sinks)} over discarded {p}:{o} of {s}"
        return self._inproc(desc, self.inproc.backfill(p, a, b, sinks))

    def backfill_low(self, rng: random.Random) -> Result:
        """`tidemark backfill --partition P --from A --to B` with A below where a chosen sink
        began: the CLI cuts it at the lowest start of the chosen sinks (each sink's run at its
        own), or refuses it (exit 2) when it lies wholly below."""
        sinks = rng.choice([None, None, ["a"], ["b"]])
        p, u1, u2 = rng.randrange(self.P), rng.random(), rng.random()
        names = sinks or list(w.SINKS)
        cps = self.checkpoints()
        m = min(cps.get((s, p), 0) for s in names)
        if m == 0 or self.oracle is None:
            return Result("backfill (below the start)", "skipped: nothing committed there yet")
        floor = min(self.oracle.began.get((s, p), 0) for s in names)
        start = int(u1 * (floor + 1)) if floor else 0  # at or below the lowest start
        end = start + 1 + int(u2 * (m - start - 1))
        desc = f"backfill p{p} [{start},{end}){_sinks(sinks)} (began at {floor})"
        out = self.inproc.backfill_as_cli(p, start, end, sinks=sinks)
        res = self._inproc(desc, out)
        expected = self.oracle.cut_below_start({p: (start, end)}, names)
        got = {r.partition: (r.start, r.end) for r in out.ranges}
        if not expected:
            if out.code != 2:
                res.problems.append(
                    f"`{desc}` lies wholly below where the sinks began: it should be refused "
                    f"(exit 2), got {out}"
                )
        elif out.ok and got != expected:
            res.problems.append(
                f"`{desc}` re-delivered {_spans(got) or 'nothing'}, should be {_spans(expected)}"
            )
        elif out.ok and start < floor and not any("began at" in line for line in out.said):
            res.problems.append(f"`{desc}` was cut without saying so: {out.said}")
        return res

    # -- an operator's hands on a stopped run's prepared transactions ---------------------------
    def gids(
        self,
        rng: random.Random,
        act: str | None = None,
        point: str | None = None,
        go_on: bool | None = None,
    ) -> Result:
        """A run (or one sink's run) stopped at a protocol point between its prepare and its
        finish; the operator commits or rolls back some of its prepared transactions by hand
        (``GID_ACTS``); then the job goes on or is killed, and recovery settles it. The oracle
        then holds the sinks to what the run decided: each record placed exactly once."""
        drawn = rng.choice(self.gid_acts_on)
        act = act or drawn
        drawn_point = rng.choice(GID_ACTS[act])
        point = point or drawn_point
        sink_u, how_many_u, go_u = rng.random(), rng.random(), rng.random()
        go_on = go_u < 0.5 if go_on is None else go_on
        appended = self.append(rng, rng.randint(5, 20))
        sinks = None if sink_u < 0.6 else [w.SINKS[int((sink_u - 0.6) / 0.4 * len(w.SINKS))]]
        job = self.sub.run(sinks, pause_at=point)
        self.jobs.append(job)
        desc = f"GIDS {act} at {point}: run{_sinks(sinks)}"
        res = Result(desc, "", faulted=True)
        notes = [appended.split(" (")[0]]
        self.gid_acts[act] += 1
        try:
            if not job.wait_reached(timeout=240):
                notes.append("point not reached")
                notes.append(self._finish(job, res))
            else:
                notes.append(self._operator(act, how_many_u))
                if go_on:
                    job.resume()
                    notes.append("job resumed: " + self._finish(job, res))
                else:
                    job.kill()
                    notes.append("job killed: " + self._finish(job, res))
                # A gid rolled back after the run verified its prepares (at after_prepare, the
                # decision still to come, it will choose it) is lost like a chosen one.
                if act.startswith("rollback") and "rollback_chosen" in self.gid_acts_on:
                    notes.append(self._settle(res))
        finally:
            if job.alive():
                job.kill()
                job.wait(30)
            self.seen(job.tail(10_000).splitlines())
        res.outcome = "; ".join(n for n in notes if n) + f" [log {job.log_path.name}]"
        return res

    @property
    def gid_acts_on(self) -> tuple[str, ...]:
        """Rolling back a chosen gid needs `tidemark settle` (the product's answer to it)."""
        import importlib.util

        settle = importlib.util.find_spec("tidemark.driver.settle") is not None
        return tuple(a for a in GID_ACTS if settle or a != "rollback_chosen")

    def _settle(self, res: Result) -> str:
        """After a chosen gid was rolled back: recovery reports the halt naming `tidemark
        settle RUN`; run that (a process, as an operator would) and say what it did."""
        rec = self.inproc.recover()
        m = re.search(r"tidemark settle (\d+)", rec.text)
        with self._ledger() as conn:
            reason = state.halted(conn, w.PIPELINE) or ""
        m = m or re.search(r"tidemark settle (\d+)", reason)
        if not m:
            if reason:
                res.problems.append(f"halted without naming `tidemark settle RUN`: {reason}")
            return f"recover: {rec}" + (f"; halted: {reason}" if reason else "; not halted")
        job = self.sub.settle(int(m[1]))
        self.jobs.append(job)
        code = self._finish(job, res)
        if code != "job exit 0":
            res.problems.append(
                f"`tidemark settle {m[1]}` failed ({code}): " + " | ".join(job.tail(5).splitlines())
            )
        return f"recover named settle {m[1]}; settle: {code}"

    def _operator(self, act: str, u: float) -> str:
        """Do ``act`` to the newest run's prepared transactions; say what was done."""
        prefix = self.inproc._settings().gid_prefix
        with self._ledger() as conn:
            run_id = runs.newest_of(conn, w.PIPELINE)
            if run_id is None:
                return "no run"
            chosen = runs.participant_gids(conn, run_id)
            prepared = conn.execute(
                "SELECT database, gid FROM pg_prepared_xacts WHERE gid LIKE %s "
                "AND database = ANY(%s) ORDER BY 2",  # the world's: its cluster may be shared
                (f"{prefix}:{run_id}:%", self.world.databases),
            ).fetchall()
        pool = [(db, g) for db, g in prepared if (g in chosen) == act.endswith("_chosen")]
        if not pool:
            return f"run {run_id}: no {act.split('_')[1]} gid prepared ({len(prepared)} prepared)"
        pick = pool[: max(1, round(u * len(pool)))]
        verb = "COMMIT" if act.startswith("commit") else "ROLLBACK"
        for db, g in pick:
            dsn = self.world.cluster.dsn(db)
            with psycopg.connect(dsn, autocommit=True, application_name="chaos-operator") as c:
                c.execute(sql.SQL(verb + " PREPARED {}").format(sql.Literal(g)))
        return f"run {run_id}: {verb} PREPARED {len(pick)} of {len(pool)} ({_short([g for _, g in pick])})"

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
        splits = self.world.features.split
        if splits:  # a key split or merge, or back to plain keys
            choices.append("split")
            weights.append(25)
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
        elif what == "split":
            k = replace(k, variant=rng.choice([v for v in (*w.SPLITS, "plain") if v != k.variant]))
        else:
            variants = [v for v in w.VARIANTS if splits or v not in w.SPLITS]
            k = replace(k, variant=rng.choice([v for v in variants if v != k.variant]))
        if k.b_rows_max > k.rows_max:  # sink b checks at least as much as the pipeline
            k = replace(k, b_rows_max=max(m for m in w.B_ROWS_MAX if m <= k.rows_max))
        self.world.write_pipeline(k)
        self.edits[f"{what}->{k.variant}" if what in ("split", "transform") else what] += 1
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


def _typed(t: datetime, zone: str | None) -> str:
    """``t`` as an operator types it: naive UTC, or in ``zone`` with its offset (Z for UTC)."""
    if zone is None:
        return t.astimezone(UTC).replace(tzinfo=None).isoformat()
    if zone == "UTC":
        return t.astimezone(UTC).replace(tzinfo=None).isoformat() + "Z"
    return t.astimezone(ZoneInfo(zone)).isoformat()


def _spans(r: dict[int, tuple[int, int]]) -> str:
    return " ".join(f"p{p}[{a},{b})" for p, (a, b) in sorted(r.items()))


def _short(ids: list) -> str:
    return clamp(",".join(map(str, ids)), 40)
