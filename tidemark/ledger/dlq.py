"""Dead letters (tidemark.dlq): filter, page, count, read, discard, export.

The query layer under `tidemark dlq` and the Airflow UI plugin (tidemark/render shows the
payloads it reads). Every value reaches
PostgreSQL as a bind parameter; column names come from the fixed lists below and are
composed with psycopg.sql. Pages are keyset pages on id DESC (no OFFSET): page 2,000 costs
what page 1 costs (indexes in sql/V003__dlq_browse.sql).
"""

from __future__ import annotations

import base64
import enum
import getpass
import json
import re
import socket
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from typing import Annotated, Any, Literal

import psycopg
from psycopg import errors as pgerr
from psycopg import pq, sql
from psycopg.rows import dict_row
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

from tidemark.config import IDENT
from tidemark.core.db import scalar
from tidemark.core.errors import BadInput, Busy
from tidemark.core.text import shown
from tidemark.ledger import letters, runs


class ErrorClass(enum.StrEnum):
    """Why a record was quarantined: the ledger's enum type tidemark.error_class, in order."""

    DECODE = "decode"
    TRANSFORM = "transform"
    VALIDATION = "validation"
    DQ_GATE = "dq_gate"
    SINK_WRITE = "sink_write"


class LetterStatus(enum.StrEnum):
    """Where a dead letter stands: the ledger's enum type tidemark.dlq_status, in order."""

    QUARANTINED = "quarantined"
    REDRIVEN = "redriven"
    DISCARDED = "discarded"


ERROR_CLASSES = tuple(c.value for c in ErrorClass)
STATUSES = tuple(s.value for s in LetterStatus)
MAX_LIMIT = 1000
MAX_IDS = 100_000
MAX_ID = 2**63 - 1  # id is a bigint: a bigger number is no id, and PostgreSQL would refuse it
MAX_NOTE = 2000
MAX_SEARCH = 200  # a reason holds at most 200 characters (engine/dead_letters.py, REASON_MAX)
LOCK_TIMEOUT = "2s"  # a redrive's prepared transaction holds its rows until it settles
PREVIEW_BYTES = 160

# What happened to a letter since it was quarantined (its record is letters.RECORD).
_LIFE = (
    "attempts",
    "status",
    "first_seen",
    "last_seen",
    "resolved_by",
    "resolved_at",
    "note",
)
_SUMMARY = (
    "id",
    "pipeline",
    "sink",
    "run_id",
    "source_partition",
    "source_offset",
    "error_class",
    "reason",
    *_LIFE,
)
ENVELOPE = (
    "id",
    *letters.RECORD,
    *_LIFE,
    # the record's headers (bytes of their text) and timestamp as the source had
    # them, and why not when unknown (sql/V007__dlq_source_record.sql)
    "source_headers",
    "source_ts",
    "source_note",
    # when retention dropped a discarded letter's payload, headers and detail (its row stays:
    # sql/V011__discard_stands.sql)
    "pruned_at",
)
_DLQ = sql.Identifier("tidemark", "dlq")


def default_by() -> str:
    """Who acts, from the command line: OS user@host."""
    return f"{getpass.getuser()}@{socket.gethostname()}"


# -- input ------------------------------------------------------------------------------------
def parse_ids(value: Any, field_name: str = "ids") -> list[int]:
    """Dead-letter ids from "4,7 9", [4, "7"], 4 ...; anything else is one clear BadInput."""
    items: Iterable[Any]
    if isinstance(value, str):
        items = value.replace(",", " ").split()
    elif isinstance(value, int | str):
        items = [value]
    elif isinstance(value, Iterable):
        items = [p for v in value for p in (str(v).replace(",", " ").split() or [v])]
    else:
        raise BadInput(f"{field_name} {shown(value)}: expected dead-letter ids")
    out = []
    for item in items:
        text = str(item).strip()
        if (
            isinstance(item, bool)
            or not text.isascii()
            or not text.isdigit()
            or not 0 < int(text) <= MAX_ID
        ):
            raise BadInput(
                f"{field_name}: {shown(item)} is not a dead-letter id "
                f"(a positive integer up to {MAX_ID:,})"
            )
        out.append(int(text))
    if len(out) > MAX_IDS:
        raise BadInput(f"{field_name}: {len(out):,} ids, at most {MAX_IDS:,} at a time")
    return out


def _problem(err: ErrorDetails) -> str:
    kind = err["type"]
    if kind == "literal_error":
        return "expected one of " + str(err["ctx"]["expected"]).replace("'", "")
    if kind == "string_pattern_mismatch":
        return "not a name (lowercase letters, digits and _, at most 40)"
    if kind.startswith("datetime"):
        return "not an ISO timestamp (e.g. 2026-05-01T12:00:00Z)"
    return str(err["msg"]).removeprefix("Value error, ")


class Filters(BaseModel):
    """Which dead letters. Every letter names the sink it applies to (docs/design.md);
    no status means every status. ``pipelines`` is not a user filter: callers set it to the
    pipelines the user may see."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pipeline: Annotated[str, Field(pattern=IDENT)] | None = None
    sink: str | None = None
    error_class: Literal["decode", "transform", "validation", "dq_gate", "sink_write"] | None = None
    status: Literal["quarantined", "redriven", "discarded"] | None = None
    since: datetime | None = None
    until: datetime | None = None
    reason: str | None = None  # a piece of the reason, any case
    ids: list[Annotated[int, Field(gt=0, le=MAX_ID)]] | None = None
    pipelines: list[str] | None = None

    @field_validator("reason")
    @classmethod
    def _reason(cls, v: str | None) -> str | None:
        if v is not None and len(v) > MAX_SEARCH:
            raise ValueError(f"{len(v):,} characters, at most {MAX_SEARCH}")
        if v is not None and "\x00" in v:
            raise ValueError("a reason holds no NUL character")
        return v

    @field_validator("sink")
    @classmethod
    def _sink(cls, v: str | None) -> str | None:
        if v is None:
            return None
        if v in ("-", "(source)"):
            raise ValueError(
                "every dead letter names its sink now; for records that failed "
                "before becoming rows, filter by class decode or transform"
            )
        if not re.match(IDENT, v):
            raise ValueError("not a sink name")
        return v

    @field_validator("since", "until")
    @classmethod
    def _aware(cls, v: datetime | None) -> datetime | None:
        return v.replace(tzinfo=UTC) if v is not None and v.tzinfo is None else v

    @model_validator(mode="after")
    def _window(self) -> Filters:
        if self.since and self.until and self.until <= self.since:
            raise ValueError(
                f"until ({self.until.isoformat()}) must be after since ({self.since.isoformat()})"
            )
        return self

    @classmethod
    def parse(cls, **raw: Any) -> Filters:
        """From user input (a query string, CLI options): blank means no filter, status
        ``any`` means every status. Raises BadInput naming the field and the value."""
        values: dict[str, Any] = {}
        for name, value in raw.items():
            if isinstance(value, str):
                value = value.strip()
            if value is None or value == "" or value == [] or (name == "status" and value == "any"):
                continue
            if name == "ids":
                value = parse_ids(value)
            elif name in ("since", "until") and isinstance(value, str) and value.isdigit():
                # pydantic reads digits as epoch seconds; users mean a date, say so
                raise BadInput(
                    f"{name} {shown(value)}: not an ISO timestamp (e.g. 2026-05-01T12:00:00Z)"
                )
            values[name] = value
        try:
            return cls(**values)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"] if not isinstance(p, int)) or "since/until"
            given = f" {shown(err['input'])}" if err["loc"] else ""
            raise BadInput(f"{where}{given}: {_problem(err)}") from None

    def without(self, *names: str) -> Filters:
        return self.model_copy(update=dict.fromkeys(names))

    def query(self) -> dict[str, str]:
        """The user filters as query-string values (for links that keep them)."""
        out = {
            k: v
            for k, v in {
                "pipeline": self.pipeline,
                "sink": self.sink,
                "error_class": self.error_class,
                "status": self.status or "any",
                "since": self.since.isoformat() if self.since else None,
                "until": self.until.isoformat() if self.until else None,
                "reason": self.reason,
            }.items()
            if v
        }
        return out

    def described(self) -> str:
        """The filters in words, for a confirmation: "pipeline orders, class validation,
        reason contains 'amount'"."""
        parts = [
            f"{label} {v}"
            for label, v in (
                ("pipeline", self.pipeline),
                ("sink", self.sink),
                ("class", self.error_class),
                ("status", self.status),
                ("last seen from", self.since and self.since.isoformat()),
                ("until", self.until and self.until.isoformat()),
            )
            if v
        ]
        if self.reason:
            parts.append(f"reason contains {shown(self.reason, MAX_SEARCH + 2)}")
        return ", ".join(parts) or "no filter"


def _where(
    f: Filters, *, status: str | None = None, before: int | None = None
) -> tuple[sql.Composable, list[Any]]:
    conds: list[sql.Composable] = []
    args: list[Any] = []

    def add(cond: str, *values: Any) -> None:
        conds.append(sql.SQL(cond))
        args.extend(values)

    if f.pipeline:
        add("pipeline = %s", f.pipeline)
    if f.pipelines is not None:
        add("pipeline = ANY(%s::text[])", list(f.pipelines))
    if f.sink:
        add("sink = %s", f.sink)
    if f.error_class:
        add("error_class = %s::tidemark.error_class", f.error_class)
    if status or f.status:
        add("status = %s::tidemark.dlq_status", status or f.status)
    if f.since:
        add("last_seen >= %s", f.since)
    if f.until:
        add("last_seen < %s", f.until)
    if f.reason:
        # A substring in any case: ILIKE with the pattern's own wildcards escaped. No index
        # (docs/dlq.md, "Search"): the other filters and the keyset bound the rows it reads.
        add("reason ILIKE %s", "%" + re.sub(r"([\\%_])", r"\\\1", f.reason) + "%")
    if f.ids is not None:
        add("id = ANY(%s::bigint[])", list(f.ids))
    if before is not None:
        add("id < %s", before)
    return (sql.SQL(" AND ").join(conds) if conds else sql.SQL("TRUE")), args


def condition(filters: Filters) -> tuple[sql.Composable, list[Any]]:
    """The WHERE condition ``filters`` make over tidemark.dlq, and its bind values."""
    return _where(filters)


def matching_ids(conn: psycopg.Connection, filters: Filters, limit: int = MAX_IDS) -> list[int]:
    """Ids of the dead letters ``filters`` select, oldest first; BadInput past ``limit``."""
    where, args = _where(filters)
    rows = conn.execute(
        sql.SQL("SELECT id FROM {} WHERE {} ORDER BY id LIMIT {}").format(
            _DLQ, where, sql.Literal(limit + 1)
        ),
        args,
    ).fetchall()
    if len(rows) > limit:
        raise BadInput(f"more than {limit:,} dead letters match; act on them in parts")
    return [r[0] for r in rows]


def matching(conn: psycopg.Connection, filters: Filters) -> int:
    """How many dead letters ``filters`` select: what an "all matching" action asks people to
    confirm."""
    where, args = _where(filters)
    return int(
        scalar(conn.execute(sql.SQL("SELECT count(*) FROM {} WHERE {}").format(_DLQ, where), args))
    )


def quarantined(conn: psycopg.Connection, pipeline: str) -> int:
    """How many of the pipeline's dead letters are live (quarantined)."""
    return int(
        scalar(
            conn.execute(
                "SELECT count(*) FROM tidemark.dlq WHERE pipeline = %s AND status = 'quarantined'",
                (pipeline,),
            )
        )
    )


def positions(conn: psycopg.Connection, pipeline: str, status: str) -> list[tuple[str, int, int]]:
    """(sink, partition, offset) of the pipeline's letters in ``status``, oldest first."""
    return conn.execute(
        "SELECT sink, source_partition, source_offset FROM tidemark.dlq "
        "WHERE pipeline = %s AND status = %s ORDER BY id",
        (pipeline, status),
    ).fetchall()


@contextmanager
def _snapshot(conn: psycopg.Connection) -> Iterator[None]:
    """A transaction whose queries all see one snapshot (REPEATABLE READ, read only); inside
    the caller's own transaction, theirs."""
    idle = conn.info.transaction_status == pq.TransactionStatus.IDLE
    with conn.transaction():
        if idle:
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        yield


def _columns(names: Iterable[str]) -> sql.Composable:
    return sql.SQL(", ").join(sql.Identifier(n) for n in names)


# -- reading ------------------------------------------------------------------------------------
@dataclass
class Page:
    rows: list[dict[str, Any]]
    next_before: int | None  # pass as ``before`` for the next (older) page; None: last page


def page(
    conn: psycopg.Connection, filters: Filters, limit: int = 50, before: int | None = None
) -> Page:
    """Newest first, ``limit`` rows with ids below ``before``. Rows carry the summary columns,
    ``payload_size`` and ``payload_head`` (the first bytes, for a preview)."""
    if not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise BadInput(f"limit {shown(limit)}: expected 1 to {MAX_LIMIT}")
    if before is not None and (not isinstance(before, int) or before <= 0):
        raise BadInput(f"before {shown(before)}: expected a dead-letter id")
    cols = sql.SQL(
        "{}, octet_length(payload) AS payload_size, "
        "substring(payload FROM 1 FOR {}) AS payload_head"
    ).format(_columns(_SUMMARY), sql.Literal(PREVIEW_BYTES))
    # Without a status filter, merge one index scan per status (PostgreSQL cannot walk
    # (pipeline, status, id DESC) in id order across statuses by itself).
    parts, args = [], []
    for status in [filters.status] if filters.status else STATUSES:
        where, a = _where(filters, status=status, before=before)
        parts.append(
            sql.SQL("(SELECT {} FROM {} WHERE {} ORDER BY id DESC LIMIT {})").format(
                cols, _DLQ, where, sql.Literal(limit + 1)
            )
        )
        args.extend(a)
    query = sql.SQL("SELECT * FROM ({}) AS p ORDER BY id DESC LIMIT {}").format(
        sql.SQL(" UNION ALL ").join(parts), sql.Literal(limit + 1)
    )
    rows = conn.cursor(row_factory=dict_row).execute(query, args).fetchall()
    more = len(rows) > limit
    rows = rows[:limit]
    for r in rows:
        r["payload_head"] = bytes(r["payload_head"]) if r["payload_head"] is not None else None
    return Page(rows, rows[-1]["id"] if more and rows else None)


def counts(conn: psycopg.Connection, filters: Filters) -> dict[str, int]:
    """Records per error class under ``filters`` (every class present, zeros included)."""
    where, args = _where(filters)
    rows = conn.execute(
        sql.SQL("SELECT error_class::text, count(*) FROM {} WHERE {} GROUP BY 1").format(
            _DLQ, where
        ),
        args,
    ).fetchall()
    out = dict.fromkeys(ERROR_CLASSES, 0)
    out.update(dict(rows))
    return out


def counts_by_pipeline(
    conn: psycopg.Connection, pipelines: list[str] | None = None
) -> dict[str, dict[str, int]]:
    """Quarantined records per pipeline and error class (for alerting), pipelines with none
    left out."""
    where, args = _where(Filters(status="quarantined", pipelines=pipelines))
    out: dict[str, dict[str, int]] = {}
    for p, cls, n in conn.execute(
        sql.SQL(
            "SELECT pipeline, error_class::text, count(*) FROM {} WHERE {} GROUP BY 1, 2 "
            "ORDER BY 1, 2"
        ).format(_DLQ, where),
        args,
    ):
        out.setdefault(p, dict.fromkeys(ERROR_CLASSES, 0))[cls] = n
    return out


def pipelines(conn: psycopg.Connection) -> list[str]:
    """The pipelines that have dead letters (a loose index scan: one probe per pipeline)."""
    rows = conn.execute("""
        WITH RECURSIVE p(name) AS (
            (SELECT pipeline FROM tidemark.dlq ORDER BY pipeline LIMIT 1)
            UNION ALL
            SELECT (SELECT pipeline FROM tidemark.dlq WHERE pipeline > p.name
                    ORDER BY pipeline LIMIT 1)
            FROM p WHERE p.name IS NOT NULL)
        SELECT name FROM p WHERE name IS NOT NULL""").fetchall()
    return [r[0] for r in rows]


def owners(conn: psycopg.Connection, ids: list[int]) -> dict[int, tuple[str, str]]:
    """id -> (pipeline, status) of the ids that exist."""
    rows = conn.execute(
        "SELECT id, pipeline, status::text FROM tidemark.dlq WHERE id = ANY(%s::bigint[])",
        (list(ids),),
    ).fetchall()
    return {i: (p, s) for i, p, s in rows}


def get(
    conn: psycopg.Connection, record_id: int, payload_limit: int | None = None
) -> dict[str, Any] | None:
    """The whole envelope of one dead letter, with ``run`` (its tidemark.runs row; ``airflow``
    names the Airflow task try that started it, if any) and ``quality`` (the run's data-quality
    results: scope, success, docs_path). ``payload_size`` is the payload's length; with
    ``payload_limit`` ``payload`` holds only its first bytes (PostgreSQL cuts it, so a 10 MB
    payload never crosses the wire for a page that shows 256 KiB)."""
    cols = [
        sql.Identifier(c)
        if c != "payload" or payload_limit is None
        else sql.SQL("substring(payload FROM 1 FOR {}) AS payload").format(
            sql.Literal(payload_limit)
        )
        for c in ENVELOPE
    ]
    cur = conn.cursor(row_factory=dict_row)
    rec = cur.execute(
        sql.SQL("SELECT {}, octet_length(payload) AS payload_size FROM {} WHERE id = %s").format(
            sql.SQL(", ").join(cols), _DLQ
        ),
        (record_id,),
    ).fetchone()
    if rec is None:
        return None
    for k in ("key", "payload", "source_headers"):
        rec[k] = bytes(rec[k]) if rec[k] is not None else None
    run = runs.get(conn, rec["run_id"])
    rec["run"] = None if run is None else run.as_dict()
    rec["quality"] = cur.execute(
        """SELECT scope, success, rows_failed, docs_path
                                    FROM tidemark.dq_results WHERE run_id = %s ORDER BY scope""",
        (rec["run_id"],),
    ).fetchall()
    return rec


def pipeline_of(conn: psycopg.Connection, record_id: int) -> str | None:
    """The pipeline a dead letter belongs to (None: no such letter), without its bytes."""
    row = conn.execute("SELECT pipeline FROM tidemark.dlq WHERE id = %s", (record_id,)).fetchone()
    return row[0] if row else None


def payload_chunks(
    conn: psycopg.Connection, record_id: int, chunk: int = 1024 * 1024
) -> Iterator[bytes]:
    """A letter's payload in slices of ``chunk`` bytes, from one snapshot: a download holds
    one slice in memory, not the whole payload."""
    with _snapshot(conn):
        start = 1
        while True:
            row = conn.execute(
                "SELECT substring(payload FROM %s FOR %s) FROM tidemark.dlq WHERE id = %s",
                (start, chunk, record_id),
            ).fetchone()
            if row is None or not row[0]:
                return
            yield bytes(row[0])
            if len(row[0]) < chunk:
                return
            start += chunk


# -- acting -------------------------------------------------------------------------------------
def _why(note: str | None, by: str | None) -> tuple[str, str]:
    """A discard's note and who, checked."""
    note = (note or "").strip()
    if not note:
        raise BadInput("note: required; say why these records are discarded")
    if len(note) > MAX_NOTE:
        raise BadInput(f"note: {len(note):,} characters, at most {MAX_NOTE:,}")
    by = (by or "").strip()
    if not by:
        raise BadInput("by: required; who discards")
    return note, by


@dataclass
class Discarded:
    changed: list[int] = field(default_factory=list)
    skipped: dict[int, str] = field(default_factory=dict)  # id -> why

    def to_dict(self) -> dict[str, Any]:
        return {
            "discarded": self.changed,
            "skipped": [{"id": i, "reason": r} for i, r in sorted(self.skipped.items())],
        }


def discard(
    conn: psycopg.Connection, ids: Iterable[int], note: str | None, by: str | None
) -> Discarded:
    """Mark quarantined records discarded, with who, when and why; others are skipped with the
    reason. All or nothing: a record locked by a redrive fails the whole call with Busy."""
    chosen = sorted(set(parse_ids(list(ids))))
    if not chosen:
        raise BadInput("ids: give at least one dead-letter id")
    note, by = _why(note, by)
    out = Discarded()
    with conn.transaction():
        conn.execute("SELECT set_config('lock_timeout', %s, true)", (LOCK_TIMEOUT,))
        try:
            with conn.transaction():  # a savepoint: find who is locked after a timeout
                rows = conn.execute(
                    "SELECT id, status::text FROM tidemark.dlq WHERE id = "
                    "ANY(%s::bigint[]) ORDER BY id FOR UPDATE",
                    (chosen,),
                ).fetchall()
        except pgerr.LockNotAvailable:
            free = {
                r[0]
                for r in conn.execute(
                    "SELECT id FROM tidemark.dlq WHERE id = ANY(%s::bigint[]) FOR UPDATE SKIP LOCKED",
                    (chosen,),
                )
            }
            exist = {
                r[0]
                for r in conn.execute(
                    "SELECT id FROM tidemark.dlq WHERE id = ANY(%s::bigint[])", (chosen,)
                )
            }
            locked = sorted(exist - free) or chosen
            if len(locked) == 1:
                raise Busy(
                    f"record {locked[0]} is being redriven, try again; nothing was discarded"
                ) from None
            raise Busy(
                f"records {', '.join(map(str, locked[:20]))} are being redriven, try "
                f"again; nothing was discarded"
            ) from None
        status: dict[int, str] = dict(rows)
        for i in chosen:
            if i not in status:
                out.skipped[i] = "no such dead letter"
            elif status[i] != "quarantined":
                out.skipped[i] = f"already {status[i]}"
        todo = [i for i in chosen if status.get(i) == "quarantined"]
        if todo:
            out.changed = sorted(
                r[0]
                for r in conn.execute(
                    """UPDATE tidemark.dlq SET status = 'discarded', resolved_by = %s,
                          resolved_at = now(), note = %s
                   WHERE id = ANY(%s::bigint[]) AND status = 'quarantined' RETURNING id""",
                    (by, note, todo),
                )
            )
    return out


def discard_matching(
    conn: psycopg.Connection,
    filters: Filters,
    note: str | None,
    by: str | None,
    expected: int | None = None,
) -> Discarded:
    """Discard every quarantined letter ``filters`` match now (up to MAX_IDS), as
    :func:`discard` does ids. ``expected``: the count the caller confirmed; more matching now
    is refused (nothing discarded): they confirmed fewer. Fewer is fine (some were resolved
    meanwhile)."""
    _why(note, by)
    ids = matching_ids(conn, filters.model_copy(update={"status": "quarantined"}))
    if expected is not None and len(ids) > expected:
        raise BadInput(
            f"{len(ids):,} dead letter(s) match now, not the {expected:,} confirmed; "
            f"nothing was discarded, look again"
        )
    if not ids:
        return Discarded()
    return discard(conn, ids, note, by)


# -- export ---------------------------------------------------------------------------------
def envelope(row: dict[str, Any]) -> dict[str, Any]:
    """A JSON-ready envelope: key and payload base64, timestamps ISO 8601."""
    out = {}
    for k in ENVELOPE:
        v = row.get(k)
        if isinstance(v, bytes | bytearray | memoryview):
            v = base64.b64encode(bytes(v)).decode("ascii")
        elif isinstance(v, datetime):
            v = (v.astimezone(UTC) if v.tzinfo else v).isoformat()
        elif isinstance(v, date):
            v = v.isoformat()
        out[k] = v
    return out


EXPORT_BYTES = 8 * 1024 * 1024  # letter bytes an export holds in memory at a time
EXPORT_END = "tidemark_export_end"  # the key of an export's last line


def export_end(records: int) -> str:
    """An export's last line: without it (or with another count) the export was cut off."""
    return json.dumps({EXPORT_END: {"records": records}}) + "\n"


def export(
    conn: psycopg.Connection, filters: Filters, batch: int = 2000, budget: int = EXPORT_BYTES
) -> Iterator[str]:
    """JSON Lines, oldest first, then export_end's line with the count: a reader tells a whole
    export from a cut one. Memory is bounded by bytes, not rows: a server-side cursor
    walks (id, size) only; the envelopes are fetched in runs of consecutive letters holding at
    most ``budget`` bytes (or ``batch`` letters), a letter bigger than that alone. One
    REPEATABLE READ snapshot makes the runs one consistent export."""
    where, args = _where(filters)
    sizes = sql.SQL(
        "SELECT id, coalesce(octet_length(payload), 0) + coalesce(octet_length(key), 0)"
        " + coalesce(octet_length(detail), 0) + coalesce(octet_length(reason), 0)"
        " + coalesce(octet_length(note), 0) + coalesce(pg_column_size(headers), 0)"
        " + coalesce(octet_length(source_headers), 0)"
        " FROM {} WHERE {} ORDER BY id"
    ).format(_DLQ, where)
    # Binary results: a bytea arrives as its bytes, not as hex text twice their size.
    rows = sql.SQL("SELECT {} FROM {} WHERE id = ANY(%s::bigint[]) ORDER BY id").format(
        sql.SQL(", ").join(
            sql.SQL("{}::text AS {}").format(sql.Identifier(c), sql.Identifier(c))
            if c in ("error_class", "status")
            else sql.Identifier(c)
            for c in ENVELOPE
        ),
        _DLQ,
    )
    with _snapshot(conn):
        with (
            conn.cursor(name="tidemark_dlq_export") as walk,
            conn.cursor(row_factory=dict_row, binary=True) as cur,
        ):
            walk.itersize = batch
            walk.execute(sizes, args)
            ids: list[int] = []
            held = sent = 0
            for rid, size in walk:
                if ids and (held + size > budget or len(ids) >= batch):
                    yield from _lines(cur, rows, ids)
                    sent += len(ids)
                    ids, held = [], 0
                ids.append(rid)
                held += size
            if ids:
                yield from _lines(cur, rows, ids)
                sent += len(ids)
    yield export_end(sent)


def _lines(
    cur: psycopg.Cursor[dict[str, Any]], query: sql.Composed, ids: list[int]
) -> Iterator[str]:
    cur.execute(query, (ids,))
    while (row := cur.fetchone()) is not None:
        line = json.dumps(envelope(row))
        del row  # its bytes go before the line grows
        line += "\n"  # in place when CPython can: no second copy of a big letter's line
        yield line
        del line
