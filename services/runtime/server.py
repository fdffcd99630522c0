"""The gRPC side of a stage: `Stage.Stream` (one bidirectional call per request), `Info`,
grpc.health.v1, reflection, the downstream call and relaying its chunks upward, and drain.

Message flow for one request on a stage with a downstream:
  caller --Start, chunks--> [reader task] --feed--> engine thread --step--> worker
  engine --up chunks--> out_q --> yielded to the caller (tagged with this stage)
  engine --Start, down chunks--> down_q --> downstream call
  downstream responses --> out_q (relayed unchanged) --> caller
Received messages are parsed by wire_view (inline tensor payloads stay in the received bytes,
decoded without a copy; a relayed response goes up as the bytes it came in).
The call ends when this stage's own work and the downstream call have both finished. A
cancelled or failed call aborts the request here (the engine frees its state) and cancels the
downstream call, so the abort travels down the chain by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from omnistage.v1 import stage_pb2, stage_pb2_grpc
from services.runtime.engine import DOWN_DONE, SELF_DONE, Engine, OpenDownstream, OutChunk, StageError, invalid
from services.runtime.shm import ShmPool, default_reader, peer_accepts_shm
from services.runtime.tensor_blob import ChunkAssembler, LazyChunk, TensorBlobError, encode_lazy_chunks
from services.runtime.wire_view import Outgoing, Received, add_stage_servicer, stage_stream

log = logging.getLogger(__name__)


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Spread calls over every address of a target (replica list or headless Service).
        ("grpc.lb_policy_name", "round_robin"),
        ("grpc.enable_retries", 0),
    ]


class StageService(stage_pb2_grpc.StageServicer):
    def __init__(
        self,
        engine: Engine,
        *,
        model_name: str,
        arch: str,
        device: str,
        dtype: str,
        downstream: str | None,
        downstream_name: str | None,
        max_message_bytes: int,
        shm: bool,
    ) -> None:
        self.engine = engine
        self.stage = engine.worker.stage
        self.model_name = model_name
        self.arch = arch
        self.device = device
        self.dtype = dtype
        self.downstream = downstream
        self.downstream_name = downstream_name or "downstream"
        self.max_message_bytes = max_message_bytes
        self.pool = ShmPool(enabled=shm)
        self.reader = default_reader() if shm else None
        self.open_streams = 0
        self.requests_total = 0
        self.draining = False
        self._channel: grpc.aio.Channel | None = None

    def _downstream_stream(self) -> Any:
        if self._channel is None:
            assert self.downstream is not None
            self._channel = grpc.aio.insecure_channel(self.downstream, options=channel_options(self.max_message_bytes))
        return stage_stream(self._channel)

    def _encode(self, out: OutChunk, seq: int, pool: ShmPool | None, request_id: str) -> list[LazyChunk]:
        meta = dict(out.meta)
        meta["n"] = out.n
        return encode_lazy_chunks(
            out.tensors,
            max_bytes=self.max_message_bytes - 1024,
            offset=out.offset,
            seq=seq,
            finished=out.finished,
            meta=meta,
            pool=pool,
            request_id=request_id,
        )

    # ---- Info -----------------------------------------------------------------------------

    async def Info(self, request: stage_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> stage_pb2.InfoResponse:
        load = self.engine.load()
        cap = self.engine.worker.capacity()
        sched = self.engine.scheduler.config
        cap.setdefault("max_num_seqs", sched.max_num_seqs)
        cap.setdefault("max_num_batched_tokens", sched.max_num_batched_tokens)
        cap.setdefault("kv_cache_tokens", sched.cache_capacity_tokens or 0)
        return stage_pb2.InfoResponse(
            model=self.model_name,
            arch=self.arch,
            role=self.stage,
            device=self.device,
            dtype=self.dtype,
            capacity=stage_pb2.Capacity(max_message_bytes=self.max_message_bytes, **cap),
            load=stage_pb2.Load(
                running=load["running"],
                waiting=load["waiting"],
                waiting_for_input=load["waiting_for_input"],
                cache_usage=load["cache_usage"],
                steps_total=load["steps_total"],
                step_requests_total=load["step_requests_total"],
                open_streams=self.open_streams,
                shm_segments=self.pool.num_segments,
                requests_total=self.requests_total,
            ),
        )

    # ---- Stream ---------------------------------------------------------------------------

    async def Stream(
        self, request_iterator: AsyncIterator[Received[stage_pb2.StageRequest]], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Outgoing | Received[stage_pb2.StageResponse] | stage_pb2.StageResponse]:
        if self.draining:
            # Read what the caller already sent first: a call the server ends while the client
            # is still writing surfaces as INTERNAL on the client instead of this status.
            await self._discard_inputs(request_iterator, limit_s=2.0)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.stage}: draining, not accepting new requests")
        if self.reader is not None:
            await context.send_initial_metadata(self.reader.accept(context.invocation_metadata()))
        else:
            await context.send_initial_metadata(())
        self.open_streams += 1
        req = None
        tasks: list[asyncio.Task[Any]] = []
        down_call: Any = None
        try:
            try:
                first = (await anext(aiter(request_iterator))).message
            except StopAsyncIteration:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self.stage}: stream closed before Start")
            if first.WhichOneof("kind") != "start":
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{self.stage}: the first message must be Start, got a chunk"
                )
            try:
                req = self.engine.open(first.start, asyncio.get_running_loop())
            except StageError as e:
                await context.abort(e.code, e.message)
            self.requests_total += 1
            tasks.append(asyncio.create_task(self._read_inputs(req, request_iterator)))
            pending = {"self"}
            seq = 0
            while pending:
                item = await req.out_q.get()
                if item is SELF_DONE:
                    pending.discard("self")
                elif item is DOWN_DONE:
                    pending.discard("down")
                elif isinstance(item, StageError):
                    await context.abort(item.code, item.message)
                elif isinstance(item, Received | stage_pb2.StageResponse):  # relayed from downstream, unchanged
                    yield item
                elif isinstance(item, OutChunk):
                    for chunk in self._encode(item, seq, None, req.request_id):
                        seq += 1
                        yield Outgoing(stage_pb2.StageResponse(stage=self.stage), chunk)
                elif isinstance(item, OpenDownstream):
                    pending.add("down")
                    down_call = self._open_downstream(req, item.start, context)
                    tasks.append(asyncio.create_task(self._relay(req, down_call)))
            # Done: end the call only once the caller has half-closed (same race as above; e.g.
            # the talker reaching its frame limit while the thinker still sends tokens).
            remaining = context.time_remaining()
            await asyncio.wait({tasks[0]}, timeout=remaining if remaining is not None else 60.0)
        finally:
            self.open_streams -= 1
            if req is not None:
                self.engine.abort(req)  # no-op when already finished
                self.pool.release_request(req.request_id)
            if down_call is not None and not down_call.done():
                down_call.cancel()
            for t in tasks:
                t.cancel()

    async def _read_inputs(self, req: Any, request_iterator: AsyncIterator[Received[stage_pb2.StageRequest]]) -> None:
        assembler = ChunkAssembler(reader=self.reader)
        try:
            async for msg in request_iterator:
                if msg.message.WhichOneof("kind") != "chunk":
                    raise invalid(f"{self.stage}: a second Start on one stream")
                decoded = assembler.push(msg.message.chunk, msg.views)
                if decoded is not None:
                    self.engine.feed(req, decoded)
            self.engine.finish_input(req)
        except TensorBlobError as e:
            self._fail(req, invalid(f"{self.stage}: {e}"))
        except StageError as e:
            self._fail(req, e)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass

    @staticmethod
    async def _discard_inputs(request_iterator: AsyncIterator[Any], limit_s: float) -> None:
        async def drain() -> None:
            async for _ in request_iterator:
                pass

        with contextlib.suppress(asyncio.TimeoutError, grpc.aio.AioRpcError, asyncio.CancelledError):
            await asyncio.wait_for(drain(), timeout=limit_s)

    def _fail(self, req: Any, err: StageError) -> None:
        self.engine.abort(req)
        req.out_q.put_nowait(err)

    # ---- downstream -----------------------------------------------------------------------

    def _open_downstream(self, req: Any, start: stage_pb2.Start, context: grpc.aio.ServicerContext) -> Any:
        """One call per request to the downstream stage; its lifetime is this request's."""
        timeout = context.time_remaining()
        call = self._downstream_stream()(
            self._down_messages(req, start),
            timeout=timeout,
            metadata=self.pool.invocation_metadata() if self.pool.enabled else None,
        )
        req.down_call = call
        return call

    async def _down_messages(
        self, req: Any, start: stage_pb2.Start
    ) -> AsyncIterator[stage_pb2.StageRequest | Outgoing]:
        yield stage_pb2.StageRequest(start=start)
        seq = 0
        accepted: bool | None = None  # shared memory, decided once the peer's metadata is known
        while True:
            item = await req.down_q.get()
            if item is None:
                return
            if req.down_call is not None and req.down_call.done():
                continue  # the downstream finished first (e.g. the talker hit its limit): drop
            if accepted is None:
                accepted = False
                if self.pool.enabled and req.down_call is not None:
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        accepted = peer_accepts_shm(await req.down_call.initial_metadata())
            for chunk in self._encode(item, seq, self.pool if accepted else None, req.request_id):
                seq += 1
                yield Outgoing(stage_pb2.StageRequest(), chunk)

    async def _relay(self, req: Any, call: Any) -> None:
        try:
            async for resp in call:
                req.out_q.put_nowait(resp)
            req.out_q.put_nowait(DOWN_DONE)
        except grpc.aio.AioRpcError as e:
            # Also when we cancelled it ourselves: then nobody reads out_q any more.
            code = e.code()
            detail = e.details() or ""
            if code in (grpc.StatusCode.UNAVAILABLE,) and not detail.startswith(self.downstream_name):
                detail = f"{self.downstream_name} unavailable at {self.downstream}: {detail}"
            self._fail(req, StageError(code, detail))


class StageServer:
    """A running stage process: server, health, reflection, engine; drains on SIGTERM."""

    def __init__(self, service: StageService, host: str, port: int, drain_grace_s: float) -> None:
        self.service = service
        self.host = host
        self.port = port
        self.drain_grace_s = drain_grace_s

    async def start(self) -> int:
        # created inside the running event loop (grpc.aio binds to it)
        self.health = health.aio.HealthServicer()
        options = [
            *channel_options(self.service.max_message_bytes)[:2],
            # Clients re-resolve DNS when a connection ends: cycling connections lets new
            # replicas (HPA scale-up) receive calls; in-flight calls get the grace to finish.
            ("grpc.max_connection_age_ms", 60_000),
            ("grpc.max_connection_age_grace_ms", int(1000 * max(self.drain_grace_s, 600))),
        ]
        self.server = grpc.aio.server(options=options)
        add_stage_servicer(self.service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (
            stage_pb2.DESCRIPTOR.services_by_name["Stage"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, self.server)
        port = self.server.add_insecure_port(f"{self.host}:{self.port}")
        if port == 0:
            raise OSError(f"{self.service.stage}: cannot listen on {self.host}:{self.port}")
        await self.server.start()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        return port

    async def _set_health(self, status: int) -> None:
        for name in ("", "omnistage.v1.Stage"):
            await self.health.set(name, status)

    async def drain(self) -> None:
        """Stop taking new calls, let in-flight requests finish (up to the grace), then stop."""
        self.service.draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + self.drain_grace_s
        while self.service.open_streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.server.stop(grace=1.0)
        self.service.engine.stop()
        self.service.pool.close()

    async def serve_forever(self) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("%s: draining", self.service.stage)
        await self.drain()
