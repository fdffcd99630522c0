"""Keepalive on the hops (grpc_common): pings find a frozen peer, and never fail a healthy call
that is merely quiet (a stage waiting on a long step sends nothing for seconds)."""

from __future__ import annotations

import asyncio
import socket

import grpc

from omnistage.server.grpc_common import channel_options, new_server

QUIET_S = 4.0
PING_S = 0.25  # the caller pings 16 times while the server says nothing


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _quiet_call(server: grpc.aio.Server, port: int) -> tuple[str, bytes]:
    async def slow(request_iterator: object, context: grpc.aio.ServicerContext) -> object:
        async for _ in request_iterator:  # type: ignore[attr-defined]
            await asyncio.sleep(QUIET_S)  # a long step: nothing on the wire
            yield b"done"
            return

    handler = grpc.method_handlers_generic_handler(
        "test.Quiet", {"Call": grpc.stream_stream_rpc_method_handler(slow)})  # fmt: skip
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options(1 << 20, PING_S)) as ch:
            async def requests() -> object:
                yield b"go"
                await asyncio.sleep(QUIET_S + 1)

            call = ch.stream_stream("/test.Quiet/Call")(requests(), timeout=20)
            try:
                got = [r async for r in call]
            except grpc.aio.AioRpcError as e:
                return e.code().name, (e.details() or "").encode()
            return "OK", b"".join(got)
    finally:
        await server.stop(None)


def test_a_quiet_call_outlives_many_pings() -> None:
    """A caller pinging every 0.25 s, a server silent for 4 s: the call completes. (A server
    with gRPC's default ping policy ends it UNAVAILABLE "Too many pings" about 3 s in: checked
    by hand with grpcio 1.85, `_quiet_call(grpc.aio.server(), port)`.)"""
    async def go() -> tuple[str, bytes]:
        return await _quiet_call(new_server(1 << 20, keepalive_s=1.0), _port())

    assert asyncio.run(go()) == ("OK", b"done")
