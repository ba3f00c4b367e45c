"""What a request selects, as typed values: numbers and filters from the query string, a
POST's fields (JSON or a form) as an :class:`ActionBody`, and what one pipeline's redrive
takes as a :data:`Selection` (given ids, the letters filters match, or an existing request)."""

from __future__ import annotations

import json
from typing import Any, overload
from urllib.parse import parse_qs, urlencode

from fastapi import Request
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, ValidationError

from tidemark.core.errors import BadInput
from tidemark.core.text import shown
from tidemark.ledger import dlq, redrives
from tidemark.web.context import FORM, links

MATCHING = ("pipeline", "sink", "error_class", "since", "until", "reason")
LISTED = ("pipeline", "sink", "error_class", "status", "since", "until", "reason")


# -- the query string -----------------------------------------------------------------------------
@overload
def number(value: str | None, name: str, default: int) -> int: ...
@overload
def number(value: str | None, name: str, default: None = None) -> int | None: ...
def number(value: str | None, name: str, default: int | None = None) -> int | None:
    """A non-negative integer the ledger can hold (a bigint), or ``default`` when not given."""
    if value is None or value.strip() == "":
        return default
    value = value.strip()
    if not value.isascii() or not value.isdigit():
        raise BadInput(f"{name} {shown(value, 40)}: not a positive integer")
    if int(value) > dlq.MAX_ID:  # ids are bigints: PostgreSQL would refuse it, as a 503
        raise BadInput(f"{name} {shown(value, 40)}: at most {dlq.MAX_ID:,}")
    return int(value)


def record_id(value: str) -> int:
    rid = number(value, "id")
    if not rid:
        raise BadInput(f"id {shown(value, 40)}: not a dead-letter id")
    return rid


def filters(request: Request, default_status: str | None) -> dlq.Filters:
    q = request.query_params
    return dlq.Filters.parse(
        pipeline=q.get("pipeline"),
        sink=q.get("sink"),
        error_class=q.get("error_class", q.get("class")),
        status=q.get("status", default_status),
        since=q.get("since"),
        until=q.get("until"),
        reason=q.get("reason"),
        ids=q.getlist("ids") or None,
    )


# -- what one pipeline's redrive takes --------------------------------------------------------
class ByIds(BaseModel):
    """The letters chosen one by one (those no longer quarantined are skipped)."""

    model_config = ConfigDict(frozen=True)
    ids: list[int]


class Matching(BaseModel):
    """Every quarantined letter of ``pipeline`` that ``filters`` match now; none if more
    match than the count the caller confirmed (``expected``)."""

    model_config = ConfigDict(frozen=True)
    filters: dlq.Filters
    pipeline: str
    expected: int | None = None


class OfRequest(BaseModel):
    """An existing redrive request as it holds its letters (one a preview made)."""

    model_config = ConfigDict(frozen=True)
    request: redrives.Request


Selection = ByIds | Matching | OfRequest


# -- a POST's fields ------------------------------------------------------------------------------
WANTED = {
    "ids": 'expected dead-letter ids: [4, 7] or "4,7"',
    "all_matching": "expected true or false",
    "expected": "expected a count",
    "dry_run": "expected true or false",
    "request": "expected a redrive request id",
}


class ActionBody(BaseModel):
    """A POST's fields (discard, redrive, export), or the confirm page's query. Strict types: a
    number where text belongs is the caller's mistake, named, not something to guess at. Other
    fields are ignored: a form also carries the page's CSRF token and whatever else it
    holds."""

    model_config = ConfigDict(extra="ignore")

    ids: list[StrictInt | StrictStr] | StrictInt | StrictStr | None = None
    note: StrictStr | None = None
    back: StrictStr | None = None
    all_matching: StrictBool | StrictStr | None = None
    expected: StrictInt | StrictStr | None = None
    dry_run: StrictBool | StrictStr | None = None
    request: StrictInt | StrictStr | None = None
    pipeline: StrictStr | None = None
    sink: StrictStr | None = None
    error_class: StrictStr | None = None
    since: StrictStr | None = None
    until: StrictStr | None = None
    reason: StrictStr | None = None

    @classmethod
    def checked(cls, data: dict[str, Any]) -> ActionBody:
        """``data`` as fields, or BadInput naming the first field of the wrong type."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            name = str(err["loc"][0]) if err["loc"] else "body"
            given = data.get(name, err.get("input"))
            raise BadInput(
                f"{name} {shown(given, 40)}: {WANTED.get(name, 'expected text')}"
            ) from None

    @property
    def all_matching_on(self) -> bool:
        """An "all matching" action (a checkbox: any of 1, true, on)."""
        value = "" if self.all_matching is None else self.all_matching
        return str(value).lower() in ("1", "true", "on")

    @property
    def dry(self) -> bool:
        """Strict, unlike the checkboxes: a misspelt "yes" must not turn a preview into a
        real redrive."""
        value = self.dry_run
        if value is None or isinstance(value, bool):
            return bool(value)
        text = value.strip().lower()
        # a bare "dry_run" (empty) is no "false": the one mistake that commits for real
        if text in ("1", "true", "on", "0", "false", "off"):
            return text in ("1", "true", "on")
        raise BadInput(f"dry_run {shown(value, 40)}: expected true or false")

    @property
    def has_ids(self) -> bool:
        return self.ids not in (None, "", [])

    def chosen(self) -> list[int]:
        """The ids, each once, in order; BadInput if there are none."""
        if self.ids is None or not self.has_ids:
            raise BadInput("ids: select at least one dead letter")
        return sorted(set(dlq.parse_ids(self.ids)))

    def matching(self, action: str) -> Matching:
        """An "all matching" action's filters (one pipeline's quarantined letters), that
        pipeline, and the count the caller confirmed (``expected``; the page's confirm step
        always sends it)."""
        f = dlq.Filters.parse(**{k: getattr(self, k) for k in MATCHING}, status="quarantined")
        if not f.pipeline:
            raise BadInput(f"pipeline: choose the pipeline whose dead letters to {action}")
        expected = self.expected
        if expected in (None, ""):
            return Matching(filters=f, pipeline=f.pipeline)
        if isinstance(expected, bool) or not str(expected).strip().isdigit():
            raise BadInput(f"expected {shown(expected, 40)}: not a count")
        return Matching(filters=f, pipeline=f.pipeline, expected=int(str(expected).strip()))

    def request_id(self) -> int | None:
        """The redrive request to run as it is (None if not given)."""
        if self.request in (None, ""):
            return None
        rid = number(str(self.request), "request")
        if not rid:
            raise BadInput(f"request {shown(self.request, 40)}: not an id")
        return rid

    def back_link(self, request: Request) -> str:
        """Where a form's result page links back to: the list with the filters it had."""
        query = self.back or ""
        safe = urlencode([(k, v) for k, vs in parse_qs(query).items() for v in vs if k in LISTED])
        return f"{links(request)['prefix']}/dlq/" + (f"?{safe}" if safe else "")


async def action_body(request: Request) -> ActionBody:
    """A POST's fields from JSON or a form (``ids`` may repeat in a form), checked."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    raw = await request.body()
    if ctype == FORM:
        form = parse_qs(raw.decode("utf-8", "replace"), keep_blank_values=True)
        for k, v in form.items():
            # one field, two values (dry_run=1&dry_run=0): which one was meant is a guess
            if k != "ids" and len(set(v)) > 1:
                raise BadInput(f"{k}: given {len(v)} times with different values")
        return ActionBody.checked({k: (v if k == "ids" else v[-1]) for k, v in form.items()})
    if not raw.strip():
        return ActionBody()
    if ctype != "application/json":
        raise BadInput(f"content type {ctype or '(none)'!r}: send application/json or a form")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise BadInput(f"body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadInput("body: expected a JSON object")
    return ActionBody.checked(data)
