"""Prometheus metrics of a stage (prefix `omnistage_`), served on OMNISTAGE_METRICS_PORT when set.

`omnistage_stage_queue_depth` (waiting + waiting for input + running) is what each stage's
HorizontalPodAutoscaler scales on (deploy/k8s)."""

from __future__ import annotations

import os
from collections.abc import Callable

from prometheus_client import Gauge, start_http_server

QUEUE_DEPTH = Gauge("omnistage_stage_queue_depth", "Requests held by the stage (waiting + running)", ["stage"])
REQUESTS = Gauge("omnistage_stage_requests", "Requests by state", ["stage", "state"])


def start_metrics_server(stage: str, load: Callable[[], dict[str, int]]) -> int | None:
    """Expose the engine's load on OMNISTAGE_METRICS_PORT; returns the port (None when unset)."""
    raw = os.environ.get("OMNISTAGE_METRICS_PORT", "")
    if not raw:
        return None
    port = int(raw)

    def depth() -> float:
        counts = load()
        return float(counts["waiting"] + counts["waiting_for_input"] + counts["running"])

    QUEUE_DEPTH.labels(stage).set_function(depth)
    for state in ("running", "waiting", "waiting_for_input"):
        REQUESTS.labels(stage, state).set_function(lambda s=state: float(load()[s]))
    start_http_server(port)
    return port
