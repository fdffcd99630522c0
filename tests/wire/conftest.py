"""Shared fixtures for the wire tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from omnistage.wire.shm import DEFAULT_DIR, ShmPool, ShmReader

needs_dev_shm = pytest.mark.skipif(
    not (DEFAULT_DIR.is_dir() and os.access(DEFAULT_DIR, os.W_OK)), reason="no writable /dev/shm"
)


def own_segments(pool: ShmPool) -> list[str]:
    """Names of this pool's files still present under its directory."""
    stem = pool.segment_names()[0].rsplit("-", 1)[0] if pool.segment_names() else None
    if stem is None:
        return []
    return sorted(n for n in os.listdir(pool.directory) if n.startswith(stem + "-"))


def pid_segments(pid: int, directory: Path = DEFAULT_DIR) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(f"omnistage-{pid}-"))


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[ShmPool]:
    monkeypatch.delenv("OMNISTAGE_SHM", raising=False)
    p = ShmPool(threshold_bytes=1024, segment_bytes=1 << 20, max_total_bytes=16 << 20, max_free_segments=2)
    if not p.enabled:
        pytest.skip("shared memory unavailable")
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def reader() -> Iterator[ShmReader]:
    r = ShmReader(enabled=True)
    try:
        yield r
    finally:
        r.close()


@pytest.fixture(scope="module")
def shm_pool() -> Iterator[tuple[ShmPool, ShmReader]]:
    """A pool (2 KiB threshold) and a reader shared by a module's property tests."""
    pool = ShmPool(enabled=True, threshold_bytes=2048, segment_bytes=4 << 20, max_total_bytes=64 << 20)
    if not pool.enabled:
        pytest.skip("shared memory unavailable")
    reader = ShmReader(enabled=True)
    try:
        yield pool, reader
    finally:
        reader.close()
        pool.close()
