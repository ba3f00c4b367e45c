"""One sink's dead letters in one task: a ledger transaction of their own (stage ``d.<sink>``),
prepared and chosen with that sink's rows, so a letter is visible exactly when its run commits
for that sink (docs/design.md, invariant 3). Letters wait and go to the ledger together (one
payload read, one COPY, one merge); each keeps its record's bytes as the source had them
(docs/design.md, "DLQ envelope")."""

from __future__ import annotations

import base64
import json
import re
from collections import Counter
from typing import Any

import psycopg
import pyarrow as pa

from tidemark.core.clock import Phases
from tidemark.core.columns import OFFSET, PARTITION
from tidemark.core.participants import Target
from tidemark.core.text import clamp
from tidemark.engine import transactions
from tidemark.engine.json_reasons import decode_reason
from tidemark.engine.records import ERR_CLASS, ERR_REASON
from tidemark.ledger import letters, redrives
from tidemark.protocol.taskspec import Prepared, TaskSpec
from tidemark.sources import PayloadReader

# Row checks find a few records in many batches, and a round trip per batch cost more than the
# letters: bounded by count and by the payloads they carry.
FLUSH_LETTERS = 10_000
FLUSH_LETTER_BYTES = 64 * 2**20
REASON_MAX = 200
REASON_SHOWN = 120  # a reason as the run's report counts it
TOP_REASONS = 5  # reasons a task reports per sink
DETAIL_MAX = 8_000
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
Record = dict[str, Any]  # one record as Arrow's to_pylist gives it
Pending = tuple[Record, str, str, str | None]  # (record, class, reason, detail)


def _kind(reason: str) -> str:
    """A reason without its values ("unexpected value 500.0" -> "unexpected value N"), so
    records failing the same way count as one reason."""
    return _NUMBER.sub("N", reason)


def pg_text(text: str, limit: int) -> str:
    """A reason for a text column: PostgreSQL refuses NUL characters."""
    return clamp(text.replace("\x00", "\\0"), limit)


def storable_headers(headers: str | None) -> str | None:
    """Headers as jsonb will take them. PostgreSQL refuses a ``\\u0000`` escape (and anything
    not JSON): such headers are kept exactly, base64-encoded, so the record still lands in its
    dead letter instead of failing its own quarantine."""
    if headers is None:
        return None
    if "\\u0000" not in headers:
        try:
            json.loads(headers)
            return headers
        except ValueError:
            pass
    return json.dumps(
        {
            "_tm_unstorable_headers_base64": base64.b64encode(
                headers.encode("utf-8", "surrogatepass")
            ).decode()
        }
    )


class DeadLetters:
    """One sink's dead letters in one ledger transaction (stage ``d.<sink>``)."""

    def __init__(self, spec: TaskSpec, sink: str, gid: str, phases: Phases) -> None:
        self.spec, self.sink, self.gid, self.phases = spec, sink, gid, phases
        # The ledger transaction and its staged letters, begun at the first statement
        self.stage: letters.Stage | None = None
        self.rows = 0
        self.resolved = 0
        self.offsets: dict[int, list[int]] = {}  # partition -> offsets quarantined here
        self.held: dict[tuple[int, int], int] = {}  # redrive: (partition, offset) -> letter id
        self.held_offsets: dict[int, pa.Array] = {}  # redrive: partition -> offsets held
        self.failed_again: list[int] = []
        self.skipped: list[int] = []  # redrive: letters of the request no longer quarantined
        self.reader: PayloadReader | None = None  # reads what the reader left out (_fill_left_out)
        self.pending: list[Pending] = []  # not yet written
        # "<class>: <reason>" -> letters, for the quarantine ceiling's message
        self.reasons: Counter[str] = Counter()
        self.classes: Counter[str] = Counter()  # letters by error class
        self.pending_bytes = 0

    def _open(self) -> psycopg.Connection:
        return self._staged().conn

    def _staged(self) -> letters.Stage:
        if self.stage is None:
            conn = transactions.begin(self.spec.ledger_dsn, self.spec.lock_timeout_ms, "dlq")
            self.stage = letters.Stage(conn, self.gid)
        return self.stage

    def hold(self, request: int) -> None:
        """Redrive: lock this sink's letters of the request (a concurrent discard waits) and
        keep those still quarantined; ``skipped``: the ids not held (discarded or resolved
        since the plan)."""
        conn = self._open()
        by_part: dict[int, list[int]] = {}
        for i, part, off, live in redrives.hold(conn, request, self.spec.pipeline, self.sink):
            if live:
                self.held[(part, off)] = i
                by_part.setdefault(part, []).append(off)
            else:
                self.skipped.append(i)
        # Built once: every batch is scoped against them (a redrive may be 100,000 letters).
        self.held_offsets = {p: pa.array(offs, pa.int64()) for p, offs in by_part.items()}

    def add(
        self,
        records: list[Record],
        error_class: str | None = None,
        reason: str | None = None,
        detail: str | None = None,
    ) -> None:
        """Quarantine ``records`` for this sink; they reach the ledger at :meth:`flush`."""
        for r in records:
            part, off = r[PARTITION], r[OFFSET]
            why = (error_class or r[ERR_CLASS], reason or r[ERR_REASON])
            self.pending.append((r, *why, detail))
            self.reasons[f"{why[0]}: {clamp(_kind(str(why[1])), REASON_SHOWN)}"] += 1
            self.classes[str(why[0])] += 1
            self.pending_bytes += len(r["_tm_payload"] or b"")
            self.offsets.setdefault(part, []).append(off)
            if (part, off) in self.held:
                self.failed_again.append(self.held[(part, off)])
        self.rows += len(records)
        if len(self.pending) >= FLUSH_LETTERS or self.pending_bytes >= FLUSH_LETTER_BYTES:
            self.flush()

    def flush(self) -> None:
        """Write the letters added since the last flush into this sink's ledger transaction."""
        if not self.pending:
            return
        pending, self.pending, self.pending_bytes = self.pending, [], 0
        self._fill_left_out(pending)
        stage = self._staged()
        with stage.copy() as copy:
            for r, error_class, reason, detail in pending:
                if error_class == "decode":  # Spark's word made precise, from the bytes
                    reason = decode_reason(r["_tm_payload"], reason)
                copy.write_row(
                    (
                        self.spec.pipeline,
                        self.sink,
                        self.spec.run_id,
                        r[PARTITION],
                        r[OFFSET],
                        r["_tm_key"],
                        r["_tm_payload"],
                        storable_headers(r["_tm_headers"]),
                        error_class,
                        pg_text(reason, REASON_MAX),
                        pg_text(detail, DETAIL_MAX) if detail else None,
                        # as the source had them: what a redrive hands the transform
                        letters.header_bytes(r["_tm_headers"]),
                        r["_tm_ts"],
                        True,
                    )
                )
        stage.merge()

    def _fill_left_out(self, pending: list[Pending]) -> None:
        """What the reader left out (TaskSpec.payloads, sources.LEFT_OUT: a decoded record's
        bytes and key, every record's headers and time), read again from the source: a
        letter keeps the record as the source had it."""
        if self.spec.payloads is None:
            return
        left_out = [r for r, _, _, _ in pending]
        wanted: dict[int, list[int]] = {}
        for r in left_out:
            wanted.setdefault(r[PARTITION], []).append(r[OFFSET])
        if wanted:
            if self.reader is None:
                self.reader = PayloadReader(self.spec.payloads)
            got = self.reader.records(wanted)
            for r in left_out:
                r.update(got[(r[PARTITION], r[OFFSET])])

    def resolve_held(self, by: str, note: str) -> None:
        """Redrive: the held letters that passed this time are resolved (one statement)."""
        self.flush()
        failed = set(self.failed_again)
        ids = [i for i in self.held.values() if i not in failed]
        if ids:
            self.resolved += letters.resolve_ids(self._open(), ids, by, note)

    def resolve(self, partition: int, start: int, end: int, by: str, note: str) -> None:
        """Re-delivery: the live letters of this sink for the records of ``[start, end)``
        that passed this time are resolved: the records are in the sink now."""
        self.flush()
        self.resolved += letters.resolve_range(
            self._open(),
            self.spec.pipeline,
            self.sink,
            partition,
            start,
            end,
            self.offsets.get(partition, []),
            by,
            note,
        )

    def live(self, partition: int, offsets: list[int]) -> set[int]:
        """Which of ``offsets`` a live letter for this sink holds (this task's own too)."""
        self.flush()
        return letters.live_offsets(self._open(), self.spec.pipeline, self.sink, partition, offsets)

    def resolve_offsets(self, partition: int, offsets: list[int], by: str, note: str) -> None:
        """Re-delivery: the live letters of these records, placed by a row now."""
        self.flush()
        self.resolved += letters.resolve_offsets(
            self._open(), self.spec.pipeline, self.sink, partition, offsets, by, note
        )

    def prepare(self) -> Prepared | None:
        with self.phases("quarantine"):
            self.flush()
        if self.stage is None:
            return None
        if not self.rows and not self.resolved:
            self.close()  # nothing to commit: no participant
            return None
        with self.phases("prepare"):
            self.stage.drop()
            transactions.finish(self.stage.conn, self.gid, self.spec.run_id, self.spec.prepare)
            self.stage.conn.close()
        return Prepared(
            gid=self.gid, target=Target.ledger(), sink=self.sink, rows=self.rows + self.resolved
        )

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        if self.stage is not None and not self.stage.conn.closed:
            self.stage.conn.close()  # an open, unprepared transaction rolls back
