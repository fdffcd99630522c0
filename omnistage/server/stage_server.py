"""The gRPC side of a stage: `Stage.Stream` (one bidirectional call per request), `Info`, the
downstream call, relaying its chunks upward, and drain.

Message flow for one request on a stage with a downstream:
  caller --Start, chunks--> [reader task] --feed--> engine thread --execute--> worker
  engine --StepOutput--> the call's queue: up chunks to the caller (tagged with this stage),
                                          down chunks to the downstream call (opened by the first)
  downstream responses --> relayed to the caller as the bytes they came in (never parsed here)
The call ends when this stage's own work and the downstream call have both finished. A
cancelled or failed call aborts the request here (the engine frees its state) and ends the
downstream call (a Cancel message, or a gRPC cancel once its input is all sent), so the abort
travels down the chain by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
import torch
from google.protobuf.message import DecodeError

from omnistage.config import TlsConfig
from omnistage.engine import Engine, OutChunk, Request, StepOutput
from omnistage.server.grpc_common import (
    CANCEL_BELOW_S,
    REPLAY_BACKOFF_S,
    STAGE_SERVICE,
    ChainWatcher,
    Endings,
    HealthState,
    add_stage_servicer,
    bind,
    drain,
    failure_status,
    grpc_code,
    lost_peer,
    new_server,
    read_to_end,
    stage_stream,
    wait_for_signal,
)
from omnistage.server.handoff import LoopHandoff
from omnistage.server.routing import Router, replica_addresses, unserved
from omnistage.server.tls import name_override, server_credentials, stage_channel_credentials
from omnistage.topology import PROCESSES, stage_def, stages_below
from omnistage.v1 import stage_pb2
from omnistage.wire import ChunkAssembler, Code, LazyChunk, StageError, TensorBlobError, encode_chunks, invalid
from omnistage.wire.resume import Resume, Seen
from omnistage.wire.shm import CallShmReader, ShmPool, ShmReader, peer_accepts_shm
from omnistage.wire.tensor_blob import LENGTH_KEY, get_meta
from omnistage.wire.wire_view import Outgoing, Received, Undecodable, failure_of, failure_response, parse_response
from services.edges import check_start, downstream_start

log = logging.getLogger(__name__)

_DOWN_DONE = object()  # on a call's queue: the downstream call has ended well
_OPEN_DOWN = object()  # on a call's queue: open the downstream call now (the request's first step starts)


class _Finished:
    """On a call's queue: the engine is done with the request (`error` when it failed)."""

    __slots__ = ("error",)

    def __init__(self, error: StageError | None) -> None:
        self.error = error


def _nbytes(out: OutChunk) -> int:
    return sum(t.nelement() * t.element_size() for t in out.tensors.values())


def _size(item: Any) -> int:
    """Bytes an item on a call's queue holds (what backpressure counts)."""
    if isinstance(item, bytes):
        return len(item)
    if isinstance(item, StepOutput):
        return sum(_nbytes(out) for out in item.up)
    if isinstance(item, Outgoing):
        return item.chunk.chunk.ByteSize() + sum(len(payload) for _, _, payload in item.chunk.lazy)
    return 0


async def host_ready(out: OutChunk) -> None:
    """A CUDA step's outputs are copied to pinned host memory on a side stream (the engine's
    device copy); wait for that copy off the event loop: a blocking synchronize here would
    stall every call of the stage meanwhile. Nothing to wait for on CPU or once it is done."""
    ready = out.ready  # read once: another waiter may clear it meanwhile
    if ready is not None and not ready.query():
        await asyncio.to_thread(out.wait)
    out.wait()  # done (or nothing to wait for): clears `ready`


# A cancelled call's messages end (as a close does) a moment before its handler is cancelled:
# 0.05-0.11 ms apart on an idle loop here. An early close is a protocol error only once this has
# passed, counted in short sleeps: after a stall past all of it (the process not scheduled, or its
# loop held up: seen once in a suite run on the loaded 2-core machine, a cancel on code2wav counted
# INVALID_ARGUMENT), most of it is still to come, so the cancel delivered just after lands first.
# The stages and the gateway send a Cancel message first (grpc_common.CancellableInput for the
# gateway), which no stall confuses; this is for other callers and a stage's last-resort cancel.
CANCEL_GRACE_S = 0.25
CANCEL_GRACE_STEPS = 25


class _Call:
    """One Stage.Stream call: where the engine's outputs for its request go (an EngineSink)."""

    _serial = 0
    sends_later = True  # the service tells the engine when a request's last output has left

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.handoff = LoopHandoff.of(loop)  # the engine thread's way to the loop (one wake-up a step)
        _Call._serial += 1
        self.serial = _Call._serial
        self.out_q: asyncio.Queue[Any] = asyncio.Queue()
        self.posted = self.relayed = self.taken = 0  # outputs handed over / taken (see congested)
        self.posted_bytes = self.relayed_bytes = self.taken_bytes = 0
        self.room = asyncio.Event()
        self.down: _DownBuffer | None = None  # what goes to the downstream stage (kept for replay)
        self.down_call: Any = None
        self.attempt = 0  # the downstream call's attempt: 0, then one more per replay
        self.down_start: stage_pb2.Start | None = None
        self.down_was_serving = False  # its replica served when the call was opened (see _replica_back)
        self.wait_ended = ""  # how a replay's last wait for a replica ended (Router.wait_after_loss)
        self.down_ever_served = False  # a replica served one of its downstream calls when opened
        self.failed = False  # the request failed: its input is read and dropped until the call ends
        self.closing = False  # the call has ended: what comes from below is read and dropped until it ends too
        # set once the request's cache is reserved, or it ended (a worker that holds its input until then)
        self.admitted = asyncio.Event()

    # Outputs waiting for the caller to take them: past either bound the engine pauses the
    # request and the relay stops reading from downstream (backpressure).
    MAX_PENDING = 64
    MAX_PENDING_BYTES = 8 << 20

    def _post(self, item: Any) -> None:
        self.posted += 1  # these two written by the engine thread only
        self.posted_bytes += _size(item)
        self.handoff.post(self.out_q.put_nowait, item)

    def _over(self) -> bool:
        items = self.posted + self.relayed - self.taken
        nbytes = self.posted_bytes + self.relayed_bytes - self.taken_bytes
        return items >= self.MAX_PENDING or nbytes >= self.MAX_PENDING_BYTES

    def congested(self) -> bool:
        return self._over()

    async def get(self) -> Any:
        item = await self.out_q.get()
        self.taken += 1  # these written by the event loop only
        self.taken_bytes += _size(item)
        if not self._over():
            self.room.set()
        return item

    async def relay(self, item: Any) -> None:
        """Queue a relayed item once there is room (the caller is reading); drop it once the
        call has ended (nobody reads the queue)."""
        while self._over() and not self.closing:
            self.room.clear()
            await self.room.wait()
        if not self.closing:
            self.put_now(item)

    def put_now(self, item: Any) -> None:
        """Queue an item at once (errors must get through), counted like the others."""
        self.relayed += 1
        self.relayed_bytes += _size(item)
        self.out_q.put_nowait(item)

    def error_after_done(self) -> StageError | None:
        """A failure queued once the call stopped reading its queue (the caller's input went
        wrong after this stage had finished its work)."""
        while not self.out_q.empty():
            item = self.out_q.get_nowait()
            if isinstance(item, StageError):
                return item
        return None

    def on_output(self, req: Request, out: StepOutput) -> None:
        # Most talker steps send nothing (frames go down in chunks): posting them would only
        # wake the event loop (its end comes as _Finished)
        if out.up or out.down:
            self._post(out)

    def on_finished(self, req: Request) -> None:
        self._post(_Finished(req.error))
        self.on_admitted(req)  # a reader held back reads (and drops) the rest

    def on_started(self, req: Request) -> None:
        self._post(_OPEN_DOWN)

    def on_admitted(self, req: Request) -> None:
        self.handoff.post(self.admitted.set)


class ReplayMemory:
    """What all of one stage process's requests keep of what they sent downstream, for replay,
    against `budget` bytes (`failover.replay_memory_bytes`): the per-request bound alone lets
    `gateway.max_in_flight` requests keep 64 MiB each. Used on the event loop only."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.held = 0
        self.refusals = 0  # requests that stopped being replayable because it was full

    def take(self, nbytes: int) -> bool:
        if self.held + nbytes > self.budget:
            self.refusals += 1
            return False
        self.held += nbytes
        return True

    def give(self, nbytes: int) -> None:
        self.held -= nbytes


_CANCEL_BELOW = object()  # in a _DownBuffer: the request ended early; send a Cancel and end the call


class _DownBuffer:
    """What one request sends downstream, in order (None: its end), read by index so a replayed
    call can send it all again. Kept while it fits `budget` bytes and the process's `memory`;
    past either the request can no longer be replayed on this hop (`why` says which) and what
    was sent is dropped. With `replayable` false (failover off) nothing is kept: each item is
    dropped once the call below has taken it."""

    def __init__(self, budget: int, memory: ReplayMemory | None = None, replayable: bool = True) -> None:
        self.items: list[OutChunk | None] = []
        self.first = 0  # index of items[0] (earlier ones dropped)
        self.nbytes = 0  # kept for replay, counted in `memory`
        self.budget = budget
        self.memory = memory or ReplayMemory(budget)
        self.replayable = replayable
        self.why = "" if replayable else "failover is off (failover.attempts: 0)"  # why it is not replayable
        self.closed = False
        self.cancelling = False  # the reader sends a Cancel next, whatever is queued (close(cancel=True))
        self.end_taken = False  # the reader has taken the end (None): the call below is half-closed
        self._added = asyncio.Event()

    def put(self, item: OutChunk | None) -> None:
        if self.closed:  # (nothing reads it any more)
            return
        self.items.append(item)
        if item is not None and self.replayable:
            nbytes = _nbytes(item)
            if self.nbytes + nbytes > self.budget:
                self._give_up(f"the request sent more than failover.replay_budget_bytes ({self.budget})")
            elif not self.memory.take(nbytes):
                self._give_up(f"the stage's replay memory is full (failover.replay_memory_bytes: "
                              f"{self.memory.budget})")
            else:
                self.nbytes += nbytes
        added, self._added = self._added, asyncio.Event()
        added.set()

    def _give_up(self, why: str) -> None:
        self.replayable, self.why = False, why
        self.memory.give(self.nbytes)
        self.nbytes = 0

    def close(self, cancel: bool = False) -> bool:
        """The request's call has ended: hand back what is counted, count nothing more, and end
        the reader waiting for more (else gRPC's task sending the downstream call's messages,
        parked in `get`, outlived a failed call until garbage collection, which logged errors).
        `cancel` (the call below still open): unless its end was taken, the reader's next item is
        a Cancel, ahead of whatever is still queued (the stage below would read all of it first).
        Returns whether a Cancel goes."""
        if cancel and not self.closed and not self.end_taken:
            self.cancelling = True
        if self.replayable:
            self._give_up("its call has ended")
        self.closed = True
        self._added.set()
        return self.cancelling

    def replay(self) -> None:
        """A new call below sends it all again: its end is not taken there yet."""
        self.end_taken = False

    async def get(self, index: int) -> Any:
        """Item `index`, once there is one (None also for an index already dropped: only a
        superseded attempt's reader, which sends nothing more, can ask for one; and once closed);
        _CANCEL_BELOW once cancelling."""
        while not self.cancelling and index >= self.first + len(self.items):
            if self.closed:
                return None
            await self._added.wait()
        if self.cancelling:
            return _CANCEL_BELOW
        return self.items[index - self.first] if index >= self.first else None

    def taken(self, index: int) -> None:
        """The current attempt has taken item `index`: drop it and those before it when nobody
        will need them again (a superseded attempt's reader must not: the replay still reads them)."""
        if not self.replayable and index >= self.first:
            del self.items[: index + 1 - self.first]
            self.first = index + 1


class StageService:
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
        edge_mode: int,
        max_message_bytes: int,
        shm: bool,
        replay_budget_bytes: int = 64 << 20,
        replay_memory_bytes: int = 1 << 30,
        failover_attempts: int = 3,
        replica_wait_s: float = 30.0,
        routing: str = "round_robin",
        tls: TlsConfig | None = None,
        below: Sequence[str] | None = None,
        keepalive_s: float = 0.0,
    ) -> None:
        """`below`: the stage processes after this one in the chain, in order (default: those
        of the colocated pipeline)."""
        self.engine = engine
        self.stage = engine.worker.name
        known = self.stage in PROCESSES
        self.stream = stage_def(self.stage).stream if known else self.stage  # a role tags as its part
        self.below = stages_below(self.stage) if below is None else tuple(below)
        # parts sampled below this stage: each gets a pinned seed (replays sample the same stream)
        parts = (stage_def(n).stream for n in self.below)
        self.sampled_below = tuple(dict.fromkeys(p for p in parts if p != self.stream))
        self.model_name = model_name
        self.arch = arch
        self.device = device
        self.dtype = dtype
        self.downstream = downstream
        self.downstream_name = downstream_name or "downstream"
        self.edge_mode = edge_mode
        self.max_message_bytes = max_message_bytes
        self.routing = routing
        self.tls = tls or TlsConfig()
        self.replay_budget_bytes = replay_budget_bytes
        self.replay_memory = ReplayMemory(replay_memory_bytes)
        self.failover_attempts = failover_attempts
        self.replica_wait_s = replica_wait_s
        self.keepalive_s = keepalive_s
        self.pool = ShmPool(enabled=shm)
        self.reader = ShmReader(enabled=shm)
        self.open_streams = 0
        self.requests_total = 0
        # gRPC messages this process sent and received, both directions and every hop (metrics)
        self.messages_sent = self.messages_received = 0
        self.draining = False
        self._ending = Endings()  # calls below being ended (_end_below)
        self._router: Router | None = None
        self.watcher: ChainWatcher | None = None  # the stages below, polled (see start_watching)

    def _downstream(self) -> Router:
        if self._router is None:  # made inside the running event loop (grpc.aio binds to it)
            assert self.downstream is not None
            self._router = Router(self.downstream, self.routing, self.max_message_bytes,
                                  stage_channel_credentials(self.tls), name_override(self.tls),
                                  self.keepalive_s)  # fmt: skip
        return self._router

    def downstream_replicas_out(self) -> int:
        """Replicas of the stage below that routing leaves out (their health polls unanswered)."""
        return len(self._router.unanswering) if self._router is not None else 0

    def start_watching(self) -> asyncio.Task[None] | None:
        """Poll the downstream stage's health (and the chain below it) for Info."""
        if self.downstream is None:
            return None
        router = self._downstream()
        self.watcher = ChainWatcher(router.health_channels(), self.downstream_name, self.downstream,
                                    again=replica_addresses(self.downstream) is None,
                                    on_answer=router.heard)  # fmt: skip

        async def on_poll() -> None:  # a replica serves again, seen by no request: the window is over
            if self.watcher is not None and self.watcher.serving:
                router.served()

        return asyncio.create_task(self.watcher.run(on_poll))

    async def _encode(self, out: OutChunk, seq: int, pool: ShmPool | None, request_id: str,
                      live: Callable[[], bool] | None = None) -> list[LazyChunk]:  # fmt: skip
        """`live`: whether the call is still there once the host copy is ready (else no shared
        memory: the request's may have been freed meanwhile, and nobody would free it again)."""
        await host_ready(out)
        if live is not None and not live():
            pool = None
        return encode_chunks(
            out.tensors,
            max_bytes=self.max_message_bytes - 1024,
            offset=out.offset,
            length=out.length,
            seq=seq,
            finished=out.finished,
            meta=out.meta,
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
                step_seconds_total=load["step_seconds_total"],
                kv_pool_tokens=load["kv_pool_tokens"],
            ),
            serving=not self.draining,
            chain=self.watcher.chain if self.watcher is not None else [],
        )

    # ---- Stream ---------------------------------------------------------------------------

    async def Stream(
        self,
        request_iterator: AsyncIterator[Received[stage_pb2.StageRequest] | Undecodable],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[Outgoing | bytes | stage_pb2.StageResponse]:
        if self.draining:
            refusal = StageError(Code.UNAVAILABLE, f"{self.stage}: draining, not accepting new requests")
            yield self._failure(refusal)
            await self._reject(context, request_iterator, refusal)
        ack, shm_reader = self.reader.accept_call(context.invocation_metadata())
        await context.send_initial_metadata(ack)
        self.open_streams += 1
        req: Request | None = None
        call = _Call(asyncio.get_running_loop())
        tasks: list[asyncio.Task[Any]] = []
        try:
            wait = self.engine.input_wait_timeout_s or None  # a caller that sends no Start holds a stream
            try:
                received = await asyncio.wait_for(anext(aiter(request_iterator)), wait)
            except StopAsyncIteration:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self.stage}: stream closed before Start")
            except TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"{self.stage}: no Start within "
                                    f"{wait:g} s of opening the call (timeouts.input_wait_timeout_s)")  # fmt: skip
            if isinstance(received, Undecodable):
                refusal = self._undecodable(received, 1)
                yield self._failure(refusal)
                await self._reject(context, request_iterator, refusal)
            first = received.message
            if first.WhichOneof("kind") != "start":
                got = {"chunk": "a chunk", "cancel": "a Cancel"}.get(first.WhichOneof("kind") or "", "an empty message")
                refusal = invalid(f"{self.stage}: the first message must be Start, got {got}")
                yield self._failure(refusal)
                await self._reject(context, request_iterator, refusal)
            start = first.start
            try:
                check_start(self.stage, start)
            except StageError as e:
                yield self._failure(e)
                await self._reject(context, request_iterator, e)
            deadline = None
            if start.deadline_unix_s > 0:
                deadline = time.monotonic() + (start.deadline_unix_s - time.time())
            try:
                # Known here by its id and this call: an id may be open twice, e.g. a replay from
                # a new caller while the lost caller's call (frozen, not yet noticed) is still open.
                req = self.engine.open(f"{start.request_id}#{call.serial}", start, call, deadline, start.request_id)
            except StageError as e:
                yield self._failure(e)
                await self._reject(context, request_iterator, e)
            self.requests_total += 1
            self.messages_received += 1  # the Start
            tasks.append(asyncio.create_task(self._read_inputs(req, call, request_iterator, shm_reader)))
            pending = {"self"}
            seq = 0
            while pending:
                item = await call.get()
                if isinstance(item, (bytes, Outgoing)):  # relayed from downstream (unchanged or resumed)
                    self.messages_sent += 1
                    yield item
                elif isinstance(item, StepOutput):
                    for out in item.up:
                        for chunk in await self._encode(out, seq, None, req.request_id):
                            seq += 1
                            self.messages_sent += 1
                            yield Outgoing(stage_pb2.StageResponse(stage=self.stream), chunk)
                    if item.down:
                        self._begin_downstream(req, call, context, pending, tasks)
                    for out in item.down:
                        assert call.down is not None
                        call.down.put(out)
                        if out.finished:
                            call.down.put(None)
                elif isinstance(item, _Finished):
                    if item.error is not None:
                        yield self._failure(item.error)
                        await self._end_with(context, call, tasks[0], item.error)
                    pending.discard("self")
                elif item is _DOWN_DONE:
                    pending.discard("down")
                elif item is _OPEN_DOWN and self.downstream is not None:
                    self._begin_downstream(req, call, context, pending, tasks)
                elif isinstance(item, StageError):
                    yield self._failure(item)
                    await self._end_with(context, call, tasks[0], item)
            # Done: end the call only once the caller has half-closed (same race as above; e.g.
            # the talker reaching its frame limit while the thinker still sends tokens).
            remaining = context.time_remaining()
            await asyncio.wait({tasks[0]}, timeout=remaining if remaining is not None else 60.0)
            late = call.error_after_done()
            if late is not None:  # the caller sent something wrong after this stage's work ended
                yield self._failure(late)
                await context.abort(grpc_code(late.code), late.message)
        finally:
            self.open_streams -= 1
            # Ended early, the call below still open: before its input's end, a Cancel tells it
            # (a gRPC cancel would look like an early close there); after it, a cancel cannot
            below = call.down_call is not None and not call.down_call.done()
            call.closing = True
            call.room.set()  # (a relay waiting for room drops what it has)
            tell = call.down is not None and call.down.close(cancel=below)
            if req is not None:
                self.engine.abort(req)  # no-op when already finished
                self.engine.sent(req)  # whatever it had not sent will not be
                if not below:  # (else once the call below has ended: what is in flight points at them)
                    self.pool.release_request(req.request_id)
            for t in tasks[:1]:  # the reader
                t.cancel()
            if below:  # (cancelling the relay would cancel the call below: grpc aio does on a cancelled read)
                if not tell:
                    call.down_call.cancel()
                self._ending.start(self._end_below(call, tasks[1:], req))
            else:
                for t in tasks[1:]:
                    t.cancel()

    async def _end_below(self, call: _Call, relay: list[asyncio.Task[Any]], req: Request | None) -> None:
        """Once the call below has ended (after the Cancel, the relay reads and drops what it
        still sends: its status comes only after them), or after CANCEL_BELOW_S: cancel what is
        left, and free the request's shared memory (the stage below has read what it sent)."""
        try:
            waiting = [t for t in relay if not t.done()]
            if not waiting and call.down_call is not None and not call.down_call.done():
                # (the relay stopped early: on a bad response from below)
                waiting = [asyncio.ensure_future(read_to_end(call.down_call))]
            if waiting:
                await asyncio.wait(waiting, timeout=CANCEL_BELOW_S)
            relay = relay + waiting
        finally:
            if call.down_call is not None and not call.down_call.done():
                call.down_call.cancel()
            for t in relay:
                t.cancel()
            if req is not None:
                self.pool.release_request(req.request_id)

    @property
    def ending_below(self) -> int:
        """Calls below that ended requests are still being ended (a Cancel sent, no end yet)."""
        return len(self._ending)

    async def wait_ending_below(self, timeout: float) -> None:
        """Until those calls have ended (they read what was sent, shared memory included), at most `timeout`."""
        await self._ending.wait(timeout)

    async def _read_inputs(
        self, req: Request, call: _Call,
        request_iterator: AsyncIterator[Received[stage_pb2.StageRequest] | Undecodable],
        shm_reader: CallShmReader,
    ) -> None:
        assembler = ChunkAssembler(reader=shm_reader)
        hold = self.engine.worker.holds_input_until_admitted
        index = 1  # the Start
        try:
            async for msg in request_iterator:
                index += 1
                self.messages_received += 1
                if call.failed:
                    continue  # the request has failed: read what the caller still sends, drop it
                try:
                    if isinstance(msg, Undecodable):
                        raise self._undecodable(msg, index)
                    kind = msg.message.WhichOneof("kind")
                    if kind == "cancel":  # the caller ended the request: as its cancel, without the race below
                        reason = msg.message.cancel.reason
                        raise StageError(Code.CANCELLED, f"{self.stage}: request {req.shown_id} cancelled by "
                                         f"its caller{f' ({reason})' if reason else ''}")  # fmt: skip
                    if kind != "chunk":
                        got = "a second Start" if kind else "an empty message"
                        raise invalid(f"{self.stage}: message {index} is {got}; expected a chunk or a Cancel")
                    decoded = assembler.push(msg.message.chunk, msg.views)
                    if decoded is not None:
                        self.engine.feed(req, decoded)
                        if hold and not decoded.finished:
                            hold = False  # its demand is known from this chunk: no more until it fits
                            await call.admitted.wait()
                except TensorBlobError as e:
                    self._fail(req, call, invalid(f"{self.stage}: message {index}: {e}"))
                except StageError as e:
                    self._fail(req, call, e)
                except Exception as e:  # e.g. out of memory placing a large input on the device: fail this request
                    log.exception("%s: request %s: reading message %d failed", self.stage, req.request_id, index)
                    code = Code.RESOURCE_EXHAUSTED if isinstance(e, (MemoryError, torch.OutOfMemoryError)) else (
                        Code.INTERNAL)
                    self._fail(req, call, StageError(code, f"{self.stage}: message {index}: {type(e).__name__}: {e}"))
            if call.failed:
                pass
            elif req.input_closed:
                self.engine.close_input(req)
            else:  # a caller that ends its side early must say so with a finished chunk
                # ...but a caller's cancel ends the messages here as a close does, and cancels this
                # call's handler (which cancels this reader) only just after: waited for, it is the
                # cancel it is (CANCELLED), not a malformed stream (INVALID_ARGUMENT on every cancel)
                for _ in range(CANCEL_GRACE_STEPS):
                    await asyncio.sleep(CANCEL_GRACE_S / CANCEL_GRACE_STEPS)
                if not call.failed:  # (nor if the request failed meanwhile)
                    self._fail(req, call, invalid(f"{self.stage}: the caller closed its side before the finished "
                                                  f"chunk ({index} messages)"))  # fmt: skip
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass

    def _undecodable(self, msg: Undecodable, index: int) -> StageError:
        return invalid(f"{self.stage}: message {index} ({msg.size} bytes) does not parse as StageRequest "
                       f"({msg.reason})")  # fmt: skip

    # Ending a call while the caller is still writing surfaces on the caller as INTERNAL
    # ("Internal error from Core", as a lost peer's) instead of our status: every rejection first
    # sends its Failure in band (`_failure`: what our callers go by), then reads what the caller
    # has already sent (bounded), then ends the call.
    REJECT_READ_S = 0.5

    def _failure(self, error: StageError) -> stage_pb2.StageResponse:
        """A request's last message: why it failed here, ahead of the status that says it too."""
        self.messages_sent += 1
        return failure_response(self.stream, error.code.name, error.message)

    async def _reject(self, context: grpc.aio.ServicerContext, request_iterator: AsyncIterator[Any],
                      error: StageError) -> None:  # fmt: skip
        """End a call that has no request yet with `error`."""

        async def drain_all() -> None:
            async for _ in request_iterator:
                pass

        with contextlib.suppress(asyncio.TimeoutError, grpc.aio.AioRpcError, asyncio.CancelledError):
            await asyncio.wait_for(drain_all(), timeout=self.REJECT_READ_S)
        await context.abort(grpc_code(error.code), error.message)

    async def _end_with(self, context: grpc.aio.ServicerContext, call: _Call, reader: asyncio.Task[Any],
                        error: StageError) -> None:  # fmt: skip
        """End a call whose request failed with `error`, once the reader has read what the
        caller sent (it drops it now; bounded)."""
        call.failed = True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait({reader}, timeout=self.REJECT_READ_S)
        await context.abort(grpc_code(error.code), error.message)

    def _fail(self, req: Request, call: _Call, err: StageError) -> None:
        self.engine.abort(req, err)
        call.failed = True
        call.put_now(err)

    # ---- downstream -----------------------------------------------------------------------

    def _begin_downstream(self, req: Request, call: _Call, context: grpc.aio.ServicerContext, pending: set[str],
                          tasks: list[asyncio.Task[Any]]) -> None:  # fmt: skip
        """The request's downstream stream, once: its buffer, its call and the relay of its
        responses (the call ends this one's wait only once it has ended too)."""
        if call.down is not None:
            return
        pending.add("down")
        call.down = _DownBuffer(self.replay_budget_bytes, self.replay_memory, replayable=self.failover_attempts > 0)
        self._open_downstream(req, call, context)
        tasks.append(asyncio.create_task(self._relay(req, call, context)))

    def _open_downstream(self, req: Request, call: _Call, context: grpc.aio.ServicerContext) -> None:
        """One call per request to the downstream stage; its lifetime is this request's (a
        replay opens it again, on whichever replica the channel picks)."""
        if call.down_start is None:  # the same Start (and seeds) for every attempt
            seeds = {s: secrets.randbits(62) for s in self.sampled_below}
            call.down_start = downstream_start(req.params, self.edge_mode, seeds)
        start = call.down_start
        if call.attempt > 0 and call.down is not None:
            call.down.replay()  # (a superseded writer checks its attempt before it marks the end)
        router = self._downstream()
        channel, done = router.pick()
        call.down_was_serving = router.serving(channel)
        call.down_ever_served |= call.down_was_serving
        call.down_call = stage_stream(channel, relay=True)(
            self._down_messages(req, call, start, call.attempt),
            timeout=context.time_remaining(),
            metadata=self.pool.invocation_metadata() if self.pool.enabled else None,
        )
        call.down_call.add_done_callback(done)

    async def _down_messages(
        self, req: Request, call: _Call, start: stage_pb2.Start, attempt: int
    ) -> AsyncIterator[stage_pb2.StageRequest | Outgoing]:
        self.messages_sent += 1
        yield stage_pb2.StageRequest(start=start)
        assert call.down is not None
        seq = 0
        index = call.down.first if attempt == 0 else 0
        # shared memory is decided once the peer's metadata is known; a replay sends inline
        accepted: bool | None = None if attempt == 0 else False

        def still() -> bool:  # this attempt's call is open (while it is current, call.down_call is its call)
            return call.attempt == attempt and not call.down_call.done()

        while True:
            item = await call.down.get(index)
            if call.attempt != attempt:
                return  # a newer attempt has taken over (its reader alone drops what was sent)
            call.down.taken(index)
            index += 1
            if item is None:  # the stream has taken every message before this: all of it has left
                call.down.end_taken = True
                self.engine.sent(req)
                return
            if item is _CANCEL_BELOW:  # then half-close: the stage below ends the call (_end_below)
                self.messages_sent += 1
                yield stage_pb2.StageRequest(cancel=stage_pb2.Cancel(reason=f"{self.stage}: its call ended early"))
                return
            if call.down_call.done():
                continue  # the downstream finished first (e.g. the talker hit its limit): drop
            if accepted is None:
                accepted = False
                if self.pool.enabled:
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        accepted = peer_accepts_shm(await call.down_call.initial_metadata())
            for chunk in await self._encode(item, seq, self.pool if accepted else None, req.request_id, still):
                seq += 1
                self.messages_sent += 1
                yield Outgoing(stage_pb2.StageRequest(), chunk)

    def _replayable(self, code: grpc.StatusCode, detail: str, call: _Call, context: grpc.aio.ServicerContext
                    ) -> str:  # fmt: skip
        """Why the downstream call's failure (`code`, `detail`) cannot be replayed on another
        replica ("" when it can)."""
        if not lost_peer(code, detail):
            return "not a lost replica"
        if detail.startswith(tuple(s for s in self.below if s != self.downstream_name)):
            return "a stage further down failed"  # that stage's caller has already tried
        if call.down is not None and not call.down.replayable:
            return call.down.why
        if call.attempt >= self.failover_attempts:
            return f"{call.attempt} replays failed (failover.attempts)"
        remaining = context.time_remaining()
        if remaining is not None and remaining < 0.5:
            return "the deadline is too close"
        return ""

    async def _relay(self, req: Request, call: _Call, context: grpc.aio.ServicerContext) -> None:
        """Pass the downstream call's responses up; when the replica is lost mid-request, open
        the call again (another replica), send everything again, and pass up only what the
        caller does not have yet."""
        resume = Resume()
        # shared memory the downstream is done with once it answers (StageWorker.downstream_consumes_input_first)
        release_at_answer = self.engine.worker.downstream_consumes_input_first
        while True:
            parts: dict[str, list[Received[stage_pb2.StageResponse]]] = {}  # per stage: a split chunk, held whole
            failure: stage_pb2.Failure | None = None  # the call's status as the stage below said it, in band
            try:
                async for raw in call.down_call:
                    self.messages_received += 1
                    if call.closing:
                        continue  # (read only for the call's end, after a Cancel)
                    if release_at_answer:
                        release_at_answer = False
                        self.pool.release_request(req.request_id)
                    if (failed := failure_of(raw)) is not None:  # the status follows (unless replaced: _failure)
                        failure = failed
                        continue
                    for out in self._resume(raw, parts, resume):
                        await call.relay(out)
                if failure is not None:  # (a Failure is always followed by its status: this is no stage of ours)
                    code, detail = failure_status(failure)
                    self._fail(req, call, StageError(Code[code.name], detail))
                    return
                await call.relay(_DOWN_DONE)
                return
            except grpc.aio.AioRpcError as e:
                if call.closing:  # this call has ended (and asked below to end): nothing to replay or tell
                    return
                # the status as the stage below gave it: grpc replaces it with its own INTERNAL, a lost
                # peer's, when our write was under way as the call ended
                code, detail = (e.code(), e.details() or "") if failure is None else failure_status(failure)
                why = self._replayable(code, detail, call, context)
                if not why:
                    call.attempt += 1
                    log.warning("%s: request %s lost its %s call (%s: %s); replaying it (attempt %d)",
                                self.stage, req.request_id, self.downstream_name, code.name, detail,
                                call.attempt)  # fmt: skip
                    await asyncio.sleep(REPLAY_BACKOFF_S * 2 ** (call.attempt - 1))  # the channel sees the loss
                    await self._replica_back(call, context, until_unreplayable=True)
                    if call.down is None or call.down.replayable:
                        self._open_downstream(req, call, context)
                        continue
                    why = call.down.why  # it sent more than it may keep while it waited: as below
                if call.down is not None and why == call.down.why and self.failover_attempts:
                    # failed as its own loss, to be replayed from above: once a replica serves here
                    # again (within the window), or that replay's call here finds none and fails too.
                    # What it makes meanwhile is dropped: it will not be sent (the engine goes on).
                    call.down.close()
                    await asyncio.sleep(REPLAY_BACKOFF_S)  # the channel sees the loss (else: READY still)
                    await self._replica_back(call, context)
                if call.down is not None and why == call.down.why and self.failover_attempts:
                    # this stage's own failure, so its caller, which holds the request (the gateway
                    # holds all of it), may replay it from there: a lost replica loses no request
                    # only because this one sent too much to keep
                    code = grpc.StatusCode.UNAVAILABLE
                    detail = (f"{self.stage}: request {req.shown_id} lost its {self.downstream_name} call and "
                              f"cannot replay it: {why} ({detail})")  # fmt: skip
                elif lost_peer(code, detail) and not detail.startswith(self.below):  # (one further down: as it said)
                    code = grpc.StatusCode.UNAVAILABLE
                    detail = f"{self.downstream_name} unavailable at {self.downstream}: {detail}"
                    said = unserved(call.wait_ended, self.replica_wait_s, call.down_ever_served)
                    if said and why != "a stage further down failed":  # (the wait was for this hop)
                        why = f"{why}; {said}"
                    if call.attempt:
                        detail += f" (not replayed again: {why})"
                self._fail(req, call, StageError(Code[code.name], detail))
                return
            except (TensorBlobError, DecodeError) as e:
                if call.closing:
                    return
                self._fail(req, call, StageError(Code.INTERNAL, f"{self.downstream_name} sent a bad response: {e}"))
                return

    async def _replica_back(self, call: _Call, context: grpc.aio.ServicerContext,
                            until_unreplayable: bool = False) -> None:  # fmt: skip
        """After a lost downstream call, before its replay: until a replica serves there (another
        one, or the lost one restarted on its port), for at most failover.replica_wait_s after
        the hop lost a replica under a call and within the request's deadline (its last 0.5 s
        left for the work); the replay follows either way. A loss starts that window only if
        the call's replica served it when it opened: a hop that was down already (not
        restarting under a request) still fails a new request fast. Not while this stage drains,
        nor, `until_unreplayable`, past the moment the request sends more than it may keep for
        replay (it then fails as its own loss, and waits as such)."""
        lost_serving, call.down_was_serving = call.down_was_serving, False  # (its loss starts the window once)
        remaining = context.time_remaining()
        down = call.down

        def stop() -> bool:  # (a drain that starts meanwhile ends the wait too)
            return self.draining or (until_unreplayable and down is not None and not down.replayable)

        call.wait_ended = await self._downstream().wait_after_loss(
            lost_serving, self.replica_wait_s, math.inf if remaining is None else remaining - 0.5, stop)

    def _resume(self, raw: bytes, parts: dict[str, list[Received[stage_pb2.StageResponse]]], resume: Resume
                ) -> list[bytes | Outgoing]:  # fmt: skip
        """What of one relayed response goes up: its bytes as they came when the caller has
        none of it, nothing when it has all of it, its new tail re-encoded when it has a head.
        Tracking positions costs a parse of each relayed message (4-25 us here); with failover
        off nothing is ever replayed, so the bytes pass untouched."""
        if not self.failover_attempts:
            return [raw]
        received = parse_response(raw)
        chunk = received.message.chunk
        stage = received.message.stage
        whole = [received]
        if chunk.parts > 1:  # the stages below relay their parts as they come: a split chunk of one
            pending = parts.setdefault(stage, [])  # stage may have another stage's chunks between its parts
            pending.append(received)
            if chunk.part < chunk.parts - 1:
                return []  # up only whole: a replay restarts at chunk boundaries
            whole = parts.pop(stage)
        meta = get_meta(chunk.meta)
        length = meta.get(LENGTH_KEY, 0)
        length = length if isinstance(length, int) else 0
        seen = resume.classify(stage, chunk.offset, length, chunk.finished)
        if seen is Seen.OLD:
            return []
        if seen is Seen.NEW:
            resume.delivered(stage, chunk.offset, length, chunk.finished)
            return [r.wire for r in whole]
        assembler = ChunkAssembler()
        decoded = None
        for r in whole:
            decoded = assembler.push(r.message.chunk, r.views)
        assert decoded is not None
        tail = resume.tail(stage, decoded)
        resume.delivered(stage, tail.offset, tail.length, tail.finished)
        pieces = encode_chunks(tail.tensors, max_bytes=self.max_message_bytes - 1024, offset=tail.offset,
                               length=tail.length, finished=tail.finished, meta=tail.meta)  # fmt: skip
        return [Outgoing(stage_pb2.StageResponse(stage=stage), p) for p in pieces]


class StageServer:
    """A running stage process: server, health, reflection, engine; drains on SIGTERM."""

    def __init__(self, service: StageService, host: str, port: int, drain_grace_s: float) -> None:
        self.service = service
        self.host = host
        self.port = port
        self.drain_grace_s = drain_grace_s
        self._watching: asyncio.Task[None] | None = None

    async def start(self) -> int:
        # created inside the running event loop (grpc.aio binds to it)
        self.server = new_server(
            self.service.max_message_bytes,
            [
                # Clients re-resolve DNS when a connection ends: cycling connections lets new
                # replicas (HPA scale-up) receive calls; in-flight calls get the grace to finish.
                ("grpc.max_connection_age_ms", 60_000),
                ("grpc.max_connection_age_grace_ms", int(1000 * max(self.drain_grace_s, 600))),
            ],
            self.service.keepalive_s,
        )
        add_stage_servicer(self.service, self.server)
        self.health = HealthState(self.server, (STAGE_SERVICE,))
        port = bind(self.server, self.host, self.port, self.service.stage,
                    server_credentials(self.service.tls, stage=True, host=self.host))  # fmt: skip
        await self.server.start()
        await self.health.set(True)
        self._watching = self.service.start_watching()
        return port

    async def drain(self) -> None:
        """Stop taking new calls, let in-flight requests finish (up to the grace), then stop."""
        self.service.draining = True
        if self._watching is not None:
            self._watching.cancel()

        async def shutdown() -> None:
            await self.service.wait_ending_below(CANCEL_BELOW_S + 0.5)  # (before the pool closes)
            self.service.engine.stop()
            self.service.pool.close()

        # (calls below still being ended keep their shared memory until then: see _end_below)
        await drain(self.health, lambda: self.service.open_streams > 0 or self.service.ending_below > 0,
                    self.drain_grace_s, self.server, shutdown)  # fmt: skip

    async def serve_forever(self) -> None:
        await wait_for_signal()
        log.info("%s: draining", self.service.stage)
        await self.drain()
