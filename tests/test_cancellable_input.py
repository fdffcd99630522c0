"""A caller's request messages that it may end early (grpc_common.CancellableInput), against an
in-process Stage.Stream server: until the stage has answered, ending early is a Cancel message
after the input (a gRPC cancel there can read as a malformed early close at the stage), the
half-close waits for that answer, and afterwards a cancel is immediate."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
import torch

from omnistage.server import grpc_common
from omnistage.server.grpc_common import CancellableInput, stage_stream
from omnistage.v1 import stage_pb2
from omnistage.wire import encode_chunk

Handler = Callable[[AsyncIterator[stage_pb2.StageRequest], grpc.aio.ServicerContext], AsyncIterator[Any]]


def _input(n_chunks: int) -> Callable[[], AsyncIterator[stage_pb2.StageRequest]]:
    async def messages() -> AsyncIterator[stage_pb2.StageRequest]:
        yield stage_pb2.StageRequest(start=stage_pb2.Start(request_id="r"))
        for i in range(n_chunks):
            yield stage_pb2.StageRequest(chunk=encode_chunk({}, offset=i, length=1, finished=i == n_chunks - 1))

    return messages


def _answer(text: str) -> bytes:
    return stage_pb2.StageResponse(stage=text).SerializeToString()


async def _serve(handler: Handler, client: Callable[[grpc.aio.Channel], Awaitable[Any]]) -> Any:
    server = grpc.aio.server()
    method = grpc.stream_stream_rpc_method_handler(handler, request_deserializer=stage_pb2.StageRequest.FromString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(grpc_common.STAGE_SERVICE,
                                                                          {"Stream": method}),))  # fmt: skip
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            return await asyncio.wait_for(client(ch), 20)
    finally:
        await server.stop(None)


async def _left_once(ready: asyncio.Event, sent: CancellableInput, call: Any) -> None:
    """The caller's own caller goes away once `ready`, while it waits for the stage's first
    response: that read is cancelled, then the call is ended early."""
    reader = asyncio.create_task(anext(sent.responses(call)))
    await ready.wait()
    reader.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reader
    sent.end_early(call)


def _kind(message: stage_pb2.StageRequest) -> str:
    return message.WhichOneof("kind") or ""


def test_ended_before_the_stage_answers_it_reads_a_cancel_after_the_whole_input(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The caller ends while the stage has not answered (it has read the whole input): the stage
    reads a Cancel message after it, not the messages' end (which a gRPC cancel gives: what the
    stage would take for a caller closing early) nor a cancel of its handler."""
    monkeypatch.setattr(grpc_common, "CANCEL_BELOW_S", 10.0)  # (the stage reads it, however loaded the machine)
    seen: list[str] = []
    how: list[str] = []
    read_all = asyncio.Event()

    async def stage(requests: AsyncIterator[stage_pb2.StageRequest], context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[bytes]:  # fmt: skip
        try:
            async for message in requests:
                seen.append(_kind(message))
                if message.HasField("chunk") and message.chunk.finished:
                    read_all.set()
                if message.HasField("cancel"):
                    how.append("cancel message")
                    await context.abort(grpc.StatusCode.CANCELLED, "cancelled by its caller")
            how.append("messages ended")
        except asyncio.CancelledError:
            how.append("handler cancelled")
            raise
        if False:  # (an async generator that never answers)
            yield b""

    async def client(ch: grpc.aio.Channel) -> bool:
        sent = CancellableInput(_input(2)(), "the test")
        call = sent.call(stage_stream(ch), timeout=10)

        async def read() -> None:
            try:
                async for _ in sent.responses(call):
                    pass
            finally:
                sent.end_early(call)

        reader = asyncio.create_task(read())
        await read_all.wait()
        reader.cancel()  # the caller's own caller went away
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        for _ in range(1000):  # the Cancel's round trip, then the call's end
            if call.done():
                break
            await asyncio.sleep(0.01)
        return call.done()

    assert asyncio.run(_serve(stage, client))
    assert seen == ["start", "chunk", "chunk", "cancel"]
    assert how == ["cancel message"]


def test_ended_while_its_input_is_still_written_it_sends_the_rest_no_more_and_a_cancel(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A large input held up by flow control (the stage reads slowly): ended early, the caller
    writes no more of it, then a Cancel message; the stage never sees the finished chunk."""
    monkeypatch.setattr(grpc_common, "CANCEL_BELOW_S", 10.0)  # (the stage reads it, however loaded the machine)
    n_chunks, seen = 40, []
    started = asyncio.Event()

    def big_input() -> AsyncIterator[stage_pb2.StageRequest]:
        async def messages() -> AsyncIterator[stage_pb2.StageRequest]:
            yield stage_pb2.StageRequest(start=stage_pb2.Start(request_id="r"))
            for i in range(n_chunks):  # 256 KiB each: far past the connection's window
                yield stage_pb2.StageRequest(chunk=encode_chunk({"x": torch.zeros(1 << 16)}, offset=i, length=1,
                                                                finished=i == n_chunks - 1))  # fmt: skip

        return messages()

    async def stage(requests: AsyncIterator[stage_pb2.StageRequest], context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[bytes]:  # fmt: skip
        async for message in requests:
            seen.append("finished" if message.HasField("chunk") and message.chunk.finished else _kind(message))
            if message.HasField("start"):
                started.set()
                await asyncio.sleep(0.5)  # (the caller ends meanwhile)
            if message.HasField("cancel"):
                await context.abort(grpc.StatusCode.CANCELLED, "cancelled by its caller")
        if False:  # (an async generator that never answers)
            yield b""

    async def client(ch: grpc.aio.Channel) -> bool:
        sent = CancellableInput(big_input(), "the test")
        call = sent.call(stage_stream(ch), timeout=10)
        await _left_once(started, sent, call)
        await grpc_common.wait_ended_early(5)
        return call.done()

    assert asyncio.run(_serve(stage, client))
    assert seen[0] == "start" and seen[-1] == "cancel" and "finished" not in seen, seen
    assert set(seen[1:-1]) <= {"chunk"} and len(seen) - 2 < n_chunks - 1, seen


def test_the_half_close_waits_for_the_stages_first_answer() -> None:
    """Every input message is written, yet the messages do not end (no half-close) until the
    stage has answered once: then they end, and the reply comes whole."""
    seen: list[str] = []

    async def stage(requests: AsyncIterator[stage_pb2.StageRequest], context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[bytes]:  # fmt: skip
        it = aiter(requests)
        seen.extend([_kind(await anext(it)) for _ in range(3)])

        async def rest() -> None:  # (read in a task of its own: a read cancelled by a timeout ends the messages)
            async for message in it:
                seen.append(_kind(message))
            seen.append("end")

        reading = asyncio.create_task(rest())
        await asyncio.wait({reading}, timeout=0.3)
        seen.append("answer")
        yield _answer("first")
        await asyncio.wait_for(reading, 5)  # the half-close, now
        yield _answer("last")

    async def client(ch: grpc.aio.Channel) -> list[str]:
        sent = CancellableInput(_input(2)(), "the test")
        call = sent.call(grpc_common.stage_stream(ch), timeout=10)
        got = [r.message.stage async for r in sent.responses(call)]
        assert sent.acknowledged
        return got

    assert asyncio.run(_serve(stage, client)) == ["first", "last"]
    assert seen == ["start", "chunk", "chunk", "answer", "end"]


def test_once_answered_ending_early_cancels_at_once() -> None:
    """After the stage's first answer the input is whole there: ending early is a gRPC cancel,
    which the stage's handler sees, with no Cancel message and no wait."""
    how: list[str] = []
    answered = asyncio.Event()

    async def stage(requests: AsyncIterator[stage_pb2.StageRequest], context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[bytes]:  # fmt: skip
        async def read() -> None:
            async for message in requests:
                how.append(_kind(message))

        reader = asyncio.create_task(read())
        try:
            yield _answer("first")
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            how.append("handler cancelled")
            raise
        finally:
            reader.cancel()

    async def client(ch: grpc.aio.Channel) -> bool:
        sent = CancellableInput(_input(1)(), "the test")
        call = sent.call(stage_stream(ch), timeout=10)
        async for _ in sent.responses(call):
            answered.set()
            break
        sent.end_early(call)
        done = call.done()  # at once
        for _ in range(1000):
            if "handler cancelled" in how:
                break
            await asyncio.sleep(0.01)
        return done

    assert asyncio.run(_serve(stage, client))
    assert "cancel" not in how and how[-1] == "handler cancelled", how


def test_a_stage_that_does_not_read_is_cancelled_after_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage that reads nothing more (stopped, or holding its input until admitted) never
    takes the Cancel: the call is cancelled after CANCEL_BELOW_S, which `wait_ended_early`
    waits for."""
    monkeypatch.setattr(grpc_common, "CANCEL_BELOW_S", 0.3)
    how: list[str] = []
    started = asyncio.Event()

    async def stage(requests: AsyncIterator[stage_pb2.StageRequest], context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[bytes]:  # fmt: skip
        await anext(aiter(requests))
        started.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            how.append("handler cancelled")
            raise
        yield b""

    async def client(ch: grpc.aio.Channel) -> tuple[bool, bool]:
        sent = CancellableInput(_input(1)(), "the test")
        call = sent.call(stage_stream(ch), timeout=10)
        await _left_once(started, sent, call)
        at_once = call.done()
        await grpc_common.wait_ended_early(5)  # (what a gateway waits for before it exits)
        ended = call.done()
        for _ in range(1000):
            if how:
                break
            await asyncio.sleep(0.01)
        return at_once, ended

    assert asyncio.run(_serve(stage, client)) == (False, True)
    assert how == ["handler cancelled"]
