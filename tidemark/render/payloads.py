"""A dead letter's bytes as people read them: pretty JSON, text or a hexdump, each bounded
in what it may grow to, and a one-line preview for lists. The web app's pages and `tidemark
dlq show` / `list` render through here; the ledger only reads the bytes."""

from __future__ import annotations

import json
from typing import Any

from tidemark.core.errors import BadInput
from tidemark.core.text import shown

# What a view of a payload may grow to, in characters. Bounding the bytes read is not enough:
# indenting 120 KB of nested JSON makes 48 MB, and a hexdump is 5 times its bytes.
RENDER_CHARS = 512 * 1024
_HEX_LINE = 79  # one hexdump line and its newline


def hexdump(data: bytes) -> str:
    lines = []
    for off in range(0, len(data), 16):
        chunk = data[off : off + 16]
        hx = (
            " ".join(f"{b:02x}" for b in chunk[:8]) + "  " + " ".join(f"{b:02x}" for b in chunk[8:])
        )
        text = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)
        lines.append(f"{off:08x}  {hx:<48}  |{text}|")
    return "\n".join(lines)


def _text(data: bytes) -> str | None:
    """The bytes as text when they are valid UTF-8 without control characters."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if any(ord(c) < 32 and c not in "\t\n\r" or c == "\x7f" for c in text):
        return None
    return text


def pretty_json(value: Any, max_chars: int | None = None) -> str | None:
    """``value`` as indented JSON, or None as soon as that passes ``max_chars``: the encoder
    yields its output in pieces, so a too-big rendering stops there instead of being built
    whole first. None too when it is nested too deeply to encode."""
    out, n = [], 0
    try:
        for piece in json.JSONEncoder(indent=2, ensure_ascii=False).iterencode(value):
            n += len(piece)
            if max_chars is not None and n > max_chars:
                return None
            out.append(piece)
    except RecursionError:
        return None
    return "".join(out)


def _parsed(text: str) -> tuple[bool, Any]:
    """(True, value) when ``text`` is JSON; (False, why) when not; RecursionError raised."""
    try:
        return True, json.loads(text)
    except ValueError as exc:
        return False, exc


def payload_kind(data: bytes | None, limit: int | None = None, size: int | None = None) -> str:
    """What ``render_payload(data, "auto", limit, size)`` would show it as (json, text or hex),
    without rendering it: the record page offers the JSON tab by it."""
    data = bytes(data or b"")[:limit] if limit is not None else bytes(data or b"")
    cut = max(size or 0, len(data)) > len(data)
    if not cut and (text := _text(data)) is not None:
        try:
            if _parsed(text)[0]:
                return "json"
        except RecursionError:
            pass
        return "text"
    for trim in range(4 if cut else 1):
        if _text(data[: len(data) - trim]) is not None:
            return "text"
    return "hex"


def render_payload(
    data: bytes | None,
    fmt: str = "auto",
    limit: int | None = None,
    size: int | None = None,
    max_chars: int | None = None,
) -> tuple[str, str]:
    """(kind, text): "json" pretty-printed when the bytes parse as JSON, "text" when they are
    UTF-8, else "hex" (a hexdump). ``fmt`` forces text, json or hex; ``limit`` cuts long
    payloads (in bytes) with a note saying so. ``size``: the whole payload's length when
    ``data`` is only its first bytes (``get(..., payload_limit=...)``). ``max_chars`` bounds
    what the rendering may grow to: past it, JSON is shown as its plain text instead, and
    text and hexdumps are cut, each with a note saying so. Only the format asked for is
    rendered."""
    if fmt not in ("auto", "text", "json", "hex"):
        raise BadInput(f"format {shown(fmt)}: expected one of auto, text, json, hex")
    data = bytes(data or b"")
    total = max(size or 0, len(data))
    if limit is not None and len(data) > limit:
        data = data[:limit]
    cut = total > len(data)
    room = max_chars

    def more(shown_bytes: int) -> str:
        rest = total - shown_bytes
        return (
            f"\n... {rest:,} more bytes not shown; download or export the record for all of them"
            if rest
            else ""
        )

    def bounded(text: str, shown_bytes: int, why: str = "") -> str:
        """``text`` (of the first ``shown_bytes``) with the notes, cut at ``max_chars``."""
        if room is not None and len(text) > room:
            return (
                text[:room] + f"\n... {why}cut here: this view shows at most {room:,} "
                f"characters; download or export the record for all {total:,} bytes"
            )
        return text + (f"\n... {why.rstrip('; ')}" if why else "") + more(shown_bytes)

    if fmt in ("auto", "json") and not cut and (text := _text(data)) is not None:
        try:
            ok, value = _parsed(text)
        except RecursionError:  # 100,000 nested '[': valid or not, shown as text
            if fmt == "json":
                raise BadInput(
                    "payload is nested too deeply to pretty-print; see it as text"
                ) from None
        else:
            if ok:
                pretty = pretty_json(value, room)
                if pretty is not None:
                    return "json", pretty
                # Indenting it would pass the bound (or the encoder's nesting limit): its own
                # text instead, which the bytes read bound.
                why = (
                    "nested too deeply"
                    if room is None
                    else f"indented, this JSON would pass {room:,} characters"
                )
                return "text", bounded(
                    text, len(data), f"not pretty-printed: {why}; this is its plain text; "
                )
            if fmt == "json":
                raise BadInput(f"payload is not JSON: {value}") from None
    if fmt == "json":
        raise BadInput(
            "payload is not JSON" + (" (too long to show parsed)" if cut else ": not UTF-8 text")
        )
    if fmt == "text":
        head = data[: room * 4] if room is not None else data  # a character is 1 to 4 bytes
        return "text", bounded(head.decode("utf-8", errors="replace"), len(head))
    if fmt == "auto":
        # a cut may split a multi-byte character: drop its first bytes rather than go hex
        for trim in range(4 if cut else 1):
            head = data[: len(data) - trim]
            if (text := _text(head)) is not None:
                return "text", bounded(text, len(head))
    # Only the lines that fit are made: a hexdump is about 5 characters per byte.
    fits = data if room is None else data[: max(1, room // _HEX_LINE) * 16]
    return "hex", hexdump(fits) + more(len(fits)) + (
        f" (this view shows at most {room:,} characters of hexdump)"
        if len(fits) < len(data)
        else ""
    )


def preview(head: bytes | None, size: int | None, width: int = 80) -> str:
    """One line of a payload for a list: text as is, binary as hex."""
    if head is None:
        return ""
    text = None
    for trim in range(4):  # the head may end inside a multi-byte character
        text = _text(head[: len(head) - trim])
        if text is not None:
            break
    if text is None:
        text = head[: width // 3].hex(" ")
    text = " ".join(text.split())
    more = (size or 0) > len(head) or len(text) > width
    return text[:width] + ("…" if more else "")
