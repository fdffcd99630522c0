"""Routing: least-outstanding picks the replica with the fewest open calls, in turn on ties."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from omnistage.server.grpc_common import (
    STAGE_SERVICE,
    ChainWatcher,
    HealthState,
    add_stage_servicer,
    bind,
    channel_options,
    new_server,
)
from omnistage.server.routing import Router, replica_addresses, unserved
from omnistage.v1 import stage_pb2, stage_pb2_grpc
from tests.integration.conftest import free_port_block, serve_stage


def test_replica_addresses_of_each_target_form() -> None:
    assert replica_addresses("ipv4:127.0.0.1:1,127.0.0.1:2") == ["127.0.0.1:1", "127.0.0.1:2"]
    assert replica_addresses("127.0.0.1:7") == ["127.0.0.1:7"]
    assert replica_addresses("dns:///talker:7201") is None


def test_least_outstanding_spreads_open_calls_and_refills_the_freed_replica() -> None:
    async def go() -> None:
        async with _replicas("a", "b", "c") as (target, _), _ready_router(target) as router:
            # every replica READY: the counts alone decide
            picks = [router.pick() for _ in range(3)]
            assert router.outstanding == [1, 1, 1]  # one open call on each replica
            assert len({id(ch) for ch, _ in picks}) == 3
            picks[1][1](None)  # the call on the second replica ends
            assert router.outstanding == [1, 0, 1]
            channel, _ = router.pick()
            assert channel is picks[1][0]  # the freed replica gets the next call

    asyncio.run(go())


def test_a_keyed_call_goes_where_its_key_prefers_within_its_share_of_the_load() -> None:
    """A conversation's calls (the gateway keys them where the thinker keeps prefixes) meet on one
    replica, conversations spread over all, and a replica takes no more than 1.25 times the mean of
    the open calls: a burst of one conversation's calls overflows to the next it prefers."""

    async def go() -> None:
        async with _replicas("a", "b", "c") as (target, _), _ready_router(target) as router:

            def home(key: bytes) -> int:
                channel, done = router.pick(key)
                done(None)
                return next(i for i, (_, ch) in enumerate(router.replicas) if ch is channel)

            assert len({home(b"conversation-1") for _ in range(10)}) == 1
            homes = [home(f"conversation-{k}".encode()) for k in range(60)]
            assert set(homes) == {0, 1, 2}, homes
            assert router.outstanding == [0, 0, 0]
            held = [router.pick(b"conversation-1") for _ in range(9)]  # none ends: the load bound decides
            assert max(router.outstanding) <= 4 and sum(router.outstanding) == 9, router.outstanding
            assert router.outstanding[home(b"conversation-1")] == max(router.outstanding)
            for _, done in held:
                done(None)

    asyncio.run(go())


def test_a_draining_replicas_calls_raise_no_ones_share() -> None:
    """The load bound of keyed calls counts the replicas they may go to: a draining replica still
    finishing 20 long calls does not let one key pile all its calls on one serving replica."""

    async def go() -> None:
        async with _replicas("a", "b", "c") as (target, healths), _ready_router(target) as router:
            await healths[2].set(False)  # c drains: its channel leaves READY
            for _ in range(100):
                if router.replicas[2][1].get_state() != grpc.ChannelConnectivity.READY:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the draining replica's channel stayed READY")
            router.outstanding[2] = 20  # its long calls, still open
            held = [router.pick(b"conversation-1") for _ in range(12)]
            assert router.outstanding[2] == 20, "nothing new for the draining replica"
            assert max(router.outstanding[:2]) <= 8 and min(router.outstanding[:2]) >= 4, router.outstanding
            for _, done in held:
                done(None)

    asyncio.run(go())


def test_round_robin_and_unsplittable_targets_use_one_shared_channel() -> None:
    async def go() -> None:
        for target, policy in (("ipv4:127.0.0.1:9,127.0.0.1:10", "round_robin"), ("dns:///x:1", "least_outstanding")):
            router = Router(target, policy, 1 << 20)
            assert router.policy == "round_robin" and router.pick()[0] is router.shared
            await router.close()

    asyncio.run(go())


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="least_outstanding"):
        Router("127.0.0.1:1", "random", 1 << 20)


def test_channels_route_only_to_replicas_whose_health_says_serving() -> None:
    """Two replicas behind one target; one says NOT_SERVING (draining): every call goes to the
    other, and once it serves again it gets calls again (gRPC client-side health checking)."""

    async def go() -> None:
        async with _replicas("a", "b") as (target, healths):
            router = Router(target, "round_robin", 1 << 20)
            stub = stage_pb2_grpc.StageStub(router.shared)

            async def roles(n: int) -> set[str]:
                return {(await stub.Info(stage_pb2.InfoRequest(), timeout=5)).role for _ in range(n)}

            try:
                for _ in range(50):  # both in the rotation once their health checks said SERVING
                    if await roles(4) == {"a", "b"}:
                        break
                    await asyncio.sleep(0.1)
                assert await roles(8) == {"a", "b"}
                await healths[1].set(False)  # b drains
                for _ in range(100):  # out of the rotation once its Watch says NOT_SERVING
                    if await roles(4) == {"a"}:
                        break
                    await asyncio.sleep(0.1)
                assert await roles(12) == {"a"}
                await healths[1].set(True)
                for _ in range(50):  # back in the rotation once its Watch says SERVING
                    if await roles(4) == {"a", "b"}:
                        break
                    await asyncio.sleep(0.1)
                else:
                    raise AssertionError("b did not come back into the rotation")
            finally:
                await router.close()

    asyncio.run(go())


def test_a_replica_is_waited_for_only_in_the_window_a_lost_one_opens() -> None:
    """failover.replica_wait_s: after a replica is lost under a call, a replay waits for the hop
    to serve again, up to the window; with no loss (a hop down already) or once it serves again
    it does not wait, so a later death with no call on it fails fast."""
    import time

    async def go() -> None:
        async with _replicas("a") as (target, healths):
            router = Router(target, "round_robin", 1 << 20)

            async def down() -> None:  # (as a replica gone: its Watch says NOT_SERVING)
                await healths[0].set(False)
                for _ in range(100):
                    if router.shared.get_state() != grpc.ChannelConnectivity.READY:
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError("the channel stayed READY")

            async def timed(*args: Any, **kwargs: Any) -> tuple[str, float]:
                t0 = time.monotonic()
                return await router.wait_for_replica(*args, **kwargs), time.monotonic() - t0

            try:
                await asyncio.wait_for(router.shared.channel_ready(), 10)
                assert (await timed(5.0, 5.0))[0] == "served"
                await down()
                ended, took = await timed(5.0, 5.0)
                assert ended == "no window" and took < 1.0  # no loss under a call: no wait
                router.lost_replica()
                ended, took = await timed(0.4, 5.0)
                assert ended == "window" and 0.3 < took < 2.0  # the window, not the timeout
                router.lost_replica()
                ended, took = await timed(5.0, 0.3)
                assert ended == "timeout" and 0.2 < took < 2.0  # the request's deadline first
                ended, took = await timed(5.0, 5.0, stop=lambda: True)
                assert ended == "stopped" and took < 1.0  # (a drain that starts meanwhile)
                back = asyncio.ensure_future(timed(5.0, 5.0))
                await asyncio.sleep(0.3)
                await healths[0].set(True)  # it serves again within the window: the wait ends there
                assert (await asyncio.wait_for(back, 5.0))[0] == "served"
                await down()
                ended, took = await timed(5.0, 5.0)
                assert ended == "no window" and took < 1.0  # the window closed when it served
                # a caller's wait after a loss: the loss of a serving replica opens the window; what
                # the request's failure then says of it
                ended = await router.wait_after_loss(False, 5.0, 5.0)
                assert ended == "no window" and "when its calls were made" in unserved(ended, 5.0, False)
                assert unserved(ended, 0.0, False) == ""  # (no waiting at all: nothing to say)
                assert unserved(ended, 5.0, True) == ""  # one of its calls was served: not "none served"
                assert await router.wait_after_loss(True, 0.3, 0.0) == "timeout"  # no time left: no wait
                ended = await router.wait_after_loss(False, 0.3, 5.0)  # the window that loss opened, run out
                assert ended == "window" and unserved(ended, 0.3, True) == (
                    "no replica served again within failover.replica_wait_s (0.3 s)")
                assert await router.wait_after_loss(True, 5.0, 5.0, stop=lambda: True) == "stopped"
                assert unserved("stopped", 5.0, False) == unserved("served", 5.0, False) == ""
            finally:
                await router.close()

    asyncio.run(go())


def test_a_watcher_sees_a_stage_that_comes_up_as_soon_as_its_channel_dials_it() -> None:
    """While the stage below cannot be reached, the ChainWatcher's poll waits for its channel to
    connect: a stage that starts after the watcher (a gateway up before its thinker, a replica
    restarted) is seen within the channel's reconnect backoff (0.2 s, growing to 2 s), not at the
    next poll (here a minute away). Meanwhile the chain says why it is down, not that a waited
    call ran out of time."""

    async def go() -> None:
        port = free_port_block(1)
        target = f"ipv4:127.0.0.1:{port}"
        channel = grpc.aio.insecure_channel(target, options=channel_options(1 << 20))
        slow, quick = ChainWatcher(channel, "talker", target, 60.0), ChainWatcher(channel, "talker", target, 0.3)
        tasks = [asyncio.ensure_future(w.run()) for w in (slow, quick)]
        server = new_server(1 << 20)
        try:
            await asyncio.sleep(1.0)  # a few of the quick one's waited polls ran out
            assert not slow.serving and not quick.serving
            assert quick.chain[0].detail.startswith("UNAVAILABLE"), quick.chain[0].detail
            add_stage_servicer(_Named("talker"), server)
            health = HealthState(server, (STAGE_SERVICE,))
            bind(server, "127.0.0.1", port, "talker")
            await server.start()
            await health.set(True)
            for _ in range(100):
                if slow.serving and quick.serving:
                    break
                await asyncio.sleep(0.1)
            assert slow.serving and quick.serving and slow.chain[0].detail == ""
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await server.stop(None)
            await channel.close()

    asyncio.run(go())


def test_a_watcher_asks_a_peer_that_answers_with_an_error_once_a_poll() -> None:
    """A peer that answers Info at once with an error (a server of another service, a proxy's
    UNAVAILABLE) is asked about once a poll, not again at once: the waited poll for a stage not
    reached came back at once and was asked again, thousands of times a second."""

    class Refusing:
        calls = 0

        async def Info(self, request: object, context: grpc.aio.ServicerContext) -> stage_pb2.InfoResponse:
            Refusing.calls += 1
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no Stage here")

        async def Stream(self, request_iterator: object, context: object) -> object:  # unused here
            raise NotImplementedError

    async def go() -> None:
        server, port = await serve_stage(Refusing(), "refusing")
        target = f"ipv4:127.0.0.1:{port}"
        channel = grpc.aio.insecure_channel(target, options=channel_options(1 << 20))
        watcher = ChainWatcher(channel, "talker", target, 0.5)
        task = asyncio.ensure_future(watcher.run())
        try:
            await asyncio.sleep(2.0)
            assert not watcher.serving and watcher.chain[0].detail.startswith("UNIMPLEMENTED")
            assert 2 <= Refusing.calls <= 12, Refusing.calls  # (two a poll at most: 8 in 2 s)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await server.stop(None)
            await channel.close()

    asyncio.run(go())


def test_a_watcher_sees_a_stage_serve_while_one_of_its_replicas_is_frozen() -> None:
    """Two replicas behind one target, one frozen (its Info never answers; its connection and
    health stream still up, as a stopped process's for a while), with requests on the shared
    channel meanwhile: the stage serves at every poll, as the other answers every call. Its
    health flapped: round robin sent every other poll to the frozen one (and a retry, with the
    requests moving the turn on, a quarter of them)."""

    class Frozen(_Named):
        async def Info(self, request: object, context: object) -> stage_pb2.InfoResponse:
            await asyncio.sleep(3600)
            raise AssertionError("unreachable")

    async def go() -> None:
        async with _replicas("a", Frozen("b")) as (target, _):
            router = Router(target, "round_robin", 1 << 20)
            watcher = ChainWatcher(router.health_channels(), "thinker", target, 0.4)
            seen: list[bool] = []

            async def polled() -> None:  # (what the gateway's health follows, after each poll)
                seen.append(watcher.serving)

            async def traffic() -> None:  # short calls on the shared channel: they move round robin on
                stub = stage_pb2_grpc.StageStub(router.shared)
                while True:
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await stub.Info(stage_pb2.InfoRequest(), timeout=0.05)
                    await asyncio.sleep(0.02)

            tasks = [asyncio.ensure_future(watcher.run(polled)), asyncio.ensure_future(traffic())]
            try:
                await asyncio.sleep(4.0)  # about 10 polls
                first = seen.index(True)
                # (one poll may miss its 0.4 s deadline on a loaded machine; the flapping missed every other)
                assert len(seen) - first >= 6 and seen[first:].count(False) <= 1, seen
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await router.close()

    asyncio.run(go())


@pytest.mark.parametrize("policy", ["round_robin", "least_outstanding"])
def test_a_replica_that_does_not_answer_its_health_polls_gets_no_new_call(policy: str) -> None:
    """One of two replicas frozen (its Info never answers; its connection and health stream
    still up, so gRPC would route to it until keepalive gave up on it): once it has left two
    health polls unanswered, every new call goes to the other; answering again, it gets calls
    again."""

    class Freezable(_Named):
        frozen = True

        async def Info(self, request: object, context: object) -> stage_pb2.InfoResponse:
            while self.frozen:
                await asyncio.sleep(0.01)
            return stage_pb2.InfoResponse(role=self.name, serving=True)

    b = Freezable("b")

    async def go() -> None:
        async with _replicas("a", b) as (target, _):
            router = Router(target, policy, 1 << 20)
            # (polls a second apart, as the processes': a replica merely slow on a loaded machine stays in)
            watcher = ChainWatcher(router.health_channels(), "thinker", target, 1.0, on_answer=router.heard)

            async def who_answers(n: int) -> list[str]:
                got = []
                for _ in range(n):
                    channel, done = router.pick()
                    try:
                        info = await stage_pb2_grpc.StageStub(channel).Info(stage_pb2.InfoRequest(), timeout=1.0)
                        got.append(info.role)
                    except grpc.aio.AioRpcError as e:
                        got.append(e.code().name)
                    finally:
                        done(None)
                return got

            async def until(condition: Callable[[], bool]) -> None:
                for _ in range(300):  # (two polls of 1 s, and a loaded machine may take a few more)
                    if condition():
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError(f"not within 15 s: unanswering {router.unanswering}")

            task = asyncio.ensure_future(watcher.run())
            try:
                await until(lambda: router.unanswering == {1})
                assert await who_answers(12) == ["a"] * 12
                b.frozen = False
                await until(lambda: not router.unanswering)
                assert "b" in await who_answers(40)
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await router.close()

    asyncio.run(go())


def test_one_unanswered_health_poll_moves_no_call() -> None:
    """A replica merely late to answer one poll (busy) keeps its calls: only UNANSWERED_POLLS in
    a row take it out; an answer in between starts the count again."""

    async def go() -> None:
        router = Router("ipv4:127.0.0.1:1,127.0.0.1:2", "least_outstanding", 1 << 20)
        single = Router("127.0.0.1:1", "round_robin", 1 << 20)  # (one address: nothing to choose)
        try:
            router.heard(1, False)
            router.heard(1, True)
            router.heard(1, False)
            assert router.unanswering == set()
            router.heard(1, False)
            assert router.unanswering == {1}
            router.heard(1, True)
            assert router.unanswering == set()
            single.heard(0, False)
            single.heard(0, False)
            assert single.unanswering == set()
        finally:
            await router.close()
            await single.close()

    asyncio.run(go())


class _Named:
    """A Stage servicer whose Info says its name."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def Info(self, request: object, context: object) -> stage_pb2.InfoResponse:
        return stage_pb2.InfoResponse(role=self.name, serving=True)

    async def Stream(self, request_iterator: object, context: object) -> object:  # unused here
        raise NotImplementedError


@contextlib.asynccontextmanager
async def _ready_router(target: str) -> AsyncIterator[Router]:
    """A least_outstanding router over `target` once every replica's channel is READY; closed after."""
    router = Router(target, "least_outstanding", 1 << 20)
    try:
        for _, ch in router.replicas:
            await asyncio.wait_for(ch.channel_ready(), 10)
        yield router
    finally:
        await router.close()


@contextlib.asynccontextmanager
async def _replicas(*names: str | Any) -> AsyncIterator[tuple[str, list[HealthState]]]:
    """Stage servers on loopback, SERVING (each a `_Named` one, or the servicer given): their
    target list and health states."""
    servers, healths, addresses = [], [], []
    try:
        for name in names:
            server = new_server(1 << 20)
            add_stage_servicer(_Named(name) if isinstance(name, str) else name, server)
            health = HealthState(server, (STAGE_SERVICE,))
            port = bind(server, "127.0.0.1", free_port_block(1), name)
            await server.start()
            await health.set(True)
            servers.append(server)
            healths.append(health)
            addresses.append(f"127.0.0.1:{port}")
        yield "ipv4:" + ",".join(addresses), healths
    finally:
        for server in servers:
            await server.stop(None)
