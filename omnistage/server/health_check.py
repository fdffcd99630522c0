"""The grpc.health.v1 client: `omnistage health` (the Docker HEALTHCHECK and the Kubernetes
probes of TLS ports run it every few seconds), `serve`'s start-up wait. It imports grpc and
nothing heavy: a probe that loaded torch took 1.5 s and 250 MB each time."""

from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["check", "health_status", "stage_role"]


def check(target: str, timeout: float = 3.0, service: str = "", credentials: grpc.ChannelCredentials | None = None,
          options: list[tuple[str, Any]] | None = None) -> bool:  # fmt: skip
    """True when `target` answers SERVING for `service` within `timeout` seconds; False on
    NOT_SERVING, UNKNOWN, a closed port, a timeout or any other error."""
    return health_status(target, timeout, service, credentials, options) == "SERVING"


def health_status(target: str, timeout: float = 3.0, service: str = "",
                  credentials: grpc.ChannelCredentials | None = None,
                  options: list[tuple[str, Any]] | None = None) -> str:  # fmt: skip
    """`target`'s grpc.health.v1 answer for `service` ("SERVING", "NOT_SERVING", ...), or a
    short reason it gave none ("UNAVAILABLE", "DEADLINE_EXCEEDED", ...). With `credentials`
    over TLS."""
    try:
        with _channel(target, credentials, options) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=max(timeout, 0.001))
    except grpc.RpcError as e:
        return e.code().name if isinstance(e, grpc.Call) else "ERROR"
    except Exception:
        return "ERROR"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def stage_role(target: str, timeout: float = 3.0, credentials: grpc.ChannelCredentials | None = None,
               options: list[tuple[str, Any]] | None = None) -> str | None:  # fmt: skip
    """The role a stage process at `target` says it runs (`Stage.Info`: "thinker",
    "thinker-prefill", ...), or None when it gives none (not a stage, down, ...)."""
    from omnistage.v1 import stage_pb2, stage_pb2_grpc

    try:
        with _channel(target, credentials, options) as channel:
            info = stage_pb2_grpc.StageStub(channel).Info(stage_pb2.InfoRequest(), timeout=max(timeout, 0.001))
    except Exception:
        return None
    return info.role or None


def _channel(target: str, credentials: grpc.ChannelCredentials | None, options: list[tuple[str, Any]] | None
             ) -> grpc.Channel:  # fmt: skip
    """A blocking channel to `target`, over TLS with `credentials`."""
    if credentials is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, credentials, options=options)
