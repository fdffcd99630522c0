"""Callbacks from the engine thread to the event loop, one loop wake-up for a burst of them.

`loop.call_soon_threadsafe` writes a byte to the loop's self-pipe for every callback. An engine
step hands over one output per request in it, so a step of 16 requests made 16 writes, each a
system call that lets go of the GIL, and the woken loop thread could take the GIL between two of
them (py-spy under load at c=16 on 2 cores: `_write_to_self` was in 7 % of the samples of the
thinker's engine thread and 4 % of the talker's; with this, 3 % and 2.8 %: a write a step
remains). `LoopHandoff.post` queues the callback and wakes the loop only when no run of the
queue is pending; the loop runs the whole queue, in order, when it next gets the GIL. Measured
by `omnistage bench handoff` (2-core VM, a step of 16 outputs): the engine thread's handoff took
41-200 us (p50, six runs) with a write each, 5-8 us with one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["LoopHandoff"]

log = logging.getLogger(__name__)

_registry: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopHandoff] = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


class LoopHandoff:
    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> LoopHandoff:
        """The loop's one handoff (shared by every call on it, so a step's outputs share a wake-up)."""
        with _registry_lock:
            handoff = _registry.get(loop)
            if handoff is None:
                handoff = _registry[loop] = cls(loop)
            return handoff

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # not a strong one: the registry's key would never be freed
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self._scheduled = False  # a run of the queue is on the loop's way
        self.wakeups = 0  # loop wake-ups asked for (tests)

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the loop, after everything posted before it. From any thread; a
        closed loop (the process is stopping) drops it, as call_soon_threadsafe would refuse it."""
        with self._lock:
            self._pending.append((fn, args))
            if self._scheduled:
                return
            self._scheduled = True
            self.wakeups += 1
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("the loop is gone")
            loop.call_soon_threadsafe(self._run)
        except RuntimeError:  # loop closed
            with self._lock:
                self._pending.clear()
                self._scheduled = False

    def _run(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._scheduled = False
        for fn, args in pending:
            try:
                fn(*args)
            except Exception:  # one callback's bug must not drop the others
                log.exception("callback %r failed", fn)
