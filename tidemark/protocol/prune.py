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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psycopg

from tidemark.config import Pipeline, Retention
from tidemark.core.db import connect, scalar
from tidemark.core.errors import TidemarkError
from tidemark.core.settings import Settings
from tidemark.ledger import retention
from tidemark.protocol.prune_summary import Progress, Summary
from tidemark.quality import docs

LOCK_KEY = 0x74647072  # 'tdpr': one prune or retire at a time

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
    retired_tables_days: int | None = None  # None: retired tables are kept

    @classmethod
    def of(cls, s: Settings) -> Policy:
        return cls(
            s.retention_letters_days,
            s.retention_runs_days,
            s.retention_requests_days,
            s.retention_batch_size,
        )

    def of_pipeline(self, r: Retention) -> Policy:
        """This policy with what the pipeline's ``retention:`` sets instead (its file is
        read again by every prune: a change needs no restart)."""
        return replace(
            self,
            letters_days=_either(r.letters_days, self.letters_days),
            runs_days=_either(r.runs_days, self.runs_days),
            requests_days=_either(r.requests_days, self.requests_days),
            retired_tables_days=_either(r.retired_tables_days, self.retired_tables_days),
        )

    def describe(self) -> str:
        return (
            f"resolved dead letters {self.letters_days} days (a discarded one's payload; its "
            f"row stays), finished runs {self.runs_days} days, redrive requests "
            f"{self.requests_days} days, retired tables "
            + ("kept" if self.retired_tables_days is None else f"{self.retired_tables_days} days")
        )


def _either(own: Any, default: Any) -> Any:
    return default if own is None else own


# How each table's rows are named in a summary, in the order shown.


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
    pipelines: dict[str, Pipeline] | None = None,
) -> Summary:
    """Delete (``dry_run``: count) what has outlived ``policy``; ``pipeline``: only its.
    ``pipelines`` (the pipeline files, read now): each one's ``retention:`` overrides the
    policy for it, and its retired tables go after ``retired_tables_days``."""
    summary = Summary(dry_run=dry_run)
    files = pipelines or {}
    own = {
        name: mine
        for name, p in files.items()
        if (mine := policy.of_pipeline(p.retention)) != policy
    }
    passes: list[tuple[str | None, Policy, list[str]]] = []
    if pipeline is None:
        passes.append((None, policy, sorted(own)))
        passes += [(name, own[name], []) for name in sorted(own)]
    else:
        passes.append((pipeline, own.get(pipeline, policy), []))
    with connect(ledger_dsn, autocommit=True, what="ledger", application="tidemark-prune") as conn:
        locked(conn)
        for name, pol, others in passes:
            if name is not None and name in own:
                summary.policies[name] = pol.describe()
            _ledger_pass(conn, name, pol, others, docs_root, summary, progress)
    for name, p in sorted(files.items()):
        if pipeline is not None and name != pipeline:
            continue
        days = own.get(name, policy).retired_tables_days
        if days is not None:
            from tidemark.protocol import retired_tables

            retired_tables.expire(p, days, summary, progress)
    return summary


def _ledger_pass(
    conn: psycopg.Connection,
    pipeline: str | None,
    policy: Policy,
    own: list[str],
    docs_root: Path,
    summary: Summary,
    progress: Progress,
) -> None:
    """One policy's letters, runs and requests: of ``pipeline`` (None: of every pipeline but
    those in ``own``, which have a pass of their own)."""
    b = policy.batch_size
    # Letters first: a run a deleted letter pointed at may go in the same prune.
    walk(
        conn,
        "redriven dead letters",
        lambda c, **kw: retention.letters(
            c, pipeline=pipeline, days=policy.letters_days, own=own, **kw
        ),
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
            c, pipeline=pipeline, days=policy.letters_days, own=own, **kw
        ),
        lambda ids: {"dlq_payloads": retention.drop_payloads(conn, ids)},
        lambda ids: {"dlq_payloads": len(ids)},
        summary,
        b,
        progress,
    )
    if summary.rows.get("dlq_payloads") and KEPT_DISCARDED not in summary.notes:
        summary.notes.append(KEPT_DISCARDED)
    pages: list[tuple[str, str]] = []

    def remove_pages() -> None:
        _docs(pages, docs_root, summary)
        pages.clear()

    walk(
        conn,
        "finished runs",
        lambda c, **kw: retention.runs(
            c,
            pipeline=pipeline,
            days=policy.runs_days,
            letters_days=policy.letters_days,
            own=own,
            **kw,
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
            retention.requests(c, pipeline=pipeline, days=policy.requests_days, own=own, **kw),
            b,
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
