"""The chaos oracle: what every sink and the DLQ must hold, row for row.

It keeps its own model of the world, independent of the data path (nothing from
tidemark.engine, driver or quality): the source records, and per sink the rows and live
dead letters that docs/design.md's delivery and re-delivery rules leave, computed in plain
Python from each record and the pipeline version (``Knobs``) that last delivered or
re-delivered it. The model's own decode, transform (world.VARIANTS, the same mapping) and
row checks mirror the pipeline file world.py writes. Tombstones (a key and no payload, in worlds whose transform
keys rows by the source key) are versions of their key that place no row where the sink's
``tombstones`` is ``delete`` (``SinkModel.tombs`` is what the sink's tombstone table keeps:
each deleted key's newest tombstone, which keeps older rows out from then on), and dead
letters where it is ``quarantine``. The source records come through world.source (a table or
a folder of segments: source.py).

What it learns from outside: which (run, sink) committed, its mode and ranges
(``tidemark.run_sinks``, ``run_ranges``: a failed or rolled-back run changes nothing), and a
batch gate's verdict (``tidemark.dq_results``: the gate's mean is the data path's to compute,
the model only applies what a failing verdict means). A redrive's records are the letters
chaos asked for. After every step, :meth:`Oracle.compare` reads each sink and the live
letters (one query each) and reports every difference.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

import psycopg
from psycopg import sql

from tidemark.devstack.chaos import world as w
from tidemark.devstack.chaos.checker import APP, Problem, Target, _ident, starts

Pos = tuple[int, int]
LIVE = ("quarantined", "discarded")
# The decode schema world.py declares, as the JSON types that read as each field.
FIELDS: dict[str, tuple[type, ...]] = {
    "id": (int,),
    "name": (str,),
    "amount": (int, float),
    "version": (int,),
}


@dataclass(frozen=True)
class Record:
    p: int
    o: int
    payload: bytes | None
    headers: str | None  # as the source log reads them (jsonb as text)
    ts: datetime | None
    key: bytes | None = None

    @property
    def tombstone(self) -> bool:
        """A key and no payload."""
        return self.payload is None and self.key is not None


@dataclass(frozen=True)
class Tomb:
    """A tombstone that deletes its key: a version of the key that places no row."""

    key: int
    order: tuple
    pos: Pos


@dataclass(frozen=True)
class Row:
    key: int
    order: tuple  # version order of the key: larger is newer
    cols: tuple  # the sink's columns, COLUMNS order

    @property
    def pos(self) -> Pos:
        return self.cols[-2], self.cols[-1]


def decode(payload: bytes | None) -> dict | None:
    """The record's fields, or None where the pipeline's decode quarantines it (empty, not
    UTF-8, not a JSON object, a field that does not read as its declared type)."""
    if not payload:
        return None
    try:
        doc = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    out = {}
    for name, types in FIELDS.items():
        v = doc.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, types)):
            return None
        out[name] = float(v) if name == "amount" and isinstance(v, int | float) else v
    return out


class Pipeline:
    """One pipeline version for one sink, in plain Python."""

    def __init__(self, knobs: w.Knobs, features: w.Features, sink: str):
        self.k, self.f, self.sink = knobs, features, sink

    @property
    def deletes(self) -> bool:
        return self.k.tombstones_of(self.sink) == "delete"

    def key_of(self, d: dict | None, rec: Record) -> int | None:
        """The sink key: the payload's id, or (worlds with tombstones, world.KEY_ID) the source
        key's number; None where it is NULL."""
        if self.f.tombstones:
            text = rec.key.decode("ascii", "replace") if rec.key is not None else ""
            i = int(text) if re.fullmatch(r"[0-9]+", text) else None
        else:
            i = None if d is None else d["id"]
        if i is None:
            return None
        v = self.k.variant
        if v == "rekey":
            return i + w.KEY_SHIFT
        if v == "split":  # SQL: amount > SPLIT_AT is NULL (false) without an amount
            big = d is not None and d["amount"] is not None and d["amount"] > w.SPLIT_AT
            return i + (w.SPLIT_SHIFT if big else 0)
        if v == "merge":  # Spark's pmod: never negative
            return i - i % (2 * w.MERGE) + i % w.MERGE
        return i

    def tomb(self, rec: Record) -> Tomb | None:
        """A tombstone that deletes its key for this sink, or None where it is quarantined."""
        if not self.deletes:
            return None
        k = self.key_of(None, rec)
        return None if k is None else Tomb(k, (rec.p, rec.o), (rec.p, rec.o))

    def order(self, rec: Record, d: dict) -> tuple:
        if self.f.versioned:  # equal versions: (partition, offset) breaks the tie
            return (d["version"] if d["version"] is not None else -1, rec.p, rec.o)
        return (rec.p, rec.o)

    def keyed(self, rec: Record) -> tuple[int, tuple] | None:
        """(key, version order) of a record this pipeline can key, passing or not (a
        tombstone too, where keys come from source keys)."""
        d = decode(rec.payload)
        if self.f.tombstones:
            k = self.key_of(d, rec)
            return None if k is None else (k, (rec.p, rec.o))
        if d is None or d["id"] is None:
            return None
        k = self.key_of(d, rec)
        return None if k is None else (k, self.order(rec, d))

    def row(self, rec: Record) -> Row | None:
        """The record's row, or None where this pipeline quarantines it for this sink."""
        d = decode(rec.payload)
        key = None if d is None else self.key_of(d, rec)
        if d is None or key is None:  # decode; required id
            return None
        if self.f.versioned and d["version"] is None:  # the version column is NOT NULL
            return None
        amount = d["amount"]
        if amount is not None:  # GX's between passes NULL
            if amount > self.k.rows_max or amount < self.k.rows_min:
                return None
            if self.sink == "b" and self.k.b_checks and amount > self.k.b_rows_max:
                return None
        name = d["name"]
        if name is not None and self.k.variant == "upper":
            name = name.upper()
        cols: tuple = (key, name, amount, d["version"])
        if self.f.meta:
            cols += (rec.ts, rec.headers)
        return Row(key, self.order(rec, d), cols + (rec.p, rec.o))


def columns(features: w.Features) -> list[str]:
    meta = ["seen_at", "hdr"] if features.meta else []
    return ["id", "name", "amount", "version", *meta, "_tm_partition", "_tm_offset"]


@dataclass
class SinkModel:
    rows: dict[int, Row] = field(default_factory=dict)  # key -> row
    live: dict[Pos, str] = field(default_factory=dict)  # record -> letter status
    checkpoint: dict[int, int] = field(default_factory=dict)  # partition -> next offset
    # key -> its newest tombstone that deleted (what the sink's tombstone table keeps).
    tombs: dict[int, Tomb] = field(default_factory=dict)
    counts: Counter = field(default_factory=Counter)  # tombstones: what they did
    # partition -> where the sink began (the model's: Oracle.began); nothing below it is
    # ever delivered to the sink, nor a version a fallback may place.
    began: dict[int, int] = field(default_factory=dict)
    # Positions the source no longer holds (retention; Oracle.trimmed, shared): never
    # re-delivered, never a version a fallback reads.
    trimmed: set[Pos] = field(default_factory=set)

    def deliver(self, recs: list[Record], pipe: Pipeline, whole_batch: bool) -> None:
        """A first delivery: the newest version per key (a row or a tombstone that deletes)
        wins against the sink; every failing record gets a live letter (all of them when the
        gate quarantines)."""
        best: dict[int, Row] = {}
        dead: dict[int, Tomb] = {}
        for rec in recs:
            if whole_batch:
                self._quarantine(rec)
                continue
            if rec.tombstone:
                t = pipe.tomb(rec)
                if t is None:
                    self._quarantine(rec)
                elif t.key not in dead or t.order > dead[t.key].order:
                    dead[t.key] = t
                continue
            row = pipe.row(rec)
            if row is None:
                self._quarantine(rec)
            elif row.key not in best or row.order > best[row.key].order:
                best[row.key] = row
        self._delete(dead.values())
        self._place(best)

    def _quarantine(self, rec: Record) -> None:
        self._fails((rec.p, rec.o))
        if rec.tombstone:
            self.counts["quarantined"] += 1

    def redeliver(self, chosen: set[Pos], source: dict[Pos, Record], pipe: Pipeline) -> None:
        """docs/design.md "Re-delivery", steps 1-5, for the records at ``chosen``."""
        lost = {k for k, r in self.rows.items() if r.pos in chosen}
        removed = {self.rows.pop(k).pos for k in lost}
        gone = {k for k, t in self.tombs.items() if t.pos in chosen}  # tombstones go too
        removed |= {self.tombs.pop(k).pos for k in gone}
        lost |= gone
        # A removed row's record that places no row now: the key it maps to now falls back
        # too (after a transform change, the older versions that row placed are that key's).
        for pos in removed:
            keyed = pipe.keyed(source[pos])
            if keyed is not None and pipe.row(source[pos]) is None:
                lost.add(keyed[0])
        best: dict[int, Row] = {}
        dead: dict[int, Tomb] = {}
        for pos in sorted(chosen):
            rec = source[pos]
            if rec.tombstone:
                t = pipe.tomb(rec)
                if t is None:
                    self._quarantine(rec)
                    continue
                self.live.pop(pos, None)  # it places itself (rule 5)
                if t.key not in dead or t.order > dead[t.key].order:
                    dead[t.key] = t
                continue
            row = pipe.row(rec)
            if row is None:
                self._fails(pos)
                continue
            # It passes: its own row or a newer version's places it (rule 5).
            self.live.pop(pos, None)
            if row.key not in best or row.order > best[row.key].order:
                best[row.key] = row
        self._delete(dead.values())
        self._place(best)
        bare = lost - set(self.rows)
        versions: dict[int, list[tuple[tuple, Record]]] = {k: [] for k in bare}
        # The range's own tombstones that delete are versions of their keys too.
        for t in dead.values():
            if t.key in versions:
                versions[t.key].append((t.order, source[t.pos]))
        # A record with a row of its own (under another key, from an earlier pipeline) is
        # placed as it was: falling back to it would place it twice.
        rowed = {r.pos for r in self.rows.values()}
        for pos, rec in source.items() if bare else ():  # one pass: every key's versions
            if pos in chosen or pos in rowed or pos[1] >= self.checkpoint.get(pos[0], 0):
                continue
            if pos[1] < self.began.get(pos[0], 0) or pos in self.trimmed:
                continue  # never delivered to this sink; or the source holds it no more
            keyed = pipe.keyed(rec)
            if keyed is not None and keyed[0] in versions:
                versions[keyed[0]].append((keyed[1], rec))
        applied = {t.pos for t in self.tombs.values()}  # the sink's tombstone table
        for k in sorted(bare):  # rule 4: fall back, newest first
            for _order, rec in sorted(versions[k], key=lambda v: v[0], reverse=True):
                pos = (rec.p, rec.o)
                if rec.tombstone and pos in applied:
                    # Placed already (as it was, or by the range): the key stays deleted.
                    self.counts["stopped a fallback"] += 1
                    break
                if rec.tombstone and pipe.deletes:
                    # The walk stops: the key stays deleted, this tombstone now its newest
                    # version; a letter that held it is resolved (rule 5).
                    self.counts["stopped a fallback"] += 1
                    self._delete([Tomb(k, pos, pos)], fallback=True)
                    self.live.pop(pos, None)
                    break
                row = None if rec.tombstone else pipe.row(rec)
                if row is None:
                    # Quarantined in turn; a live letter (a discarded one too: a discard
                    # stands while its record fails) places it.
                    if (rec.p, rec.o) not in self.live and rec.tombstone:
                        self.counts["quarantined in a fallback"] += 1
                    self.live.setdefault((rec.p, rec.o), "quarantined")
                    continue
                self._place({k: row})
                self.live.pop((rec.p, rec.o), None)
                break

    def _fails(self, pos: Pos) -> None:
        """The record fails (again): a live letter, quarantined, except that a discard stands
        while its record fails (docs/design.md, "DLQ envelope")."""
        if self.live.get(pos) != "discarded":
            self.live[pos] = "quarantined"

    def _delete(self, tombs: Iterable[Tomb], fallback: bool = False) -> None:
        """Tombstones that delete: each removes its key's row if that is not newer, and is
        kept as the key's tombstone if it is the newest."""
        for t in tombs:
            self.counts["deleted in a fallback" if fallback else "deleted"] += 1
            cur = self.tombs.get(t.key)
            if cur is None or t.order >= cur.order:
                self.tombs[t.key] = t
            row = self.rows.get(t.key)
            if row is not None and t.order >= row.order:
                del self.rows[t.key]
                self.counts["removed a row"] += 1

    def _place(self, best: dict[int, Row]) -> None:
        for k, row in best.items():
            t = self.tombs.get(k)
            if t is not None and t.order >= row.order:
                self.counts["kept an older row out"] += 1
                continue  # never older than its key's tombstone
            cur = self.rows.get(k)
            if cur is None or row.order > cur.order:
                self.rows[k] = row


@dataclass
class Applied:
    run_id: int
    sink: str
    mode: str
    what: str


class Oracle:
    def __init__(self, target: Target, features: w.Features):
        self.target = target
        self.f = features
        self.cols = columns(features)
        self.trimmed: set[Pos] = set()
        self.sinks = {s: SinkModel(trimmed=self.trimmed) for s in target.sinks}
        self.source: dict[Pos, Record] = {}
        self.last_run = 0
        self.last: list[Applied] = []  # what the last sync applied
        # (sink, partition) -> where the sink began: the source's end (start: latest) or its
        # first record (earliest) when the sink's checkpoint there first appeared (every
        # append of a step comes before its jobs claim).
        self.began: dict[tuple[str, int], int] = {}
        self.problems: list[Problem] = []  # what the last sync found wrong on its own
        self.refusals: Counter = Counter()  # re-deliveries refused as they should be, by why
        self.aborted: list[Problem] = []  # (run, sink)s the last sync found aborted

    # -- learning what happened -----------------------------------------------------------
    def _led(self) -> psycopg.Connection:
        return psycopg.connect(self.target.ledger_dsn, autocommit=True, application_name=APP)

    def letters(self, ids: Iterable[int]) -> dict[int, tuple[str, int, int]]:
        """Dead letter id -> (sink, partition, offset): what a letter holds never changes."""
        with self._led() as led:
            return {
                i: (s, p, o)
                for i, s, p, o in led.execute(
                    "SELECT id, sink, source_partition, source_offset FROM tidemark.dlq "
                    "WHERE id = ANY(%s)",
                    (list(ids),),
                )
            }

    def sync(
        self,
        knobs: w.Knobs,
        redrive: dict[int, tuple[str, int, int]] | None = None,
        discarded: dict[int, tuple[str, int, int]] | None = None,
        trimmed: Iterable[Pos] = (),
        reread: bool = False,
        accept_pruned: bool = False,
    ) -> list[Applied]:
        """Apply every (run, sink) committed since the last sync, with ``knobs`` (the
        pipeline of this step); ``redrive``: the letters this step's redrive asked for;
        ``discarded``: letters this step discarded."""
        have: dict[int, int] = {}
        for p, o in self.source:
            have[p] = max(have.get(p, -1), o)
        # Trimmed records stay in the model (the sinks may hold them), marked; a late
        # segment's records lie below what was read: read everything again.
        self.trimmed.update(trimmed)
        for r in self.target.source.records(None if reread else have):
            self.source[(r.p, r.o)] = Record(r.p, r.o, r.payload, r.headers, r.ts, r.key)
        self.problems = []
        with self._led() as led:
            self._learn_starts(led)
            runs = led.execute(
                """SELECT rs.run_id, rs.sink, r.mode, rs.state::text, rs.error
                   FROM tidemark.run_sinks rs
                   JOIN tidemark.runs r USING (run_id)
                   WHERE r.pipeline = %s AND rs.run_id > %s ORDER BY 1, 2""",
                (self.target.pipeline, self.last_run),
            ).fetchall()
            if not runs:
                ranges, gates = [], []
            else:
                ids = sorted({r[0] for r in runs})
                ranges = led.execute(
                    "SELECT run_id, sink, partition, from_offset, to_offset "
                    "FROM tidemark.run_ranges WHERE run_id = ANY(%s)",
                    (ids,),
                ).fetchall()
                gates = led.execute(
                    "SELECT run_id, scope FROM tidemark.dq_results "
                    "WHERE run_id = ANY(%s) AND NOT success",
                    (ids,),
                ).fetchall()
        if discarded:
            for s, p, o in discarded.values():
                if self.sinks[s].live.get((p, o)) == "quarantined":
                    self.sinks[s].live[(p, o)] = "discarded"
        by_run: dict[tuple[int, str], list[tuple[int, int, int]]] = {}
        for run_id, s, p, a, b in ranges:
            by_run.setdefault((run_id, s), []).append((p, a, b))
        failed = set(gates)
        done: list[Applied] = []
        self.aborted = []
        for run_id, s, mode, st, error in runs:
            self.last_run = max(self.last_run, run_id)
            mine = sorted(by_run.get((run_id, s), []))
            if (
                mode in ("backfill", "rebuild")
                and s in self.sinks
                and self._pruned(run_id, s, mode, st, error, mine, accept_pruned)
            ):
                continue
            if mode == "backfill" and s in self.sinks and st in ("aborted", "committed"):
                changed = self.key_changes(s, mine, knobs)
                partial = bool(changed) and not self.whole(s, mine, changed)
                if st == "aborted" and "key change" in str(error):
                    if not partial:
                        self.problems.append(
                            Problem(
                                s,
                                "-",
                                "-",
                                f"run {run_id} (backfill) refused as a key change, but no row "
                                f"of its range {_span(mine)} changed key (or the range holds "
                                f"every older version): {' '.join(str(error).split())[:300]}",
                            )
                        )
                    elif "tidemark sink rebuild" not in str(error):
                        self.problems.append(
                            Problem(
                                s,
                                "-",
                                "-",
                                f"run {run_id} refused a key change without naming "
                                f"`tidemark sink rebuild`: {str(error)[:300]}",
                            )
                        )
                    self.refusals["key change"] += 1
                    continue
                if st == "committed" and partial:
                    p, o = changed[0]
                    self.problems.append(
                        Problem(
                            s,
                            p,
                            o,
                            f"run {run_id} re-delivered {_span(mine)} after a key change "
                            f"({len(changed)} row(s) of it map to another key now) without "
                            f"every older version: it should have been refused",
                        )
                    )
            if st == "aborted":
                self.aborted.append(
                    Problem(
                        s,
                        "-",
                        "-",
                        f"run {run_id} ({mode}) aborted: {' '.join(str(error).split())[:300]}",
                    )
                )
            if st != "committed" or s not in self.sinks:
                continue
            gate_failed = (run_id, "") in failed or (run_id, s) in failed
            done.append(
                self._apply(
                    run_id,
                    s,
                    mode,
                    mine,
                    gate_failed,
                    knobs,
                    redrive or {},
                )
            )
        self.last = done
        return done

    def held_trimmed(self, s: str, ranges: list[tuple[int, int, int]] | None) -> list[Pos]:
        """Positions the sink holds (a row, a tombstone, a live letter) whose record the
        source no longer holds: in ``ranges``, or (None) anywhere below its checkpoint."""
        m = self.sinks[s]
        held = {r.pos for r in m.rows.values()} | {t.pos for t in m.tombs.values()} | set(m.live)
        return sorted(
            (p, o)
            for p, o in held & self.trimmed
            if (ranges is None and o < m.checkpoint.get(p, 0))
            or any(q == p and a <= o < b for q, a, b in ranges or [])
        )

    def _pruned(
        self,
        run_id: int,
        s: str,
        mode: str,
        st: str,
        error: object,
        ranges: list[tuple[int, int, int]],
        accept: bool,
    ) -> bool:
        """Judge a re-delivery against what retention trimmed: refused (without
        --accept-pruned) exactly where the sink holds positions the source lost. True where
        the run was such a refusal (nothing of it to apply)."""
        wide = self.held_trimmed(s, None)  # a fallback may read anywhere below the checkpoint
        inside = self.held_trimmed(s, None if mode == "rebuild" else ranges)
        if st == "aborted" and "--accept-pruned" in str(error):
            self.refusals["pruned positions"] += 1
            if accept or not wide:
                self.problems.append(
                    Problem(
                        s,
                        "-",
                        "-",
                        f"run {run_id} ({mode}) refused over pruned positions"
                        + (" although --accept-pruned was given" if accept else "")
                        + (", but the sink holds none" if not wide else "")
                        + f": {' '.join(str(error).split())[:300]}",
                    )
                )
            return True
        if st == "committed" and inside and not accept:
            p, o = inside[0]
            self.problems.append(
                Problem(
                    s,
                    p,
                    o,
                    f"run {run_id} ({mode}) re-delivered over {len(inside)} position(s) the "
                    f"sink holds and the source no longer does, without --accept-pruned: it "
                    f"should have been refused",
                )
            )
        return False

    def key_changes(self, s: str, ranges: list[tuple[int, int, int]], knobs: w.Knobs) -> list[Pos]:
        """Positions of the sink's rows in ``ranges`` whose record ``knobs``' transform maps to
        another key than the row's (a record that fails before it has a key has none)."""
        m, pipe = self.sinks[s], Pipeline(knobs, self.f, s)
        out = []
        for k, row in m.rows.items():
            p, o = row.pos
            if any(q == p and a <= o < b for q, a, b in ranges):
                keyed = pipe.keyed(self.source[row.pos])
                if keyed is not None and keyed[0] != k:
                    out.append(row.pos)
        return sorted(out)

    def whole(self, s: str, ranges: list[tuple[int, int, int]], changed: list[Pos]) -> bool:
        """Whether ``ranges`` hold every version older than the ``changed`` rows: their
        partitions from the first record (where the sink began, if later); every partition to
        its checkpoint where the sink orders versions by a column."""
        m = self.sinks[s]
        parts = set(m.checkpoint) if self.f.versioned else {p for p, _o in changed}
        for p in parts:
            offs = [o for q, o in self.source if q == p]
            first = max(min(offs) if offs else 0, m.began.get(p, 0))
            mine = [(a, b) for q, a, b in ranges if q == p]
            if not mine or mine[0][0] > first:
                return False
            if self.f.versioned and mine[-1][1] < m.checkpoint.get(p, 0):
                return False
        return True

    def _learn_starts(self, led: psycopg.Connection) -> None:
        cps = led.execute(
            "SELECT sink, partition FROM tidemark.checkpoints WHERE pipeline = %s",
            (self.target.pipeline,),
        ).fetchall()
        for s, p in cps:
            if (s, p) in self.began or s not in self.sinks:
                continue
            offs = [o for q, o in self.source if q == p]
            how = self.f.start_at(p)
            if how == "latest":
                at = max(offs) + 1 if offs else 0
            elif how == "earliest":
                at = min(offs) if offs else 0
            else:  # an offset: once the source has reached it, there (or at its first record)
                assert isinstance(how, int)
                end = max(offs) + 1 if offs else 0
                if end < how:
                    self.problems.append(
                        Problem(
                            s, p, end, f"the sink began before the source reached its start {how}"
                        )
                    )
                at = max(how, min(offs)) if offs else how
            self.began[(s, p)] = at
            self.sinks[s].began[p] = at
        recorded = starts(led, self.target.pipeline)
        for (s, p), at in sorted(recorded.items()):
            want = self.began.get((s, p))
            if want is not None and at != want:
                self.problems.append(
                    Problem(
                        s,
                        p,
                        at,
                        f"the ledger says the sink began at {at}; it first saw the partition "
                        f"where it should have begun: {want} (start: {self.f.start})",
                    )
                )

    def cut_below_start(
        self, ranges: dict[int, tuple[int, int]], sinks: Iterable[str]
    ) -> dict[int, tuple[int, int]]:
        """Per partition [a, b) cut at the lowest start of ``sinks`` (none below it was
        delivered to any of them); a range wholly below is left out."""
        out = {}
        for p, (a, b) in ranges.items():
            floors = [self.began.get((s, p), 0) for s in sinks]
            a = max(a, min(floors)) if floors else a
            if b > a:
                out[p] = (a, b)
        return out

    def _apply(
        self,
        run_id: int,
        s: str,
        mode: str,
        ranges: list[tuple[int, int, int]],
        gate_failed: bool,
        knobs: w.Knobs,
        redrive: dict[int, tuple[str, int, int]],
    ) -> Applied:
        m, pipe = self.sinks[s], Pipeline(knobs, self.f, s)
        span = " ".join(f"p{p}[{a},{b})" for p, a, b in ranges)
        if mode == "run":
            recs = [
                self.source[(p, o)]
                for p, a, b in ranges
                for o in range(a, b)
                if (p, o) in self.source
            ]
            whole = gate_failed and knobs.on_gate_failure == "quarantine_batch"
            if not gate_failed or whole:
                m.deliver(recs, pipe, whole)
            for p, _a, b in ranges:
                m.checkpoint[p] = max(m.checkpoint.get(p, 0), b)
            return Applied(run_id, s, mode, span + (" gate quarantined" if whole else ""))
        for p, a, _b in ranges:
            if mode != "run" and a < m.began.get(p, 0):
                self.problems.append(
                    Problem(
                        s,
                        p,
                        a,
                        f"run {run_id} ({mode}) re-delivered from {a}, below where the sink "
                        f"began ({m.began[p]})",
                    )
                )
        if mode == "rebuild":
            if not gate_failed:  # a rebuild whose gate fails changes nothing
                # A new, empty table (and tombstone table) takes every record the sink has
                # received: nothing to remove, no key to fall back.
                m.rows.clear()
                # Tombstones the source no longer holds are carried into the new table's
                # tombstone table (--accept-pruned): a deleted key stays deleted.
                m.tombs = {k: t for k, t in m.tombs.items() if t.pos in self.trimmed}
                chosen = {
                    (p, o)
                    for p, a, b in ranges
                    for o in range(max(a, m.began.get(p, 0)), b)
                    if (p, o) in self.source and (p, o) not in self.trimmed
                }
                m.redeliver(chosen, self.source, pipe)
            return Applied(run_id, s, mode, span)
        if mode == "backfill":
            if not gate_failed:  # a backfill whose gate fails changes nothing
                chosen = {
                    (p, o)
                    for p, a, b in ranges
                    for o in range(max(a, m.began.get(p, 0)), b)
                    if (p, o) in self.source and (p, o) not in self.trimmed
                }
                m.redeliver(chosen, self.source, pipe)
            return Applied(run_id, s, mode, span)
        chosen = {
            (p, o)
            for ls, p, o in redrive.values()
            if ls == s and m.live.get((p, o)) == "quarantined"
        }
        m.redeliver(chosen, self.source, pipe)
        return Applied(run_id, s, mode, f"{len(chosen)} letter(s)")

    @property
    def tombstone_counts(self) -> Counter:
        """What the model's tombstones did, over every sink."""
        out: Counter = Counter()
        for m in self.sinks.values():
            out.update(m.counts)
        return out

    # -- comparing ------------------------------------------------------------------------
    def compare(self) -> list[Problem]:
        problems: list[Problem] = list(self.problems)
        with self._led() as led:
            letters = led.execute(
                "SELECT sink, source_partition, source_offset, status::text, id "
                "FROM tidemark.dlq WHERE pipeline = %s AND status::text = ANY(%s)",
                (self.target.pipeline, list(LIVE)),
            ).fetchall()
        have_live: dict[str, dict[Pos, tuple[str, int]]] = {s: {} for s in self.sinks}
        for s, p, o, status, lid in letters:
            if s in have_live:
                have_live[s][(p, o)] = (status, lid)
        for s, (dsn, table) in self.target.sinks.items():
            m = self.sinks[s]
            rows = self._rows(dsn, table)
            have: dict[int, list[tuple]] = {}
            for r in rows:
                have.setdefault(r[0], []).append(tuple(r))
            for k in sorted(set(have) | set(m.rows)):
                want = m.rows.get(k)
                got = have.get(k, [])
                if want is None:
                    for g in got:
                        problems.append(
                            Problem(
                                s,
                                g[-2],
                                g[-1],
                                f"extra row: key {k} {self._show(g)} should not be in the sink",
                            )
                        )
                    continue
                p, o = want.pos
                if not got:
                    problems.append(
                        Problem(
                            s, p, o, f"missing row: key {k} should hold {self._show(want.cols)}"
                        )
                    )
                    continue
                g = got[0]
                diff = [
                    f"{c} {g[i]!r} (want {want.cols[i]!r})"
                    for i, c in enumerate(self.cols)
                    if g[i] != want.cols[i]
                ]
                if diff:
                    problems.append(Problem(s, p, o, f"wrong row for key {k}: " + ", ".join(diff)))
            for pos in sorted(set(m.live) | set(have_live[s])):
                want_st = m.live.get(pos)
                got_st = have_live[s].get(pos)
                if got_st is None:
                    problems.append(
                        Problem(s, *pos, f"letter should be live ({want_st}) but none is")
                    )
                elif want_st is None:
                    problems.append(
                        Problem(
                            s, *pos, f"live letter {got_st[1]} ({got_st[0]}) should not be live"
                        )
                    )
                elif want_st != got_st[0]:
                    problems.append(
                        Problem(s, *pos, f"letter {got_st[1]} is {got_st[0]}, should be {want_st}")
                    )
        return problems

    def _show(self, cols: tuple) -> str:
        return (
            "("
            + ", ".join(
                f"{c}={v!r}"
                for c, v in zip(self.cols, cols, strict=True)
                if not c.startswith("_tm_")
            )
            + f" from {cols[-2]}:{cols[-1]})"
        )

    def _rows(self, dsn: str, table: str) -> list[tuple]:
        with psycopg.connect(dsn, autocommit=True, application_name=APP) as conn:
            found = conn.execute("SELECT to_regclass(%s)", (table,)).fetchone()
            if found is None or found[0] is None:
                return []
            cols = [
                sql.SQL("{}::text").format(sql.Identifier(c)) if c == "hdr" else sql.Identifier(c)
                for c in self.cols
            ]
            return conn.execute(
                sql.SQL("SELECT {} FROM {}").format(sql.SQL(", ").join(cols), _ident(table))
            ).fetchall()


def _span(ranges: list[tuple[int, int, int]]) -> str:
    return " ".join(f"p{p}[{a},{b})" for p, a, b in ranges) or "(no range)"
