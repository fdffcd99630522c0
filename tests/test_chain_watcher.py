"""`ChainWatcher`: how often a process polls the stage below it."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from omnistage.server import grpc_common
from omnistage.server.grpc_common import ChainWatcher
from omnistage.v1 import stage_pb2


class _Stub:
    """The stage below: unreachable for its first `down` polls, then serving."""

    def __init__(self, down: int) -> None:
        self.down, self.calls = down, 0

    async def Info(self, request: Any, timeout: float) -> stage_pb2.InfoResponse:
        self.calls += 1
        if self.calls <= self.down:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "connection refused")  # fmt: skip
        return stage_pb2.InfoResponse(serving=True)


def test_a_stage_below_that_does_not_serve_is_polled_more_often_until_it_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway started before its thinker served waited a whole period (1 s) to see it serve."""
    slept: list[float] = []
    seen: list[bool] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    async def scenario() -> None:
        async with grpc.aio.insecure_channel("127.0.0.1:1") as channel:
            watcher = ChainWatcher(channel, "thinker", "127.0.0.1:1", poll_s=1.0, down_poll_s=0.2)
            watcher.stub = _Stub(down=2)  # type: ignore[assignment]

            async def on_poll() -> None:
                seen.append(watcher.serving)
                if len(seen) == 4:
                    raise asyncio.CancelledError

            monkeypatch.setattr(grpc_common.asyncio, "sleep", sleep)
            with pytest.raises(asyncio.CancelledError):
                await watcher.run(on_poll)

    asyncio.run(scenario())
    assert seen == [False, False, True, True]
    assert slept == [0.2, 0.2, 1.0]  # (the fourth poll ended the run)
