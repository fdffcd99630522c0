"""What one streamed message costs in grpc.aio on this machine (`omnistage bench grpc-floor`).

Every token, frame chunk and audio chunk of a request is a gRPC message on a bidirectional stream
between two stage processes, and every relayed chunk is one more per hop. This measures the floor
under that: a server process that answers each request message with one response (as a stage
relays), a client in this process that streams `--messages` requests of `--payload` bytes on one
call, and the CPU time each side spent per message it sent and received. Nothing of omnistage
runs but its generated stubs, so the figure is what any stage pays per message before its own
work (encoding, the engine handoff).

Loopback only; the count is bounded by `--messages` and each run by `--timeout` seconds.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import grpc

from omnistage.v1 import stage_pb2, stage_pb2_grpc, tensor_pb2

MAX_MESSAGES = 200_000


class _Echo(stage_pb2_grpc.StageServicer):
    async def Stream(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        async for _ in request_iterator:
            yield stage_pb2.StageResponse(stage="echo")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _serve(conn: Any) -> None:
    """The server process: sends its port, then, when asked, the CPU it used since it was ready."""

    async def main() -> None:
        server = grpc.aio.server()
        stage_pb2_grpc.add_StageServicer_to_server(_Echo(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ready = _cpu_s()
        conn.send(port)
        loop = asyncio.get_running_loop()
        while True:
            msg = await loop.run_in_executor(None, conn.recv)
            if msg == "cpu":
                conn.send(_cpu_s() - ready)
            else:
                break
        await server.stop(None)

    asyncio.run(main())


async def _stream(port: int, messages: int, payload: int, timeout: float) -> tuple[int, float, float]:
    request = stage_pb2.StageRequest(chunk=tensor_pb2.Chunk(offset=1))
    request.chunk.meta["pad"].string_value = "x" * payload  # a token chunk's size, in one field

    async def requests() -> Any:
        for _ in range(messages):
            yield request

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = stage_pb2_grpc.StageStub(channel)
        await channel.channel_ready()
        wall0, cpu0 = time.perf_counter(), _cpu_s()
        got = 0
        async for _ in stub.Stream(requests(), timeout=timeout):
            got += 1
        return got, time.perf_counter() - wall0, _cpu_s() - cpu0


def measure(messages: int = 20_000, payload: int = 600, repeats: int = 3, timeout: float = 60.0) -> dict[str, Any]:
    if not 1 <= messages <= MAX_MESSAGES:
        raise ValueError(f"--messages must be in 1..{MAX_MESSAGES}, got {messages}")
    ctx = mp.get_context("spawn")  # a fresh interpreter: no gRPC state forked from this one
    parent, child = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(child,), daemon=True)
    server.start()
    runs = []
    try:
        if not parent.poll(timeout):
            raise RuntimeError(f"the echo server did not start within {timeout:g} s")
        port = parent.recv()
        asyncio.run(_stream(port, min(messages, 1000), payload, timeout))  # warm-up: connection, code paths
        for _ in range(repeats):
            parent.send("cpu")
            server_before = parent.recv()
            got, wall, client_cpu = asyncio.run(_stream(port, messages, payload, timeout))
            parent.send("cpu")
            server_cpu = parent.recv() - server_before
            if got != messages:
                raise RuntimeError(f"{got} responses to {messages} messages")
            runs.append({"messages": got, "wall_s": wall, "client_cpu_s": client_cpu, "server_cpu_s": server_cpu,
                         "client_us_per_message": 1e6 * client_cpu / got,
                         "server_us_per_message": 1e6 * server_cpu / got,
                         "messages_per_s": got / wall})  # fmt: skip
    finally:
        parent.send("stop")
        server.join(5)
        if server.is_alive():
            server.kill()
    med = {k: statistics.median(r[k] for r in runs) for k in
           ("client_us_per_message", "server_us_per_message", "messages_per_s")}  # fmt: skip
    return {"messages": messages, "payload_bytes": payload, "repeats": repeats, "runs": runs, "median": med,
            "cpu_count": os.cpu_count(), "grpc": grpc.__version__}  # fmt: skip


def main(messages: int, payload: int, repeats: int, json_out: Path | None) -> None:
    result = measure(messages, payload, repeats)
    med = result["median"]
    print(f"grpc.aio bidi stream on loopback, {messages} messages of ~{payload} bytes, each answered by one "
          f"(median of {repeats}): client {med['client_us_per_message']:.0f} us CPU per message sent and its "
          f"answer received, server {med['server_us_per_message']:.0f} us; {med['messages_per_s']:.0f} messages/s "
          f"(grpc {result['grpc']}, {result['cpu_count']} CPUs)")  # fmt: skip
    if json_out:
        json_out.write_text(json.dumps(result, indent=2))
