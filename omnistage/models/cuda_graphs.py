"""CUDA graphs of a fixed-shape batched loop, one per batch size bucket.

At decode widths a step's kernels take microseconds and launching them from Python takes
longer: on an H200 the tiny checkpoint's talker spent 17.5 ms a step at batch 1 with a core at
99 % (benchmarks/results/gpu-h200). A graph captured once per batch size replays every kernel
of the loop with one launch. vLLM-Omni captures its code predictor the same way.

`BatchGraphs(fn, sizes, like)` captures `fn(*xs) -> y` for inputs `xs` of the shapes in `like`
(one tensor or several) with their first (batch) axis set to each of `sizes`. A call pads its
batch up to the next captured size (the padded rows hold whatever an earlier call left there:
every row of the loop is computed on its own, so they touch no real row) and returns the real
rows of the graph's output, `y`'s batch axis being `out_batch_dim`. What `fn` reads besides
`xs` (weights, its buffers) must live at fixed addresses from the first capture on; the graphs
share one memory pool, captured largest first, and are replayed one at a time on one stream
(each call copies its rows out before the next can run).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence

import torch

__all__ = ["BatchGraphs", "bucket_sizes"]

log = logging.getLogger(__name__)


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, ... up to `max_batch`, and `max_batch` itself."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    sizes = []
    size = 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return [*sizes, max_batch]


class BatchGraphs:
    @torch.no_grad()
    def __init__(self, fn: Callable[..., torch.Tensor], sizes: Sequence[int],
                 like: torch.Tensor | Sequence[torch.Tensor], out_batch_dim: int = 0,
                 warmup: int = 2) -> None:  # fmt: skip
        likes = [like] if isinstance(like, torch.Tensor) else list(like)
        device = likes[0].device
        if device.type != "cuda" or any(t.device != device for t in likes):
            raise ValueError(f"CUDA graphs need their inputs on one CUDA device, not {[str(t.device) for t in likes]}")
        self.sizes = sorted(set(sizes))
        self.out_batch_dim = out_batch_dim
        self.fn = fn
        largest = self.sizes[-1]
        self.inputs = [t.new_zeros((largest, *t.shape[1:])) for t in likes]
        self.device = device
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        started = time.perf_counter()
        # Streams, captures and pools act on the current device: make it the tensors' (cuda:1 ...),
        # else the kernels run on a stream that is not captured and the graph is empty.
        with torch.cuda.device(self.device):
            pool = torch.cuda.graph_pool_handle()
            for size in reversed(self.sizes):  # largest first: its buffers serve the smaller ones
                xs = [t[:size] for t in self.inputs]
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up off the capture (lazy init, workspace allocation)
                    for _ in range(warmup):
                        fn(*xs)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = fn(*xs)
                self.graphs[size] = (graph, out)
            torch.cuda.synchronize()
        log.info("captured %d CUDA graphs (batch %s) in %.2f s", len(self.sizes), self.sizes,
                 time.perf_counter() - started)  # fmt: skip

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def __call__(self, *xs: torch.Tensor) -> torch.Tensor:
        if len(xs) != len(self.inputs):
            raise ValueError(f"{len(xs)} inputs for graphs captured with {len(self.inputs)}")
        batch = xs[0].shape[0]
        if batch > self.max_batch:
            raise ValueError(f"batch {batch} over the largest captured ({self.max_batch})")
        size = self.sizes[bisect.bisect_left(self.sizes, batch)]
        with torch.cuda.device(self.device):  # replayed on that device's current stream
            for static, x in zip(self.inputs, xs, strict=True):
                static[:batch].copy_(x)
            graph, out = self.graphs[size]
            graph.replay()
            # a copy: the next replay (of this graph or another sharing the pool) overwrites `out`
            return out.narrow(self.out_batch_dim, 0, batch).clone()
