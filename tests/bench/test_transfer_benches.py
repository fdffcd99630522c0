"""The transfer benchmarks' gRPC paths run and count what arrived (short forms of
`omnistage bench wire`, `omnistage bench pd`'s KV transfer, `omnistage bench grpc-floor` and
`omnistage bench handoff`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import grpc_floor, wire
from benchmarks.pd import kv_transfer
from omnistage.wire.shm import ShmPool


def test_kv_transfer_moves_the_whole_cache_inline_and_through_shared_memory() -> None:
    layout = {"layers": 2, "kv_heads": 4, "head_dim": 128, "dtype": "bfloat16"}
    row = kv_transfer(layout, 600, 256, reps=1)  # 256 KiB per tensor per chunk: over the shm threshold
    assert row["bytes"] == 2 * 2 * 4 * 600 * 128 * 2  # the receiver checks it got every byte
    assert row["shm_used"] and row["tensors_in_shm"] is False  # the last chunk's 88 tokens go inline
    for key in ("memcpy_gb_s", "inline_grpc_gb_s", "shm_gb_s"):
        assert row[key] > 0


def test_wire_grpc_throughput_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "GRPC_CHUNKS", 3)
    pool = ShmPool(enabled=True)
    try:
        res = wire._grpc(pool, reps=1)
    finally:
        pool.close()
    assert res["bytes_per_request"] == 3 * wire.GRPC_CHUNK_BYTES
    assert res["inline_mb_s"] > 0 and res["shm_mb_s"] > 0 and res["shm_used"]


def test_the_grpc_floor_counts_every_answer_and_each_sides_cpu() -> None:
    result = grpc_floor.measure(messages=300, repeats=1)
    (run,) = result["runs"]
    assert run["messages"] == 300  # every message answered (measure raises otherwise)
    assert run["client_cpu_s"] > 0 and run["server_cpu_s"] > 0  # the server's own CPU, from its process
    assert result["median"]["client_us_per_message"] == pytest.approx(1e6 * run["client_cpu_s"] / 300)
    with pytest.raises(ValueError, match="--messages"):
        grpc_floor.measure(messages=0)


def test_the_handoff_bench_times_both_ways_for_each_batch(tmp_path: Path) -> None:
    from benchmarks import handoff

    rows = handoff.main([1, 3], steps=20, work_us=100, json_out=tmp_path / "handoff.json")
    # each way twice per batch (alternated); every output reached its queue (run raises otherwise)
    assert [(r["batch"], r["mode"]) for r in rows] == [(b, m) for b in (1, 3) for m in handoff.MODES * 2]
    assert all(r["wall_us_p50"] > 0 and r["cpu_us_mean"] >= 0 for r in rows)
    assert json.loads((tmp_path / "handoff.json").read_text())["rows"] == rows
    with pytest.raises(ValueError, match="steps"):
        handoff.main([1], steps=0, work_us=0, json_out=None)
