"""Entry point of the gateway process (`omnistage gateway ...`): the gRPC server
(`Gateway.Generate`, health, Info), the OpenAI-compatible HTTP server on the same event loop,
and the metrics port; SIGTERM drains both front doors."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

from gateway.server import GatewayService
from omnistage.config import DeployConfig, TlsConfig
from omnistage.models import Checkpoint
from omnistage.server.grpc_common import (
    CANCEL_BELOW_S,
    HealthState,
    add_servicer,
    bind,
    drain,
    new_server,
    wait_ended_early,
    wait_for_signal,
)
from omnistage.server.metrics import serve_metrics
from omnistage.server.ports import PortTaken
from omnistage.server.tls import server_credentials
from omnistage.v1 import gateway_pb2

log = logging.getLogger(__name__)

__all__ = ["run_gateway"]


def _http_socket(host: str, port: int) -> socket.socket:
    """The HTTP port, bound exclusively (no SO_REUSEPORT), or PortTaken naming it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say TCP (an accepted one
    # takes the listener's proto; with 0, Nagle held each small event behind the last one's
    # delayed ACK: 40 ms between a WebSocket's first events, and at the end of an SSE stream)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # not SO_REUSEPORT: a second bind fails
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise PortTaken(f"gateway HTTP: cannot listen on {host}:{port}: the port is taken by another process") from None
    sock.set_inheritable(False)
    return sock


def _http_server(app: object, sock: socket.socket, tls: TlsConfig) -> object:
    import uvicorn

    class EmbeddedServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:  # the gateway handles its own signals
            yield

    https = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file} if tls.gateway else {}
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=5,
                            **https)  # fmt: skip
    return EmbeddedServer(config)


def run_gateway(cfg: DeployConfig, ckpt: Checkpoint, host: str, port: int, thinker_target: str, *,
                http_port: int | None = None, api_key: str = "") -> None:  # fmt: skip
    async def main() -> None:
        from gateway.app import build_app

        service = GatewayService(cfg, ckpt, thinker_target, api_key=api_key)
        # clients send their media in the request: the receive limit is the media request limit
        server = new_server(max(cfg.max_message_bytes, cfg.media.max_request_bytes))
        add_servicer(service, server, gateway_pb2.DESCRIPTOR.services_by_name["Gateway"])
        health_state = HealthState(server, (gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name,))
        await health_state.set(False)  # until the thinker answers
        metrics_port = cfg.metrics_port(port)
        if metrics_port is not None:  # first: a taken port fails the start before a server is bound
            serve_metrics(service.metrics.registry, host, metrics_port, f"gateway at {host}:{port}")
        bind(server, host, port, "gateway", server_credentials(cfg.tls, stage=False, host=host))
        http_sock = _http_socket(host, http_port) if http_port else None
        await server.start()
        http = http_task = None
        if http_sock is not None:
            http = _http_server(build_app(service), http_sock, cfg.tls)
            http_task = asyncio.create_task(http.serve(sockets=[http_sock]))  # type: ignore[attr-defined]
        watcher = asyncio.create_task(service.watch_thinker(health_state))
        log.info("gateway serving gRPC on %s:%d%s -> thinker %s (metrics on %s)", host, port,
                 f", HTTP on {host}:{http_port}" if http_sock else "", thinker_target,
                 metrics_port or "off")  # fmt: skip
        await wait_for_signal()
        log.info("gateway: draining (%d requests in flight, up to %g s)", service.active, cfg.timeouts.drain_grace_s)
        service.draining = True
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await drain(health_state, lambda: service.active > 0, cfg.timeouts.drain_grace_s, server)
        await wait_ended_early(CANCEL_BELOW_S + 0.5)
        if http is not None and http_task is not None:
            http.should_exit = True  # type: ignore[attr-defined]
            with contextlib.suppress(asyncio.CancelledError):
                await http_task
            await wait_ended_early(CANCEL_BELOW_S + 0.5)  # (what the HTTP server's exit cancelled)

    asyncio.run(main())
