"""Who may see and change which letters, asked of Airflow's auth manager (auth.py) for the
pipelines the ledger says they belong to. A letter one may not see is not found, exactly like
one that does not exist."""

from __future__ import annotations

from typing import Any

import psycopg

from tidemark.core.errors import NotFound
from tidemark.ledger import dlq
from tidemark.web import auth as web_auth
from tidemark.web.auth import Caller, Forbidden
from tidemark.web.context import Web
from tidemark.web.selection import record_id
from tidemark.web.views import SHOW_BYTES


def may(caller: Caller, method: str, pipeline: str) -> bool:
    try:
        web_auth.require(caller, method, [pipeline])
    except Forbidden:
        return False
    return True


def visible(conn: psycopg.Connection, caller: Caller, f: dlq.Filters) -> dlq.Filters:
    """``f`` narrowed to the pipelines the caller may read; one they named but may not read
    matches nothing, like a pipeline without dead letters."""
    if f.pipeline:
        return f if may(caller, "GET", f.pipeline) else f.model_copy(update={"pipelines": []})
    if web_auth.may_read_all(caller):
        return f
    return f.model_copy(update={"pipelines": web_auth.readable(caller, dlq.pipelines(conn))})


def readable_pipelines(conn: psycopg.Connection, caller: Caller) -> list[str]:
    """The pipelines with letters that the caller may read."""
    names = dlq.pipelines(conn)
    return names if web_auth.may_read_all(caller) else web_auth.readable(caller, names)


def owned(
    conn: psycopg.Connection, caller: Caller, ids: list[int], method: str
) -> dict[int, tuple[str, str]]:
    """id -> (pipeline, status) of the ids that exist and that the caller may see: the others
    are left out, so they read like ids that do not exist. 403 if the caller may see one but
    not ``method`` it (edit, PUT)."""
    owners = dlq.owners(conn, ids)
    names = {p for p, _ in owners.values()}
    seen = names if web_auth.may_read_all(caller) else set(web_auth.readable(caller, names))
    owners = {i: o for i, o in owners.items() if o[0] in seen}
    if method != "GET":
        web_auth.require(caller, method, {p for p, _ in owners.values()})
    return owners


def seen(conn: psycopg.Connection, caller: Caller, rid_text: str) -> int:
    """The id, if the letter exists and the caller may read its pipeline."""
    rid = record_id(rid_text)
    pipeline = dlq.pipeline_of(conn, rid)
    if pipeline is None or not may(caller, "GET", pipeline):
        raise NotFound(f"no dead letter {rid}")
    return rid


def readable(web: Web, caller: Caller, rid_text: str) -> dict[str, Any]:
    """The dead letter ``rid_text`` with the first SHOW_BYTES of its payload."""
    with web.ledger() as conn:
        rec = dlq.get(conn, seen(conn, caller, rid_text), payload_limit=SHOW_BYTES)
    if rec is None:  # gone since: read as never there
        raise NotFound(f"no dead letter {record_id(rid_text)}")
    return rec
