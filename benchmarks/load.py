"""Load shapes: a closed loop at a fixed concurrency, and open-loop Poisson arrivals.

Both issue requests from a fixed list (so every configuration sees the same mix) and stop
issuing when the list is used up or the level's time limit has passed; requests already in
flight are waited for (the driver's own timeout bounds them).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.drivers import BenchRequest, Driver, StreamEvent, build_record
from benchmarks.stats import RequestRecord, summarize_records


@dataclass
class LevelResult:
    name: str
    driver: str
    role: str  # "sut" (system under test) or "baseline"
    load: dict[str, Any]
    mode: str | None
    records: list[RequestRecord] = field(default_factory=list)
    wall_s: float | None = None
    stopped_by_time_limit: bool = False
    notes: list[str] = field(default_factory=list)
    stage_load: dict[str, Any] | None = None  # per process role, from the stack's metrics (stage_load.py)

    def summary(self) -> dict[str, Any]:
        return summarize_records(self.records, self.wall_s)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "driver": self.driver,
            "role": self.role,
            "load": self.load,
            "mode": self.mode,
            "wall_s": self.wall_s,
            "stopped_by_time_limit": self.stopped_by_time_limit,
            "notes": self.notes,
            "summary": self.summary(),
            "stage_load": self.stage_load,
            "requests": [r.to_json() for r in sorted(self.records, key=lambda r: r.index)],
        }


async def _one(driver: Driver, name: str, req: BenchRequest, t0: float) -> RequestRecord:
    t_submit = time.perf_counter()
    events: list[StreamEvent] | None = None
    error: BaseException | None = None
    try:
        events = await driver.run(req)
    except Exception as e:  # a failed request is a figure too
        error = e
    return build_record(name, req, t_submit - t0, t_submit, events, error)


async def run_concurrency(
    driver: Driver,
    level: LevelResult,
    requests: Sequence[BenchRequest],
    concurrency: int,
    time_limit: float | None,
    progress: Callable[[int], Any] | None = None,
) -> LevelResult:
    """Closed loop: `concurrency` clients, each issuing its next request when the last ends."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    pending = list(requests)
    t0 = time.perf_counter()

    async def client() -> None:
        while pending:
            if time_limit is not None and time.perf_counter() - t0 > time_limit:
                level.stopped_by_time_limit = True
                return
            req = pending.pop(0)
            level.records.append(await _one(driver, level.name, req, t0))
            if progress is not None:
                progress(1)

    await asyncio.gather(*(client() for _ in range(min(concurrency, max(1, len(pending))))))
    level.wall_s = time.perf_counter() - t0 if level.records else None
    return level


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times (seconds after the start) of n requests at `rate` per second."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


async def run_poisson(
    driver: Driver,
    level: LevelResult,
    requests: Sequence[BenchRequest],
    rate: float,
    time_limit: float | None,
    seed: int,
    progress: Callable[[int], Any] | None = None,
) -> LevelResult:
    """Open loop: requests arrive at Poisson times whatever the system's state."""
    t0 = time.perf_counter()
    tasks: list[asyncio.Task[RequestRecord]] = []

    async def one(req: BenchRequest) -> RequestRecord:
        rec = await _one(driver, level.name, req, t0)
        if progress is not None:
            progress(1)
        return rec

    for req, at in zip(requests, poisson_offsets(len(requests), rate, seed), strict=True):
        if time_limit is not None and at > time_limit:
            level.stopped_by_time_limit = True
            break
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    level.records.extend(await asyncio.gather(*tasks))
    # from the first arrival, not the level's start (the wait for it is no time the system served)
    end = time.perf_counter() - t0
    level.wall_s = end - min(r.issued_at for r in level.records) if level.records else None
    return level
