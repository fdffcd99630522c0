"""Copies between a stage's device and the host at its edges, off the forward's path (DESIGN.md §3).

Out: after a step, every CUDA tensor in the step's outgoing chunks goes to the host in one copy:
the engine packs them into one device buffer (a `torch.cat`, queued behind the step's kernels), and
a side stream copies that buffer into one pinned host buffer. The engine starts its next step at
once; each chunk carries the copy's event, and whoever encodes the chunk waits on it first
(`OutChunk.wait`). Pinned buffers come from torch's caching host allocator, which reuses a freed
block only after the copies recorded on it have completed: a ring that needs no slot bookkeeping,
and a chunk kept for replay holds its buffer no longer than it is kept.

In: the input tensors a worker names (`StageWorker.wants_on_device`) are copied to its device as
they arrive, on the transport's thread: pinned, then on a side stream. The engine makes the
compute stream wait for that copy (no host sync) when it hands the chunk to the worker, so the
worker's `.to(device)` is a no-op and never blocks a step behind a synchronous copy.

On CPU neither does anything.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from omnistage.engine.worker import OutChunk, StepOutput
from omnistage.wire import DecodedChunk

__all__ = ["DeviceInputs", "HostOutputs"]

_ALIGN = 16  # bytes: every tensor's view into the packed buffer starts aligned for any dtype


class _SideStreams:
    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    def get(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream


class HostOutputs:
    """Moves the CUDA tensors of a step's outgoing chunks to pinned host memory, asynchronously."""

    def __init__(self) -> None:
        self._streams = _SideStreams()
        self.copies = 0  # steps whose outputs were copied (tests, metrics)

    def stage(self, outputs: Sequence[StepOutput | Exception]) -> None:
        chunks: dict[int, OutChunk] = {}  # a chunk can go both up and down: copy it once
        for out in outputs:
            if isinstance(out, StepOutput):
                for c in (*out.up, *out.down):
                    chunks[id(c)] = c
        by_device: dict[torch.device, list[tuple[OutChunk, str, torch.Tensor]]] = {}
        for c in chunks.values():
            for name, t in c.tensors.items():
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    by_device.setdefault(t.device, []).append((c, name, t))
        for device, found in by_device.items():
            self._copy(device, found)

    def _copy(self, device: torch.device, found: list[tuple[OutChunk, str, torch.Tensor]]) -> None:
        parts: list[torch.Tensor] = []
        offsets: list[int] = []
        total = 0
        for _, _, t in found:
            raw = t.detach().contiguous().view(-1).view(torch.uint8)
            offsets.append(total)
            parts.append(raw)
            pad = -raw.numel() % _ALIGN
            if pad:
                parts.append(torch.zeros(pad, dtype=torch.uint8, device=device))
            total += raw.numel() + pad
        packed = torch.cat(parts)  # a new buffer (also for one part): the step may reuse its own
        host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        stream = self._streams.get(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            host.copy_(packed, non_blocking=True)
        packed.record_stream(stream)  # freed by this thread before the side stream has read it
        done = torch.cuda.Event()
        done.record(stream)
        for (c, name, t), at in zip(found, offsets, strict=True):
            nbytes = t.numel() * t.element_size()
            c.tensors[name] = host[at : at + nbytes].view(t.dtype).view(t.shape)
            c.ready = done
        self.copies += 1


class DeviceInputs:
    """Copies a worker's named input tensors to its device as they arrive."""

    def __init__(self, device: torch.device | str, wanted: Callable[[str], bool]) -> None:
        self.device = torch.device(device)
        self.enabled = self.device.type == "cuda"
        self.wanted = wanted
        self._streams = _SideStreams()

    def start(self, chunk: DecodedChunk) -> None:
        """Begin the copies (transport thread): the chunk's named tensors become device tensors
        that are ready once the compute stream waits for `chunk.ready` (`finish`)."""
        if not self.enabled:
            return
        moved = [k for k, t in chunk.tensors.items() if self.wanted(k) and not t.is_cuda]
        if not moved:
            return
        stream = self._streams.get(self.device)
        with torch.cuda.stream(stream):
            for k in moved:
                chunk.tensors[k] = chunk.tensors[k].pin_memory().to(self.device, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        chunk.ready = (done, [chunk.tensors[k] for k in moved])

    def finish(self, chunk: DecodedChunk) -> None:
        """Order the compute stream after the chunk's copies (engine thread; no host sync)."""
        if chunk.ready is None:
            return
        done, tensors = chunk.ready
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(done)
        for t in tensors:  # allocated on the side stream, read on the compute stream
            t.record_stream(compute)
        chunk.ready = None
