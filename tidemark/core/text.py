"""Text cut to fit one line or one column: one rule for messages, stored reasons and errors."""

from __future__ import annotations

ELLIPSIS = "…"


def clamp(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` characters; a cut is marked with an ellipsis."""
    return text if len(text) <= limit else text[: limit - 1] + ELLIPSIS


def shown(value: object, limit: int = 60) -> str:
    """A value someone gave, quoted (repr) and clamped, for naming it in an error message."""
    return clamp(repr(value), limit)
