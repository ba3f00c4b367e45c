"""What a prune (or retire) did, or would do: rows per table, Data Docs files and bytes,
retired tables, and notes; shared by tidemark/protocol/prune.py and the modules it calls
(retired_tables.py), so none of them imports another for its report.

May import: core.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Progress = Callable[[str], None]

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
    "retired_tables": "retired tables",
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
    policies: dict[str, str] = field(default_factory=dict)  # pipelines with their own retention
    tables: list[str] = field(default_factory=list)  # retired tables dropped, each with why

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
        out += [f"  {t}" for t in self.tables]
        out += [f"  {n}" for n in self.notes]
        own = [f"  pipeline {name}: its own retention: {d}" for name, d in self.policies.items()]
        return [*(["retention of its own:", *own] if own else []), f"{verb}:", *out]

    def to_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "rows": self.rows,
            "docs_files": self.docs_files,
            "docs_bytes": self.docs_bytes,
            "outside": self.outside,
            "notes": self.notes,
            "policies": self.policies,
            "tables": self.tables,
        }
