"""A Realtime response cancelled at the moment its generation ends: nothing left unread."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from omnistage.v1 import gateway_pb2


def test_a_response_cancelled_as_its_client_leaves_logs_no_unread_error() -> None:
    """The connection closes (the response's task is cancelled) the moment its generation ends
    with the client gone: its _Gone was never read, which asyncio logs as "Task exception was never
    retrieved" when the task is collected (`_log_traceback`: the flag it decides that by)."""
    from types import SimpleNamespace

    from gateway.realtime import Response, _Gone

    async def replies() -> Any:  # (no reply: the generation fails first)
        for reply in ():
            yield reply

    async def gone(self: Any, _replies: Any) -> Any:
        raise _Gone

    async def go() -> bool:
        response = Response.__new__(Response)
        response.session = SimpleNamespace(service=SimpleNamespace(serve=lambda *a: replies()))
        response.req, response.fit, response.cancelled = gateway_pb2.GenerateRequest(), None, None
        response.generating = None
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(Response, "_generate", gone)
            outcome = asyncio.ensure_future(response._outcome())
            while response.generating is None or not response.generating.done():
                await asyncio.sleep(0)
            outcome.cancel()  # (its wait has not yet seen the generation end)
            with pytest.raises(asyncio.CancelledError):
                await outcome
        return bool(response.generating._log_traceback)

    unread = asyncio.run(go())
    assert not unread, "the generation's error was left unread"
