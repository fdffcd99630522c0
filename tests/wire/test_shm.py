"""Shared-memory pool/reader: zero-copy transfer, reclamation (also after SIGKILL), fallbacks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from omnistage.v1.tensor_pb2 import ShmRef, TensorBlob
from omnistage.wire import shm as shm_mod
from omnistage.wire import tensor_blob as tb
from omnistage.wire.shm import ShmPool, ShmReader, list_segments, peer_accepts_shm, sweep_stale_segments
from omnistage.wire.tensor_blob import TensorBlobError

from .conftest import needs_dev_shm, own_segments, pid_segments

REPO = Path(__file__).resolve().parents[2]
pytestmark = needs_dev_shm


def test_large_blob_travels_by_reference_and_decodes_in_place(pool: ShmPool, reader: ShmReader) -> None:
    x = torch.randn(512, 64)
    blob = TensorBlob.FromString(tb.encode(x, pool=pool, request_id="r1").SerializeToString())
    assert blob.WhichOneof("data") == "shm" and blob.ByteSize() < 200
    assert blob.shm.segment.startswith(f"omnistage-{os.getpid()}-") and blob.shm.offset % 64 == 0
    y = tb.decode(blob, reader=reader)
    assert torch.equal(x, y)
    # a view over the mapping, not a copy: a write through one mapping shows through a fresh one
    y[0, 0] = 1234.5
    assert tb.decode_numpy(blob, reader=ShmReader(enabled=True))[0, 0] == np.float32(1234.5)
    small = tb.encode(torch.ones(4), pool=pool, request_id="r1")
    assert small.WhichOneof("data") == "raw"  # below threshold_bytes


def test_bf16_and_cuda_free_paths_through_shm(pool: ShmPool, reader: ShmReader) -> None:
    x = torch.randn(100, 33).bfloat16()[:, 1:]  # non-contiguous
    blob = tb.encode(x, pool=pool, request_id="r")
    assert blob.WhichOneof("data") == "shm"
    assert torch.equal(tb.decode(blob, reader=reader).view(torch.int16), x.contiguous().view(torch.int16))
    a = np.arange(4000, dtype=np.int64).reshape(40, 100)[:, ::2]
    assert np.array_equal(tb.decode_numpy(tb.encode(a, pool=pool, request_id="r"), reader=reader), a)


def test_slots_of_a_request_never_overlap(pool: ShmPool, reader: ShmReader) -> None:
    blobs = [tb.encode(torch.full((30_000,), float(i)), pool=pool, request_id="r") for i in range(40)]
    assert len({b.shm.segment for b in blobs}) > 1  # spilled into further segments
    for i, b in enumerate(blobs):
        assert bool((tb.decode(b, reader=reader) == i).all())


def test_release_request_reuses_segments_and_bounds_free_list(pool: ShmPool) -> None:
    for rid in ("a", "b", "c", "d"):
        assert pool.allocate(rid, 600_000) is not None
    assert pool.num_segments == 4 and pool.held_requests() == ["a", "b", "c", "d"]
    for rid in ("a", "b", "c", "d"):
        assert pool.release_request(rid) == 1
    assert pool.release_request("a") == 0  # idempotent
    assert pool.num_segments == 2  # max_free_segments
    assert len(own_segments(pool)) == 2
    names = set(pool.segment_names())
    pool.allocate("e", 1000)
    assert set(pool.segment_names()) == names  # reused, not created


def test_no_segment_outlives_its_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNISTAGE_SHM", raising=False)
    before = list_segments()
    pool = ShmPool(threshold_bytes=1, segment_bytes=1 << 20, max_free_segments=0)
    mine = f"omnistage-{os.getpid()}-"
    for rid in ("r1", "r2", "r3"):
        for _ in range(3):
            tb.encode(torch.randn(100_000), pool=pool, request_id=rid)
    big = tb.encode(torch.randn(600_000), pool=pool, request_id="r1")  # dedicated oversize segment
    assert big.WhichOneof("data") == "shm"
    assert len([n for n in list_segments() if n.startswith(mine)]) > 3
    for rid in ("r1", "r2", "r3"):
        pool.release_request(rid)
    assert pool.num_segments == 0
    assert sorted(set(list_segments()) - set(before)) == []
    pool.close()


def test_close_and_garbage_collection_unlink_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNISTAGE_SHM", raising=False)
    before = set(list_segments())
    pool = ShmPool(threshold_bytes=1)
    pool.allocate("r", 10)
    pool.probe_token()
    assert len(set(list_segments()) - before) == 2
    pool.close()
    assert set(list_segments()) - before == set()
    assert pool.allocate("r", 10) is None  # closed
    pool2 = ShmPool(threshold_bytes=1)
    pool2.allocate("r", 10)
    del pool2
    import gc

    gc.collect()
    assert set(list_segments()) - before == set()


_CHILD = """
import sys, time
from omnistage.wire.shm import ShmPool
pool = ShmPool(threshold_bytes=1, segment_bytes=1 << 16)
for i in range(3):
    pool.allocate(f"r{i}", 1000)
pool.probe_token()
print("ready", flush=True)
time.sleep(60)
"""


def _spawn_child() -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("OMNISTAGE_SHM", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # bounded: the child prints or dies
    assert line.strip() == "ready", line
    return proc


def _kill(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_sweeper_reclaims_segments_of_a_sigkilled_owner() -> None:
    before = set(list_segments())
    proc = _spawn_child()
    try:
        names = pid_segments(proc.pid)
        assert len(names) == 4  # 3 data segments + the probe
        sweep_stale_segments()
        assert pid_segments(proc.pid) == names  # a live owner is never swept
    finally:
        _kill(proc)
    assert pid_segments(proc.pid) == names  # SIGKILL ran no cleanup
    removed = sweep_stale_segments()
    assert set(names) <= set(removed)
    assert pid_segments(proc.pid) == []
    assert set(list_segments()) - before == set()


def test_next_pool_start_sweeps_dead_owners(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNISTAGE_SHM", raising=False)
    proc = _spawn_child()
    _kill(proc)
    assert len(pid_segments(proc.pid)) == 4
    with ShmPool():
        assert pid_segments(proc.pid) == []


def test_sweeper_detects_pid_reuse(tmp_path: Path) -> None:
    me = os.getpid()
    ns = shm_mod._pid_namespace()
    start = shm_mod._start_time(me)
    live = tmp_path / f"omnistage-{me}-{ns}-{start}-aa-1"
    reused = tmp_path / f"omnistage-{me}-{ns}-{(start or 0) + 1}-bb-1"  # same pid, other process
    foreign = tmp_path / f"omnistage-{me}-{ns + 1}-1-cc-1"  # another pid namespace: not ours to judge
    for p in (live, reused, foreign):
        p.write_bytes(b"x")
    assert sweep_stale_segments(tmp_path) == [reused.name]
    assert live.exists() and foreign.exists() and not reused.exists()


def test_missing_segment_and_bad_ranges_raise(pool: ShmPool, reader: ShmReader) -> None:
    slot = pool.allocate("r", 4096)
    assert slot is not None
    name = slot.segment
    size = pool.segment_bytes
    for ref in (
        ShmRef(segment=name, offset=size - 8, nbytes=16),
        ShmRef(segment=name, offset=-8, nbytes=8),
        ShmRef(segment=name, offset=0, nbytes=size + 8),
        ShmRef(segment=name + "0", offset=0, nbytes=8),
        ShmRef(segment="omnistage-../../etc", offset=0, nbytes=8),
        ShmRef(segment="", offset=0, nbytes=8),
    ):
        with pytest.raises(TensorBlobError):
            reader.buffer(ref)
        n = max(ref.nbytes, 0) // 8
        with pytest.raises(TensorBlobError):
            tb.decode(TensorBlob(dtype=tb.tensor_pb2.I64, shape=[n], shm=ref), reader=reader)
    pool.release_request("r")
    pool.close()
    with pytest.raises(TensorBlobError):  # segment gone after its owner closed
        ShmReader(enabled=True).buffer(ShmRef(segment=name, offset=0, nbytes=8))


def test_handshake_accepts_and_declines(
    pool: ShmPool, reader: ShmReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    md = pool.invocation_metadata()
    assert md and md[0][0] == shm_mod.SHM_PROBE_KEY
    assert peer_accepts_shm(reader.accept(md))
    assert not peer_accepts_shm(ShmReader(enabled=False).accept(md))
    probe = md[0][1]
    wrong = probe[:-2] + ("ff" if probe.endswith("00") else "00")  # (a random nonce ends in 00 once in 256)
    assert not peer_accepts_shm(reader.accept([(shm_mod.SHM_PROBE_KEY, wrong)]))  # wrong nonce
    assert not peer_accepts_shm(reader.accept([(shm_mod.SHM_PROBE_KEY, "omnistage-nope-1:00")]))
    assert not peer_accepts_shm(reader.accept([(shm_mod.SHM_PROBE_KEY, "garbage")]))
    assert not peer_accepts_shm(reader.accept(None))
    other_dir = ShmReader(enabled=True, directory="/nonexistent-omnistage")
    assert not peer_accepts_shm(other_dir.accept(md))  # a receiver that cannot see our segments
    monkeypatch.setenv("OMNISTAGE_SHM", "0")
    assert not peer_accepts_shm(ShmReader().accept(md))


def test_disabled_by_flag_and_env_falls_back_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(100_000)
    with ShmPool(enabled=False, threshold_bytes=1) as p:
        assert not p.enabled and p.invocation_metadata() == []
        assert tb.encode(x, pool=p, request_id="r").WhichOneof("data") == "raw"
    monkeypatch.setenv("OMNISTAGE_SHM", "0")
    with ShmPool(threshold_bytes=1) as p:
        assert not p.enabled
        assert tb.encode(x, pool=p, request_id="r").WhichOneof("data") == "raw"
        assert p.num_segments == 0
    with ShmPool(threshold_bytes=1, directory="/nonexistent-omnistage", enabled=True) as p:
        assert not p.enabled


def test_full_pool_and_request_cap_fall_back_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNISTAGE_SHM", raising=False)
    with ShmPool(
        threshold_bytes=1, segment_bytes=1 << 20, max_total_bytes=2 << 20, max_request_bytes=1 << 30
    ) as p:
        kinds = [
            tb.encode(torch.randn(200_000), pool=p, request_id=f"r{i}").WhichOneof("data") for i in range(4)
        ]
        assert kinds == ["shm", "shm", "raw", "raw"]
        assert p.inline_fallbacks == 2  # what the stage's metrics count
        p.release_request("r0")
        assert tb.encode(torch.randn(200_000), pool=p, request_id="r9").WhichOneof("data") == "shm"
    with ShmPool(threshold_bytes=1, max_request_bytes=1 << 20) as p:
        kinds = [tb.encode(torch.randn(100_000), pool=p, request_id="r").WhichOneof("data") for _ in range(3)]
        assert kinds == ["shm", "shm", "raw"] and p.inline_fallbacks == 1


def test_reader_cache_is_bounded(pool: ShmPool) -> None:
    r = ShmReader(enabled=True, max_cached=2)
    blobs = [tb.encode(torch.randn(200_000), pool=pool, request_id=f"r{i}") for i in range(3)]
    for b in blobs:
        tb.decode(b, reader=r)
    assert r.num_mapped == 2
    kept = tb.decode(blobs[2], reader=r)
    for i in range(3):
        pool.release_request(f"r{i}")
    pool.close()
    r.close()
    assert r.num_mapped == 0
    assert kept.shape == (200_000,)  # still readable after the mapping was dropped and unlinked


def test_segment_reuse_after_release_is_bounded_in_time() -> None:
    # a smoke check that allocation/release cycles neither leak nor slow down pathologically
    deadline = time.monotonic() + 20
    with ShmPool(threshold_bytes=1, segment_bytes=1 << 16, max_free_segments=1, enabled=True) as p:
        for i in range(500):
            assert p.allocate(f"r{i}", 30_000) is not None
            p.release_request(f"r{i}")
            assert time.monotonic() < deadline
        assert p.num_segments == 1


def test_reader_forgets_segments_the_sender_unlinked(pool: ShmPool) -> None:
    """A dedicated segment (a blob over segment_bytes) is unlinked when its request is released;
    the receiver must not keep it mapped (its memory would stay in use) once it maps the next."""
    r = ShmReader(enabled=True)
    big = pool.segment_bytes // 4 + 1  # float32 elements: over one pooled segment
    first = tb.encode(torch.ones(big), pool=pool, request_id="a")
    tb.decode(first, reader=r)
    pool.release_request("a")
    assert not (pool.directory / first.shm.segment).exists()  # the sender unlinked it
    second = tb.encode(torch.ones(big), pool=pool, request_id="b")
    tb.decode(second, reader=r)
    assert r.num_mapped == 1  # the second only
    pool.release_request("b")
    r.close()


def test_a_request_holds_segments_sized_to_what_it_sends(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply holds its segments for its whole call. A request that sends one small blob (the
    thinker's prompt rows for the talker) holds a segment its size, not a whole pooled segment,
    so many more requests in flight share the pool; one that sends much (a prefill role's KV)
    gets segments that double, so it holds few."""
    monkeypatch.delenv("OMNISTAGE_SHM", raising=False)
    with ShmPool(threshold_bytes=1, segment_bytes=8 << 20, min_segment_bytes=1 << 20,
                 max_total_bytes=16 << 20, max_free_segments=0) as p:  # fmt: skip
        kinds = [tb.encode(torch.randn(125_000), pool=p, request_id=f"r{i}").WhichOneof("data") for i in range(16)]
        assert kinds == ["shm"] * 16  # 500 kB each in a 1 MiB segment (a whole 8 MiB one each: 2 of them)
        assert tb.encode(torch.randn(125_000), pool=p, request_id="r16").WhichOneof("data") == "raw"  # full
        for i in range(17):
            p.release_request(f"r{i}")
        assert p.num_segments == 0
        for _ in range(20):  # 20 slots of 500 kB for one request
            assert tb.encode(torch.randn(125_000), pool=p, request_id="big").WhichOneof("data") == "shm"
        sizes = sorted(os.path.getsize(p.directory / n) for n in p.segment_names() if not n.endswith("-probe"))
        assert sizes == [1 << 20, 2 << 20, 4 << 20, 8 << 20]  # 1 + 2 + 4 + 8 MiB hold 2 + 4 + 8 + 16 slots


def test_the_free_list_keeps_the_largest_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Released segments beyond max_free_segments are dropped smallest first: a large one is
    costly to make again (posix_fallocate) and serves any request, a small one only small ones."""
    monkeypatch.delenv("OMNISTAGE_SHM", raising=False)
    with ShmPool(threshold_bytes=1, segment_bytes=8 << 20, min_segment_bytes=1 << 20,
                 max_total_bytes=64 << 20, max_free_segments=2) as p:  # fmt: skip
        assert p.allocate("big", 7 << 20) is not None  # an 8 MiB segment
        for i in range(3):
            assert p.allocate(f"small{i}", 100_000) is not None  # 1 MiB each
        for rid in ("small0", "small1", "small2", "big"):  # the large one last, with the list full
            p.release_request(rid)
        sizes = sorted(os.path.getsize(p.directory / n) for n in p.segment_names() if not n.endswith("-probe"))
        assert sizes == [1 << 20, 8 << 20]


def test_a_stages_metrics_count_the_pools_inline_fallbacks() -> None:
    """`omnistage_stage_shm_inline_fallbacks_total` reads the stage's pool on each scrape: what
    an operator sizes /dev/shm (and the pool) by."""
    from prometheus_client import generate_latest

    from omnistage.server.metrics import StageMetrics

    with ShmPool(threshold_bytes=1, segment_bytes=1 << 20, max_total_bytes=1 << 20, enabled=True) as p:
        load = {"waiting": 0, "waiting_for_input": 0, "running": 0, "cache_usage": 0.0, "held_tokens": 0,
                "kv_pool_tokens": 0, "prefix_cache_tokens": 0, "prefill_tokens_total": 0, "cached_tokens_total": 0}
        metrics = StageMetrics("thinker", "tokens", lambda: load, lambda: p.num_segments, lambda: 0,
                               lambda: p.inline_fallbacks)  # fmt: skip
        for i in range(3):
            tb.encode(torch.randn(200_000), pool=p, request_id=f"r{i}")  # 800 kB: one fits the pool
        text = generate_latest(metrics.registry).decode()
        assert 'omnistage_stage_shm_inline_fallbacks_total{stage="thinker"} 2.0' in text
