"""What handing a step's outputs to the event loop costs the engine thread (`omnistage bench handoff`).

A producer thread stands for the engine: each step it hands one output per request to the loop,
where one task per request takes them from its queue (as a stage's calls do), then holds the GIL
in pure-Python work for `work_us` (the next step). Timed on the producer, per step: the wall
time of the handoff and its CPU time, with `loop.call_soon_threadsafe` per output (one self-pipe
write, and a GIL handoff to the woken loop, each) and with `LoopHandoff.post` (one wake-up a
burst; omnistage/server/handoff.py). The two alternate, twice each, so drift hits both.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import machine_info, write_json
from omnistage.server.handoff import LoopHandoff

MODES = ("call_soon_threadsafe", "LoopHandoff")


def run(mode: str, batch: int, steps: int, work_us: float) -> dict[str, float]:
    loop = asyncio.new_event_loop()
    queues: list[asyncio.Queue[int | None]] = [asyncio.Queue() for _ in range(batch)]
    taken = 0

    async def take(q: asyncio.Queue[int | None]) -> None:
        nonlocal taken
        while await q.get() is not None:
            taken += 1

    tasks = [loop.create_task(take(q)) for q in queues]
    handoff = LoopHandoff.of(loop)
    walls: list[float] = []
    cpus: list[float] = []

    def engine() -> None:
        for step in range(steps):
            t0, c0 = time.perf_counter(), time.thread_time()
            for q in queues:
                if mode == "LoopHandoff":
                    handoff.post(q.put_nowait, step)
                else:
                    loop.call_soon_threadsafe(q.put_nowait, step)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.thread_time() - c0)
            end = time.perf_counter() + work_us / 1e6
            while time.perf_counter() < end:  # the next step, holding the GIL
                pass
        for q in queues:
            loop.call_soon_threadsafe(q.put_nowait, None)

    thread = threading.Thread(target=engine)
    thread.start()
    loop.run_until_complete(asyncio.gather(*tasks))
    thread.join()
    loop.close()
    if taken != steps * batch:
        raise RuntimeError(f"{mode}: {taken} outputs taken of {steps * batch}")
    p99 = statistics.quantiles(walls, n=100)[98] if len(walls) >= 2 else walls[0]
    return {"wall_us_p50": statistics.median(walls) * 1e6, "wall_us_p99": p99 * 1e6,
            "cpu_us_mean": statistics.fmean(cpus) * 1e6}  # fmt: skip


def main(batches: Sequence[int], steps: int, work_us: float, json_out: Path | None) -> list[dict[str, Any]]:
    if not 1 <= steps <= 100_000:
        raise ValueError(f"steps must be 1..100000, got {steps}")
    rows = []
    for batch in batches:
        for mode in MODES * 2:
            row = {"batch": batch, "mode": mode, **run(mode, batch, steps, work_us)}
            rows.append(row)
            print(f"batch {batch:3d}  {mode:20s}  handoff wall p50 {row['wall_us_p50']:7.1f} us  p99 "
                  f"{row['wall_us_p99']:7.1f} us  engine-thread CPU {row['cpu_us_mean']:6.1f} us a step")
    if json_out is not None:
        write_json(json_out, {"machine": machine_info(), "steps": steps, "work_us": work_us, "rows": rows})
    return rows
