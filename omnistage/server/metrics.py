"""Prometheus metrics (prefix `omnistage_`, base units, `_total` counters): every process serves
its own registry on its metrics port (the process's port + `metrics.port_offset`), bound to the
configured host; the gateway's is also at `/metrics` on its HTTP port.

A stage's metrics, each labelled with `stage`:
  omnistage_stage_queue_depth                 requests held (waiting + waiting for input + running);
                                              what each stage's HorizontalPodAutoscaler scales on
  omnistage_stage_requests{state}             requests by state
  omnistage_stage_batch_size                  histogram: requests per engine step
  omnistage_stage_step_seconds                histogram: time of one engine step
  omnistage_stage_step_cpu_seconds_total      CPU time the engine thread spent in steps (below the
                                              steps' time when it waited for a core or the GIL)
  omnistage_stage_output_{unit}_total         tokens (thinker), frames (talker), samples (code2wav) made
  omnistage_stage_requests_opened_total       requests opened
  omnistage_stage_requests_finished_total{outcome}  requests the engine ended: ok, CANCELLED (by the
                                              caller), or the status they failed with
  omnistage_stage_messages_{sent,received}_total  gRPC messages, every hop and direction (each costs
                                              the process CPU outside its steps: `bench grpc-floor`)
  omnistage_stage_kv_cache_usage_ratio        reserved KV-cache tokens / capacity (0 when unbounded)
  omnistage_stage_kv_held_tokens              of those, the tokens of ended requests whose outputs
                                              wait to be sent (a prefill role's KV)
  omnistage_stage_kv_pool_tokens              positions per layer fast batching's pooled KV buffers
                                              hold (a pool's memory, reservations aside; 0 when idle)
  omnistage_stage_prefix_cache_tokens         positions the thinker's prefix cache keeps of ended
                                              requests (thinker.prefix_cache_tokens)
  omnistage_stage_prompt_tokens_total{source} prompt tokens: prefilled (run through a step), or
                                              cached (in a request's cache when it was admitted: a
                                              prefix cache's hit, a decode role's handed-off prompt)
  omnistage_stage_open_streams                Stage.Stream calls now open (a request's call stays open
                                              until its output is all sent and its caller has closed)
  omnistage_stage_shm_segments                shared-memory segments this process holds
  omnistage_stage_shm_inline_fallbacks_total  large blobs sent inline because the pool was full (or
                                              the request over its share): size /dev/shm by it
  omnistage_stage_replay_bytes                what requests keep of what they sent downstream, to
                                              replay it on another replica (failover)
  omnistage_stage_replay_memory_full_total    requests no longer replayable on their hop because the
                                              process's failover.replay_memory_bytes was full
  omnistage_stage_downstream_replicas_out     replicas of the stage below out of the rotation: health
                                              polls unanswered (frozen; routing.Router.heard)
and prometheus_client's process metrics (process_cpu_seconds_total, process_resident_memory_bytes, ...),
and, in every process, the same CPU by kind of thread (thread_cpu.py):
  omnistage_thread_cpu_seconds_total{thread}  engine, main (the event loop), grpc, other
  omnistage_thread_context_switches_total{thread, switch}  voluntary, involuntary
The gateway's are in gateway/metrics.py (`GatewayMetrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from omnistage.server.ports import PortTaken, port_free
from omnistage.server.thread_cpu import ThreadCpuCollector

__all__ = ["StageMetrics", "serve_metrics"]

BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def serve_metrics(registry: CollectorRegistry, host: str, port: int, role: str) -> None:
    """Serve `registry` on `host:port` (HTTP, /metrics), or raise PortTaken naming the role."""
    taken = PortTaken(f"{role} metrics: cannot listen on {host}:{port}: the port is taken by another process")
    if not port_free(host, port):
        raise taken
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError:
        raise taken from None


class StageMetrics:
    """A stage's registry; the engine reports each step to `on_step` (it is its StepObserver),
    and the load figures are read from `load()` and `shm_segments()` on each scrape."""

    def __init__(self, stage: str, unit: str, load: Callable[[], dict[str, float]],
                 shm_segments: Callable[[], int], requests_total: Callable[[], int],
                 shm_fallbacks: Callable[[], int] = lambda: 0, replay_bytes: Callable[[], int] = lambda: 0,
                 replay_refusals: Callable[[], int] = lambda: 0, messages_sent: Callable[[], int] = lambda: 0,
                 messages_received: Callable[[], int] = lambda: 0,
                 open_streams: Callable[[], int] = lambda: 0,
                 replicas_out: Callable[[], int] = lambda: 0) -> None:  # fmt: skip
        self.registry = registry = CollectorRegistry()
        ProcessCollector(registry=registry)  # process_cpu_seconds_total and friends (Linux)
        registry.register(ThreadCpuCollector())  # the same by kind of thread: engine, event loop, gRPC
        labels = ["stage"]
        depth = Gauge("omnistage_stage_queue_depth", "Requests held by the stage (waiting + running)", labels,
                      registry=registry)  # fmt: skip
        by_state = Gauge("omnistage_stage_requests", "Requests by state", [*labels, "state"], registry=registry)
        cache = Gauge("omnistage_stage_kv_cache_usage_ratio", "Reserved KV-cache tokens over the capacity", labels,
                      registry=registry)  # fmt: skip
        held = Gauge("omnistage_stage_kv_held_tokens", "KV-cache tokens reserved for ended requests whose outputs "
                     "wait to be sent", labels, registry=registry)  # fmt: skip
        pooled = Gauge("omnistage_stage_kv_pool_tokens", "Positions per layer the pooled KV buffers of fast "
                       "batching hold", labels, registry=registry)  # fmt: skip
        prefixes = Gauge("omnistage_stage_prefix_cache_tokens", "Positions the prefix cache keeps of ended "
                         "requests", labels, registry=registry)  # fmt: skip
        shm = Gauge("omnistage_stage_shm_segments", "Shared-memory segments held", labels, registry=registry)
        streams = Gauge("omnistage_stage_open_streams", "Stage.Stream calls now open", labels, registry=registry)
        replay = Gauge("omnistage_stage_replay_bytes", "Bytes requests keep of what they sent downstream, for "
                       "failover replay", labels, registry=registry)  # fmt: skip
        out = Gauge("omnistage_stage_downstream_replicas_out", "Replicas of the stage below out of the rotation: "
                    "their health polls unanswered", labels, registry=registry)  # fmt: skip
        registry.register(_CounterOnScrape("omnistage_stage_requests_opened", "Requests opened", stage,
                                           requests_total))  # fmt: skip
        registry.register(_PromptTokens(stage, load))
        for way, read in (("sent", messages_sent), ("received", messages_received)):
            registry.register(_CounterOnScrape(f"omnistage_stage_messages_{way}", f"gRPC messages {way}, every hop",
                                               stage, read))  # fmt: skip
        registry.register(_CounterOnScrape("omnistage_stage_shm_inline_fallbacks", "Large blobs sent inline "
                                           "because the shared-memory pool was full or the request over its share",
                                           stage, shm_fallbacks))  # fmt: skip
        registry.register(_CounterOnScrape("omnistage_stage_replay_memory_full", "Requests no longer replayable "
                                           "on their hop because failover.replay_memory_bytes was full", stage,
                                           replay_refusals))  # fmt: skip
        self._batch = Histogram("omnistage_stage_batch_size", "Requests per engine step", labels,
                                buckets=BATCH_BUCKETS, registry=registry).labels(stage)  # fmt: skip
        self._step = Histogram("omnistage_stage_step_seconds", "Engine step time", labels, buckets=STEP_BUCKETS,
                               registry=registry).labels(stage)  # fmt: skip
        self._step_cpu = Counter("omnistage_stage_step_cpu_seconds", "CPU time of the engine thread in steps", labels,
                                 registry=registry).labels(stage)  # fmt: skip
        self._produced = Counter(f"omnistage_stage_output_{unit}", f"Output {unit} made", labels,
                                 registry=registry).labels(stage)  # fmt: skip
        self._finished = Counter("omnistage_stage_requests_finished", "Requests ended here, by outcome (ok, or a "
                                 "status name)", [*labels, "outcome"], registry=registry)  # fmt: skip
        self._stage = stage

        def queue_depth() -> float:
            counts = load()
            return float(counts["waiting"] + counts["waiting_for_input"] + counts["running"])

        depth.labels(stage).set_function(queue_depth)
        for state in ("running", "waiting", "waiting_for_input"):
            by_state.labels(stage, state).set_function(lambda s=state: float(load()[s]))
        cache.labels(stage).set_function(lambda: float(load()["cache_usage"]))
        held.labels(stage).set_function(lambda: float(load()["held_tokens"]))
        pooled.labels(stage).set_function(lambda: float(load()["kv_pool_tokens"]))
        prefixes.labels(stage).set_function(lambda: float(load()["prefix_cache_tokens"]))
        shm.labels(stage).set_function(lambda: float(shm_segments()))
        streams.labels(stage).set_function(lambda: float(open_streams()))
        replay.labels(stage).set_function(lambda: float(replay_bytes()))
        out.labels(stage).set_function(lambda: float(replicas_out()))

    def on_step(self, batch_size: int, seconds: float, cpu_seconds: float, produced: int) -> None:
        self._batch.observe(batch_size)
        self._step.observe(seconds)
        self._step_cpu.inc(cpu_seconds)
        if produced:
            self._produced.inc(produced)

    def on_finished(self, outcome: str) -> None:
        self._finished.labels(self._stage, outcome).inc()


class _PromptTokens(Collector):
    """Prompt tokens prefilled and cached, read from the engine's totals on each scrape."""

    def __init__(self, stage: str, load: Callable[[], dict[str, float]]) -> None:
        self.stage, self.load = stage, load

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("omnistage_stage_prompt_tokens", "Prompt tokens prefilled (run through a "
                                     "step) or cached (in a request's cache when admitted)",
                                     labels=["stage", "source"])  # fmt: skip
        counts = self.load()
        family.add_metric([self.stage, "prefilled"], float(counts["prefill_tokens_total"]))
        family.add_metric([self.stage, "cached"], float(counts["cached_tokens_total"]))
        yield family


class _CounterOnScrape(Collector):
    """A counter whose value is read from its owner on each scrape."""

    def __init__(self, name: str, doc: str, stage: str, read: Callable[[], int]) -> None:
        self.name, self.doc, self.stage, self.read = name, doc, stage, read

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.doc, labels=["stage"])
        family.add_metric([self.stage], float(self.read()))
        yield family
