"""The engine thread's handoff to the event loop (omnistage/server/handoff.py)."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import pytest

from omnistage.server.handoff import LoopHandoff


def test_a_burst_from_another_thread_runs_in_order_after_one_wake_up() -> None:
    async def go() -> tuple[list[int], int, LoopHandoff]:
        loop = asyncio.get_running_loop()
        handoff = LoopHandoff.of(loop)
        ran: list[int] = []
        done = asyncio.Event()

        def burst() -> None:  # a step's outputs, posted while the loop waits for the GIL
            for i in range(50):
                handoff.post(ran.append, i)
            handoff.post(done.set)

        thread = threading.Thread(target=burst)
        thread.start()
        thread.join()  # all posted before the loop runs any of them
        await asyncio.wait_for(done.wait(), 5)
        return ran, handoff.wakeups, handoff

    ran, wakeups, handoff = asyncio.run(go())
    assert ran == list(range(50))
    assert wakeups == 1  # one self-pipe write for 51 callbacks
    assert handoff._pending == [] and not handoff._scheduled


def _post_both(handoff: LoopHandoff, fn: Any, arg: Any, then: Any) -> None:
    handoff.post(fn, arg)
    handoff.post(then)


def test_posts_after_a_run_wake_the_loop_again_and_calls_on_one_loop_share_it() -> None:
    async def go() -> tuple[list[str], int, bool]:
        loop = asyncio.get_running_loop()
        handoff = LoopHandoff.of(loop)
        ran: list[str] = []
        for name in ("a", "b"):
            ran_it = asyncio.Event()
            thread = threading.Thread(target=_post_both, args=(handoff, ran.append, name, ran_it.set))
            thread.start()
            thread.join()  # both posted before the loop runs either
            await asyncio.wait_for(ran_it.wait(), 5)
        return ran, handoff.wakeups, LoopHandoff.of(loop) is handoff

    ran, wakeups, shared = asyncio.run(go())
    assert ran == ["a", "b"] and wakeups == 2 and shared


def test_a_failing_callback_is_logged_and_the_rest_still_run(caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> list[Any]:
        handoff = LoopHandoff.of(asyncio.get_running_loop())
        ran: list[Any] = []
        done = asyncio.Event()

        def broken() -> None:
            raise ValueError("boom")

        def burst() -> None:
            handoff.post(ran.append, 1)
            handoff.post(broken)
            handoff.post(ran.append, 2)
            handoff.post(done.set)

        threading.Thread(target=burst).start()
        await asyncio.wait_for(done.wait(), 5)
        return ran

    with caplog.at_level(logging.ERROR, logger="omnistage.server.handoff"):
        assert asyncio.run(go()) == [1, 2]
    assert "boom" in caplog.text


def test_a_closed_loop_drops_posts_without_raising() -> None:
    loop = asyncio.new_event_loop()
    handoff = LoopHandoff.of(loop)
    loop.close()
    ran: list[int] = []
    handoff.post(ran.append, 1)  # a process stopping: the engine thread must not raise
    handoff.post(ran.append, 2)
    assert ran == [] and handoff._pending == [] and not handoff._scheduled


def test_a_loop_that_is_gone_leaves_the_registry() -> None:
    import gc
    import weakref

    loop = asyncio.new_event_loop()
    LoopHandoff.of(loop)
    gone = weakref.ref(loop)
    loop.close()
    del loop
    gc.collect()
    assert gone() is None  # the handoff kept no strong reference to it
