from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _single_torch_thread() -> Iterator[None]:
    """Run these many-small-op tests on one intra-op thread.

    Streaming steps are hundreds of small kernels; with OpenMP's 2 threads on a 2-core box
    that other processes also use, each barrier can stall for milliseconds (measured: a
    100x32 @ 32x64 linear took 8 ms instead of 30 us).  One thread keeps the test time stable.
    Restored after each module so other tests are unaffected.
    """
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)
