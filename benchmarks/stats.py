"""Statistics for ``omnistage bench``: percentiles, per-request figures and same-run ratios.

Pure functions over plain floats, so they are unit-tested with small synthetic inputs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SUMMARY_KEYS = ("n", "mean", "median", "p90", "p99", "min", "max")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's
    default "linear" method); None for no values."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(float(v) for v in values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    frac = pos - lo
    return xs[lo] + (xs[hi] - xs[lo]) * frac


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The value at rank int(q * n) of the sorted values (q in 0..1; NaN for no values): the
    percentile of `bench routing` and `bench pd`."""
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summarize(values: Sequence[float | None]) -> dict[str, float | int | None]:
    """n, mean, median, p90, p99, min, max of the non-None values (None figures when empty)."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"n": 0, "mean": None, "median": None, "p90": None, "p99": None, "min": None, "max": None}
    return {
        "n": len(xs),
        "mean": sum(xs) / len(xs),
        "median": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "min": xs[0] if len(xs) == 1 else min(xs),
        "max": max(xs),
    }


def real_time_factor(generation_s: float | None, audio_s: float | None) -> float | None:
    """Generation time over the duration of the audio generated (< 1: faster than real time);
    None without audio."""
    if generation_s is None or audio_s is None or audio_s <= 0:
        return None
    return generation_s / audio_s


def gaps(times: Sequence[float]) -> list[float]:
    """Differences between consecutive arrival times (the inter-chunk gaps of a stream)."""
    return [b - a for a, b in itertools.pairwise(times)]


def playback_stall(times: Sequence[float], samples: Sequence[int], sample_rate: int) -> float | None:
    """Total time a player waits for audio after it starts at the first chunk's arrival: chunk i
    arrives at `times[i]` with `samples[i]` samples; the player needs them back to back."""
    if not times or not sample_rate:
        return None
    stall, runs_dry = 0.0, times[0]
    for t, n in zip(times, samples, strict=True):
        if t > runs_dry:
            stall += t - runs_dry
            runs_dry = t
        runs_dry += n / sample_rate
    return stall


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either side was not measured (or is zero)."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


@dataclass
class RequestRecord:
    """Raw figures of one request. Times are seconds since the request was issued."""

    config: str
    index: int
    prompt_index: int
    prompt_chars: int
    issued_at: float  # seconds since the level started
    ok: bool = True
    error: str | None = None
    ttft: float | None = None
    ttfa: float | None = None
    e2e: float | None = None
    text_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    audio_samples: int = 0
    sample_rate: int = 24_000
    text_times: list[float] = field(default_factory=list)
    audio_times: list[float] = field(default_factory=list)
    audio_chunk_samples: list[int] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def audio_s(self) -> float:
        return self.audio_samples / self.sample_rate if self.sample_rate else 0.0

    @property
    def rtf(self) -> float | None:
        return real_time_factor(self.e2e, self.audio_s if self.audio_samples else None)

    @property
    def chunk_gaps(self) -> list[float]:
        return gaps(self.audio_times)

    @property
    def stall_s(self) -> float | None:
        """Seconds a client that starts playing at the first audio, and plays on at the sample
        rate, waits for audio after that (0: the stream never ran dry)."""
        return playback_stall(self.audio_times, self.audio_chunk_samples, self.sample_rate)

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "index": self.index,
            "prompt_index": self.prompt_index,
            "prompt_chars": self.prompt_chars,
            "issued_at": self.issued_at,
            "ok": self.ok,
            "error": self.error,
            "ttft": self.ttft,
            "ttfa": self.ttfa,
            "e2e": self.e2e,
            "text_tokens": self.text_tokens,
            "token_ids": self.token_ids,
            "audio_samples": self.audio_samples,
            "sample_rate": self.sample_rate,
            "audio_s": self.audio_s,
            "rtf": self.rtf,
            "text_times": self.text_times,
            "audio_times": self.audio_times,
            "audio_chunk_samples": self.audio_chunk_samples,
            "chunk_gaps": self.chunk_gaps,
            "stall_s": self.stall_s,
            "info": self.info,
        }


def throughput(records: Sequence[RequestRecord], wall_s: float | None) -> dict[str, float | None]:
    """Per-run rates over the wall time of the level (first issue to last completion)."""
    ok = [r for r in records if r.ok]
    if not ok or not wall_s or wall_s <= 0:  # nothing finished: no rate, not a rate of zero
        return {"requests_per_s": None, "audio_s_per_s": None, "text_tokens_per_s": None}
    return {
        "requests_per_s": len(ok) / wall_s,
        "audio_s_per_s": sum(r.audio_s for r in ok) / wall_s,
        "text_tokens_per_s": sum(r.text_tokens for r in ok) / wall_s,
    }


def wall_time(records: Sequence[RequestRecord]) -> float | None:
    """From the first request issued to the last one finished (seconds), over finished requests."""
    done = [r for r in records if r.ok and r.e2e is not None]
    if not done:
        return None
    start = min(r.issued_at for r in done)
    end = max(r.issued_at + (r.e2e or 0.0) for r in done)
    return end - start


def summarize_records(records: Sequence[RequestRecord], wall_s: float | None = None) -> dict[str, Any]:
    """Latency distributions (TTFT, TTFA, E2E, RTF, audio seconds, pooled inter-chunk gaps) and
    the level's rates. ``wall_s`` defaults to first issue -> last completion."""
    ok = [r for r in records if r.ok]
    if wall_s is None:
        wall_s = wall_time(records)
    pooled_gaps = [g for r in ok for g in r.chunk_gaps]
    return {
        "requests": len(records),
        "ok": len(ok),
        "failed": len(records) - len(ok),
        "wall_s": wall_s,
        "ttft_s": summarize([r.ttft for r in ok]),
        "ttfa_s": summarize([r.ttfa for r in ok]),
        "e2e_s": summarize([r.e2e for r in ok]),
        "rtf": summarize([r.rtf for r in ok]),
        "audio_s": summarize([r.audio_s for r in ok if r.audio_samples]),
        "chunk_gap_s": summarize(pooled_gaps),
        "max_chunk_gap_s": summarize([max(r.chunk_gaps) for r in ok if r.chunk_gaps]),
        "stall_s": summarize([r.stall_s for r in ok if r.audio_times]),
        **throughput(records, wall_s),
    }


RATIO_KEYS = (
    "ttfa_async_over_full",
    "ttfa_over_monolithic_e2e",
    "e2e_grpc_over_inprocess_c1",
    "throughput_cmax_over_sequential_monolithic",
    "throughput_cmax_over_c1",
    "pipeline_over_bottleneck_stage",
)


@dataclass
class RatioInputs:
    """The figures the headline ratios are made of; None where that run did not happen."""

    ttfa_median_async_c1: float | None = None  # system under test, c=1, async_chunk
    ttfa_median_full_c1: float | None = None  # system under test, c=1, full_payload
    ttfa_median_c1_vs_monolithic: float | None = None  # as the first, over the requests monolithic ran
    monolithic_e2e_median: float | None = None
    monolithic_requests_per_s: float | None = None  # sequential
    grpc_e2e_median_c1: float | None = None
    inprocess_e2e_median_c1: float | None = None
    requests_per_s_cmax: float | None = None
    requests_per_s_c1: float | None = None
    bottleneck_stage_requests_per_s: float | None = None


def compute_ratios(x: RatioInputs) -> dict[str, float | None]:
    """The six headline ratios (RATIO_KEYS), each None when one of its baselines was skipped."""
    return {
        "ttfa_async_over_full": ratio(x.ttfa_median_async_c1, x.ttfa_median_full_c1),
        "ttfa_over_monolithic_e2e": ratio(x.ttfa_median_c1_vs_monolithic, x.monolithic_e2e_median),
        "e2e_grpc_over_inprocess_c1": ratio(x.grpc_e2e_median_c1, x.inprocess_e2e_median_c1),
        "throughput_cmax_over_sequential_monolithic": ratio(x.requests_per_s_cmax, x.monolithic_requests_per_s),
        "throughput_cmax_over_c1": ratio(x.requests_per_s_cmax, x.requests_per_s_c1),
        "pipeline_over_bottleneck_stage": ratio(x.requests_per_s_cmax, x.bottleneck_stage_requests_per_s),
    }
