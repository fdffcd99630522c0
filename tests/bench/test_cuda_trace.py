"""The trace summary of `omnistage bench trace` (the tracing itself needs CUDA; this part does not)."""

from __future__ import annotations

from benchmarks.cuda_trace import copies_and_overlap


def _span(cat: str, name: str, ts: float, dur: float, stream: int) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_copy_time_under_kernels_of_other_streams_is_counted_once() -> None:
    d2h = "Memcpy DtoH (Device -> Pinned)"
    events = [
        _span("kernel", "gemm", 0, 10, 7),
        _span("kernel", "gemm", 5, 10, 7),  # overlaps the first: the union, not the sum, counts
        _span("kernel", "copy_kernel", 100, 50, 13),  # on the copy's own stream: not compute beside it
        _span("gpu_memcpy", d2h, 8, 10, 13),  # 8..18, kernels on stream 7 cover 8..15: 7 us
        _span("gpu_memcpy", d2h, 120, 10, 13),  # only its own stream's kernel: 0 us
        _span("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 30, 4, 7),  # nothing beside it
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 0},  # not a span: ignored
    ]
    summary = copies_and_overlap(events)
    assert summary["kernel_streams"] == [13, 7]
    rows = {(r["kind"], r["stream"]): r for r in summary["copies"]}
    side = rows[(d2h, 13)]
    assert side["count"] == 2 and side["us"] == 20 and side["overlapped_us"] == 7
    assert side["overlapped_fraction"] == 7 / 20
    sync = rows[("Memcpy DtoH (Device -> Pageable)", 7)]
    assert sync["count"] == 1 and sync["overlapped_us"] == 0
