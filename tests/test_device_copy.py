"""The engine's copies at a stage's edges (omnistage/engine/device_copy.py): a step's CUDA outputs
go to pinned host memory in one copy on a side stream; named inputs go to the device as they
arrive. On CPU both leave everything as it is. The CUDA tests run where a GPU is (the device
machine); here they skip, saying so."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from omnistage.engine import Engine, FinishReason, OutChunk, Request, ScheduledItem, StageWorker, StepOutput
from omnistage.engine.device_copy import DeviceInputs, HostOutputs
from omnistage.wire import DecodedChunk

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")


def _odd_tensors(device: str) -> dict[str, torch.Tensor]:
    """Every dtype the stages send, sizes that are not multiples of 16 bytes, a 0-dim tensor and a
    non-contiguous view."""
    g = torch.Generator().manual_seed(0)
    return {
        "hidden": torch.randn(3, 7, generator=g).to(torch.bfloat16).to(device),
        "ids": torch.tensor([5, 3, 11]).to(device),
        "codes": torch.randint(0, 100, (16, 5), generator=g).to(device).t(),  # non-contiguous
        "mask": torch.tensor([True, False, True]).to(device),
        "scalar": torch.tensor(2.5).to(device),
        "pcm": torch.randn(1001, generator=g).to(device),
    }


def test_on_cpu_outputs_and_inputs_stay_as_they_are() -> None:
    tensors = _odd_tensors("cpu")
    chunk = OutChunk(dict(tensors), offset=0, length=1)
    HostOutputs().stage([StepOutput(up=[chunk], down=[chunk])])
    assert chunk.ready is None
    assert all(chunk.tensors[k] is t for k, t in tensors.items())

    inputs = DeviceInputs("cpu", lambda name: True)
    decoded = DecodedChunk(dict(tensors))
    inputs.start(decoded)
    inputs.finish(decoded)
    assert decoded.ready is None
    assert all(decoded.tensors[k] is t for k, t in tensors.items())


@cuda
def test_a_steps_cuda_outputs_arrive_on_the_host_whole() -> None:
    tensors = _odd_tensors("cuda")
    expected = {k: t.cpu() for k, t in tensors.items()}
    a = OutChunk(dict(tensors), offset=0, length=1)
    b = OutChunk({"ids": tensors["ids"], "host": torch.arange(4)}, offset=1, length=1)
    outputs: list[StepOutput | Exception] = [StepOutput(up=[a], down=[a]), ValueError("failed"), StepOutput(up=[b])]
    copier = HostOutputs()
    copier.stage(outputs)
    # what the step made may change at once (the next step reuses it): the copy is a snapshot
    for t in tensors.values():
        t.zero_()
    assert copier.copies == 1 and a.ready is not None and a.ready is b.ready
    for c in (a, b):
        c.wait()
        assert c.ready is None
    for name, want in expected.items():
        got = a.tensors[name]
        assert got.device.type == "cpu" and got.is_pinned()
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want), name
    assert torch.equal(b.tensors["ids"], expected["ids"])
    assert torch.equal(b.tensors["host"], torch.arange(4)) and not b.tensors["host"].is_pinned()


@cuda
def test_named_inputs_reach_the_device_before_the_compute_stream_reads_them() -> None:
    inputs = DeviceInputs("cuda", lambda name: name in {"embed", "hidden"})
    g = torch.Generator().manual_seed(1)
    embed, hidden, ids = torch.randn(2, 64, generator=g), torch.randn(2, 64, generator=g), torch.tensor([1, 2])
    chunk = DecodedChunk({"embed": embed.clone(), "hidden": hidden.clone(), "ids": ids})
    inputs.start(chunk)
    assert chunk.ready is not None
    inputs.finish(chunk)
    assert chunk.ready is None
    assert chunk.tensors["ids"] is ids  # not named: left on the host
    out = chunk.tensors["embed"] + chunk.tensors["hidden"]  # on the compute stream, after the copy
    assert chunk.tensors["embed"].is_cuda and torch.equal(out.cpu(), embed + hidden)


class _CudaWorker(StageWorker):
    """One token per step, made on the GPU: `[step, step]` in a bf16 row, then finished."""

    name = "fake"
    device = torch.device("cuda")

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.fed: list[torch.Tensor] = []

    def wants_on_device(self, name: str) -> bool:
        return name == "x"

    def open(self, req: Request) -> None:
        req.state = 0

    def feed(self, req: Request, chunk: DecodedChunk) -> None:
        self.fed.append(chunk.tensors["x"] * 2)  # on the compute stream

    def ready(self, req: Request) -> bool:
        return bool(self.fed)

    def execute(self, batch: Sequence[ScheduledItem]) -> list[StepOutput | Exception]:
        outs: list[StepOutput | Exception] = []
        for item in batch:
            req = item.request
            row = torch.full((1, 2), float(req.state), device="cuda", dtype=torch.bfloat16) + self.fed[0]
            req.state += 1
            done = req.state == self.steps
            outs.append(StepOutput(up=[OutChunk({"row": row}, offset=req.state - 1, length=1, finished=done)],
                                   finished=FinishReason.STOP if done else None))  # fmt: skip
        return outs

    def close(self, req: Request) -> None:
        pass


class _Sink:
    def __init__(self) -> None:
        self.rows: list[Any] = []
        self.ended = False

    def on_output(self, req: Request, out: StepOutput) -> None:
        for c in out.up:
            self.rows.append(c.wait().tensors["row"])

    def on_finished(self, req: Request) -> None:
        self.ended = True


@cuda
def test_the_engine_copies_inputs_in_and_outputs_out() -> None:
    worker = _CudaWorker(steps=5)
    engine = Engine(worker, 0, background=False)
    sink = _Sink()
    req = engine.open("r", None, sink)
    engine.feed(req, DecodedChunk({"x": torch.tensor([[1.0, 3.0]])}, offset=0, finished=True))
    for _ in range(20):
        if sink.ended:
            break
        engine.run_once()
    assert sink.ended and engine.host_outputs.copies == 5
    assert all(r.device.type == "cpu" and r.is_pinned() for r in sink.rows)
    assert [r.float().tolist() for r in sink.rows] == [[[2.0 + k, 6.0 + k]] for k in range(5)]
