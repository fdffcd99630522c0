"""How a stage's caller names a failure below it. A stage says why it failed a request in band
(a `Failure` response) before the call's status: grpc hands a caller whose write was under way
as the call ended its own INTERNAL ("Internal error from Core", a lost peer's) instead of the
status, and our callers took that for a lost replica: they replayed the request and reported
UNAVAILABLE. They go by the Failure now."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc
import pytest
import torch

from omnistage.engine import Demand, Engine, OutChunk, Request, StageWorker, StepOutput
from omnistage.engine.request import FinishReason
from omnistage.engine.scheduler import ScheduledItem
from omnistage.server.grpc_common import CORE_WRITE_FAILED, add_stage_servicer, new_server
from omnistage.server.stage_server import StageService
from omnistage.v1 import stage_pb2
from omnistage.wire import DecodedChunk, encode_chunk, invalid
from omnistage.wire.tensor_blob import LazyChunk
from omnistage.wire.wire_view import Outgoing, failure_of, failure_response, serialize


def test_failure_of_finds_a_failure_and_passes_a_chunk_unparsed() -> None:
    failure = failure_response("talker", "INVALID_ARGUMENT", "talker: bad chunk").SerializeToString()
    found = failure_of(failure)
    assert found is not None and (found.code, found.message) == ("INVALID_ARGUMENT", "talker: bad chunk")
    without_stage = failure_of(stage_pb2.StageResponse(failure=stage_pb2.Failure(code="INTERNAL")).SerializeToString())
    assert without_stage is not None and without_stage.code == "INTERNAL"
    chunk = encode_chunk({"x": torch.zeros(3)}, offset=0, length=1)
    assert failure_of(stage_pb2.StageResponse(stage="talker", chunk=chunk).SerializeToString()) is None
    lazy = Outgoing(stage_pb2.StageResponse(stage="code2wav"), LazyChunk(chunk, []))
    assert failure_of(serialize(lazy)) is None
    assert failure_of(b"") is None and failure_of(b"\x0a\xff") is None  # (garbage: the parse says so)


class _Stage(StageWorker):
    """Sends `steps` chunks of `elems` floats down (and up), one a step; `refuse_at` fails the
    request at that input offset."""

    def __init__(self, name: str, steps: int = 1, elems: int = 4, refuse_at: int | None = None) -> None:
        self.name, self.steps, self.elems, self.refuse_at = name, steps, elems, refuse_at
        self.opened: list[str] = []

    def open(self, req: Request) -> None:
        req.state = {"n": 0}
        self.opened.append(req.request_id)

    def feed(self, req: Request, chunk: DecodedChunk) -> None:
        if chunk.offset == self.refuse_at:
            raise invalid(f"{self.name}: bad chunk at offset {chunk.offset}")

    def demand(self, req: Request) -> Demand:
        return Demand(0, 1 << 20)

    def ready(self, req: Request) -> bool:
        return req.input_finished

    def sends_down(self, req: Request) -> bool:
        return self.refuse_at is None

    def execute(self, batch: Sequence[ScheduledItem]) -> list[StepOutput | Exception]:
        out: list[StepOutput | Exception] = []
        for item in batch:
            state = item.request.state
            state["n"] += 1
            last = state["n"] >= self.steps
            piece = OutChunk({"x": torch.zeros(self.elems)}, offset=state["n"] - 1, length=1, finished=last)
            step = StepOutput(up=[piece], down=[piece] if self.refuse_at is None else [])
            step.finished = FinishReason.STOP if last else None
            out.append(step)
        return out

    def close(self, req: Request) -> None:
        pass


async def _serve(servicer: Any) -> tuple[grpc.aio.Server, str]:
    server = new_server(64 << 20)
    add_stage_servicer(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _service(worker: _Stage, below: str | None = None, failover_attempts: int = 3) -> StageService:
    return StageService(Engine(worker), model_name="m", arch="a", device="cpu", dtype="float32", downstream=below,
                        downstream_name="code2wav" if below else None, edge_mode=0, max_message_bytes=64 << 20,
                        shm=False, below=["code2wav"] if below else [], replica_wait_s=0.0,
                        failover_attempts=failover_attempts)  # fmt: skip


async def _call(address: str, chunks: int = 1) -> tuple[list[stage_pb2.StageResponse], grpc.aio.AioRpcError]:
    """Start and `chunks` input chunks; the responses, and the error that ended the call."""

    async def messages() -> Any:
        yield stage_pb2.StageRequest(start=stage_pb2.Start(request_id="r"))
        for i in range(chunks):
            chunk = encode_chunk({"x": torch.zeros(2)}, offset=i, length=1, finished=i == chunks - 1)
            yield stage_pb2.StageRequest(chunk=chunk)

    responses: list[stage_pb2.StageResponse] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stream = channel.stream_stream("/omnistage.v1.Stage/Stream", request_serializer=lambda m: m.SerializeToString(),
                                       response_deserializer=stage_pb2.StageResponse.FromString)  # fmt: skip
        call = stream(messages(), timeout=30)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for response in call:
                responses.append(response)
    return responses, e.value


def test_a_stage_says_why_it_failed_in_band_before_its_status() -> None:
    async def go() -> tuple[list[stage_pb2.StageResponse], grpc.aio.AioRpcError]:
        service = _service(_Stage("talker", refuse_at=1))
        server, address = await _serve(service)
        try:
            return await _call(address, chunks=3)
        finally:
            await server.stop(None)
            service.engine.stop()

    responses, error = asyncio.run(go())
    assert [r.HasField("failure") for r in responses] == [True]
    assert (responses[0].stage, responses[0].failure.code) == ("talker", "INVALID_ARGUMENT")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert responses[0].failure.message == error.details() == "talker: bad chunk at offset 1"


class _RefusingBelow:
    """A stage below as a caller that was still writing sees it: its Failure, then grpc's own
    INTERNAL in place of its status."""

    def __init__(self) -> None:
        self.calls = 0

    async def Info(self, request: Any, context: Any) -> stage_pb2.InfoResponse:
        return stage_pb2.InfoResponse(role="code2wav")

    async def Stream(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        self.calls += 1
        async for _ in request_iterator:
            break
        yield failure_response("code2wav", "INVALID_ARGUMENT", "code2wav: bad chunk at offset 0")
        await context.abort(grpc.StatusCode.INTERNAL, CORE_WRITE_FAILED)


def test_a_caller_goes_by_the_failure_below_not_by_the_status_grpc_put_in_its_place() -> None:
    """The stage above fails the request with the reason the stage below gave, and does not
    replay it on another replica (the INTERNAL it sees alone is a lost peer's)."""

    async def go() -> tuple[list[stage_pb2.StageResponse], grpc.aio.AioRpcError, int]:
        below = _RefusingBelow()
        below_server, below_address = await _serve(below)
        service = _service(_Stage("talker", steps=3), below=below_address)
        server, address = await _serve(service)
        try:
            responses, error = await _call(address)
            return responses, error, below.calls
        finally:
            await server.stop(None)
            await below_server.stop(None)
            service.engine.stop()

    responses, error, calls = asyncio.run(go())
    assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "code2wav: bad chunk at offset 0")
    assert calls == 1  # not replayed
    failures = [r.failure for r in responses if r.HasField("failure")]
    assert [(f.code, f.message) for f in failures] == [("INVALID_ARGUMENT", "code2wav: bad chunk at offset 0")]
    assert responses[-1].HasField("failure")  # its own Failure last, for its caller in turn


def test_with_failover_off_a_stage_below_that_is_down_is_named() -> None:
    """Failover off keeps nothing for replay; a lost call below is still the stage below's loss
    (UNAVAILABLE naming it), not this stage's own loss for its caller to replay (none would)."""
    from tests.integration.conftest import free_port_block

    async def go() -> grpc.aio.AioRpcError:
        dead = f"127.0.0.1:{free_port_block(1)}"  # nothing listens there
        service = _service(_Stage("talker", steps=3), below=dead, failover_attempts=0)
        server, address = await _serve(service)
        try:
            return (await _call(address))[1]
        finally:
            await server.stop(None)
            service.engine.stop()

    error = asyncio.run(go())
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert (error.details() or "").startswith("code2wav unavailable at 127.0.0.1:"), error.details()
