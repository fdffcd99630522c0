"""Option values more than one command takes the same way (`serve`, `gateway`, `client`, `bench`)."""

from __future__ import annotations

import typer


def api_key(value: str | None) -> str | None:
    """An API key as a secret file holds it (`kubectl create secret --from-file`, `$(cat key)`
    keeps none, an editor adds one): its surrounding whitespace, a trailing newline, is not
    part of it. Kept, it locked every client out: they cannot send it in a header. One with
    whitespace or control characters inside is refused for the same reason."""
    if not value:
        return value
    key = value.strip()
    if not key or not all("!" <= c <= "~" for c in key):
        raise typer.BadParameter("an API key is printable ASCII without spaces (what 'Authorization: Bearer KEY' "
                                 "carries)")  # fmt: skip
    return key
