"""Statistics of `omnistage bench` on small synthetic inputs; expected values worked out by hand."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from benchmarks.drivers import BenchRequest, Driver, StreamEvent, build_record
from benchmarks.harness import Run, ratio_inputs
from benchmarks.load import LevelResult, poisson_offsets, run_concurrency
from benchmarks.prompts import request_sequence
from benchmarks.stats import (
    RATIO_KEYS,
    RatioInputs,
    RequestRecord,
    compute_ratios,
    gaps,
    percentile,
    playback_stall,
    real_time_factor,
    summarize,
    summarize_records,
    throughput,
    wall_time,
)


def test_percentile_linear_interpolation() -> None:
    xs = [7, 3, 10, 1, 5, 2, 9, 4, 8, 6]  # 1..10, unsorted
    # rank = (n - 1) * q / 100 over the sorted values, interpolated between neighbours
    assert percentile(xs, 50) == pytest.approx(5.5)  # rank 4.5: 5 + 0.5 * (6 - 5)
    assert percentile(xs, 90) == pytest.approx(9.1)  # rank 8.1: 9 + 0.1 * (10 - 9)
    assert percentile(xs, 99) == pytest.approx(9.91)  # rank 8.91
    assert percentile(xs, 0) == 1
    assert percentile(xs, 100) == 10
    assert percentile([4.2], 99) == 4.2
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_summarize_ignores_none() -> None:
    s = summarize([4.0, None, 1.0, 3.0, 2.0])
    assert s["n"] == 4
    assert s["mean"] == pytest.approx(2.5)
    assert s["median"] == pytest.approx(2.5)
    assert s["p90"] == pytest.approx(3.7)  # rank 2.7: 3 + 0.7
    assert s["p99"] == pytest.approx(3.97)  # rank 2.97
    assert (s["min"], s["max"]) == (1.0, 4.0)
    empty = summarize([None])
    assert empty["n"] == 0 and empty["median"] is None and empty["p99"] is None


def test_rtf_and_gaps() -> None:
    assert real_time_factor(1.5, 3.0) == pytest.approx(0.5)
    assert real_time_factor(2.0, 0.0) is None
    assert real_time_factor(None, 1.0) is None
    assert gaps([0.1, 0.3, 0.35, 1.0]) == pytest.approx([0.2, 0.05, 0.65])
    assert gaps([0.4]) == []
    assert gaps([]) == []


def test_playback_stall() -> None:
    rate = 100  # samples per second: a 10-sample chunk plays 0.1 s
    # chunks that arrive before the audio before them has played: never dry
    assert playback_stall([1.0, 1.05, 1.15], [10, 10, 10], rate) == pytest.approx(0.0)
    # the second chunk 0.3 s after the first, which plays 0.1 s: 0.2 s dry; the third waits 0.05 s more
    assert playback_stall([1.0, 1.3, 1.45], [10, 10, 10], rate) == pytest.approx(0.25)
    # a large chunk buys time for later, slower ones
    assert playback_stall([0.0, 0.5, 0.9], [100, 10, 10], rate) == pytest.approx(0.0)
    assert playback_stall([], [], rate) is None
    record = RequestRecord("x", 0, 0, 3, 0.0, audio_times=[1.0, 1.3], audio_chunk_samples=[2400, 2400])
    assert record.stall_s == pytest.approx(0.2)
    assert summarize_records([record])["stall_s"]["median"] == pytest.approx(0.2)


def _req(i: int = 0) -> BenchRequest:
    return BenchRequest(index=i, prompt_index=i, prompt="abc", thinker_max_tokens=4, talker_max_tokens=8)


def test_record_from_events() -> None:
    t0 = 100.0
    events = [
        StreamEvent("text", t0 + 0.1, token_ids=(5,)),
        StreamEvent("text", t0 + 0.2, token_ids=(6, 7)),
        StreamEvent("audio", t0 + 0.5, samples=2400, sample_rate=24000),
        StreamEvent("audio", t0 + 0.9, samples=4800, sample_rate=24000),
        StreamEvent("final", t0 + 1.2, info={"x": 1}),
    ]
    rec = build_record("cfg", _req(), 3.0, t0, events)
    assert rec.ok and rec.issued_at == 3.0
    assert rec.ttft == pytest.approx(0.1)
    assert rec.ttfa == pytest.approx(0.5)
    assert rec.e2e == pytest.approx(1.2)
    assert rec.text_tokens == 3 and rec.token_ids == [5, 6, 7]
    assert rec.audio_samples == 7200
    assert rec.audio_s == pytest.approx(0.3)  # 7200 / 24000
    assert rec.rtf == pytest.approx(4.0)  # 1.2 s to make 0.3 s
    assert rec.chunk_gaps == pytest.approx([0.4])
    assert rec.info == {"x": 1}


def test_record_failures() -> None:
    failed = build_record("cfg", _req(), 0.0, 0.0, None, RuntimeError("boom"))
    assert not failed.ok and "boom" in (failed.error or "")
    unfinished = build_record("cfg", _req(), 0.0, 0.0, [StreamEvent("text", 0.5, token_ids=(1,))])
    assert not unfinished.ok and unfinished.e2e == pytest.approx(0.5)
    text_only = build_record("cfg", _req(), 0.0, 0.0, [StreamEvent("final", 0.4)])
    assert text_only.ok and text_only.ttfa is None and text_only.rtf is None


def _rec(i: int, issued: float, e2e: float, tokens: int, samples: int, ok: bool = True) -> RequestRecord:
    return RequestRecord(config="c", index=i, prompt_index=i, prompt_chars=1, issued_at=issued, ok=ok, e2e=e2e,
                         ttft=e2e / 10, ttfa=e2e / 2, text_tokens=tokens, audio_samples=samples, sample_rate=1000)


def test_throughput_and_wall() -> None:
    recs = [_rec(0, 0.0, 1.0, 10, 2000), _rec(1, 0.5, 2.0, 30, 6000), _rec(2, 0.7, 9.0, 99, 99, ok=False)]
    assert wall_time(recs) == pytest.approx(2.5)  # first issue 0.0, last finish 0.5 + 2.0; failed ignored
    t = throughput(recs, 2.5)
    assert t["requests_per_s"] == pytest.approx(2 / 2.5)
    assert t["audio_s_per_s"] == pytest.approx((2.0 + 6.0) / 2.5)
    assert t["text_tokens_per_s"] == pytest.approx(40 / 2.5)
    assert throughput(recs, None)["requests_per_s"] is None
    assert throughput(recs[2:], 5.0)["requests_per_s"] is None  # nothing finished: no rate, not zero
    s = summarize_records(recs)
    assert (s["requests"], s["ok"], s["failed"]) == (3, 2, 1)
    assert s["e2e_s"]["median"] == pytest.approx(1.5)
    assert s["ttfa_s"]["median"] == pytest.approx(0.75)
    assert s["rtf"]["median"] == pytest.approx((0.5 + 2.0 / 6.0) / 2)  # 1 s for 2 s; 2 s for 6 s
    assert s["wall_s"] == pytest.approx(2.5)


def test_ratio_keys_and_nulls() -> None:
    none = compute_ratios(RatioInputs())
    assert tuple(none) == RATIO_KEYS and all(v is None for v in none.values())
    some = compute_ratios(RatioInputs(ttfa_median_async_c1=0.2, ttfa_median_full_c1=0.8, requests_per_s_cmax=3.0,
                                      requests_per_s_c1=1.5, monolithic_requests_per_s=0.0))
    assert some["ttfa_async_over_full"] == pytest.approx(0.25)
    assert some["throughput_cmax_over_c1"] == pytest.approx(2.0)
    assert some["throughput_cmax_over_sequential_monolithic"] is None  # zero denominator
    assert some["ttfa_over_monolithic_e2e"] is None
    assert some["e2e_grpc_over_inprocess_c1"] is None
    assert some["pipeline_over_bottleneck_stage"] is None


def _level(name: str, driver: str, role: str, c: int, mode: str | None, recs: list[RequestRecord]) -> LevelResult:
    return LevelResult(name=name, driver=driver, role=role, load={"type": "concurrency", "value": c}, mode=mode,
                       records=recs, wall_s=wall_time(recs))


def test_ratios_from_levels_with_skipped_baselines() -> None:
    from benchmarks.harness import BenchOptions

    reqs = [_req(0), _req(1)]
    run = Run(BenchOptions(), reqs, reqs[:1])  # baselines ran on request 0 only
    c1 = [_rec(0, 0.0, 1.0, 4, 1000), _rec(1, 1.0, 3.0, 4, 1000)]  # TTFA = e2e / 2
    c4 = [_rec(0, 0.0, 1.0, 4, 1000), _rec(1, 0.0, 1.0, 4, 1000)]
    full = [_rec(0, 0.0, 4.0, 4, 1000)]
    run.levels = [
        _level("grpc c=1", "grpc", "sut", 1, "async_chunk", c1),
        _level("grpc c=4", "grpc", "sut", 4, "async_chunk", c4),
        _level("grpc full_payload c=1", "grpc", "sut", 1, "full_payload", full),
    ]
    inputs, basis = ratio_inputs(run, "grpc")
    ratios = compute_ratios(inputs)
    assert set(basis) == set(RATIO_KEYS)
    # Same requests only: c=1 request 0 has TTFA 0.5; full_payload request 0 has 2.0.
    assert ratios["ttfa_async_over_full"] == pytest.approx(0.25)
    # c=1: 2 requests over 4 s; c=4: 2 over 1 s.
    assert ratios["throughput_cmax_over_c1"] == pytest.approx(2.0 / 0.5)
    for skipped in ("ttfa_over_monolithic_e2e", "e2e_grpc_over_inprocess_c1",
                    "throughput_cmax_over_sequential_monolithic", "pipeline_over_bottleneck_stage"):
        assert ratios[skipped] is None


def test_request_sequence_and_schedules() -> None:
    seq = request_sequence(4, 10, seed=3)
    assert seq == request_sequence(4, 10, seed=3)
    assert sorted(seq[:4]) == [0, 1, 2, 3] and sorted(seq[4:8]) == [0, 1, 2, 3]
    assert len(seq) == 10
    offs = poisson_offsets(5, 2.0, seed=1)
    assert offs == poisson_offsets(5, 2.0, seed=1) and offs == sorted(offs) and offs[0] > 0


class _FakeDriver(Driver):
    name = "fake"

    def __init__(self) -> None:
        self.in_flight = 0
        self.most = 0

    async def run(self, req: BenchRequest) -> list[StreamEvent]:
        import time

        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        await asyncio.sleep(0.001)
        self.in_flight -= 1
        return [StreamEvent("text", time.perf_counter(), token_ids=(1,)), StreamEvent("final", time.perf_counter())]


@pytest.mark.parametrize("c", [1, 3])
def test_closed_loop_keeps_concurrency(c: int) -> None:
    drv = _FakeDriver()
    level = LevelResult(name="fake", driver="fake", role="sut", load={}, mode=None)
    asyncio.run(run_concurrency(drv, level, [_req(i) for i in range(7)], c, None))
    assert sorted(r.index for r in level.records) == list(range(7))
    assert drv.most == c
    assert all(r.ok for r in level.records)


def test_an_open_loop_level_is_timed_from_its_first_arrival() -> None:
    """Requests/s at a --rate counts from the first request issued to the last finished (as the
    closed loop does), not from the level's start: the wait for the first Poisson arrival was
    counted as time served (1.09 req/s where 1.64 was served)."""
    import time

    from benchmarks.load import run_poisson

    offsets = poisson_offsets(3, 4.0, seed=0)
    assert offsets[0] > 0.05
    level = LevelResult(name="fake", driver="fake", role="sut", load={}, mode=None)
    t = time.perf_counter()
    asyncio.run(run_poisson(_FakeDriver(), level, [_req(i) for i in range(3)], 4.0, None, seed=0))
    elapsed = time.perf_counter() - t
    assert level.wall_s is not None and level.wall_s <= elapsed - offsets[0] + 1e-3


def test_ratios_pair_requests_with_monolithic_and_inprocess() -> None:
    from benchmarks.harness import BenchOptions

    reqs = [_req(0), _req(1), _req(2)]
    run = Run(BenchOptions(), reqs, reqs[:2])
    c1 = [_rec(0, 0.0, 1.0, 4, 1000), _rec(1, 1.0, 3.0, 4, 1000), _rec(2, 4.0, 5.0, 4, 1000)]  # TTFA = e2e / 2
    mono = [_rec(0, 0.0, 2.0, 4, 1000), _rec(1, 2.0, 4.0, 4, 1000, ok=False)]  # only request 0 finished
    inproc = [_rec(0, 0.0, 0.5, 4, 1000), _rec(1, 0.5, 1.5, 4, 1000)]
    run.levels = [
        _level("grpc c=1", "grpc", "sut", 1, "async_chunk", c1),
        _level("inprocess c=1", "inprocess", "baseline", 1, "async_chunk", inproc),
        _level("monolithic sequential", "monolithic", "baseline", 1, None, mono),
    ]
    ratios = compute_ratios(ratio_inputs(run, "grpc")[0])
    assert ratios["ttfa_over_monolithic_e2e"] == pytest.approx(0.5 / 2.0)  # request 0 only
    assert ratios["e2e_grpc_over_inprocess_c1"] == pytest.approx(2.0 / 1.0)  # medians over requests 0 and 1
    # c=1 is the highest level: 3 requests over 9 s (over itself no ratio); monolithic: 1 finished over 2 s.
    assert ratios["throughput_cmax_over_c1"] is None
    assert ratios["throughput_cmax_over_sequential_monolithic"] == pytest.approx((3 / 9) / (1 / 2))
    assert ratios["ttfa_async_over_full"] is None and ratios["pipeline_over_bottleneck_stage"] is None
    # The in-process pipeline as the system under test: no gRPC figure to divide.
    assert compute_ratios(ratio_inputs(run, "inprocess")[0])["e2e_grpc_over_inprocess_c1"] is None


def test_free_port_blocks_are_free_apart_and_below_the_ephemeral_range() -> None:
    from benchmarks.harness import _ephemeral_low, free_port_blocks
    from omnistage.server.ports import port_free

    sizes, offset = [3, 1, 12], 1000
    bases = free_port_blocks(sizes, metrics_offset=offset)
    blocks = [set(range(b, b + n)) | set(range(b + offset, b + offset + n)) for b, n in zip(bases, sizes, strict=True)]
    ports = set().union(*blocks)
    assert len(ports) == sum(map(len, blocks))  # no two blocks share a port, metrics ports included
    assert all(port_free("127.0.0.1", p) for p in ports)
    if _ephemeral_low() - max(sizes) - offset > 10_000:  # room below the range: drawn there
        assert max(ports) < _ephemeral_low()


def test_throughput_baselines_are_taken_over_the_prompts_the_level_ran() -> None:
    """A baseline that ran fewer requests (--baseline-requests) ran another mix of prompts: its
    rate is turned into the rate over the level's prompts by each prompt's cost (monolithic: its
    E2E; the slowest stage: its work, here talker frames). Checked against the time each would
    take over the level's prompts, summed request by request."""
    from benchmarks.harness import BenchOptions

    prompts = [0, 1, 0, 0]
    reqs = [BenchRequest(index=i, prompt_index=p, prompt="abc", thinker_max_tokens=4, talker_max_tokens=8)
            for i, p in enumerate(prompts)]  # fmt: skip

    def rec(i: int, issued: float, e2e: float) -> RequestRecord:
        return RequestRecord(config="c", index=i, prompt_index=prompts[i], prompt_chars=1, issued_at=issued, ok=True,
                             e2e=e2e, ttft=e2e / 10, ttfa=e2e / 2, text_tokens=4, audio_samples=1000,
                             sample_rate=1000)  # fmt: skip

    run = Run(BenchOptions(), reqs, reqs[:2])  # the baselines ran prompts 0 and 1 once each
    mono_e2e = {0: 1.0, 1: 3.0}
    talker_frames = {0: 10, 1: 30}
    run.levels = [
        _level("grpc c=4", "grpc", "sut", 4, "async_chunk", [rec(i, 0.0, 1.0) for i in range(4)]),  # 4 req/s
        _level("monolithic sequential", "monolithic", "baseline", 1, None,
               [rec(0, 0.0, mono_e2e[0]), rec(1, mono_e2e[0], mono_e2e[1])]),
    ]
    talker_s = 1.0  # both baseline requests, alone on the talker
    run.stage_baseline = {"bottleneck": "talker", "bottleneck_requests_per_s": 2 / talker_s,
                          "stages": {"talker": {"frames": [talker_frames[0], talker_frames[1]]}}}  # fmt: skip
    inputs, basis = ratio_inputs(run, "grpc")
    ratios = compute_ratios(inputs)
    mono_s = sum(mono_e2e[p] for p in prompts)  # generate() over the level's prompts, one after another
    assert inputs.monolithic_requests_per_s == pytest.approx(len(prompts) / mono_s)
    assert ratios["throughput_cmax_over_sequential_monolithic"] == pytest.approx(4.0 / (len(prompts) / mono_s))
    frames_per_s = sum(talker_frames.values()) / talker_s
    stage_s = sum(talker_frames[p] for p in prompts) / frames_per_s
    assert ratios["pipeline_over_bottleneck_stage"] == pytest.approx(4.0 / (len(prompts) / stage_s))
    assert "scaled to these 4 by each prompt's median E2E" in basis["throughput_cmax_over_sequential_monolithic"]
    assert "scaled to these 4 by each prompt's frames" in basis["pipeline_over_bottleneck_stage"]

    # A prompt the baselines never ran: no cost to scale by; the rates stand as measured, and say so.
    prompts[3] = 2
    reqs[3] = replace(reqs[3], prompt_index=2)
    run.levels[0] = _level("grpc c=4", "grpc", "sut", 4, "async_chunk", [rec(i, 0.0, 1.0) for i in range(4)])
    inputs, basis = ratio_inputs(run, "grpc")
    assert inputs.monolithic_requests_per_s == pytest.approx(2 / sum(mono_e2e.values()))
    assert inputs.bottleneck_stage_requests_per_s == pytest.approx(2 / talker_s)
    assert "not scaled" in basis["throughput_cmax_over_sequential_monolithic"]
    assert "not scaled" in basis["pipeline_over_bottleneck_stage"]
