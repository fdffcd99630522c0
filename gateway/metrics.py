"""The gateway's Prometheus metrics (prefix `omnistage_gateway_`, base units), served on its
metrics port and at `/metrics` on its HTTP port:

  omnistage_gateway_requests_total{api, outcome}      requests by front door and outcome: ok, or a gRPC
                                                      status name, over HTTP too (http_api.refusal_outcome)
  omnistage_gateway_requests_in_flight
  omnistage_gateway_time_to_first_token_seconds       histogram
  omnistage_gateway_time_to_first_audio_seconds       histogram
  omnistage_gateway_request_duration_seconds          histogram: end to end
  omnistage_gateway_real_time_factor                  histogram: generation time / audio duration
  omnistage_gateway_audio_chunk_gap_seconds           histogram: between audio chunks of a request
  omnistage_gateway_prompt_tokens_total, _completion_tokens_total (text), _audio_seconds_total
  omnistage_gateway_replays_total                     thinker calls made again after a replica was lost
  omnistage_gateway_media_cache_lookups_total{result} decoded media reused (hit) or decoded (miss)
  omnistage_gateway_media_cache_bytes                 what the decoded media kept take (media_cache.py)
  omnistage_gateway_thinker_replicas_out              thinker replicas out of the rotation: health polls
                                                      unanswered (frozen; routing.Router.heard)
  omnistage_thread_cpu_seconds_total{thread}, omnistage_thread_context_switches_total{thread, switch}
                                                      by kind of thread (omnistage/server/thread_cpu.py)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from omnistage.server.thread_cpu import ThreadCpuCollector

__all__ = ["GatewayMetrics", "Outcome"]

# up to past timeouts.request_timeout_s (600 s): a quantile over requests that ran to their deadline
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0)
GAP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0)


@dataclass
class Outcome:
    """What the access log and the metrics say of one request (times since it arrived)."""

    request_id: str
    t0: float  # time.perf_counter() at arrival
    stage_request_id: str = ""  # what the stages know it by (see GatewayService._start)
    api: str = "grpc"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    audio_samples: int = 0  # samples of the reply's audio (time-stretched by its speed: what the client hears)
    audio_sent: int = 0  # of those, covered by the audio chunks sent so far
    ttft: float | None = None
    ttfa: float | None = None
    audio_times: list[float] = field(default_factory=list)
    finish_reason: str = ""
    status: str = "ok"
    error: str = ""  # the status's message when it failed (for the access log)
    shed: bool = False  # refused at once over gateway.max_in_flight: counted, not a latency


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # process_cpu_seconds_total and friends (Linux)
        r.register(ThreadCpuCollector())  # the same by kind of thread: the event loop, gRPC, other
        self.requests = Counter("omnistage_gateway_requests", "Requests by front door and outcome",
                                ["api", "outcome"], registry=r)  # fmt: skip
        self.in_flight = Gauge("omnistage_gateway_requests_in_flight", "Requests in flight", registry=r)
        self.ttft = Histogram("omnistage_gateway_time_to_first_token_seconds", "Time to the first text token",
                              buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.ttfa = Histogram("omnistage_gateway_time_to_first_audio_seconds", "Time to the first audio chunk",
                              buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram("omnistage_gateway_request_duration_seconds", "Request time, end to end",
                             buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.rtf = Histogram("omnistage_gateway_real_time_factor", "Generation time over the audio's duration",
                             buckets=RTF_BUCKETS, registry=r)  # fmt: skip
        self.gap = Histogram("omnistage_gateway_audio_chunk_gap_seconds", "Time between audio chunks of a request",
                             buckets=GAP_BUCKETS, registry=r)  # fmt: skip
        self.prompt_tokens = Counter("omnistage_gateway_prompt_tokens", "Prompt tokens", registry=r)
        self.completion_tokens = Counter("omnistage_gateway_completion_tokens", "Generated text tokens", registry=r)
        self.audio_seconds = Counter("omnistage_gateway_audio_seconds", "Audio generated", registry=r)
        self.replays = Counter("omnistage_gateway_replays", "Thinker calls made again after a replica was lost",
                               registry=r)  # fmt: skip
        self.media_cache = Counter("omnistage_gateway_media_cache_lookups", "Media parts looked up among the "
                                   "decoded ones kept, by result (hit, miss)", ["result"], registry=r)  # fmt: skip
        self.media_cache_bytes = Gauge("omnistage_gateway_media_cache_bytes", "Bytes of decoded media kept",
                                       registry=r)  # fmt: skip
        self.thinker_replicas_out = Gauge("omnistage_gateway_thinker_replicas_out", "Thinker replicas out of the "
                                          "rotation: their health polls unanswered", registry=r)  # fmt: skip

    def media_lookup(self, hit: bool) -> None:
        self.media_cache.labels("hit" if hit else "miss").inc()

    def observe(self, o: Outcome, e2e: float, sample_rate: int) -> None:
        self.requests.labels(o.api, o.status).inc()
        if o.shed:
            return
        self.e2e.observe(e2e)
        self.prompt_tokens.inc(o.prompt_tokens)
        self.completion_tokens.inc(o.completion_tokens)
        if o.ttft is not None:
            self.ttft.observe(o.ttft)
        if o.ttfa is not None:
            self.ttfa.observe(o.ttfa)
        for a, b in zip(o.audio_times, o.audio_times[1:], strict=False):
            self.gap.observe(b - a)
        if o.audio_samples:
            seconds = o.audio_samples / sample_rate
            self.audio_seconds.inc(seconds)
            self.rtf.observe(e2e / seconds)
