"""Why a payload is not the JSON object a pipeline decodes, said precisely.

Spark's JSON reader only tells a record it cannot read from one it can: a payload cut short
and a JSON array look alike to it ("payload is not a JSON object"). The task that quarantines
such a record holds its bytes, so it asks Python's parser, which says where and what: only
for the records that failed, never for the batch.
"""

from __future__ import annotations

import json

# Spark's reasons that say no more than "not a JSON object" (tidemark/engine/records.py).
VAGUE = ("payload is not a JSON object", "payload is not JSON")
_KINDS = {
    list: "an array",
    str: "a string",
    bool: "a boolean",
    int: "a number",
    float: "a number",
    type(None): "null",
}


def decode_reason(payload: bytes | None, reason: str) -> str:
    """``reason`` made precise where Spark's is vague: "payload is not valid JSON: unexpected
    end at byte 24" for a payload cut short, "payload is not a JSON object (an array)" for
    valid JSON of another kind. Any other reason stands."""
    if reason not in VAGUE or not payload:
        return reason
    try:
        text = bytes(payload).decode("utf-8")
    except UnicodeDecodeError:
        return reason
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated"):
            return f"payload is not valid JSON: unexpected end at byte {len(payload)}"
        at = len(text[: exc.pos].encode("utf-8"))  # a byte offset: what a hexdump shows
        what = {"Expecting value": "expecting a value"}.get(
            exc.msg, exc.msg[:1].lower() + exc.msg[1:]
        )
        return f"payload is not valid JSON: {what} at byte {at}"
    except (ValueError, RecursionError):
        return reason
    kind = _KINDS.get(type(doc))
    return f"payload is not a JSON object ({kind})" if kind else reason
