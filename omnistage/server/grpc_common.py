"""What every omnistage gRPC process shares: channel options, health, reflection, signals,
drain, the Stage.Stream handlers and stub with the zero-copy codec, and status mapping. (The
health-check client is `health_check`, which imports no torch.)"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import signal
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from omnistage.server.ports import PortTaken, port_free
from omnistage.v1 import stage_pb2, stage_pb2_grpc
from omnistage.wire import Code
from omnistage.wire.wire_view import Undecodable, or_undecodable, parse_request, parse_response, serialize

__all__ = [
    "LIVENESS_SERVICE",
    "REPLAY_BACKOFF_S",
    "STAGE_SERVICE",
    "ChainWatcher",
    "HealthState",
    "add_servicer",
    "add_stage_servicer",
    "bind",
    "channel_options",
    "grpc_code",
    "lost_peer",
    "new_server",
    "stage_stream",
    "wait_for_signal",
]

STAGE_SERVICE = "omnistage.v1.Stage"
LIVENESS_SERVICE = "omnistage.v1.Liveness"  # health name that stays SERVING while the process drains
_STREAM_METHOD = f"/{STAGE_SERVICE}/Stream"


SERVICE_CONFIG = json.dumps({"loadBalancingConfig": [{"round_robin": {}}],
                             "healthCheckConfig": {"serviceName": STAGE_SERVICE}})  # fmt: skip


def _limits(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def _keepalive(keepalive_s: float) -> list[tuple[str, Any]]:
    if keepalive_s <= 0:
        return []
    ms = max(int(keepalive_s * 1000), 1)
    return [
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", ms),
        ("grpc.http2.ping_timeout_ms", ms),  # what gRPC 1.85 waits for the ack (60 s otherwise)
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # a call that waits on a long step sends no data
    ]


def channel_options(max_message_bytes: int, keepalive_s: float = 0.0) -> list[tuple[str, Any]]:
    """A caller's options. `keepalive_s` > 0: ping the connection that often, and declare the
    peer lost when a ping goes unanswered as long again. A frozen or cut-off replica sends no
    reset, so without this its calls would hang until their deadline and new calls would keep
    going to it; with it they fail UNAVAILABLE (replayed elsewhere) and the replica leaves the
    rotation."""
    return [
        *_limits(max_message_bytes),
        *_keepalive(keepalive_s),
        # Spread calls over every address of a target (replica list or headless Service), and
        # only over replicas whose grpc.health.v1 Watch says SERVING: a draining replica or one
        # that stopped answering leaves the rotation until its health check passes again.
        ("grpc.service_config", SERVICE_CONFIG),
        # A replica restarted on its port (serve, a rescheduled pod) is dialled again within 2 s,
        # not after gRPC's default reconnect backoff (up to 120 s).
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
        ("grpc.enable_retries", 0),
    ]


# Replays wait 0.25, 0.5, 1 s: together about the channels' longest reconnect backoff (2 s), so a
# replica restarted on its port is dialled again before the last attempt.
REPLAY_BACKOFF_S = 0.25
CORE_WRITE_FAILED = "Internal error from Core"  # grpc aio's status for a write to a call whose peer is gone


def lost_peer(code: grpc.StatusCode, detail: str) -> bool:
    """A call that ended because its peer (connection, process) went away, not because the
    peer answered an error: UNAVAILABLE, or the INTERNAL grpc aio gives a caller whose write
    failed under it (a replica killed while we were still sending)."""
    return code == grpc.StatusCode.UNAVAILABLE or (code == grpc.StatusCode.INTERNAL and detail == CORE_WRITE_FAILED)


def grpc_code(code: Code) -> grpc.StatusCode:
    return grpc.StatusCode[code.name]


def failure_status(failure: stage_pb2.Failure) -> tuple[grpc.StatusCode, str]:
    """A stage's in-band Failure as the status it stands for (a code no stage sends: INTERNAL)."""
    return grpc_code(Code.__members__.get(failure.code, Code.INTERNAL)), failure.message


def new_server(max_message_bytes: int, extra: Iterable[tuple[str, Any]] = (), keepalive_s: float = 0.0
               ) -> grpc.aio.Server:  # fmt: skip
    """A grpc.aio server (create it inside the running event loop) with our message limits.
    It binds exclusively: gRPC's default SO_REUSEPORT would let a second stack bind the same
    ports and the kernel split the traffic between the two.

    `keepalive_s` > 0 (a stage, whose callers are our own processes): it pings its callers that
    often, so a frozen caller's calls are cancelled and what they held is freed, and it accepts
    its callers' pings as often as they come (by default gRPC answers pings more often than
    every 5 minutes on a quiet connection with GOAWAY, failing the calls on it). 0 (the
    gateway, whose callers are anyone's clients): gRPC's own ping policy, and no ping that a
    client on a slow uplink, its acks queued behind a large upload, could fail."""
    pings: list[tuple[str, Any]] = []
    if keepalive_s > 0:
        pings = [
            ("grpc.http2.min_ping_interval_without_data_ms", 100),
            ("grpc.http2.max_ping_strikes", 0),
            *_keepalive(keepalive_s),
        ]
    return grpc.aio.server(options=[*_limits(max_message_bytes), ("grpc.so_reuseport", 0), *pings, *extra])


def bind(server: grpc.aio.Server, host: str, port: int, role: str,
         credentials: grpc.ServerCredentials | None = None) -> int:  # fmt: skip
    """Listen on `host:port` (TLS with `credentials`), or raise `PortTaken` naming the port and `role`."""
    taken = PortTaken(f"{role}: cannot listen on {host}:{port}: the port is taken by another process")
    if not port_free(host, port):
        raise taken
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError:
        bound = 0
    if bound == 0 and credentials is not None and port_free(host, port):  # (tls.check_files passed them)
        from omnistage.server.tls import TlsError

        raise TlsError(f"{role}: cannot listen on {host}:{port} with TLS: gRPC refused tls.cert_file and tls.key_file")
    if bound == 0:
        raise taken
    return bound


class HealthState:
    """grpc.health.v1 and reflection for a server: `names` are the served service names."""

    def __init__(self, server: grpc.aio.Server, names: tuple[str, ...]) -> None:
        self.names = names
        self.servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        reflection.enable_server_reflection(
            (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
        )

    async def set(self, serving: bool) -> None:
        """Readiness: "" and every served name. LIVENESS_SERVICE says SERVING from the first
        call on, draining included (a liveness probe must not kill a draining process)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.names):
            await self.servicer.set(name, status)
        await self.servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)


async def wait_for_signal() -> None:
    """Until SIGTERM or SIGINT (then the caller drains)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def drain(
    health_state: HealthState,
    busy: Callable[[], bool],
    grace_s: float,
    server: grpc.aio.Server,
    after: Callable[[], Awaitable[None] | None] | None = None,
) -> None:
    """Stop taking new calls (NOT_SERVING), let in-flight ones finish (up to the grace), stop."""
    await health_state.set(False)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while busy() and loop.time() < deadline:
        await asyncio.sleep(0.05)
    await server.stop(grace=1.0)
    if after is not None:
        result = after()
        if result is not None:
            await result


def add_servicer(servicer: Any, server: grpc.aio.Server, service: ServiceDescriptor) -> None:
    """Register `servicer`'s methods for `service` with deserializers that never raise: a
    request that does not parse ends its call INVALID_ARGUMENT naming the message (gRPC would
    answer UNKNOWN, or leave a stream hanging). Stage.Stream requests are parsed by
    `wire_view.parse_request` through `or_undecodable` (tensor payloads left in the received bytes) and its
    responses written by `wire_view.serialize` (one copy; relayed bytes as they came)."""
    handlers = {}
    for method in service.methods:
        request_cls = GetMessageClass(method.input_type)
        response_cls = GetMessageClass(method.output_type)
        fn = getattr(servicer, method.name)
        parse = or_undecodable(request_cls.FromString)
        if method.client_streaming and method.server_streaming:
            assert service.full_name == STAGE_SERVICE and method.name == "Stream"
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                fn, request_deserializer=or_undecodable(parse_request), response_serializer=serialize
            )
        elif method.server_streaming:
            assert inspect.iscoroutinefunction(fn), f"{method.name}: a writer (context.write), not a generator"
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _checked_stream(fn, request_cls.DESCRIPTOR.name), request_deserializer=parse,
                response_serializer=response_cls.SerializeToString,
            )  # fmt: skip
        elif not method.client_streaming:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _checked_unary(fn, request_cls.DESCRIPTOR.name), request_deserializer=parse,
                response_serializer=response_cls.SerializeToString,
            )  # fmt: skip
        else:
            raise NotImplementedError(f"{method.full_name}: client-streaming only")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def add_stage_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    add_servicer(servicer, server, stage_pb2.DESCRIPTOR.services_by_name["Stage"])


def _not_parsed(request: Undecodable, name: str) -> str:
    return f"the request ({request.size} bytes) does not parse as {name} ({request.reason})"


def _checked_unary(fn: Callable[[Any, Any], Any], name: str) -> Callable[[Any, Any], Any]:
    if not inspect.iscoroutinefunction(fn):  # a servicer of a sync grpc.server

        def sync_handler(request: Any, context: grpc.ServicerContext) -> Any:
            if isinstance(request, Undecodable):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, _not_parsed(request, name))
            return fn(request, context)

        return sync_handler

    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _not_parsed(request, name))
        return await fn(request, context)

    return handler


_Writer = Callable[[Any, Any], Awaitable[None]]


def _checked_stream(fn: _Writer, name: str) -> _Writer:
    """A server-streaming handler that writes its responses (`context.write`, which it can time)."""

    async def handler(request: Any, context: grpc.aio.ServicerContext) -> None:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _not_parsed(request, name))
        await fn(request, context)

    return handler


def stage_stream(channel: Any, *, relay: bool = False) -> Any:
    """Stage.Stream on `channel`. `relay=False`: responses parsed by `wire_view.parse_response`
    (tensors as views of the received bytes); `relay=True`: responses are the raw bytes, for a
    stage that only passes them up."""
    return channel.stream_stream(
        _STREAM_METHOD,
        request_serializer=serialize,
        response_deserializer=None if relay else parse_response,
        _registered_method=True,
    )


# A call that ends early asks the stage below to end the request with a Cancel message (which
# cannot pass for a half-close, whatever the load), then half-closes; the call below is cancelled
# only if that stage has not ended it within this long (it does not read: stopped, or its worker
# holds its input until the request is admitted).
CANCEL_BELOW_S = 1.0


class CancellableInput:
    """A Stage.Stream call's request messages (`source`: its Start, then its input), for a caller
    that may end the request early (`end_early`).

    A gRPC cancel cannot end a call whose input may not all have reached the stage: the stage
    sees its messages end before the finished chunk, as a malformed stream's (INVALID_ARGUMENT),
    and the cancel that tells the two apart may never reach its handler (seen under random
    cancels on a loaded 2-core machine: a cancel just after the last message was written, that
    message lost, no cancel seen within 5 s). So until the stage's first response shows it has the whole
    input, the call is not half-closed and not cancelled: ending early sends a Cancel message
    after what is being written, and the call is read to its end; the first response is read
    apart from the caller's task (a read cancelled with its task cancels the call: grpc aio's).
    The stage must answer (a token, its Failure) before it waits for the half-close, as every
    stage does: it waits only once its request has ended."""

    def __init__(self, source: AsyncGenerator[stage_pb2.StageRequest, None], reason: str) -> None:
        self._source, self._reason = source, reason
        self._cancel = False
        self.acknowledged = False  # the stage answered: it has every message
        self._release = asyncio.Event()  # acknowledged, cancelled, or the call has ended
        self._first: asyncio.Future[Any] | None = None

    async def _messages(self) -> AsyncIterator[stage_pb2.StageRequest]:
        started = False
        async for message in self._source:  # (each pull comes once the one before is written)
            if self._cancel and started:
                await self._source.aclose()  # (no more of it is written)
                break
            started = True
            yield message
        else:
            await self._release.wait()  # then the half-close
        if self._cancel:
            yield stage_pb2.StageRequest(cancel=stage_pb2.Cancel(reason=self._reason))

    def call(self, method: Any, **kwargs: Any) -> Any:
        """Open the call on `method` (`stage_stream(channel)`) with these messages."""
        call = method(self._messages(), **kwargs)
        call.add_done_callback(lambda _: self._release.set())
        return call

    async def responses(self, call: Any) -> AsyncIterator[Any]:
        """The call's responses (`call` from `self.call`)."""
        messages = aiter(call)
        self._first = asyncio.ensure_future(anext(messages))
        self._first.add_done_callback(_retrieved)  # (the caller may have gone: no one else reads its error)
        try:
            first = await asyncio.shield(self._first)
        except StopAsyncIteration:
            return
        self.acknowledged = True
        self._release.set()
        yield first
        async for message in messages:
            yield message

    def end_early(self, call: Any) -> None:
        """End `call` before its end: cancelled at once once acknowledged; else with a Cancel
        message, whatever the stage still sends read and dropped until the call ends (its status
        comes only after them), or cancelled after CANCEL_BELOW_S."""
        if call.done():
            return
        if self.acknowledged:
            call.cancel()
            return
        self._cancel = True
        self._release.set()
        _ENDED_EARLY.start(_read_then_cancel(call, self._first))


class Endings:
    """Calls being ended in the background (a Cancel sent, what they still send read to their
    end), held until done (the loop keeps only weak references to tasks), so that a process can
    wait for them before it exits."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[None]] = set()

    def start(self, ending: Awaitable[None]) -> None:
        task = asyncio.ensure_future(ending)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait(self, timeout: float) -> None:
        """Until those started have ended, at most `timeout`."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)


_ENDED_EARLY = Endings()  # CancellableInput.end_early's


async def read_to_end(call: Any) -> None:
    """Read and drop what `call` still sends, until it ends (however it ends)."""
    with contextlib.suppress(Exception):
        async for _ in call:
            pass


async def _read_then_cancel(call: Any, first: asyncio.Future[Any] | None) -> None:
    async def the_rest() -> None:
        if first is not None:
            with contextlib.suppress(Exception):  # (StopAsyncIteration, or the call's error)
                await first
        await read_to_end(call)

    try:
        await asyncio.wait_for(the_rest(), CANCEL_BELOW_S)
    except (TimeoutError, asyncio.CancelledError):
        pass
    finally:
        call.cancel()  # (a no-op once it has ended)


async def wait_ended_early(timeout: float) -> None:
    """Until the calls `end_early` is ending have ended, at most `timeout` (before a process
    exits: its requests' Cancel messages reach their stages)."""
    await _ENDED_EARLY.wait(timeout)


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class ChainWatcher:
    """Polls the next stage's `Info` every `poll_s`: `chain` is that stage's health followed by
    the chain it reports (so each process knows every stage below it). Given a channel to each
    of its replicas (Router.health_channels), it asks them all: the stage serves while any
    answers, its chain the first answer's.

    While the next stage cannot be reached, each poll waits (up to `poll_s`) for the channel to
    connect, so a stage that comes up (at start, or restarted after a failure) is seen as soon as
    its channel dials it, not up to `poll_s` later."""

    def __init__(self, channel: grpc.aio.Channel | Sequence[grpc.aio.Channel], stage: str, target: str,
                 poll_s: float = 1.0, again: bool = False,
                 on_answer: Callable[[int, bool], None] | None = None) -> None:  # fmt: skip
        channels = [channel] if isinstance(channel, grpc.aio.Channel) else list(channel)
        self.stubs = [stage_pb2_grpc.StageStub(ch) for ch in channels]
        self.stage, self.target, self.poll_s = stage, target, poll_s
        self.on_answer = on_answer  # (channel index, whether its Info answered), after each poll's call
        # a poll that fails where the last had an answer is made once more at once: behind a name
        # gRPC resolves to replicas unknown here (a headless Service), round robin asks another
        self.again = again
        self.chain: list[stage_pb2.StageHealth] = [stage_pb2.StageHealth(stage=stage, target=target, serving=False,
                                                                         detail="not checked yet")]  # fmt: skip
        self.reached = False  # the last poll had an answer

    @property
    def serving(self) -> bool:
        """The next stage itself serves."""
        return self.chain[0].serving

    async def poll(self, wait: bool = False, again: bool = True) -> None:
        """One `Info` call (to each replica, given their channels). `wait`: the call waits for
        the channel to connect, up to `poll_s`; if it never does, a call that fails at once then
        says why (a waited call would only say DEADLINE_EXCEEDED). `again`: with `self.again`, a
        failed call is made once more."""
        try:
            info = await self._first_answer(wait)
            head = stage_pb2.StageHealth(stage=self.stage, target=self.target, serving=info.serving,
                                         detail="" if info.serving else "draining")  # fmt: skip
            self.chain = [head, *info.chain]
            self.reached = True
        except grpc.aio.AioRpcError as e:
            if wait and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return await self.poll()
            if again and self.again and self.reached:
                return await self.poll(again=False)
            detail = f"{e.code().name}: {e.details() or ''}".strip()
            self.chain = [stage_pb2.StageHealth(stage=self.stage, target=self.target, serving=False, detail=detail)]
            self.reached = False

    async def _first_answer(self, wait: bool) -> stage_pb2.InfoResponse:
        """Every replica's `Info` at once: the first that serves, else the first answer, else
        the first failure (raised)."""
        calls = [asyncio.ensure_future(stub.Info(stage_pb2.InfoRequest(), timeout=self.poll_s, wait_for_ready=wait))
                 for stub in self.stubs]  # fmt: skip
        for i, call in enumerate(calls):  # (the others run on after the first answer, each to its timeout)
            call.add_done_callback(functools.partial(self._answered, i))
        answered: list[stage_pb2.InfoResponse] = []
        failed: list[grpc.aio.AioRpcError] = []
        try:
            for call in asyncio.as_completed(calls):
                try:
                    info = await call
                except grpc.aio.AioRpcError as e:
                    failed.append(e)
                    continue
                if info.serving:
                    return info
                answered.append(info)  # (draining: another may serve)
        except BaseException:
            for call in calls:
                call.cancel()
            raise
        if answered:
            return answered[0]
        raise failed[0]

    def _answered(self, index: int, call: asyncio.Future[stage_pb2.InfoResponse]) -> None:
        if call.cancelled():
            return
        answered = call.exception() is None  # (and its error retrieved)
        if self.on_answer is not None:
            self.on_answer(index, answered)

    async def run(self, on_poll: Callable[[], Awaitable[None]] | None = None) -> None:
        await self.poll()
        while True:
            if on_poll is not None:
                await on_poll()
            if self.reached:
                await asyncio.sleep(self.poll_s)
                await self.poll()
                continue
            started = time.monotonic()
            await self.poll(wait=True)  # (returns as soon as the next stage can be dialled)
            if not self.reached:  # once a poll_s: a peer that answers at once with an error (no Stage
                # service, a proxy's UNAVAILABLE) is not asked again at once
                await asyncio.sleep(max(0.0, self.poll_s - (time.monotonic() - started)))
