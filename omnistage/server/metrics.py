"""Prometheus metrics (prefix `omnistage_`): every process serves its own registry on its
metrics port (the process's port + `metrics.port_offset`), bound to the configured host.

`omnistage_stage_queue_depth` (waiting + waiting for input + running) is what each stage's
HorizontalPodAutoscaler scales on (deploy/k8s)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from omnistage.server.grpc_common import PortTaken, port_free

__all__ = ["serve_metrics", "stage_metrics"]


def serve_metrics(registry: CollectorRegistry, host: str, port: int, role: str) -> None:
    """Serve `registry` on `host:port` (HTTP, /metrics), or raise PortTaken naming the role."""
    taken = PortTaken(f"{role} metrics: cannot listen on {host}:{port}: the port is taken by another process")
    if not port_free(host, port):
        raise taken
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError:
        raise taken from None


def stage_metrics(stage: str, load: Callable[[], dict[str, float]]) -> CollectorRegistry:
    """A stage's registry: queue depth and requests by state, read from the engine on scrape."""
    registry = CollectorRegistry()
    depth = Gauge("omnistage_stage_queue_depth", "Requests held by the stage (waiting + running)", ["stage"],
                  registry=registry)  # fmt: skip
    by_state = Gauge("omnistage_stage_requests", "Requests by state", ["stage", "state"], registry=registry)

    def queue_depth() -> float:
        counts = load()
        return float(counts["waiting"] + counts["waiting_for_input"] + counts["running"])

    depth.labels(stage).set_function(queue_depth)
    for state in ("running", "waiting", "waiting_for_input"):
        by_state.labels(stage, state).set_function(lambda s=state: float(load()[s]))
    return registry
