"""`omnistage bench pd`: prefill/decode disaggregation of the thinker.

1. KV transfer rate. A request's KV cache, shaped as a thinker's (default: the published
   Qwen3-Omni-30B-A3B thinker: 48 layers, 4 KV heads of 128, bfloat16) for a long prompt, sent
   the way the prefill role sends it (one chunk per prefill step, per layer keys and values,
   split under the message limit) over a gRPC stream on 127.0.0.1 to a receiver that copies it
   into a preallocated cache as the decode role does: inline in the messages, and through shared
   memory. The baseline is a memcpy of the same bytes into the same cache.
2. Mixed load. Short chat requests at a steady rate, and long-prompt requests (about 1,500
   tokens) among them, against the colocated thinker (two replicas) and the split one (one
   prefill and one decode process: the same number of thinker processes). For the short
   requests: p50/p99 time between tokens and time to first audio; the ratio split / colocated
   of p99 time between tokens.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import torch

from benchmarks.common import machine_info, write_json
from benchmarks.harness import free_port_blocks
from benchmarks.stats import nearest_rank
from benchmarks.wire import SinkStage, loopback_stage, stream_to
from omnistage.wire import tensor_blob as tb
from omnistage.wire.shm import ShmPool, ShmReader

MAX_MSG = 4 * 1024 * 1024
QWEN3_OMNI_30B = {"layers": 48, "kv_heads": 4, "head_dim": 128, "dtype": "bfloat16"}


# ---- 1. KV transfer -----------------------------------------------------------------------------


def _kv_chunks(layout: dict[str, Any], tokens: int, chunk: int) -> list[tuple[int, dict[str, torch.Tensor]]]:
    dtype = getattr(torch, layout["dtype"])
    out = []
    for pos in range(0, tokens, chunk):
        n = min(chunk, tokens - pos)
        shape = (1, layout["kv_heads"], n, layout["head_dim"])
        out.append((pos, {f"{kv}.{i}": torch.randn(shape).to(dtype) for i in range(layout["layers"]) for kv in "kv"}))
    return out


def _cache(layout: dict[str, Any], tokens: int) -> dict[str, torch.Tensor]:
    shape = (1, layout["kv_heads"], tokens, layout["head_dim"])
    dtype = getattr(torch, layout["dtype"])
    return {f"{kv}.{i}": torch.empty(shape, dtype=dtype) for i in range(layout["layers"]) for kv in "kv"}


def _receiver(layout: dict[str, Any], tokens: int) -> Callable[[tb.DecodedChunk], None]:
    """The decode role's receive path for one call: each whole chunk copied into a preallocated
    cache."""
    cache = _cache(layout, tokens)

    def handle(d: tb.DecodedChunk) -> None:
        for name, t in d.tensors.items():
            cache[name][:, :, d.offset : d.offset + t.shape[2]].copy_(t)

    return handle


def _send(address: str, chunks: list[tuple[int, dict[str, torch.Tensor]]], pool: ShmPool | None) -> tuple[float, bool]:
    def encoded(use: ShmPool | None, rid: str) -> Iterator[tb.LazyChunk]:
        seq = 0
        for i, (pos, tensors) in enumerate(chunks):
            n = next(iter(tensors.values())).shape[2]
            for c in tb.encode_chunks(tensors, max_bytes=MAX_MSG - 1024, offset=pos, length=n, seq=seq,
                                      finished=i == len(chunks) - 1, pool=use, request_id=rid):  # fmt: skip
                seq += 1
                yield c

    elapsed, shm, got = stream_to(address, encoded, pool, MAX_MSG, timeout=120)
    assert got == sum(t.numel() * t.element_size() for _, ts in chunks for t in ts.values())
    return elapsed, shm


def kv_transfer(layout: dict[str, Any], tokens: int, chunk: int, reps: int = 3) -> dict[str, Any]:
    chunks = _kv_chunks(layout, tokens, chunk)
    nbytes = sum(t.numel() * t.element_size() for _, ts in chunks for t in ts.values())
    copy = _receiver(layout, tokens)  # the receiver's own copy, without the wire
    decoded = [tb.DecodedChunk(ts, offset=pos) for pos, ts in chunks]

    def memcpy() -> float:
        t0 = time.perf_counter()
        for d in decoded:
            copy(d)
        return time.perf_counter() - t0

    memcpy()
    t_mem = statistics.median(memcpy() for _ in range(reps))
    reader = ShmReader(enabled=True)
    pool = ShmPool(enabled=True, segment_bytes=max(64 << 20, 2 * nbytes))
    try:
        with loopback_stage(SinkStage(reader, lambda: _receiver(layout, tokens)), MAX_MSG) as address:
            _send(address, chunks, None)  # warm the channel
            inline = [_send(address, chunks, None)[0] for _ in range(reps)]
            shm_runs = [_send(address, chunks, pool) for _ in range(reps)]
    finally:
        reader.close()
        pool.close()
    t_inline, t_shm = statistics.median(inline), statistics.median(t for t, _ in shm_runs)
    return {"layout": layout, "prompt_tokens": tokens, "chunk_tokens": chunk, "bytes": nbytes,
            "memcpy_gb_s": nbytes / t_mem / 1e9, "inline_grpc_gb_s": nbytes / t_inline / 1e9,
            "shm_gb_s": nbytes / t_shm / 1e9, "shm_used": all(u for _, u in shm_runs),
            # the pool takes a tensor of at least its threshold; smaller ones go inline anyway
            "tensors_in_shm": min(t.numel() * t.element_size() for _, ts in chunks for t in ts.values())
            >= pool.threshold_bytes,
            "inline_ms": 1000 * t_inline, "shm_ms": 1000 * t_shm, "memcpy_ms": 1000 * t_mem}  # fmt: skip


# ---- 2. mixed load --------------------------------------------------------------------------------


async def _short(address: str, prompt: str, out: dict[str, list[float]], errors: list[str]) -> None:
    from gateway.client import stream_generate

    t0 = time.perf_counter()
    last = None
    first_audio = None
    try:
        async for ev in stream_generate(address, prompt, thinker_max_tokens=24, talker_max_tokens=24, timeout=300):
            now = time.perf_counter()
            if ev.kind == "text" and ev.token_ids:
                if last is not None:
                    out["itl"].append((now - last) / len(ev.token_ids))
                last = now
            elif ev.kind == "audio" and first_audio is None:
                first_audio = now - t0
    except grpc.aio.AioRpcError as e:
        errors.append(f"{e.code().name}: {e.details()}")
        return
    if first_audio is not None:
        out["ttfa"].append(first_audio)


async def _long(address: str, prompt: str, errors: list[str]) -> None:
    from gateway.client import generate

    try:
        await generate(address, prompt, want_audio=False, thinker_max_tokens=4, timeout=300)
    except grpc.aio.AioRpcError as e:
        errors.append(f"{e.code().name}: {e.details()}")


async def _mixed(address: str, shorts: int, rate: float, long_every: int, long_prompt: str) -> dict[str, Any]:
    out: dict[str, list[float]] = {"itl": [], "ttfa": []}
    errors: list[str] = []
    tasks = []
    for i in range(shorts):
        tasks.append(asyncio.create_task(_short(address, f"Question {i}: tell me about {i}.", out, errors)))
        if i % long_every == long_every // 2:
            tasks.append(asyncio.create_task(_long(address, long_prompt, errors)))
        await asyncio.sleep(1.0 / rate)
    await asyncio.gather(*tasks)
    return {"itl_ms": {"p50": 1000 * nearest_rank(out["itl"], 0.5), "p99": 1000 * nearest_rank(out["itl"], 0.99)},
            "ttfa_ms": {"p50": 1000 * nearest_rank(out["ttfa"], 0.5), "p99": 1000 * nearest_rank(out["ttfa"], 0.99)},
            "short_requests": shorts, "long_requests": len(tasks) - shorts, "errors": errors[:5],
            "failed": len(errors)}  # fmt: skip


def mixed_load(model: Path | None, shorts: int, rate: float, long_every: int, long_tokens: int) -> dict[str, Any]:
    from omnistage.cli.serve import start_stack
    from omnistage.config import parse_config
    from omnistage.models import load_tokenizer, open_checkpoint

    results: dict[str, Any] = {}
    for name in ("colocated", "disaggregated"):
        base = free_port_blocks([12])[0]
        thinker: dict[str, Any] = {"base_port": base + 2, "replicas": 2}
        if name == "disaggregated":
            thinker = {"disaggregated": True, "prefill": {"base_port": base + 2}, "decode": {"base_port": base + 3}}
        data = {"gateway": {"port": base, "http_port": None}, "thinker": thinker,
                "talker": {"base_port": base + 4}, "code2wav": {"base_port": base + 8}}  # fmt: skip
        cfg = parse_config(data, "bench pd")
        with start_stack(cfg, model=str(model) if model else None,
                         log_dir=Path(tempfile.mkdtemp(prefix=f"omnistage-pd-{name}-"))) as stack:  # fmt: skip
            tok = load_tokenizer(open_checkpoint(stack.model_dir))
            words = "lorem ipsum dolor sit amet, "
            per = max(1, len(tok(words * 10)["input_ids"]) // 10)
            long_prompt = words * max(1, long_tokens // per)
            asyncio.run(_mixed(stack.gateway_address, 4, rate, 1000, long_prompt))  # warm up
            results[name] = asyncio.run(_mixed(stack.gateway_address, shorts, rate, long_every, long_prompt))
            results[name]["long_prompt_tokens"] = len(tok(long_prompt)["input_ids"])
        print(f"[pd] {name}: {results[name]}", flush=True)
    co, pd = results["colocated"], results["disaggregated"]
    results["ratio_p99_itl"] = pd["itl_ms"]["p99"] / co["itl_ms"]["p99"]
    results["ratio_p50_itl"] = pd["itl_ms"]["p50"] / co["itl_ms"]["p50"]
    results["ratio_p99_ttfa"] = pd["ttfa_ms"]["p99"] / co["ttfa_ms"]["p99"]
    return results


def main(model: Path | None, tokens: int, chunk: int, shorts: int, rate: float, long_every: int,
         json_out: Path | None) -> dict[str, Any]:  # fmt: skip
    from omnistage.cli.serve import resolve_model
    from omnistage.config import DeployConfig
    from omnistage.models import open_checkpoint

    ckpt = open_checkpoint(resolve_model(DeployConfig(), str(model) if model else None))
    text = ckpt.config.thinker_config.text_config
    own = {"layers": text.num_hidden_layers, "kv_heads": text.num_key_value_heads,
           "head_dim": getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
           "dtype": "float32"}  # fmt: skip
    result: dict[str, Any] = {"schema": "omnistage.bench.pd/1", "machine": machine_info(), "kv_transfer": []}
    for layout in (QWEN3_OMNI_30B, own):
        row = kv_transfer(layout, tokens, chunk)
        result["kv_transfer"].append(row)
        print(f"[pd] KV of {tokens} tokens ({row['bytes'] / 1e6:.1f} MB, {layout}): memcpy {row['memcpy_gb_s']:.2f} "
              f"GB/s, inline gRPC {row['inline_grpc_gb_s']:.2f} GB/s, shared memory {row['shm_gb_s']:.2f} GB/s "
              f"(tensors through shm: {row['shm_used'] and row['tensors_in_shm']})", flush=True)  # fmt: skip
    result["mixed_load"] = mixed_load(model, shorts, rate, long_every, tokens)
    m = result["mixed_load"]
    print(f"[pd] mixed load: p99 time between tokens, disaggregated / colocated = {m['ratio_p99_itl']:.2f} "
          f"(p50 {m['ratio_p50_itl']:.2f}); p99 TTFA ratio {m['ratio_p99_ttfa']:.2f}", flush=True)  # fmt: skip
    if json_out is not None:
        write_json(json_out, result)
    return result
