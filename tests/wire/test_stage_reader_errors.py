"""A stage's input reader: an unexpected error while taking a chunk in (out of memory placing
a large input on the device, a bug) fails that request at once with a clear status, instead of
killing the reader and leaving the request to starve until the input wait runs out."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omnistage.server.stage_server import StageService, _Call
from omnistage.v1 import stage_pb2
from omnistage.wire import Code, StageError
from omnistage.wire.shm import CallShmReader, ShmReader
from omnistage.wire.tensor_blob import encode_chunk
from omnistage.wire.wire_view import Received


class _Engine:
    """What the reader touches of an Engine: `feed` raises `error`; `abort` records."""

    def __init__(self, error: BaseException) -> None:
        self.worker = SimpleNamespace(name="talker")
        self.error = error
        self.aborted: list[StageError | None] = []

    def feed(self, req: Any, chunk: Any) -> None:
        raise self.error

    def abort(self, req: Any, error: StageError | None = None) -> None:
        self.aborted.append(error)


@pytest.mark.parametrize(("error", "code"), [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB"), Code.RESOURCE_EXHAUSTED),
    (MemoryError(), Code.RESOURCE_EXHAUSTED),
    (RuntimeError("something broke"), Code.INTERNAL),
])  # fmt: skip
def test_an_unexpected_error_taking_a_chunk_fails_the_request(error: BaseException, code: Code) -> None:
    engine = _Engine(error)
    service = StageService(engine, model_name="m", arch="a", device="cpu", dtype="float32",  # type: ignore[arg-type]
                           downstream=None, downstream_name=None, edge_mode=0, max_message_bytes=1 << 20,
                           shm=False)  # fmt: skip
    chunk = encode_chunk({"ids": torch.tensor([1, 2])}, offset=0, length=2, finished=True)

    async def go() -> tuple[_Call, list[Any]]:
        async def messages() -> Any:
            yield Received(stage_pb2.StageRequest(chunk=chunk), {}, b"")

        call = _Call(asyncio.get_running_loop())
        req = SimpleNamespace(request_id="r#1", input_closed=False)
        await service._read_inputs(req, call, messages(), CallShmReader(ShmReader(enabled=False), None))  # type: ignore[arg-type]
        queued = []
        while not call.out_q.empty():
            queued.append(call.out_q.get_nowait())
        return call, queued

    call, queued = asyncio.run(go())
    assert call.failed
    errors = [q for q in queued if isinstance(q, StageError)]
    assert len(errors) == 1 and errors[0].code == code, queued
    assert errors[0].message.startswith("talker: message 2: "), errors[0].message
    assert engine.aborted == [errors[0]]  # the engine frees the request
