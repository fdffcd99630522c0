"""`omnistage bench routing`: round_robin against least_outstanding on a mix of short and long
requests, two talker replicas, the same requests in the same order for both (closed loop).
Reports median and p99 end-to-end latency per policy and their ratio."""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import machine_info, write_json
from benchmarks.harness import free_port_blocks
from benchmarks.stats import nearest_rank


async def _run(address: str, plan: list[tuple[str, int]], concurrency: int, limit_s: float
               ) -> tuple[list[float], int]:  # fmt: skip
    from gateway.client import stream_generate

    sem = asyncio.Semaphore(concurrency)
    e2e: list[float] = []
    failed = 0
    t_end = time.monotonic() + limit_s

    async def one(prompt: str, frames: int) -> None:
        nonlocal failed
        async with sem:
            if time.monotonic() > t_end:
                return
            t0 = time.perf_counter()
            try:
                async for _ in stream_generate(address, prompt, thinker_max_tokens=16, talker_max_tokens=frames,
                                               timeout=300):  # fmt: skip
                    pass
                e2e.append(time.perf_counter() - t0)
            except Exception:
                failed += 1

    await asyncio.gather(*(one(p, f) for p, f in plan))
    return e2e, failed


def main(model: Path | None, requests: int, concurrency: int, short_frames: int, long_frames: int,
         long_share: float, time_limit_s: float, json_out: Path | None) -> dict[str, Any]:  # fmt: skip
    from omnistage.cli.serve import start_stack
    from omnistage.config import parse_config

    rng = random.Random(5)
    plan = [(f"Question {i}: say something.", long_frames if rng.random() < long_share else short_frames)
            for i in range(requests)]  # fmt: skip
    result: dict[str, Any] = {"schema": "omnistage.bench.routing/1", "machine": machine_info(), "requests": requests,
                              "concurrency": concurrency, "short_frames": short_frames, "long_frames": long_frames,
                              "long_requests": sum(f == long_frames for _, f in plan), "policies": {}}  # fmt: skip
    for policy in ("round_robin", "least_outstanding"):
        base = free_port_blocks([10])[0]
        cfg = parse_config({"gateway": {"port": base, "http_port": None}, "thinker": {"base_port": base + 2},
                            "talker": {"base_port": base + 4, "replicas": 2}, "code2wav": {"base_port": base + 8},
                            "routing": policy}, "bench routing")  # fmt: skip
        with start_stack(cfg, model=str(model) if model else None,
                         log_dir=Path(tempfile.mkdtemp(prefix=f"omnistage-routing-{policy}-"))) as stack:
            asyncio.run(_run(stack.gateway_address, plan[:2], 2, time_limit_s))  # warm-up
            t0 = time.perf_counter()
            e2e, failed = asyncio.run(_run(stack.gateway_address, plan, concurrency, time_limit_s))
            wall = time.perf_counter() - t0
        row = {"median_e2e_s": nearest_rank(e2e, 0.5), "p99_e2e_s": nearest_rank(e2e, 0.99), "completed": len(e2e),
               "failed": failed, "wall_s": wall}  # fmt: skip
        result["policies"][policy] = row
        print(f"[routing] {policy}: median E2E {1000 * row['median_e2e_s']:.0f} ms, p99 {1000 * row['p99_e2e_s']:.0f} "
              f"ms, {len(e2e)} completed, {failed} failed, {wall:.1f} s", flush=True)
    rr, lo = result["policies"]["round_robin"], result["policies"]["least_outstanding"]
    result["least_outstanding_over_round_robin"] = {"median_e2e": lo["median_e2e_s"] / rr["median_e2e_s"],
                                                    "p99_e2e": lo["p99_e2e_s"] / rr["p99_e2e_s"]}  # fmt: skip
    ratio = result["least_outstanding_over_round_robin"]
    print(f"[routing] least_outstanding / round_robin: median {ratio['median_e2e']:.3f}, p99 {ratio['p99_e2e']:.3f}",
          flush=True)  # fmt: skip
    write_json(json_out, result)
    return result
