"""A client's string quoted in an error message: cut, so a huge one is not sent back whole (past
16 KiB gRPC turns the status itself into RESOURCE_EXHAUSTED)."""

from __future__ import annotations

__all__ = ["QUOTED_CHARS", "quoted"]

QUOTED_CHARS = 64


def quoted(text: str, limit: int = QUOTED_CHARS) -> str:
    """`repr` of at most `limit` characters of `text`, saying so when it was cut."""
    return repr(text[:limit]) + (f" (cut; {len(text)} characters)" if len(text) > limit else "")
