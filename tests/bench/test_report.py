"""The bench report's saturation reading: where requests/s stops growing, against the slowest
stage alone."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.report import format_saturation, saturation


def _result(rates: dict[int, float], limit: float = 10.0) -> dict[str, Any]:
    configs = [{"role": "sut", "mode": "async_chunk", "load": {"type": "concurrency", "value": c},
                "summary": {"requests_per_s": r, "ttfa_s": {"p99": c / 10}}} for c, r in rates.items()]  # fmt: skip
    configs.append({"role": "sut", "mode": "full_payload", "load": {"type": "concurrency", "value": 1},
                    "summary": {"requests_per_s": 99.0, "ttfa_s": {"p99": 1.0}}})  # fmt: skip
    return {"configurations": configs, "stage_baseline": {"bottleneck": "talker", "bottleneck_requests_per_s": limit}}


def test_saturation_is_the_first_level_at_nine_tenths_of_the_best() -> None:
    sat = saturation(_result({16: 8.1, 1: 1.0, 4: 3.9, 8: 7.5, 32: 7.7, 64: 8.3}))  # 7.5 >= 0.9 * 8.3
    assert sat is not None and sat["saturated"]
    assert sat["concurrency"] == 8 and sat["requests_per_s"] == 7.5
    assert sat["of_bottleneck_alone"] == 0.75
    assert [lv["concurrency"] for lv in sat["levels"]] == [1, 4, 8, 16, 32, 64]  # full_payload left out
    assert "saturates at c=8: 7.50 req/s, 0.75 of the slowest stage alone (talker)" in format_saturation(
        _result({1: 1.0, 4: 3.9, 8: 7.5, 16: 8.1, 32: 7.7, 64: 8.3}))


def test_the_cpu_ceiling_is_the_cores_over_the_core_seconds_a_request_costs() -> None:
    result = _result({1: 1.0, 4: 3.0, 8: 4.0})
    result["machine"] = {"affinity_cpus": 2, "torch_threads": 1}
    result["stage_baseline"]["stages"] = {"thinker": {"requests_per_s": 20.0}, "talker": {"requests_per_s": 10.0},
                                          "code2wav": {"requests_per_s": 20.0}}  # 0.05 + 0.1 + 0.05 core-s
    result["configurations"][2]["stage_load"] = {  # c=8: 0.4 cores besides the stages at 4 req/s
        "talker": {"steps": 10.0, "cpu_cores": 0.9}, "gateway": {"steps": None, "cpu_cores": 0.3},
        "bench client": {"steps": None, "cpu_cores": 0.1}}  # fmt: skip
    cap = saturation(result)["cpu_ceiling"]
    assert cap["stages_core_s_per_request"] == pytest.approx(0.2)
    assert cap["others_core_s_per_request"] == pytest.approx(0.1)
    assert cap["requests_per_s"] == pytest.approx(2 / 0.3) and cap["of_bottleneck_alone"] == pytest.approx(2 / 3)
    assert "CPU ceiling on 2 cores: 6.67 req/s, 0.67 of the slowest alone" in format_saturation(result)
    result["machine"]["torch_threads"] = 4  # then a stage alone is not one core: no ceiling
    assert saturation(result)["cpu_ceiling"] is None
    result["machine"]["torch_threads"] = 1
    result["configurations"][2]["stage_load"] = None  # a stack at --target: its processes' CPU not read
    assert saturation(result)["cpu_ceiling"] is None  # (it printed them as 0.0 ms)
    assert "CPU ceiling" not in format_saturation(_result({1: 1.0, 4: 3.0}))


def test_a_sweep_still_growing_at_its_last_level_is_not_called_saturated() -> None:
    sat = saturation(_result({1: 1.0, 4: 3.0, 8: 5.0}))
    assert sat is not None and not sat["saturated"] and sat["concurrency"] == 8
    assert "still growing at c=8" in format_saturation(_result({1: 1.0, 4: 3.0, 8: 5.0}))
    assert saturation(_result({1: 1.0})) is None


def test_stage_load_divides_the_metrics_difference_by_the_level() -> None:
    from benchmarks.report import format_stage_load
    from benchmarks.stage_load import load_between

    threads = {"thread_cpu_s:engine": 0.4, "thread_cpu_s:main": 4.0, "thread_cpu_s:grpc": 0.5}
    before = {"talker": {"steps": 10.0, "batch_sum": 20.0, "step_s": 1.0, "step_cpu_s": 0.5, "cpu_s": 5.0,
                         "messages": 100.0, **threads, "switches": 1000.0}, "gateway": {"cpu_s": 1.0}}  # fmt: skip
    after = {"talker": {"steps": 110.0, "batch_sum": 820.0, "step_s": 4.0, "step_cpu_s": 2.9, "cpu_s": 8.6,
                        "messages": 1300.0, "thread_cpu_s:engine": 2.8, "thread_cpu_s:main": 5.0,
                        "thread_cpu_s:grpc": 0.6, "switches": 1800.0}, "gateway": {"cpu_s": 1.4}}  # fmt: skip
    load = load_between(before, after, 4.0)
    assert load["talker"].pop("thread_cpu_s") == pytest.approx({"engine": 2.4, "main": 1.0, "grpc": 0.1})
    assert load["talker"] == pytest.approx({"steps": 100.0, "mean_batch": 8.0, "mean_step_ms": 30.0, "busy": 0.75,
                                            "step_on_cpu": 0.8, "cpu_cores": 0.9,
                                            "cpu_outside_steps": 1 - 2.4 / 3.6, "messages": 1200.0,
                                            "us_outside_per_message": 1e6 * 1.2 / 1200,
                                            "context_switches": 800.0})  # fmt: skip
    load["talker"]["thread_cpu_s"] = {"engine": 2.4, "main": 1.0, "grpc": 0.1}
    assert load["gateway"]["steps"] is None and load["gateway"]["cpu_cores"] == pytest.approx(0.1)
    assert load["gateway"]["messages"] is None and load["gateway"]["us_outside_per_message"] is None
    assert load["gateway"]["thread_cpu_s"] is None and load["gateway"]["context_switches"] is None
    levels = [{"name": "grpc c=16", "stage_load": load, "summary": {"ok": 4}}, {"name": "x"}]
    text = format_stage_load({"machine": {"affinity_cpus": 2}, "configurations": levels})
    assert "grpc c=16: talker busy 0.75 batch 8.0 step 30.0 ms (80% on a core) cpu 0.90 (33% outside steps), " \
           "300 messages a request (1000 us each outside steps), by thread engine 600.0, main 250.0, grpc 25.0 ms " \
           "a request, 200 context switches a request; gateway cpu 0.10; all 1.00 cores of 2" in text  # fmt: skip
    assert format_stage_load({"configurations": [{"name": "x"}]}) == ""


def test_stage_load_endpoints_cover_every_replica_and_role() -> None:
    from benchmarks.stage_load import endpoints
    from omnistage.config import apply_overrides, parse_config

    cfg = apply_overrides(parse_config({}), {"talker.replicas": 2, "talker.base_port": 7200, "gateway.port": 7000,
                                                  "gateway.http_port": 7050})
    eps = endpoints(cfg)
    assert eps["talker"] == ["http://127.0.0.1:8200/metrics", "http://127.0.0.1:8201/metrics"]
    assert eps["gateway"] == ["http://127.0.0.1:8000/metrics"]
    assert set(eps) == {"thinker", "talker", "code2wav", "gateway"}
    assert endpoints(apply_overrides(cfg, {"metrics.enabled": False})) == {}


def test_a_levels_line_gives_its_figures_as_it_ends() -> None:
    """Logged when the level ends, before the report: a run killed later keeps them."""
    from benchmarks.report import level_line
    from benchmarks.stats import summarize

    summary = {"requests": 3, "ok": 2, "ttft_s": summarize([0.01, 0.03]), "ttfa_s": summarize([0.1, 0.3]),
               "e2e_s": summarize([1.0, 2.0]), "rtf": summarize([0.5, 0.5]), "stall_s": summarize([0.0]),
               "requests_per_s": 2.5, "audio_s_per_s": None, "text_tokens_per_s": 40.0}  # fmt: skip
    line = level_line("grpc c=4", summary)
    assert line.startswith("grpc c=4: ok 2/3, ")
    assert "TTFA p50 0.200" in line and "E2E p50 1.500" in line and "req/s 2.50" in line
    assert "audio s/s -" in line and "stall p99 0.000" in line
