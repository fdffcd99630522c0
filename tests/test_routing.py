"""Routing: least-outstanding picks the replica with the fewest open calls, in turn on ties."""

from __future__ import annotations

import asyncio

import pytest

from omnistage.server.routing import Router, replica_addresses


def test_replica_addresses_of_each_target_form() -> None:
    assert replica_addresses("ipv4:127.0.0.1:1,127.0.0.1:2") == ["127.0.0.1:1", "127.0.0.1:2"]
    assert replica_addresses("127.0.0.1:7") == ["127.0.0.1:7"]
    assert replica_addresses("dns:///talker:7201") is None


def test_least_outstanding_spreads_open_calls_and_refills_the_freed_replica() -> None:
    async def go() -> None:
        router = Router("ipv4:127.0.0.1:9,127.0.0.1:10,127.0.0.1:11", "least_outstanding", 1 << 20)
        try:
            picks = [router.pick() for _ in range(3)]
            assert router.outstanding == [1, 1, 1]  # one open call on each replica
            assert len({id(ch) for ch, _ in picks}) == 3
            picks[1][1](None)  # the call on the second replica ends
            assert router.outstanding == [1, 0, 1]
            channel, _ = router.pick()
            assert channel is picks[1][0]  # the freed replica gets the next call
        finally:
            await router.close()

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
