"""Text cut to fit one line or one column: one rule for messages, stored reasons and errors."""

from __future__ import annotations

ELLIPSIS = "…"


def clamp(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` characters; a cut is marked with an ellipsis."""
    return text if len(text) <= limit else text[: limit - 1] + ELLIPSIS


def shown(value: object, limit: int = 60) -> str:
    """A value someone gave, quoted (repr) and clamped, for naming it in an error message."""
    return clamp(repr(value), limit)


def literal(value: object, limit: int = 60) -> str:
    """A value as a user writes it (SQL-like), clamped: -98.12 not Decimal('-98.12'), 'text',
    NULL, 2026-01-02. For the values reasons and results show people."""
    return clamp(_literal(value), limit)


def _literal(value: object) -> str:
    from datetime import date, datetime, time
    from decimal import Decimal

    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Decimal):
        return format(value, "f") if value.is_finite() else str(value)
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    if isinstance(value, datetime):
        return value.isoformat(sep=" ")
    if isinstance(value, date | time):
        return value.isoformat()
    if isinstance(value, bytes | bytearray | memoryview):
        return "'\\x" + bytes(value).hex() + "'"  # PostgreSQL's bytea hex form
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_literal(v)}" for k, v in value.items()) + "}"
    return str(value)
