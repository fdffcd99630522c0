"""What each process of a served stack did during a load level, read from its own Prometheus
metrics before and after the level: engine steps, mean batch size, mean step time, the share of
the level's wall time spent in steps (busy), the share of the step time the engine thread was on
a core (the rest it waited for a core or for the GIL), the CPU the process used, in cores, and
the gRPC messages it sent and received (with the CPU outside steps per message: compare
`omnistage bench grpc-floor`), and its CPU by kind of thread (the engine thread, the main
thread's event loop, gRPC's threads, the rest) and context switches (omnistage/server/thread_cpu.py).

Busy near 1 marks the stage that limits the pipeline. The CPU column shows how the processes
share the machine: on 2 cores, four processes whose cores add up to about 2 are limited by the
machine, not by any one stage.
"""

from __future__ import annotations

import time
import urllib.request
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from omnistage.server.thread_cpu import ThreadCpuCollector

__all__ = ["endpoints", "load_between", "own_snapshot", "parse_metrics", "snapshot"]

_SAMPLES = {
    "omnistage_stage_batch_size_sum": "batch_sum",
    "omnistage_stage_batch_size_count": "steps",
    "omnistage_stage_step_seconds_sum": "step_s",
    "omnistage_stage_step_cpu_seconds_total": "step_cpu_s",
    "process_cpu_seconds_total": "cpu_s",
    "omnistage_stage_messages_sent_total": "messages",
    "omnistage_stage_messages_received_total": "messages",
    "omnistage_thread_context_switches_total": "switches",  # every thread, voluntary or not
}
THREAD_CPU, THREAD_KEY = "omnistage_thread_cpu_seconds_total", "thread_cpu_s:"


def endpoints(cfg: Any) -> dict[str, list[str]]:
    """The metrics URLs of every process of the stack `cfg` describes, by role (stage names and
    `gateway`); empty when metrics are off."""
    if not cfg.metrics.enabled:
        return {}
    out: dict[str, list[str]] = {}
    ports = {d.name: cfg.stage_ports(d.name) for d in cfg.chain()}
    ports["gateway"] = [cfg.gateway.port + i for i in range(cfg.gateway.replicas)]
    for role, plist in ports.items():
        out[role] = [f"http://{cfg.address(cfg.metrics_port(p))}/metrics" for p in plist]
    return out


def _scrape(url: str, timeout: float) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # loopback only: the bench's own stack
        return parse_metrics(resp.read().decode())


def parse_metrics(text: str) -> dict[str, float]:
    """The figures this module reads from one process's metrics page, summed over their labels
    (threads: one figure per kind)."""
    got: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = _SAMPLES.get(sample.name)
            if sample.name == THREAD_CPU:  # one figure per kind of thread
                key = f"{THREAD_KEY}{sample.labels.get('thread', 'other')}"
            if key is not None:
                got[key] = got.get(key, 0.0) + float(sample.value)
    return got


def snapshot(eps: dict[str, list[str]], timeout: float = 2.0) -> dict[str, dict[str, float]] | None:
    """Each role's figures summed over its replicas (and their count, `replicas`); None if any
    process did not answer."""
    out: dict[str, dict[str, float]] = {}
    try:
        for role, urls in eps.items():
            total: dict[str, float] = {"replicas": float(len(urls))}
            for url in urls:
                for k, v in _scrape(url, timeout).items():
                    total[k] = total.get(k, 0.0) + v
            out[role] = total
    except OSError:
        return None
    return out


def own_snapshot(threads: ThreadCpuCollector) -> dict[str, float]:
    """This process's figures (the bench client's), as a stack process's metrics give them: its
    CPU, all of its threads, and the same by kind of thread, with their context switches."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(threads)  # read the way a stack process's page is: one mapping, parse_metrics'
    return {**parse_metrics(generate_latest(registry).decode()), "cpu_s": time.process_time()}


def load_between(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]],
                 wall_s: float) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Per role, what happened between two snapshots `wall_s` apart."""
    out: dict[str, dict[str, Any]] = {}
    for role, end in after.items():
        start = before.get(role, {})

        def delta(key: str, _end: dict[str, float] = end, _start: dict[str, float] = start) -> float | None:
            return _end[key] - _start.get(key, 0.0) if key in _end else None

        steps, batch, step_s, cpu = delta("steps"), delta("batch_sum"), delta("step_s"), delta("cpu_s")
        step_cpu, messages = delta("step_cpu_s"), delta("messages")
        threads = {k.removeprefix(THREAD_KEY): delta(k) for k in end if k.startswith(THREAD_KEY)}
        outside = max(0.0, cpu - step_cpu) if cpu is not None and step_cpu is not None else None
        out[role] = {
            "steps": steps,
            "mean_batch": batch / steps if steps and batch is not None else None,
            "mean_step_ms": 1000 * step_s / steps if steps and step_s is not None else None,
            # a replica's share of the level in steps, the mean over the role's replicas (summed, two
            # half-busy replicas read as one saturated one)
            "busy": step_s / wall_s / end.get("replicas", 1.0) if step_s is not None and wall_s > 0 else None,
            # the engine thread's share of its step time on a core: the rest it waited (a core, the GIL)
            "step_on_cpu": step_cpu / step_s if step_cpu is not None and step_s else None,
            "cpu_cores": cpu / wall_s if cpu is not None and wall_s > 0 else None,
            # the process's CPU outside engine steps: its event loop (gRPC, encoding, relaying) and the rest
            # (at least 0: process CPU counts in clock ticks, the engine thread's more finely)
            "cpu_outside_steps": max(0.0, 1 - step_cpu / cpu) if step_cpu is not None and cpu else None,
            # gRPC messages sent and received (every hop), and the CPU outside steps per message
            "messages": messages,
            "us_outside_per_message": 1e6 * outside / messages if outside is not None and messages else None,
            # CPU seconds by kind of thread (engine, main: the event loop, grpc, other) and context switches
            "thread_cpu_s": threads or None,
            "context_switches": delta("switches"),
        }
    return out
