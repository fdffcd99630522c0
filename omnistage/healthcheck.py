"""grpc.health.v1 client for `omnistage health`: the Docker HEALTHCHECK and compose health check.

(Kubernetes probes use the kubelet's native `grpc:` probe instead; both ask the same question:
is the overall server, service name "", SERVING?)
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["check"]


def check(target: str, timeout: float = 3.0, service: str = "") -> bool:
    """True when `target` (HOST:PORT or any gRPC target) answers SERVING for `service` within
    `timeout` seconds; False on NOT_SERVING, UNKNOWN, a closed port, a timeout or any other error."""
    try:
        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=max(timeout, 0.001))
    except Exception:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
