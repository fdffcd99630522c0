"""Which replica of the next stage gets a request's call.

- `round_robin`: one channel over every address of the target; gRPC's own round_robin policy
  (only replicas whose health Watch says SERVING, see grpc_common.SERVICE_CONFIG). While a
  replica of a listed target leaves its health polls unanswered (`heard`: frozen, which gRPC
  sees only once keepalive gives up on it), calls go in turn over the others' own channels.
- `least_outstanding`: one channel per replica; a call goes to the replica with the fewest
  calls this process has open on it (ties in turn), among those whose channel is READY. Long
  requests then stop piling up behind each other on one replica while another idles. Needs the
  replica list in the target (`ipv4:host:port,...`, what `serve` passes); a DNS target (compose,
  a Kubernetes headless Service) cannot be split here and keeps round_robin (`deploy render`
  refuses it).
  A call with a key (the gateway's: a conversation's, where the thinker keeps prefixes) goes to
  the replica its key prefers (rendezvous hashing), unless that one would hold more than its
  share of the open calls (consistent hashing with bounded loads: `AFFINITY_LOAD` times the mean
  over the replicas it may go to, counting this call, rounded up), when the next it prefers takes
  it: a conversation's turns meet the prefixes its earlier turns left on one replica, and no
  replica takes much more than its share.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import grpc

from omnistage.server.grpc_common import channel_options
from omnistage.server.tls import aio_channel

log = logging.getLogger(__name__)

POLICIES = ("round_robin", "least_outstanding")
AFFINITY_LOAD = 1.25  # a keyed call's replica may hold this many times the mean of open calls (rounded up)
UNANSWERED_POLLS = 2  # health polls in a row a replica leaves unanswered before it gets no new call


def replica_addresses(target: str) -> list[str] | None:
    """The addresses of an `ipv4:a,b` / `ipv6:` list or a single `host:port`; None for a name
    gRPC resolves itself (dns:///...)."""
    for scheme in ("ipv4:", "ipv6:"):
        if target.startswith(scheme):
            return [a for a in target[len(scheme) :].split(",") if a]
    if "://" in target or target.startswith("dns:"):
        return None
    return [target]


class Router:
    def __init__(self, target: str, policy: str, max_message_bytes: int,
                 credentials: grpc.ChannelCredentials | None = None,
                 extra_options: list[tuple[str, Any]] | None = None, keepalive_s: float = 0.0) -> None:  # fmt: skip
        if policy not in POLICIES:
            raise ValueError(f"routing: unknown policy {policy!r}; expected one of {POLICIES}")
        options = channel_options(max_message_bytes, keepalive_s) + (extra_options or [])
        self.target = target
        # round_robin over the whole target (also what Info polling uses)
        self.shared = aio_channel(target, credentials, options)
        addresses = replica_addresses(target)
        self.policy = policy
        if policy == "least_outstanding" and (addresses is None or len(addresses) < 2):
            if addresses is None:
                log.warning("routing: %s is resolved by gRPC; least_outstanding needs a replica list, "
                            "keeping round_robin", target)  # fmt: skip
            self.policy = "round_robin"
        self.replicas: list[tuple[str, grpc.aio.Channel]] = []
        if self.policy == "least_outstanding":
            assert addresses is not None
            self.replicas = [(a, aio_channel(a, credentials, options)) for a in addresses]
        self.outstanding = [0] * len(self.replicas)
        self._polled: list[grpc.aio.Channel] = []  # health_channels' own, under round_robin (and `_answering`'s)
        self._dial = lambda address: aio_channel(address, credentials, options)
        self._turn = itertools.count()
        self.lost_at = -math.inf  # when a call on a serving replica was last lost (lost_replica)
        self.unanswering: set[int] = set()  # replicas out of the rotation: polls unanswered (`heard`)
        self._answered: set[int] = set()  # replicas that have answered one
        self._misses: dict[int, int] = {}  # health polls in a row each replica left unanswered

    def pick(self, key: bytes | None = None) -> tuple[grpc.aio.Channel, Callable[[Any], None]]:
        """A channel for one call, and what to call when that call is done. `key`: the call's
        affinity (least_outstanding: the replica it prefers, within its share of the load)."""
        if self.policy == "round_robin":
            answering = self._answering()
            if answering is None:
                return self.shared, _nothing
            return answering[next(self._turn) % len(answering)], _nothing
        states = [ch.get_state(try_to_connect=True) for _, ch in self.replicas]
        ready = [i for i, s in enumerate(states) if s == grpc.ChannelConnectivity.READY]
        candidates = ready or [i for i, s in enumerate(states) if s != grpc.ChannelConnectivity.TRANSIENT_FAILURE]
        candidates = candidates or list(range(len(self.replicas)))
        candidates = [i for i in candidates if i not in self.unanswering] or candidates
        if key is not None:
            # (the calls on the candidates only: a draining replica's long calls raise no one's share)
            share = math.ceil(AFFINITY_LOAD * (sum(self.outstanding[i] for i in candidates) + 1) / len(candidates))
            preferred = sorted(candidates, key=lambda i: hashlib.blake2b(key + self.replicas[i][0].encode(),
                                                                         digest_size=8).digest(), reverse=True)
            best = next(i for i in preferred if self.outstanding[i] + 1 <= share)
        else:
            turn = next(self._turn)
            n = len(self.replicas)
            best = min(candidates, key=lambda i: (self.outstanding[i], (i - turn) % n))
        self.outstanding[best] += 1

        def done(_: Any) -> None:
            self.outstanding[best] -= 1

        return self.replicas[best][1], done

    def heard(self, index: int, answered: bool) -> None:
        """A health poll's call to replica `index` (of `health_channels`) answered or not. One
        that does not (frozen, or its event loop stuck) keeps its connection, and gRPC keeps
        sending it calls, until keepalive gives up on it (twice `timeouts.keepalive_s`): after
        UNANSWERED_POLLS in a row, until it answers again, new calls go to the replicas that do
        (while any does)."""
        if len(self.health_channels()) < 2:  # (one address, or a name gRPC resolves: no choice here)
            return
        if answered:
            if index in self.unanswering and index in self._answered:
                log.info("routing: replica %s of %s answers again", self._address(index), self.target)
            self.unanswering.discard(index)
            self._answered.add(index)
            self._misses.pop(index, None)
            return
        self._misses[index] = self._misses.get(index, 0) + 1
        # (two in a row: one late answer from a replica merely busy moves no conversation off it)
        if self._misses[index] >= UNANSWERED_POLLS and index not in self.unanswering:
            self.unanswering.add(index)
            if index in self._answered:  # (not one still starting)
                log.warning("routing: replica %s of %s left %d health polls unanswered; new calls go to the "
                            "others until it answers", self._address(index), self.target,
                            UNANSWERED_POLLS)  # fmt: skip

    def _address(self, index: int) -> str:
        addresses = replica_addresses(self.target) or []
        return addresses[index] if index < len(addresses) else str(index)

    def _answering(self) -> list[grpc.aio.Channel] | None:
        """Under round_robin, while a replica does not answer its health polls: the channels of
        those that do and are READY; None (the shared channel) otherwise, or if none is."""
        if not self.unanswering:
            return None
        self.shared.get_state(try_to_connect=True)  # (kept connected for when they all answer again)
        answering = [ch for i, ch in enumerate(self._polled)
                     if i not in self.unanswering and ch.get_state() == grpc.ChannelConnectivity.READY]  # fmt: skip
        return answering or None

    def lost_replica(self) -> None:
        """A call this process had opened on a serving replica was lost (the replica died, or
        was cut off): the window of `wait_for_replica` starts."""
        self.lost_at = time.monotonic()

    def served(self) -> None:
        """A replica of the hop serves (a call opened on it, a health poll, a wait that saw it):
        the window of `wait_for_replica` is over, so a later death with no call on it is a hop
        down, not a restart."""
        self.lost_at = -math.inf

    def serving(self, channel: grpc.aio.Channel) -> bool:
        """Whether `channel` is READY now (its replica serves: `served`)."""
        ready = channel.get_state() == grpc.ChannelConnectivity.READY
        if ready:
            self.served()
        return ready

    async def wait_for_replica(self, window_s: float, timeout: float, stop: Callable[[], bool] | None = None) -> str:
        """Wait for a replica to serve (a channel READY: gRPC's health Watch says SERVING) until
        `window_s` after this hop lost a replica under a call, at most `timeout` s, or until
        `stop()`: the process restarted on its port (`serve`'s, a container restarted in its
        pod) when no other replica serves meanwhile. Outside a window (a hop down with no call
        lost on it, down for longer, or serving again since) it does not wait. Why it ended:
        "served", "window" (it ran out: no replica came back), "no window", "timeout", "stopped"."""
        channels = [self.shared] if self.policy == "round_robin" else [ch for _, ch in self.replicas]
        deadline = time.monotonic() + timeout
        while not any(ch.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY for ch in channels):
            now = time.monotonic()
            if stop is not None and stop():
                return "stopped"
            if self.lost_at == -math.inf or window_s <= 0:
                return "no window"
            if now >= self.lost_at + window_s:
                return "window"
            if now >= deadline:
                return "timeout"
            await asyncio.sleep(min(0.1, self.lost_at + window_s - now, deadline - now))  # (only while none serves)
        self.served()
        return "served"

    async def wait_after_loss(self, lost_serving: bool, window_s: float, timeout: float,
                              stop: Callable[[], bool] | None = None) -> str:  # fmt: skip
        """After a call on this hop was lost, before its replay (the gateway's and each stage's):
        the loss opens the window if its replica served the call (`lost_serving`), then
        `wait_for_replica`. Why it ended, for `unserved`."""
        if lost_serving:
            self.lost_replica()
        return await self.wait_for_replica(window_s, timeout, stop)

    def health_channels(self) -> list[grpc.aio.Channel]:
        """A channel to each replica, for health polls (a frozen replica must not hide one that
        serves: on the shared channel, round robin sends every other poll to it); the shared one
        where the target is one address or a name gRPC resolves itself."""
        if self.replicas:
            return [ch for _, ch in self.replicas]
        addresses = replica_addresses(self.target)
        if addresses is None or len(addresses) < 2:
            return [self.shared]
        if not self._polled:
            self._polled = [self._dial(a) for a in addresses]
        return self._polled

    async def close(self) -> None:
        await self.shared.close()
        for ch in [*(ch for _, ch in self.replicas), *self._polled]:
            await ch.close()


def unserved(ended: str, window_s: float, ever_served: bool) -> str:
    """What a request that failed after its replays says of its last wait for a replica (how
    `wait_after_loss` ended; `ever_served`: whether a replica served any of its calls there);
    "" when that says nothing (a replica served, a drain stopped it)."""
    if ended == "window":
        return f"no replica served again within failover.replica_wait_s ({window_s:g} s)"
    if ended == "no window" and window_s > 0 and not ever_served:  # (replica_wait_s 0: no wait to explain)
        return "no replica served there when its calls were made, so none was waited for"
    return ""


def _nothing(_: Any) -> None:
    return None
