"""What a level's figures measure: in-process event times, a role's busy share over replicas, the
window of an open loop's stage figures, and a level too short for its concurrency."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from benchmarks import drivers, harness, stage_load
from benchmarks.drivers import BenchRequest, InProcessDriver
from benchmarks.load import LevelResult
from omnistage.models.sampling import SamplingParams
from omnistage.server.thread_cpu import ThreadCpuCollector


def test_in_process_events_are_timed_when_their_stage_made_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline hands out a round's events after its last stage: a token made 1 s into the
    request, released at 5 s (after the talker's and code2wav's steps), is timed at 1 s."""
    from services.pipeline import AudioEvent, TextEvent

    clock = iter([100.0, 105.0, 105.0, 105.0])
    monkeypatch.setattr(drivers, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    pipe = SimpleNamespace(
        prompt_ids=lambda prompt: [1, 2], thinker_defaults=lambda: SamplingParams(),
        checkpoint=SimpleNamespace(sample_rate=24_000),
        run=lambda req: iter([TextEvent(7, "a", 1.0), AudioEvent(torch.zeros(480), 0, 5.0)]),
    )  # fmt: skip
    req = BenchRequest(index=0, prompt_index=0, prompt="hi", thinker_max_tokens=4, talker_max_tokens=4)
    text, audio = list(InProcessDriver(pipe).stream(req))
    assert (text.kind, text.t) == ("text", 101.0)
    assert (audio.kind, audio.t) == ("audio", 105.0)


def test_busy_is_a_replicas_share_not_the_sum_over_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two replicas each in steps for 0.85 of the level are 0.85 busy (their sum, 1.7, read as
    more than saturated); steps and CPU stay summed."""
    pages = {"a": {"steps": 10.0, "step_s": 1.7, "cpu_s": 2.0}, "b": {"steps": 12.0, "step_s": 1.7, "cpu_s": 2.0}}
    monkeypatch.setattr(stage_load, "_scrape", lambda url, timeout: pages[url])
    after = stage_load.snapshot({"talker": ["a", "b"]})
    assert after is not None and after["talker"]["replicas"] == 2
    before = {"talker": {"replicas": 2.0, "steps": 0.0, "step_s": 0.0, "cpu_s": 0.0}}
    load = stage_load.load_between(before, after, 2.0)["talker"]
    assert load["busy"] == pytest.approx(0.85) and load["steps"] == 22 and load["cpu_cores"] == pytest.approx(2.0)


def test_stage_figures_are_over_the_levels_own_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """An open loop's requests/s runs from its first arrival; its stage figures over the same
    window, not from before the wait for that arrival."""
    snaps = iter([{"talker": {"step_s": 0.0, "steps": 0.0}}, {"talker": {"step_s": 1.5, "steps": 30.0}}])
    monkeypatch.setattr(harness, "snapshot", lambda eps: next(snaps))
    run = SimpleNamespace(metrics_endpoints={"talker": ["x"]}, client_threads=ThreadCpuCollector())
    level = LevelResult(name="rate=3/s", driver="grpc", role="sut", load={"type": "poisson", "value": 3}, mode=None)

    async def measure() -> None:
        async with harness.Run._stage_load(run, level):  # type: ignore[arg-type]
            level.wall_s = 3.0  # (run_poisson's window: the level took no time here)

    asyncio.run(measure())
    assert level.stage_load is not None and level.stage_load["talker"]["busy"] == pytest.approx(0.5)


@pytest.mark.parametrize(("n", "c", "said", "one_at_a_time"),
                         [(16, 16, "mostly one burst", False), (64, 16, None, False), (8, 16, "not 16", False),
                          (3, 1, None, False), (16, 8, None, True)])  # fmt: skip
def test_a_level_too_short_for_its_concurrency_says_so(monkeypatch: pytest.MonkeyPatch, n: int, c: int,
                                                       said: str | None, one_at_a_time: bool) -> None:  # fmt: skip
    """(Not where the driver runs one request at a time, as the in-process pipeline's does: no ramp down.)"""
    async def no_load(*args: Any) -> None:
        return None

    @contextlib.asynccontextmanager
    async def no_stage_load(level: LevelResult) -> AsyncIterator[None]:
        yield

    @contextlib.contextmanager
    def bar(desc: str, total: int) -> Iterator[Any]:
        yield SimpleNamespace(update=lambda k: None)

    monkeypatch.setattr(harness, "run_concurrency", no_load)
    run = SimpleNamespace(bar=bar, _stage_load=no_stage_load, _finish_level=lambda level: None)
    reqs = [BenchRequest(index=i, prompt_index=0, prompt="hi", thinker_max_tokens=4, talker_max_tokens=4)
            for i in range(n)]  # fmt: skip
    driver = object.__new__(InProcessDriver) if one_at_a_time else SimpleNamespace(name="grpc")
    level = asyncio.run(harness.Run.level_concurrency(run, driver, f"c={c}", "sut", reqs, c, None, None))  # type: ignore[arg-type]
    assert [said in note for note in level.notes] == ([] if said is None else [True]), level.notes
