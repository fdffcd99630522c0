"""The engine thread of a stage: owns the model and every request's state.

The gRPC side (asyncio) only moves messages: it feeds decoded input chunks into a request's
inbox and forwards what the engine emits. Each iteration of the engine loop takes every
request's new input, tells the stage's `Scheduler` which requests can make progress, asks it
for this step's batch (admission, token budget, chunked prefill, cache capacity), runs the
worker's one batched step over that batch, and hands outputs back to the event loop with
`call_soon_threadsafe`. All model state (KV caches, code2wav stream state) is created and
freed on this thread, including on abort, so nothing is freed while a step uses it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
import traceback
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import grpc

from omnistage.v1 import stage_pb2
from services.runtime.scheduler import DONE_STATES, RequestRejected, RequestState, Scheduler, SchedulerConfig
from services.runtime.tensor_blob import DecodedChunk, TensorBlobError

__all__ = [
    "DONE_STATES", "Emit", "Engine", "OutChunk", "RequestState", "StageError", "StageWorker", "StepItem", "invalid",
]  # fmt: skip

log = logging.getLogger(__name__)


class StageError(Exception):
    """Fails one request with a gRPC status; the message names the stage and the problem."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> StageError:
    return StageError(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass
class OutChunk:
    """A chunk before encoding; the gRPC side encodes it (inline or through shared memory)."""

    tensors: dict[str, Any]
    offset: int
    n: int = 0  # stream positions it advances (tokens, frames, samples)
    finished: bool = False
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Emit:
    """What one worker step produced for one request."""

    up: list[OutChunk] = field(default_factory=list)  # to the caller (client side)
    down: list[OutChunk] = field(default_factory=list)  # to the downstream stage
    open_downstream: stage_pb2.Start | None = None  # open the downstream call with this Start
    done: bool = False  # this stage's own work for the request is complete
    close_downstream: bool = False  # no more chunks go down (finished chunk already sent)


@dataclass
class StepItem:
    """One request's part in an engine step."""

    state: Any
    input_finished: bool  # every input chunk has been fed
    num_tokens: int  # what the scheduler gave it: prompt tokens to prefill, or 1 (a decode step)


class StageWorker(ABC):
    """Stage-specific logic; all methods run on the engine thread."""

    stage: str

    @abstractmethod
    def open(self, start: stage_pb2.Start) -> Any:
        """Validate the Start and create per-request state (raise StageError)."""

    @abstractmethod
    def feed(self, state: Any, chunk: DecodedChunk) -> None:
        """Validate and take one input chunk (raise StageError)."""

    @abstractmethod
    def ready(self, state: Any, input_finished: bool) -> bool:
        """Can a step make progress now?"""

    @abstractmethod
    def step(self, state: Any, input_finished: bool) -> Emit:
        """Run one step for this request."""

    @abstractmethod
    def close(self, state: Any) -> None:
        """Free everything the request holds."""

    def step_batch(self, items: list[StepItem]) -> list[Emit | BaseException]:
        """One engine step for every scheduled request. Stages that run several requests in one
        forward override this; the default steps them in turn. A per-request failure is
        returned in that request's place."""
        out: list[Emit | BaseException] = []
        for item in items:
            try:
                out.append(self.step(item.state, item.input_finished))
            except Exception as e:
                out.append(e)
        return out

    def demand(self, state: Any) -> tuple[int, int] | None:
        """(input tokens, most new tokens) to queue the request with, once known (None before).
        Stages with a per-token KV cache (the thinker) count tokens; the others count steps
        (no input tokens, and a bound on the steps a request can take)."""
        return 0, self.max_steps(state)

    def max_steps(self, state: Any) -> int:
        return 1 << 30

    def max_model_len(self) -> int:
        return 1 << 31

    def capacity(self) -> dict[str, int]:
        return {}


@dataclass
class Request:
    request_id: str
    start: stage_pb2.Start
    loop: asyncio.AbstractEventLoop
    out_q: asyncio.Queue[Any]
    down_q: asyncio.Queue[Any]
    state: Any = None
    inbox: collections.deque[DecodedChunk | None] = field(default_factory=collections.deque)  # None: closed
    input_finished: bool = False  # the caller sent `finished` (or closed its side)
    all_input_fed: bool = False  # ...and the worker has taken every chunk before it
    next_offset: int = 0
    scheduled: bool = False  # added to the scheduler
    last_input: float = field(default_factory=time.monotonic)
    abort_requested: bool = False
    down_call: Any = None  # the gRPC side's downstream call for this request, if any


@dataclass
class OpenDownstream:
    """Posted on a request's out_q: open the downstream call with this Start."""

    start: stage_pb2.Start


# Sentinels on a request's out_q: this stage's own work is done / the downstream call is done.
SELF_DONE = object()
DOWN_DONE = object()


class Engine:
    def __init__(
        self,
        worker: StageWorker,
        input_wait_timeout_s: float = 600.0,
        *,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 2048,
        cache_capacity_tokens: int | None = None,
        chunked_prefill: bool = True,
    ) -> None:
        self.worker = worker
        self.input_wait_timeout_s = input_wait_timeout_s
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=worker.max_model_len(),
                cache_capacity_tokens=cache_capacity_tokens,
                chunked_prefill=chunked_prefill,
            )
        )
        self._requests: dict[str, Request] = {}
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"{worker.stage}-engine", daemon=True)
        self._thread.start()

    # ---- called from the event loop -------------------------------------------------------

    def open(self, start: stage_pb2.Start, loop: asyncio.AbstractEventLoop) -> Request:
        if not start.request_id:
            raise invalid(f"{self.worker.stage}: Start.request_id is empty")
        with self._cond:
            if start.request_id in self._requests:
                raise invalid(f"{self.worker.stage}: Start.request_id {start.request_id!r} is already open")
            req = Request(start.request_id, start, loop, asyncio.Queue(), asyncio.Queue())
            self._requests[req.request_id] = req
            self._cond.notify()
        return req

    def feed(self, req: Request, chunk: DecodedChunk) -> None:
        """Order checks happen here so a bad chunk fails before it reaches the worker."""
        stage = self.worker.stage
        with self._cond:
            if req.input_finished:
                raise invalid(f"{stage}: chunk (offset {chunk.offset}) after the finished chunk")
            if chunk.offset != req.next_offset:
                raise invalid(f"{stage}: chunk offset {chunk.offset} out of order; expected {req.next_offset}")
            req.next_offset = chunk.offset + _chunk_length(chunk)
            req.input_finished = chunk.finished
            req.inbox.append(chunk)
            req.last_input = time.monotonic()
            self._cond.notify()

    def finish_input(self, req: Request) -> None:
        with self._cond:
            req.input_finished = True
            req.inbox.append(None)
            self._cond.notify()

    def abort(self, req: Request) -> None:
        with self._cond:
            req.abort_requested = True
            self._cond.notify()

    def load(self) -> dict[str, Any]:
        """Queue metrics: the scheduler's, plus requests open but not yet queued (waiting)."""
        stats = self.scheduler.stats()
        with self._cond:
            unqueued = sum(1 for r in self._requests.values() if not r.scheduled)
            return {
                "running": int(stats["running"]),
                "waiting": int(stats["waiting"]) + unqueued,
                "waiting_for_input": int(stats["waiting_for_input"]),
                "cache_usage": float(stats["cache_usage"]),
                "reserved_tokens": int(stats["reserved_tokens"]),
                "steps_total": int(stats["total_steps"]),
                "step_requests_total": int(stats["total_scheduled_requests"]),
                "open": len(self._requests),
            }

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            for r in self._requests.values():
                r.abort_requested = True
            self._cond.notify()
        self._thread.join(timeout=10)

    # ---- engine thread --------------------------------------------------------------------

    def _post(self, req: Request, item: Any, queue: str = "out") -> None:
        q = req.out_q if queue == "out" else req.down_q
        with contextlib.suppress(RuntimeError):  # loop closed: the call is gone
            req.loop.call_soon_threadsafe(q.put_nowait, item)

    def _finish(self, req: Request, status: RequestState, error: StageError | None = None) -> None:
        try:
            if req.state is not None:
                self.worker.close(req.state)
        except Exception:  # closing must never take the engine down
            log.exception("%s: close failed for %s", self.worker.stage, req.request_id)
        req.state = None
        if req.scheduled:
            req.scheduled = False
            end = {
                RequestState.FINISHED: self.scheduler.finish,
                RequestState.ABORTED: self.scheduler.abort,
            }.get(status, self.scheduler.fail)
            end(req.request_id)
        with self._cond:
            self._requests.pop(req.request_id, None)
        if error is not None:
            self._post(req, error)
            self._post(req, None, "down")
        elif status is RequestState.FINISHED:
            self._post(req, SELF_DONE)
        else:
            self._post(req, None, "down")

    def _fail_with(self, req: Request, exc: BaseException) -> None:
        """Fail one request with the status its exception maps to; the others go on."""
        if isinstance(exc, StageError):
            err = exc
        elif isinstance(exc, TensorBlobError):
            err = invalid(f"{self.worker.stage}: {exc}")
        else:  # a bug must fail the request, not the service
            trace = "".join(traceback.format_exception(exc))
            log.error("%s: request %s failed:\n%s", self.worker.stage, req.request_id, trace)
            err = StageError(grpc.StatusCode.INTERNAL, f"{self.worker.stage}: internal error: {exc}")
        self._finish(req, RequestState.FAILED, err)

    def _guarded(self, req: Request, fn: Any) -> Any:
        """Run `fn()` for one request; any failure fails that request only (returns None)."""
        try:
            return fn()
        except Exception as e:
            self._fail_with(req, e)
        return None

    def _run(self) -> None:
        """One iteration = take every request's new input, then one step for the scheduled batch."""
        while True:
            with self._cond:
                if self._stop and not self._requests:
                    return
                active = list(self._requests.values())
            now = time.monotonic()
            progressed = False
            for req in active:
                took = self._guarded(req, lambda r=req, t=now: self._prepare(r, t))
                progressed |= bool(took)
            plan = self.scheduler.schedule()
            if plan:
                progressed = True
                self._step(plan)
            if not progressed:
                with self._cond:
                    if not any(r.inbox or r.abort_requested for r in self._requests.values()):
                        self._cond.wait(timeout=0.05)

    def _prepare(self, req: Request, now: float) -> bool:
        """Abort, open, feed new input, queue with the scheduler, tell it whether the request
        can step, check the input-wait timeout. Returns whether input was taken."""
        worker = self.worker
        if req.abort_requested:
            self._finish(req, RequestState.ABORTED)
            return False
        if req.state is None:
            req.state = worker.open(req.start)
        took = False
        while True:
            with self._cond:
                if not req.inbox:
                    break
                chunk = req.inbox.popleft()
            took = True
            if chunk is None:  # the caller closed its side
                req.all_input_fed = True
                continue
            worker.feed(req.state, chunk)
            if chunk.finished:
                req.all_input_fed = True
        if not req.scheduled:
            demand = worker.demand(req.state)
            if demand is not None:
                try:
                    self.scheduler.add(req.request_id, demand[0], demand[1])
                except RequestRejected as e:
                    status = grpc.StatusCode
                    code = status.RESOURCE_EXHAUSTED if e.resource_exhausted else status.INVALID_ARGUMENT
                    raise StageError(code, f"{worker.stage}: {e}") from None
                req.scheduled = True
        if worker.ready(req.state, req.all_input_fed):
            if req.scheduled:
                self.scheduler.mark_runnable(req.request_id)
            return took
        if req.scheduled:
            self.scheduler.mark_waiting_for_input(req.request_id)
        if req.all_input_fed:
            raise invalid(f"{worker.stage}: the input ended before the request was complete")
        waited = now - req.last_input
        if self.input_wait_timeout_s and waited > self.input_wait_timeout_s:
            raise StageError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"{worker.stage}: no input for {waited:.1f} s (input_wait_timeout_s="
                f"{self.input_wait_timeout_s:g}); request {req.request_id} starved",
            )
        return took

    def _step(self, plan: Any) -> None:
        with self._cond:
            batch = [(self._requests[item.request_id], item.num_tokens) for item in plan]
        items = [StepItem(req.state, req.all_input_fed, n) for req, n in batch]
        try:
            emits: list[Emit | BaseException] = self.worker.step_batch(items)
        except Exception as e:  # the shared forward failed: every request in it fails
            emits = [e] * len(batch)
        for (req, _), emit in zip(batch, emits, strict=True):
            if isinstance(emit, BaseException):
                self._fail_with(req, emit)
                continue
            self._route(req, emit)
            if not emit.done:
                sreq = self.scheduler.get(req.request_id)
                if sreq is not None and sreq.is_exhausted:  # would never be scheduled again
                    self._fail_with(
                        req,
                        StageError(
                            grpc.StatusCode.INTERNAL,
                            f"{self.worker.stage}: request {req.request_id} used its scheduled budget unfinished",
                        ),
                    )

    def _route(self, req: Request, emit: Emit) -> None:
        for c in emit.up:
            self._post(req, c)
        if emit.open_downstream is not None:
            self._post(req, OpenDownstream(emit.open_downstream))
        for c in emit.down:
            self._post(req, c, "down")
        if emit.close_downstream:
            self._post(req, None, "down")
        if emit.done:
            self._finish(req, RequestState.FINISHED)


def _chunk_length(chunk: DecodedChunk) -> int:
    """How many stream positions (tokens, frames) a chunk advances the offset: meta `n`."""
    n = chunk.meta.get("n", 0)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise invalid(f"chunk meta 'n' must be a non-negative integer, got {n!r}")
    return n
