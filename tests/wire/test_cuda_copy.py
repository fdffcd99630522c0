"""cuda_copy: CPU fallback always; the CUDA side-stream paths only where CUDA exists."""

from __future__ import annotations

import pytest
import torch

from services.runtime import tensor_blob as tb
from services.runtime.cuda_copy import D2HCopier, H2DCopier, PinnedRing, cuda_available

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")


def test_cpu_fallback_passes_tensors_through() -> None:
    x = torch.randn(8, 8)
    d2h = D2HCopier()
    with d2h.copy(x) as hc:
        assert hc.ready() and hc.wait() is x and hc.event is None
    h2d = H2DCopier("cpu")
    dc = h2d.copy(x)
    assert dc.ready() and dc.wait() is x
    blob = tb.encode(D2HCopier().copy(x).wait())
    assert torch.equal(tb.decode(blob), x)


def test_fallback_without_cuda_even_when_a_cuda_target_is_named() -> None:
    if cuda_available():
        pytest.skip("CUDA present: covered by the CUDA tests")
    x = torch.arange(10)
    assert H2DCopier("cuda").copy(x).wait() is x
    assert not D2HCopier("cuda").enabled


@needs_cuda
def test_d2h_on_side_stream_into_ring() -> None:
    copier = D2HCopier(slots=2, slot_bytes=1 << 20)
    xs = [torch.randn(256, 256, device="cuda") * i for i in range(4)]  # 256 KiB each
    copies = [copier.copy(x) for x in xs]
    for x, hc in zip(xs, copies, strict=True):
        host = hc.wait()
        assert host.device.type == "cpu" and host.is_pinned()
        assert torch.equal(host, x.cpu())
        blob = tb.encode(host)
        hc.release()
        assert torch.equal(tb.decode(blob), x.cpu())
    big = copier.copy(torch.ones(1 << 20, device="cuda"))  # larger than a slot: one-off pinned buffer
    assert torch.equal(big.wait(), torch.ones(1 << 20))


@needs_cuda
def test_d2h_sees_producer_writes_and_bf16() -> None:
    copier = D2HCopier()
    x = torch.zeros(1 << 16, device="cuda", dtype=torch.bfloat16)
    x.add_(3)  # enqueued on the current stream; the side stream must wait for it
    with copier.copy(x) as hc:
        assert bool((hc.wait() == 3).all())


@needs_cuda
def test_h2d_staged_through_pinned_ring() -> None:
    h2d = H2DCopier("cuda", slots=2, slot_bytes=1 << 20)
    for i in range(5):
        x = torch.full((1000, 64), float(i))
        dc = h2d.copy(x)
        y = dc.wait()
        assert y.device.type == "cuda" and torch.equal(y.cpu(), x)
    decoded = tb.decode(tb.encode(torch.arange(100)))  # a non-writable bytes-backed tensor
    assert torch.equal(h2d.copy(decoded).wait().cpu(), torch.arange(100))


@needs_cuda
def test_ring_reuses_slots() -> None:
    ring = PinnedRing(slots=2, slot_bytes=1024)
    a, b = ring.acquire(10), ring.acquire(10)
    assert a is not None and b is not None and ring.acquire(10) is None and ring.acquire(4096) is None
    ring.release(a)
    assert ring.acquire(10) is a and ring.allocated == 2
