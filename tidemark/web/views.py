"""Letters as people and programs read them: a list row, and one letter with its payload
rendered within bounds, its headers, and links to its Airflow run and Data Docs (links only:
never a server path)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from fastapi import Request

from tidemark.ledger import dlq, letters
from tidemark.quality.docs import site_dir
from tidemark.render import payloads
from tidemark.web.context import Web, links

SHOW_BYTES = 256 * 1024  # payload bytes a page renders; the download and export have them all
SHOW_CHARS = payloads.RENDER_CHARS  # what one rendering of them (pretty JSON, hexdump) may grow to
KEY_CHARS = 64 * 1024  # a key's or the headers' rendering
CUT = (
    f"\n... cut here: this view shows at most {KEY_CHARS:,} characters; export the record "
    f"for all of them"
)


def iso(v: Any) -> Any:
    if isinstance(v, datetime):
        return (v.astimezone(UTC) if v.tzinfo else v).isoformat()
    return v


def summary(row: dict[str, Any]) -> dict[str, Any]:
    out = {k: iso(v) for k, v in row.items() if k != "payload_head"}
    out["payload_preview"] = payloads.preview(row["payload_head"], row["payload_size"])
    return out


def docs_site(web: Web, pipeline: str) -> Path:
    """Where the pipeline's Data Docs site is, resolved."""
    return Path(site_dir(str(web.settings().docs_dir(pipeline)))).resolve()


def docs_href(web: Web, request: Request, pipeline: str, docs_path: str | None) -> str | None:
    """The page's address under the pipeline's own Data Docs site (None if it is elsewhere,
    e.g. rendered before Data Docs were kept per pipeline)."""
    if not docs_path:
        return None
    site = docs_site(web, pipeline)
    try:
        rel = Path(unquote(docs_path)).resolve().relative_to(site)
    except ValueError:
        return None
    return f"{links(request)['prefix']}/dlq/docs/{quote(pipeline)}/{quote(rel.as_posix())}"


def airflow_links(request: Request, run: dict[str, Any] | None) -> dict[str, str]:
    af = (run or {}).get("airflow")
    if not af:
        return {}
    root = links(request)["airflow"]
    dag_run = f"{root}/dags/{quote(af['dag_id'], safe='')}/runs/{quote(af['run_id'], safe='')}"
    out = {"dag_run": dag_run}
    if isinstance(af.get("task_id"), str):
        tries = f"?try_number={af['try_number']}" if af.get("try_number") is not None else ""
        out["task_log"] = f"{dag_run}/tasks/{quote(af['task_id'], safe='')}{tries}"
    return out


def record(web: Web, request: Request, rec: dict[str, Any], fmt: str) -> dict[str, Any]:
    """A letter read with ``payload_limit=SHOW_BYTES``: ``payload`` (base64) only when that
    is all of it, else null; ``payload_download`` has every byte."""
    size = rec["payload_size"]
    kind, text = payloads.render_payload(
        rec["payload"], fmt, limit=SHOW_BYTES, size=size, max_chars=SHOW_CHARS
    )
    docs = []
    if rec["error_class"] in ("validation", "dq_gate"):  # links only: no server paths
        docs = [
            {
                "scope": q["scope"] or "(pipeline)",
                "success": q["success"],
                "href": docs_href(web, request, rec["pipeline"], q["docs_path"]),
            }
            for q in rec["quality"]
            if q["docs_path"]
        ]
    whole = size is None or size <= SHOW_BYTES
    return {
        **dlq.envelope(rec if whole else {**rec, "payload": None}),
        "payload_size": size,
        "payload_complete": whole,
        "payload_download": f"{links(request)['prefix']}/dlq/api/records/{rec['id']}/payload"
        if size is not None
        else None,
        "payload_rendered": {"kind": kind, "text": text},
        "key_text": None
        if rec["key"] is None
        else payloads.render_payload(rec["key"], limit=4096, max_chars=KEY_CHARS)[1],
        "run": {k: iso(v) for k, v in rec["run"].items()} if rec["run"] else None,
        "links": airflow_links(request, rec["run"]),
        "data_docs": docs,
    }


def headers_text(rec: dict[str, Any]) -> str | None:
    """The headers as the source had them (exact text); a letter that does not know them
    (from before ledger V007) as jsonb stored them."""
    exact = letters.header_text(rec["source_headers"])
    if exact is not None:
        return exact if len(exact) <= KEY_CHARS else exact[:KEY_CHARS] + CUT
    if rec["headers"] is None:
        return None
    pretty = payloads.pretty_json(rec["headers"], KEY_CHARS)
    if pretty is not None:
        return pretty
    # Indented they would pass the bound: their plain JSON, cut.
    plain = json.dumps(rec["headers"], ensure_ascii=False)
    return plain if len(plain) <= KEY_CHARS else plain[:KEY_CHARS] + CUT


def formats(rec: dict[str, Any]) -> list[str]:
    """The views a letter's page offers. Whether to offer the JSON tab, without rendering a
    view nobody asked for (parsing 256 KiB again costs milliseconds; indenting it could cost a
    48 MB page)."""
    out = ["auto", "text", "hex"]
    if payloads.payload_kind(rec["payload"], SHOW_BYTES, rec["payload_size"]) == "json":
        out.insert(1, "json")
    return out
