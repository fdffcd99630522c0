"""`omnistage.server.health_check`: grpc.health.v1 against a real server on 127.0.0.1, and the
`omnistage health` command light enough to run as a probe every few seconds."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from omnistage.server.health_check import check


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_closed_port_is_unhealthy() -> None:
    start = time.monotonic()
    assert check(f"127.0.0.1:{_free_port()}", timeout=2.0) is False
    assert time.monotonic() - start < 5


def test_serving_and_not_serving() -> None:
    async def scenario() -> tuple[bool, bool, bool]:
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            target = f"127.0.0.1:{port}"
            await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            serving = await asyncio.to_thread(check, target, 3.0)
            unknown_service = await asyncio.to_thread(check, target, 3.0, "no.such.Service")
            await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            draining = await asyncio.to_thread(check, target, 3.0)
        finally:
            await server.stop(None)
        return serving, unknown_service, draining

    serving, unknown_service, draining = asyncio.run(scenario())
    assert serving is True
    assert unknown_service is False
    assert draining is False


def test_the_health_command_loads_neither_torch_nor_transformers() -> None:
    """Docker's HEALTHCHECK and the TLS ports' Kubernetes probes run `omnistage health` every
    few seconds in each container: with torch it cost 1.5 s and 250 MB a run."""
    import subprocess
    import sys

    target = f"127.0.0.1:{_free_port()}"
    code = "\n".join([
        f"import sys; sys.argv = ['omnistage', 'health', '--target', '{target}', '--timeout', '0.2']",
        "from omnistage.cli.main import run",
        "try:\n    run()\nexcept SystemExit as e:\n    print('exit', e.code)",
        "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))",
    ])  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert "UNAVAILABLE" in out and "exit 1" in out, out  # it did check, and said so
    assert out.strip().endswith("[]"), out
