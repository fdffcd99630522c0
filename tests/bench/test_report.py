"""The bench report's saturation reading: where requests/s stops growing, against the slowest
stage alone."""

from __future__ import annotations

from typing import Any

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


def test_a_sweep_still_growing_at_its_last_level_is_not_called_saturated() -> None:
    sat = saturation(_result({1: 1.0, 4: 3.0, 8: 5.0}))
    assert sat is not None and not sat["saturated"] and sat["concurrency"] == 8
    assert "still growing at c=8" in format_saturation(_result({1: 1.0, 4: 3.0, 8: 5.0}))
    assert saturation(_result({1: 1.0})) is None
