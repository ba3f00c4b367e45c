"""The independent checker: docs/design.md's invariants read straight from the databases.

It shares no code with the data path on purpose (plain psycopg and SQL against the source
log, the sink tables, ``tidemark.dlq``, ``tidemark.checkpoints``, ``tidemark.pipelines``,
``tidemark.run_sinks`` and ``pg_prepared_xacts``): a bug in the data path cannot hide itself
by being shared with its judge. What it checks, per sink and partition (invariant 1 and
"Which sinks a verdict applies to"):

- every source offset below that sink's checkpoint is placed exactly once for that sink: its
  own row in the sink, or a newer version of its key in the sink (same ``_tm_partition``,
  higher ``_tm_offset``; with a version column, a higher ``(version, partition, offset)``), or exactly one live dead letter for that sink (status quarantined
  or discarded). Never its own row and a live letter; never two live letters. A tombstone
  that deletes its key (the sink's tombstone table ``tidemark.tomb_*`` holds it) is placed by
  itself (neither a row nor a letter), and supersedes the older versions of its key like a
  row; no row of a key is older than the key's tombstone;
- nothing at or above the checkpoint is placed (no sink row, no live letter for that sink);
- a dead letter names its sink (sink NULL is a problem), and its payload and key are the
  source record's bytes;
- a sink row's id (and version) are those of its source record's payload (its id, or the id
  shifted by ``key_shift`` where a transform variant maps keys so);
- checkpoints never move backwards between two checks, nor past the end of the source;
- after recovery: no prepared transaction on any database, no run left in an open state,
  no halted pipeline.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Protocol

import psycopg
from psycopg import sql

LIVE = ("quarantined", "discarded")
OPEN_STATES = ("planned", "writing", "prepared", "committing")
APP = "chaos-check"


@dataclass(frozen=True, order=True)
class Problem:
    sink: str
    partition: int | str
    offset: int | str
    what: str

    def __str__(self) -> str:
        return f"sink {self.sink} partition {self.partition} offset {self.offset}: {self.what}"


@dataclass
class Target:
    """What to check: one pipeline, its source log, its sinks."""

    ledger_dsn: str
    pipeline: str
    source: Source  # the source log's records (chaos/source.py)
    sinks: dict[str, tuple[str, str]]  # name -> (dsn, table)
    databases: list[str]  # every database whose prepared transactions count
    key_shift: int | None = None  # a sink key may also be the payload's id + this
    versioned: bool = False  # the sinks order versions by the version column
    key_from_key: bool = False  # the sink key is the source key's number (tombstones)

    def keys(self, pid: int) -> tuple[int, ...]:
        """The keys a record with id ``pid`` may have: its id, or as a transform variant maps
        it (world.VARIANTS: shifted, split off, merged with another id)."""
        if self.key_shift is None:
            return (pid,)
        from tidemark.devstack.chaos.world import MERGE, SPLIT_SHIFT

        return (pid, pid + self.key_shift, pid + SPLIT_SHIFT, pid - pid % (2 * MERGE) + pid % MERGE)


class Source(Protocol):
    # of SourceRecord (p, o, key, payload, headers, ts); ``after``: only those above its offsets
    def records(self, after: dict[int, int] | None = None) -> list: ...


@dataclass
class Snapshot:
    checkpoints: dict[tuple[str, int], int] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)  # sink -> rows
    live: dict[str, int] = field(default_factory=dict)  # sink -> live letters
    letters: int = 0
    tombs: dict[str, int] = field(default_factory=dict)  # sink -> deleting tombstones


def _ident(table: str) -> sql.Composable:
    return sql.SQL(".").join(sql.Identifier(p) for p in table.split(".", 1))


def _payload_fields(payload: bytes | None) -> tuple[int | None, int | None]:
    """(id, version) of a payload, None where it has none (not JSON, wrong types...)."""
    if payload is None:
        return None, None
    try:
        doc = json.loads(bytes(payload).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None, None
    if not isinstance(doc, dict):
        return None, None

    def integer(v):
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    return integer(doc.get("id")), integer(doc.get("version"))


def has_column(led: psycopg.Connection, table: str, column: str) -> bool:
    """Whether ``tidemark.<table>`` has ``column`` (a ledger of this release or an older)."""
    return (
        led.execute(
            "SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass(%s) "
            "AND attname = %s AND NOT attisdropped",
            (f"tidemark.{table}", column),
        ).fetchone()
        is not None
    )


def starts(led: psycopg.Connection, pipeline: str) -> dict[tuple[str, int], int]:
    """(sink, partition) -> where the sink began (``checkpoints.start_offset``, ledger V009),
    where the ledger knows it; nothing on a ledger without the column."""
    if not has_column(led, "checkpoints", "start_offset"):
        return {}
    return {
        (s, p): n
        for s, p, n in led.execute(
            "SELECT sink, partition, start_offset FROM tidemark.checkpoints "
            "WHERE pipeline = %s AND start_offset IS NOT NULL",
            (pipeline,),
        )
    }


def _b(v) -> bytes | None:
    return None if v is None else bytes(v)


class Checker:
    def __init__(self, target: Target):
        self.target = target
        self.previous: dict[tuple[str, int], int] | None = None
        self.known: dict[tuple[int, int], tuple[bytes | None, bytes | None]] = {}

    def check(self) -> tuple[list[Problem], Snapshot]:
        problems: list[Problem] = []
        snap = Snapshot()
        held = {(r.p, r.o): (_b(r.key), _b(r.payload)) for r in self.target.source.records()}
        # Records retention trimmed from the source stay known (a sink may still hold them,
        # and must: nothing re-delivers them); they need no place of their own any more.
        self.known.update(held)
        source = self.known
        trimmed = {pos for pos in source if pos not in held}
        with psycopg.connect(self.target.ledger_dsn, autocommit=True, application_name=APP) as led:
            checkpoints = {
                (s, p): n
                for s, p, n in led.execute(
                    "SELECT sink, partition, next_offset FROM tidemark.checkpoints "
                    "WHERE pipeline = %s",
                    (self.target.pipeline,),
                )
            }
            began = starts(led, self.target.pipeline)
            # Retention drops a discarded letter's payload (never its row; ledger V011).
            pruned = "pruned_at IS NOT NULL" if has_column(led, "dlq", "pruned_at") else "false"
            letters = led.execute(
                f"""SELECT id, sink, source_partition, source_offset, key, payload,
                          status::text, error_class::text, {pruned}
                   FROM tidemark.dlq WHERE pipeline = %s ORDER BY id""",
                (self.target.pipeline,),
            ).fetchall()
            halted = led.execute(
                "SELECT halted_reason FROM tidemark.pipelines WHERE name = %s",
                (self.target.pipeline,),
            ).fetchone()
            open_runs = led.execute(
                """SELECT rs.run_id, rs.sink, rs.state::text FROM tidemark.run_sinks rs
                   JOIN tidemark.runs r USING (run_id)
                   WHERE r.pipeline = %s AND rs.state::text = ANY(%s) ORDER BY 1, 2""",
                (self.target.pipeline, list(OPEN_STATES)),
            ).fetchall()
            prepared = led.execute(
                "SELECT database, gid FROM pg_prepared_xacts WHERE database = ANY(%s) "
                "ORDER BY database, gid",
                (self.target.databases,),
            ).fetchall()
        rows = {s: self._sink_rows(dsn, table) for s, (dsn, table) in self.target.sinks.items()}
        tombs = {s: self._tombs(dsn, table) for s, (dsn, table) in self.target.sinks.items()}

        ends: dict[int, int] = {}
        for p, o in source:
            ends[p] = max(ends.get(p, 0), o + 1)
        parsed = {pos: self._fields(k, v) for pos, (k, v) in source.items()}

        # -- dead letters: their sink, their bytes -----------------------------------------
        live: dict[tuple[str, int, int], list[int]] = {}
        unnamed: dict[tuple[int, int], list[int]] = {}  # live letters that name no sink
        for lid, sink, p, o, key, payload, status, cls, dropped in letters:
            where = (p, o)
            if where not in source:
                problems.append(
                    Problem(
                        sink or "-",
                        p,
                        o,
                        f"dead letter {lid} ({cls}, {status})"
                        f" holds a record that is not in the source",
                    )
                )
            else:
                skey, spayload = source[where]
                if dropped and (payload is not None or status != "discarded"):
                    problems.append(
                        Problem(
                            sink or "-",
                            p,
                            o,
                            f"dead letter {lid} ({cls}, {status}) pruned, yet "
                            + ("it holds a payload" if payload is not None else "not discarded"),
                        )
                    )
                elif dropped:
                    pass  # a discarded letter past retention: its row stays, its bytes went
                elif _b(payload) != spayload:
                    problems.append(
                        Problem(
                            sink or "-",
                            p,
                            o,
                            f"dead letter {lid} ({cls}): "
                            f"payload differs from the source record's bytes",
                        )
                    )
                if _b(key) != skey:
                    problems.append(
                        Problem(
                            sink or "-",
                            p,
                            o,
                            f"dead letter {lid} ({cls}): key differs from the source record's key",
                        )
                    )
            if sink is None:
                problems.append(
                    Problem("-", p, o, f"dead letter {lid} ({cls}, {status}) names no sink")
                )
                if status in LIVE:
                    unnamed.setdefault((p, o), []).append(lid)
                continue
            if sink not in self.target.sinks:
                problems.append(
                    Problem(
                        sink, p, o, f"dead letter {lid} names a sink the pipeline does not have"
                    )
                )
                continue
            if status in LIVE:
                live.setdefault((sink, p, o), []).append(lid)

        # -- per sink and partition: exactly once below, nothing at or above ----------------
        for s in self.target.sinks:
            by_pos: dict[tuple[int, int], tuple] = {}
            by_id: dict[int, tuple[int, int, int | None]] = {}
            for rid, version, p, o in rows[s]:
                by_pos[(p, o)] = (rid, version)
                by_id[rid] = (p, o, version)
                cp = checkpoints.get((s, p), 0)
                if (p, o) not in source:
                    problems.append(
                        Problem(
                            s, p, o, f"sink row id {rid} for a record that is not in the source"
                        )
                    )
                    continue
                pid, pversion = parsed[(p, o)]
                if pid is None:
                    problems.append(
                        Problem(
                            s,
                            p,
                            o,
                            f"sink row id {rid} for a record whose payload has no readable id",
                        )
                    )
                elif rid not in self.target.keys(pid):
                    problems.append(
                        Problem(s, p, o, f"sink row id {rid} but its source record's id is {pid}")
                    )
                elif pversion is not None and version is not None and pversion != version:
                    problems.append(
                        Problem(
                            s,
                            p,
                            o,
                            f"sink row id {rid} version {version} but "
                            f"its source record's version is {pversion}",
                        )
                    )
                if o >= cp:
                    problems.append(
                        Problem(s, p, o, f"sink row id {rid} at or above the checkpoint {cp}")
                    )
                if o < began.get((s, p), 0):
                    problems.append(
                        Problem(
                            s,
                            p,
                            o,
                            f"sink row id {rid} below where the sink began ({began[(s, p)]})",
                        )
                    )
            tomb_pos: dict[tuple[int, int], int] = {}
            tomb_id: dict[int, tuple[int, int, None]] = {}
            for tid, p, o in tombs[s]:
                tomb_pos[(p, o)] = tid
                tomb_id[tid] = (p, o, None)
                cp = checkpoints.get((s, p), 0)
                if (p, o) not in source:
                    problems.append(
                        Problem(
                            s,
                            p,
                            o,
                            f"tombstone of key {tid} for a record that is not in the source",
                        )
                    )
                    continue
                skey, spayload = source[(p, o)]
                if spayload is not None:
                    problems.append(
                        Problem(s, p, o, f"tombstone of key {tid} for a record with a payload")
                    )
                elif tid not in self.target.keys(parsed[(p, o)][0] or -1):
                    problems.append(
                        Problem(
                            s, p, o, f"tombstone of key {tid} for a record whose key is {skey!r}"
                        )
                    )
                if o >= cp:
                    problems.append(
                        Problem(s, p, o, f"tombstone of key {tid} at or above the checkpoint {cp}")
                    )
                row = by_id.get(tid)
                if row and self._newer((p, o, None), row[0], row[1], row[2], tie=True):
                    problems.append(
                        Problem(
                            s,
                            row[0],
                            row[1],
                            f"sink row id {tid} is older than its key's tombstone at {p}:{o}",
                        )
                    )
            for p, o in sorted(source):
                cp = checkpoints.get((s, p), 0)
                mine = live.get((s, p, o), [])
                own = (p, o) in by_pos or (p, o) in tomb_pos
                if o >= cp:
                    if mine:
                        problems.append(
                            Problem(
                                s,
                                p,
                                o,
                                f"live dead letter(s) {_ids(mine)} at or above the checkpoint {cp}",
                            )
                        )
                    continue
                if o < began.get((s, p), 0):
                    if own or mine:
                        problems.append(
                            Problem(
                                s,
                                p,
                                o,
                                f"placed ({'its row' if own else f'letter(s) {_ids(mine)}'}) "
                                f"below where the sink began ({began[(s, p)]})",
                            )
                        )
                    continue
                if len(mine) > 1:
                    problems.append(
                        Problem(
                            s, p, o, f"{len(mine)} live dead letters {_ids(mine)} for one record"
                        )
                    )
                if own and mine:
                    problems.append(
                        Problem(s, p, o, f"in the sink and in live dead letter(s) {_ids(mine)}")
                    )
                if own or mine or (p, o) in trimmed:
                    continue
                pid, pversion = parsed[(p, o)]
                newer = None
                for k in self.target.keys(pid) if pid is not None else ():
                    if (row := by_id.get(k)) and self._newer(row, p, o, pversion):
                        newer = row
                    if (row := tomb_id.get(k)) and self._newer(row, p, o, pversion):
                        newer = row
                if newer is not None:
                    continue
                newer = next(
                    (
                        by_id[k]
                        for k in (self.target.keys(pid) if pid is not None else ())
                        if k in by_id
                    ),
                    None,
                )
                what = f"below the checkpoint {cp} but not placed: no sink row"
                if pid is not None:
                    what += (
                        f", id {pid} in the sink at {newer[0]}:{newer[1]}"
                        if newer
                        else f", no row for id {pid}"
                    )
                what += ", no live dead letter"
                if (p, o) in unnamed:
                    what += f" (only {_ids(unnamed[(p, o)])} without a sink)"
                problems.append(Problem(s, p, o, what))
            snap.rows[s] = len(rows[s])
            if tombs[s]:
                snap.tombs[s] = len(tombs[s])
            snap.live[s] = sum(1 for (ls, _p, _o), v in live.items() if ls == s for _ in v)

        # -- checkpoints: monotone, within the source ---------------------------------------
        for (s, p), n in sorted(checkpoints.items()):
            if n > ends.get(p, 0):
                problems.append(
                    Problem(
                        s, p, n, f"checkpoint {n} is past the end of the source ({ends.get(p, 0)})"
                    )
                )
        if self.previous is not None:
            for (s, p), before in sorted(self.previous.items()):
                now = checkpoints.get((s, p))
                if now is None:
                    problems.append(Problem(s, p, before, "checkpoint row disappeared"))
                elif now < before:
                    problems.append(
                        Problem(s, p, now, f"checkpoint moved backwards from {before} to {now}")
                    )
        # Keep the highest seen, so one backward move is reported once, not forever after.
        merged = dict(self.previous or {})
        for at, n in checkpoints.items():
            merged[at] = max(n, merged.get(at, n))
        self.previous = merged
        snap.checkpoints = checkpoints
        snap.letters = len(letters)

        # -- nothing in doubt after recovery ----------------------------------------------
        for db, gid in prepared:
            problems.append(
                Problem("-", "-", "-", f"prepared transaction {gid} left on database {db}")
            )
        for run_id, sink, st in open_runs:
            problems.append(Problem(sink, "-", "-", f"run {run_id} still {st} after recovery"))
        if halted and halted[0]:
            problems.append(
                Problem("-", "-", "-", f"pipeline {self.target.pipeline} is halted: {halted[0]}")
            )
        return sorted(set(problems), key=_order), snap

    def _newer(
        self,
        row: tuple[int, int, int | None],
        p: int,
        o: int,
        version: int | None,
        tie: bool = False,
    ) -> bool:
        """Whether the sink row (or tombstone) at ``row`` (partition, offset, version) is a
        newer version than the record at ``p:o`` (``tie``: or the same)."""
        rp, ro, rv = row
        a: tuple[int, ...]  # bools order as ints: a row of the record's partition is after
        b: tuple[int, ...]
        if self.target.versioned and rv is not None:
            a, b = (rv, rp, ro), (version if version is not None else -1, p, o)
        else:
            a, b = (rp == p, ro), (True, o)
        return a > b or (tie and a == b)

    def _fields(self, key: bytes | None, payload: bytes | None) -> tuple[int | None, int | None]:
        """(id, version) of a record: the payload's, the id the key's where sink keys come
        from source keys (a tombstone's only id)."""
        pid, version = _payload_fields(payload)
        if self.target.key_from_key:
            text = key.decode("ascii", "replace") if key is not None else ""
            pid = int(text) if re.fullmatch(r"[0-9]+", text) else None
        return pid, version

    def _tombs(self, dsn: str, table: str) -> list[tuple[int, int, int]]:
        """(key, partition, offset) of the sink's tombstones that delete (its table's
        tombstone table, if any run ever deleted a key; a rebuild's retired table keeps its
        own under another name)."""
        from tidemark.protocol.sinks import tombstone_name

        name = tombstone_name(table)
        with psycopg.connect(dsn, autocommit=True, application_name=APP) as conn:
            if conn.execute("SELECT to_regclass(%s)", (f"tidemark.{name}",)).fetchone() == (None,):
                return []
            return conn.execute(
                sql.SQL("SELECT id, _tm_partition, _tm_offset FROM {}").format(
                    sql.Identifier("tidemark", name)
                )
            ).fetchall()

    def _sink_rows(self, dsn: str, table: str) -> list[tuple]:
        with psycopg.connect(dsn, autocommit=True, application_name=APP) as conn:
            found = conn.execute("SELECT to_regclass(%s)", (table,)).fetchone()
            if found is None or found[0] is None:
                return []  # created by the first run that writes to it
            cols = {
                r[0]
                for r in conn.execute(
                    "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass "
                    "AND attnum > 0 AND NOT attisdropped",
                    (table,),
                )
            }
            version = sql.Identifier("version") if "version" in cols else sql.SQL("NULL")
            return conn.execute(
                sql.SQL("SELECT id, {}, _tm_partition, _tm_offset FROM {}").format(
                    version, _ident(table)
                )
            ).fetchall()


def _ids(ids: list[int]) -> str:
    return ", ".join(map(str, ids))


def _order(p: Problem):
    return (
        str(p.sink),
        str(type(p.partition)),
        p.partition if isinstance(p.partition, int) else 0,
        p.offset if isinstance(p.offset, int) else -1,
        p.what,
    )
