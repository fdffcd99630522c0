"""Asynchronous device<->host copies for the wire (DESIGN.md §3).

Sender: ``D2HCopier.copy(t)`` enqueues the device->host copy of ``t`` on a dedicated CUDA stream
into a pinned buffer from a reusable ring and returns at once, so the producer's next forward
step does not wait for it. The returned ``HostCopy`` carries the CUDA event to wait on before
encoding: ``with copier.copy(t) as hc: blob = tensor_blob.encode(hc.wait(), ...)``; leaving the
``with`` block (or ``release()``) returns the pinned slot to the ring.

Receiver: ``H2DCopier.copy(t)`` stages a host tensor through a pinned ring slot and copies it to
the device on its own stream; ``DeviceCopy.wait()`` makes the current stream wait for the copy
(no host sync) and returns the device tensor.

Without CUDA (or for tensors already where they should be) both degrade to no-ops that return
the input tensor, so callers need no branches.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["D2HCopier", "DeviceCopy", "H2DCopier", "HostCopy", "PinnedRing", "cuda_available"]


def cuda_available() -> bool:
    return torch.cuda.is_available()


@dataclass
class _Slot:
    buffer: torch.Tensor  # pinned uint8
    in_use: bool = False
    event: Any = None  # torch.cuda.Event pending on this slot's memory


class PinnedRing:
    """A fixed ring of pinned host buffers, allocated lazily and reused.

    ``acquire`` returns a free slot large enough, or None (the caller then allocates a one-off
    pinned tensor from torch's caching host allocator) so a busy ring never blocks a step.
    A slot is free when its owner released it and its pending copy event has completed.
    """

    def __init__(self, slots: int = 4, slot_bytes: int = 16 << 20) -> None:
        self.slot_bytes = slot_bytes
        self._slots: list[_Slot | None] = [None] * slots
        self._next = 0
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> _Slot | None:
        if nbytes > self.slot_bytes or not self._slots:
            return None
        with self._lock:
            n = len(self._slots)
            for k in range(n):
                i = (self._next + k) % n
                slot = self._slots[i]
                if slot is None:
                    slot = _Slot(torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=True))
                    self._slots[i] = slot
                elif slot.in_use or (slot.event is not None and not slot.event.query()):
                    continue
                slot.in_use, slot.event = True, None
                self._next = (i + 1) % n
                return slot
        return None

    def release(self, slot: _Slot, event: Any = None) -> None:
        with self._lock:
            slot.event = event
            slot.in_use = False

    @property
    def allocated(self) -> int:
        return sum(s is not None for s in self._slots)


def _view_of(slot: _Slot, like: torch.Tensor) -> torch.Tensor:
    nbytes = like.numel() * like.element_size()
    return slot.buffer[:nbytes].view(like.dtype).view(like.shape)


@dataclass
class HostCopy:
    """A device->host copy in flight. ``wait()`` before reading ``tensor``; ``release()`` after."""

    tensor: torch.Tensor
    event: Any = None
    _ring: PinnedRing | None = field(default=None, repr=False)
    _slot: _Slot | None = field(default=None, repr=False)

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.tensor

    def release(self) -> None:
        """Give the pinned slot back; ``tensor`` must no longer be used (copy what you keep)."""
        if self._ring is not None and self._slot is not None:
            self.wait()
            self._ring.release(self._slot)
            self._slot = None

    def __enter__(self) -> HostCopy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class DeviceCopy:
    """A host->device copy in flight; ``wait()`` orders the consumer stream after it."""

    tensor: torch.Tensor
    event: Any = None

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait(self, stream: Any = None) -> torch.Tensor:
        if self.event is not None:
            s = stream if stream is not None else torch.cuda.current_stream(self.tensor.device)
            s.wait_event(self.event)
            self.tensor.record_stream(s)
        return self.tensor


class D2HCopier:
    """Device->host copies on a dedicated stream into pinned ring buffers."""

    def __init__(
        self, device: torch.device | str | None = None, *, slots: int = 4, slot_bytes: int = 16 << 20
    ) -> None:
        self.enabled = cuda_available()
        self.device = torch.device(device) if device is not None else None
        self._ring = PinnedRing(slots, slot_bytes) if self.enabled else None
        self._streams: dict[torch.device, Any] = {}

    def _stream(self, device: torch.device) -> Any:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
        return s

    def copy(self, x: torch.Tensor) -> HostCopy:
        """Start copying ``x`` to host memory; returns at once. CPU tensors pass through."""
        if x.device.type != "cuda" or not self.enabled:
            return HostCopy(x)
        x = x.detach()
        stream = self._stream(x.device)
        slot = self._ring.acquire(x.numel() * x.element_size()) if self._ring is not None else None
        dst = _view_of(slot, x) if slot is not None else torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(x.device))  # see the producer's writes
        with torch.cuda.stream(stream):
            dst.copy_(x, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        x.record_stream(stream)  # keep the allocator from reusing x before the copy ran
        return HostCopy(dst, event, self._ring if slot is not None else None, slot)


class H2DCopier:
    """Host->device copies on a dedicated stream, staged through pinned ring buffers."""

    def __init__(
        self, device: torch.device | str = "cuda", *, slots: int = 4, slot_bytes: int = 16 << 20
    ) -> None:
        self.enabled = cuda_available()
        self.device = torch.device(device)
        self._ring = PinnedRing(slots, slot_bytes) if self.enabled else None
        self._stream_obj: Any = None

    def copy(self, x: torch.Tensor, device: torch.device | str | None = None) -> DeviceCopy:
        """Start copying host tensor ``x`` to the device; returns at once (after a host memcpy
        into a pinned slot when ``x`` is not pinned). Without CUDA, ``x`` passes through."""
        target = torch.device(device) if device is not None else self.device
        if target.type != "cuda" or x.device.type == "cuda":
            return DeviceCopy(x.to(target))  # no-op when already there
        if not self.enabled:
            return DeviceCopy(x)  # CPU-only build or machine: stay on the host
        if self._stream_obj is None:
            self._stream_obj = torch.cuda.Stream(device=target)
        stream = self._stream_obj
        slot = None
        src = x
        if not x.is_pinned():
            slot = self._ring.acquire(x.numel() * x.element_size()) if self._ring is not None else None
            if slot is not None:
                src = _view_of(slot, x)
                src.copy_(x)  # host memcpy into pinned memory, makes the device copy truly async
            else:
                src = x.pin_memory()
        with torch.cuda.stream(stream):
            dst = torch.empty(x.shape, dtype=x.dtype, device=target)
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        if slot is not None and self._ring is not None:
            self._ring.release(slot, event)  # free again once the copy has completed
        return DeviceCopy(dst, event)
