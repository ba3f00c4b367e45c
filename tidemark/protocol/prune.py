"""Retention (docs/operations.md, "Retention"): delete redriven dead letters (and drop the
payloads of discarded ones, whose rows stay: each is its record's one place), finished runs
with their children and Data Docs pages, and redrive requests once older than their keeping
time, in bounded batches, each its own short ledger transaction.

What recovery needs is never selected (tidemark/ledger/retention.py says what and why).
Commit markers (``tidemark.commits``) are not this module's: the recovery sweep drops the
day-old markers of settled runs on every database it scans (ledger/markers.py, prune).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from tidemark.core.db import connect, scalar
from tidemark.core.errors import TidemarkError
from tidemark.core.settings import Settings
from tidemark.ledger import retention
from tidemark.quality import docs

LOCK_KEY = 0x74647072  # 'tdpr': one prune or retire at a time

Progress = Callable[[str], None]
KEPT_DISCARDED = (
    "discarded letters: only their payloads, headers and detail go; their rows stay (who "
    "discarded each record, when and why: its one place)"
)


@dataclass(frozen=True)
class Policy:
    letters_days: int = 30
    runs_days: int = 90
    requests_days: int = 30
    batch_size: int = 500

    @classmethod
    def of(cls, s: Settings) -> Policy:
        return cls(
            s.retention_letters_days,
            s.retention_runs_days,
            s.retention_requests_days,
            s.retention_batch_size,
        )


# How each table's rows are named in a summary, in the order shown.
LABELS = {
    "pipelines": "pipeline row",
    "checkpoints": "checkpoints",
    "leases": "leases",
    "dlq": "dead letters",
    "dlq_payloads": "discarded payloads",
    "runs": "runs",
    "run_sinks": "run sinks",
    "run_ranges": "run ranges",
    "participants": "participants",
    "run_metrics": "run metrics",
    "dq_results": "data-quality results",
    "redrive_requests": "redrive requests",
    "redrive_letters": "redrive request letters",
    "markers": "commit markers",
}


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("bytes", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:,.0f} {unit}" if unit == "bytes" else f"{size:,.1f} {unit}"
        size /= 1024
    return f"{n} bytes"


@dataclass
class Summary:
    """Rows per table, and Data Docs files and bytes, deleted (or, dry, to be deleted)."""

    dry_run: bool = False
    rows: dict[str, int] = field(default_factory=dict)
    docs_files: int = 0
    docs_bytes: int = 0
    outside: list[str] = field(default_factory=list)  # pages not under the Data Docs folder
    notes: list[str] = field(default_factory=list)  # anything else left behind, and why

    def add(self, counts: dict[str, int]) -> None:
        for k, v in counts.items():
            self.rows[k] = self.rows.get(k, 0) + v

    def lines(self) -> list[str]:
        verb = "would delete" if self.dry_run else "deleted"
        out = [
            f"  {LABELS.get(k, k):<24} {self.rows.get(k, 0):>10,}" for k in LABELS if k in self.rows
        ]
        out.append(
            f"  {'Data Docs files':<24} {self.docs_files:>10,}  ({human_bytes(self.docs_bytes)})"
        )
        if self.outside:
            out.append(
                f"  kept {len(self.outside)} Data Docs page(s) outside the Data Docs "
                f"folder, e.g. {self.outside[0]}"
            )
        out += [f"  {n}" for n in self.notes]
        return [f"{verb}:", *out]

    def to_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "rows": self.rows,
            "docs_files": self.docs_files,
            "docs_bytes": self.docs_bytes,
            "outside": self.outside,
            "notes": self.notes,
        }


def locked(conn: psycopg.Connection) -> None:
    """Take the retention lock for this session, or say who holds it."""
    if not scalar(conn.execute("SELECT pg_try_advisory_lock(%s)", (LOCK_KEY,))):
        raise TidemarkError(
            "another `tidemark prune` or `pipelines retire` is running on this "
            "ledger; try again when it is done"
        )


def walk(
    conn: psycopg.Connection,
    kind: str,
    select: Callable[..., list[Any]],
    delete: Callable[[list[int]], dict[str, int]],
    count: Callable[[list[int]], dict[str, int]],
    summary: Summary,
    batch: int,
    progress: Progress,
    each: Callable[[list[int]], None] | None = None,
    committed: Callable[[], None] | None = None,
) -> None:
    """Page through ``select`` (ids, or tuples whose first item is the id) ``batch`` at a time;
    per page, one transaction: ``each`` (reads what goes with the rows), ``delete`` (or, dry,
    ``count``) its rows; then ``committed`` (their files: only once the rows are gone)."""
    after, done = 0, 0
    while True:
        with conn.transaction():
            page = select(conn, after=after, limit=batch, lock=not summary.dry_run)
            if not page:
                break
            ids = [p[0] if isinstance(p, tuple) else p for p in page]
            if each is not None:
                each(ids)  # reads the files' paths before their rows go
            counts = count(ids) if summary.dry_run else delete(ids)
        if committed is not None:
            committed()
        summary.add(counts)
        done += len(ids)
        after = ids[-1]
        progress(f"{kind}: {'found' if summary.dry_run else 'deleted'} {done:,}")


def prune(
    ledger_dsn: str,
    policy: Policy,
    docs_root: Path,
    *,
    pipeline: str | None = None,
    dry_run: bool = False,
    progress: Progress = lambda m: None,
) -> Summary:
    """Delete (``dry_run``: count) what has outlived ``policy``; ``pipeline``: only its."""
    summary = Summary(dry_run=dry_run)
    b = policy.batch_size
    with connect(ledger_dsn, autocommit=True, what="ledger", application="tidemark-prune") as conn:
        locked(conn)
        # Letters first: a run a deleted letter pointed at may go in the same prune.
        walk(
            conn,
            "redriven dead letters",
            lambda c, **kw: retention.letters(c, pipeline=pipeline, days=policy.letters_days, **kw),
            lambda ids: {"dlq": retention.delete_letters(conn, ids)},
            lambda ids: {"dlq": len(ids)},
            summary,
            b,
            progress,
        )
        # A discarded letter is its record's one place (docs/design.md, invariant 1): its
        # row stays; what it carried of the record goes.
        walk(
            conn,
            "discarded dead letters' payloads",
            lambda c, **kw: retention.discarded(
                c, pipeline=pipeline, days=policy.letters_days, **kw
            ),
            lambda ids: {"dlq_payloads": retention.drop_payloads(conn, ids)},
            lambda ids: {"dlq_payloads": len(ids)},
            summary,
            b,
            progress,
        )
        if summary.rows.get("dlq_payloads"):
            summary.notes.append(KEPT_DISCARDED)
        pages: list[tuple[str, str]] = []

        def remove_pages() -> None:
            _docs(pages, docs_root, summary)
            pages.clear()

        walk(
            conn,
            "finished runs",
            lambda c, **kw: retention.runs(
                c, pipeline=pipeline, days=policy.runs_days, letters_days=policy.letters_days, **kw
            ),
            lambda ids: retention.delete_runs(conn, ids),
            lambda ids: retention.run_rows(conn, ids),
            summary,
            b,
            progress,
            each=lambda ids: pages.extend(retention.docs_pages(conn, ids)),
            committed=remove_pages,
        )
        walk(
            conn,
            "redrive requests",
            lambda c, **kw: _by_letters(
                retention.requests(c, pipeline=pipeline, days=policy.requests_days, **kw), b
            ),
            lambda ids: retention.delete_requests(conn, ids),
            lambda ids: {
                "redrive_requests": len(ids),
                "redrive_letters": retention.request_letters(conn, ids),
            },
            summary,
            b,
            progress,
        )
    return summary


def _by_letters(page: list[tuple[int, int]], batch: int) -> list[tuple[int, int]]:
    """The first requests of ``page`` holding about ``batch`` letter rows in all (at least
    one request): deleting a request deletes its letters in the same statement."""
    out: list[tuple[int, int]] = []
    letters = 0
    for request_id, n in page:
        if out and letters + n > batch:
            break
        out.append((request_id, n))
        letters += n
    return out


def _docs(pages: list[tuple[str, str]], root: Path, summary: Summary) -> None:
    """The pages of the deleted runs' results and the validation results they render."""
    files: list[tuple[str, str]] = []
    for name, page in pages:
        found = docs.validation_files(str(root / name), page)
        if found is None:
            summary.outside.append(page)
        else:
            files += found
    count, size = (docs.files_size if summary.dry_run else docs.remove_files)(files)
    summary.docs_files += count
    summary.docs_bytes += size
