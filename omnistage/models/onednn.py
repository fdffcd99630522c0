"""oneDNN's primitive cache, sized for streaming decoders.

PyTorch runs CPU convolutions on oneDNN, which JIT-compiles a kernel (a "primitive") for each
input shape it meets and keeps the last 1,024 in a process-wide cache. code2wav's streaming
decoder convolves a batch of requests' new frames with their histories every step: the shape
is (requests in the step, frames that arrived for the longest) for each of its convolutions, and
each new shape makes a kernel and an output reorder. Under load at c=16 (tiny checkpoint) the
code2wav process met 2,292 convolution shapes in 400 requests, more than the cache holds, so it
kept compiling: in `perf` on the 2-core VM, oneDNN's kernel generation and cache were a fifth of
its engine thread's CPU time. The shapes are bounded (batch size by `max_num_seqs`, frames by
the talker's chunk schedule), so a larger cache stops the compiling once it has met them.

Memory: each entry holds generated code. On the tiny checkpoint's shapes the served code2wav
process held 30-40 MB more with every shape cached than with oneDNN's default; with 96-channel
convolutions about 120 kB an entry. Set ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` to choose another
size (0 turns the cache off: every convolution compiles its kernel again).
"""

from __future__ import annotations

import os

__all__ = ["CACHE_ENTRIES", "ENV", "widen_primitive_cache"]

ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
CACHE_ENTRIES = 8192


def widen_primitive_cache() -> None:
    """Give oneDNN's primitive cache `CACHE_ENTRIES` entries unless the environment says how many.
    oneDNN reads the variable when it makes its first primitive: call this before the process
    runs any convolution (a later call has no effect on this process, only on its children)."""
    os.environ.setdefault(ENV, str(CACHE_ENTRIES))
