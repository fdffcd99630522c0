"""The engine thread of a stage: owns the model and every request's state.

The transport side only moves messages: it opens requests, feeds decoded input chunks into a
request's inbox, and receives what the engine emits through the request's sink. One iteration:

    for every request: take its new input, queue it once its demand is known, note whether its
                       worker can step (and fail it on a timeout or deadline)
    batch = scheduler.schedule()
    outputs = worker.execute(batch)
    scheduler.update_from_output(batch, outputs); hand each output to its request's sink

All model state is created and freed on this thread, on abort too, so nothing is freed while a
step uses it.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from omnistage.engine.device_copy import DeviceInputs, HostOutputs
from omnistage.engine.request import FinishReason, Request, RequestStatus
from omnistage.engine.scheduler import RequestRejected, ScheduledItem, Scheduler, SchedulerConfig
from omnistage.engine.worker import StageWorker, StepOutput
from omnistage.wire import DEADLINE_PASSED, Code, DecodedChunk, StageError, TensorBlobError, invalid

__all__ = ["Engine", "EngineSink", "StepObserver"]

log = logging.getLogger(__name__)


class EngineSink(Protocol):
    """Receives one request's outputs; called on the engine thread (hand over, do not block).
    A sink whose outputs leave the process later (a transport) has `sends_later = True` and
    calls `Engine.sent(req)` once the request's last output has left, or its call has ended."""

    def on_output(self, req: Request, out: StepOutput) -> None: ...

    def on_finished(self, req: Request) -> None:
        """The request ended: `req.status` says how and `req.error` why when it failed."""

    def congested(self) -> bool:
        """Outputs handed over and not yet taken by the caller fill the request's buffer: the
        engine pauses the request until they are taken."""

    def on_started(self, req: Request) -> None:
        """The request's first step is about to run, and its worker says it will send chunks
        downstream (`StageWorker.sends_down`): open the downstream call now. Optional."""

    def on_admitted(self, req: Request) -> None:
        """The request's cache is reserved and its worker holds its input until then
        (`StageWorker.holds_input_until_admitted`): read the rest of its input now. Optional."""


class StepObserver(Protocol):
    """Told of every engine step (metrics): requests in it, seconds it took, the CPU seconds the
    engine thread spent in it (less than `seconds` when the thread waited for a core or for the
    GIL), and the stream positions its outputs to the caller advanced (tokens, frames or samples)."""

    def on_step(self, batch_size: int, seconds: float, cpu_seconds: float, produced: int) -> None: ...

    def on_finished(self, outcome: str) -> None:
        """A request ended here: "ok" (stopped or at its length), "CANCELLED" (its caller), or
        its error's status name."""


def _outcome(req: Request, reason: FinishReason) -> str:
    """How a request ended, in the gateway's words (ok, or a status name)."""
    if reason in (FinishReason.STOP, FinishReason.LENGTH):
        return "ok"
    if reason is FinishReason.ABORT:
        return "CANCELLED"
    return req.error.code.value if req.error is not None else "INTERNAL"


def _congested(sink: object) -> bool:
    """The sink's `congested()`, for sinks that have one (in-process sinks never block)."""
    check = getattr(sink, "congested", None)
    return bool(check()) if check is not None else False


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
        prefill_chunk: int | None = None,
        background: bool = True,
        observer: StepObserver | None = None,
        output_stall_timeout_s: float = 60.0,
        on_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        """`background=False`: no engine thread; the owner calls `run_once()` (in-process use).
        `on_dead(exc)`: called on the engine thread if it fails outside any one request's work (a
        bug in the loop, the scheduler or a step's bookkeeping), when nothing can step again:
        a stage process exits, so its callers replay elsewhere and `serve` restarts it (a live
        process with a dead engine would hold every request until its deadline)."""
        self.on_dead = on_dead
        self.dead: BaseException | None = None
        self.worker = worker
        self.observer = observer
        self.input_wait_timeout_s = input_wait_timeout_s
        self.output_stall_timeout_s = output_stall_timeout_s
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=worker.max_model_len(),
                cache_capacity_tokens=cache_capacity_tokens,
                chunked_prefill=chunked_prefill,
                prefill_chunk=prefill_chunk,
            )
        )
        self._requests: dict[str, Request] = {}
        self._arrivals = 0
        self._sent: list[str] = []  # requests whose transport is done with them (see `sent`)
        self._cond = threading.Condition()
        self._stop = False
        self.step_seconds_total = 0.0  # time in worker.execute, for metrics
        self.host_outputs = HostOutputs()  # a step's CUDA outputs -> pinned host, on a side stream
        self.device_inputs = DeviceInputs(worker.device, worker.wants_on_device)
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name=f"{worker.name}-engine", daemon=True)
            self._thread.start()

    # ---- called from the transport side ---------------------------------------------------

    def open(self, request_id: str, params: Any, sink: EngineSink, deadline: float | None = None,
             caller_id: str = "") -> Request:  # fmt: skip
        """A new request; `deadline` is a time.monotonic() value; `caller_id`: the id the caller
        knows it by, which error messages name (default `request_id`)."""
        name = self.worker.name
        if not request_id:
            raise invalid(f"{name}: Start.request_id is empty")
        with self._cond:
            if request_id in self._requests:
                raise invalid(f"{name}: Start.request_id {request_id!r} is already open")
            self._arrivals += 1
            req = Request(request_id, params, arrival=self._arrivals, caller_id=caller_id, sink=sink,
                          deadline=deadline)  # fmt: skip
            self._requests[request_id] = req
            self._cond.notify()
        return req

    def feed(self, req: Request, chunk: DecodedChunk) -> None:
        """Order checks happen here, so a bad chunk fails before it reaches the worker. A request
        that has ended (e.g. the talker at its frame limit while the thinker still sends) drops
        what comes after its end, still checked, and holds none of it."""
        name = self.worker.name
        with self._cond:  # one reader feeds a request, so nothing changes these between the two blocks
            if req.input_closed:
                raise invalid(f"{name}: chunk (offset {chunk.offset}) after the finished chunk")
            if chunk.offset != req.next_offset:
                raise invalid(f"{name}: chunk offset {chunk.offset} out of order; expected {req.next_offset}")
            ended = self._requests.get(req.request_id) is not req
        if not ended:
            self.device_inputs.start(chunk)  # only a chunk that is in order takes device memory
        with self._cond:
            req.next_offset = chunk.offset + chunk.length
            req.input_closed = chunk.finished
            if ended or self._requests.get(req.request_id) is not req:  # (or it ended meanwhile)
                return
            req.inbox.append(chunk)
            req.last_input = time.monotonic()
            self._cond.notify()

    def close_input(self, req: Request) -> None:
        """The caller closed its side: no more input will come."""
        with self._cond:
            req.input_closed = True
            if self._requests.get(req.request_id) is req:  # (once it has ended nothing reads it)
                req.inbox.append(None)
                self._cond.notify()

    def abort(self, req: Request, error: StageError | None = None) -> None:
        """Cancel (no error) or fail (`error`) the request; a no-op once it has ended."""
        with self._cond:
            if error is not None and req.error is None:
                req.error = error
            req.abort_requested = True
            self._cond.notify()

    def sent(self, req: Request) -> None:
        """The transport has sent the request's last output, or its call ended: free the
        reservation its worker kept past its end (`StageWorker.holds_reservation_until_sent`).
        Idempotent; call `abort` first when the call ended early. A no-op for a worker that
        holds nothing (the transport tells every stage alike)."""
        if not self.worker.holds_reservation_until_sent:
            return
        with self._cond:
            req.sent = True  # a request that ends after this holds nothing (see _holds)
            self._sent.append(req.request_id)
            self._cond.notify()

    def load(self) -> dict[str, Any]:
        """Requests by status plus the scheduler's cache use and totals."""
        with self._cond:
            statuses = [r.status for r in self._requests.values()]
        stats = self.scheduler.stats()
        return {
            "running": statuses.count(RequestStatus.RUNNING),
            "waiting": statuses.count(RequestStatus.WAITING),
            "waiting_for_input": statuses.count(RequestStatus.WAITING_FOR_INPUT),
            "open": len(statuses),
            "cache_usage": float(stats["cache_usage"]),
            "reserved_tokens": int(stats["reserved_tokens"]),
            "held_tokens": int(stats["held_tokens"]),
            "steps_total": int(stats["total_steps"]),
            "step_requests_total": int(stats["total_scheduled_requests"]),
            "step_seconds_total": self.step_seconds_total,
            "kv_pool_tokens": self.worker.kv_pool_tokens(),
            "prefix_cache_tokens": self.worker.prefix_cache_tokens(),
            "prefill_tokens_total": int(stats["total_prefill_tokens"]),
            "cached_tokens_total": int(stats["total_cached_tokens"]),
        }

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            for r in self._requests.values():
                r.abort_requested = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ---- engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:
            self.dead = e
            with self._cond:  # (a request that makes every replica's engine fail shows by its id in each log)
                held = ", ".join(self._requests) or "none"
            log.critical("%s: the engine thread failed (requests in it: %s); no request can step again:\n%s",
                         self.worker.name, held, "".join(traceback.format_exception(e)))  # fmt: skip
            if self.on_dead is not None:
                self.on_dead(e)

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._stop and not self._requests:
                    return
            if not self.run_once():
                with self._cond:
                    if not self._sent and not any(r.inbox or r.abort_requested for r in self._requests.values()):
                        self._cond.wait(timeout=0.05)

    def run_once(self) -> bool:
        """One iteration: every request's new input, then one step. Returns whether anything
        happened (input taken or a step run)."""
        with self._cond:
            active = list(self._requests.values())
            sent, self._sent = self._sent, []
        for request_id in sent:  # a hold made before; one not made yet never will be (req.sent)
            self.scheduler.release(request_id)
        now = time.monotonic()
        progressed = bool(sent)
        for req in active:
            try:
                progressed |= self._prepare(req, now)
            except Exception as e:
                self._fail(req, e)
        batch = self.scheduler.schedule()
        if self.worker.holds_input_until_admitted:
            for req in active:
                if req.admitted and not req.told_admitted:
                    req.told_admitted, req.last_input = True, time.monotonic()  # its input wait starts now
                    notify = getattr(req.sink, "on_admitted", None)  # in-process sinks have none
                    if notify is not None:
                        notify(req)
        if batch:
            progressed = True
            self._step(batch)
        return progressed

    @property
    def idle(self) -> bool:
        """No request is open."""
        with self._cond:
            return not self._requests

    def _prepare(self, req: Request, now: float) -> bool:
        """Abort, open, feed new input, queue, note readiness, check timeouts. Returns whether
        input was taken."""
        worker = self.worker
        if req.abort_requested:
            self._end(req, FinishReason.ERROR if req.error else FinishReason.ABORT)
            return False
        if req.deadline is not None and now > req.deadline:
            # queued, able to step, never admitted: it waited for room, not for its own steps
            waited = " waiting to be admitted (the stage's max_num_seqs or cache_capacity_tokens taken by the " \
                     "requests before it)" if req.queued and not req.admitted and req.ready else ""  # fmt: skip
            raise StageError(Code.DEADLINE_EXCEEDED,
                             f"{worker.name}: request {req.shown_id} {DEADLINE_PASSED}{waited}")  # fmt: skip
        if req.state is None:
            worker.open(req)
        took = False
        while True:
            with self._cond:
                if not req.inbox:
                    break
                chunk = req.inbox.popleft()
            took = True
            if chunk is not None:
                self.device_inputs.finish(chunk)
                worker.feed(req, chunk)
            if chunk is None or chunk.finished:
                req.input_finished = True
        if not req.queued:
            demand = worker.demand(req)
            if demand is not None:
                try:
                    self.scheduler.add(req, *demand, reserve_early=worker.holds_input_until_admitted)
                except RequestRejected as e:  # it would be refused again: no retry helps (HTTP 400)
                    raise StageError(Code.INVALID_ARGUMENT, f"{worker.name}: {e}") from None
        ready = worker.ready(req)
        # Backpressure: a caller that stops reading pauses its own request (its outputs wait in
        # a bounded buffer), and fails it after output_stall_timeout_s.
        congested = ready and _congested(req.sink)
        if not congested:
            req.stalled_since = None
        elif req.stalled_since is None:
            req.stalled_since = now
        elif self.output_stall_timeout_s and now - req.stalled_since > self.output_stall_timeout_s:
            raise StageError(Code.DEADLINE_EXCEEDED, f"{worker.name}: the caller read none of request "
                             f"{req.shown_id}'s outputs for {now - req.stalled_since:.1f} s "
                             f"(output_stall_timeout_s={self.output_stall_timeout_s:g})")  # fmt: skip
        if req.queued:
            self.scheduler.set_ready(req, ready and not congested)
        if ready:
            return took
        if req.input_finished:
            raise invalid(f"{worker.name}: the input ended before the request was complete")
        if req.reserve_early and not req.admitted:
            return took  # its input is held back until its cache is reserved: it waits for room, not input
        waited = now - req.last_input
        if self.input_wait_timeout_s and waited > self.input_wait_timeout_s:
            raise StageError(
                Code.DEADLINE_EXCEEDED,
                f"{worker.name}: no input for {waited:.1f} s (input_wait_timeout_s="
                f"{self.input_wait_timeout_s:g}); request {req.shown_id} starved",
            )
        return took

    def _step(self, batch: Sequence[ScheduledItem]) -> None:
        for item in batch:
            req = item.request
            if not req.started:
                req.started = True
                notify = getattr(req.sink, "on_started", None)  # in-process sinks have none
                if notify is not None and self.worker.sends_down(req):
                    notify(req)
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            outputs: list[StepOutput | Exception] = self.worker.execute(batch)
            self.host_outputs.stage(outputs)
        except Exception as e:  # the shared forward failed: every request in it fails
            outputs = [self._shared_failure(e, batch)] * len(batch)
        seconds, cpu_seconds = time.perf_counter() - t0, time.thread_time() - cpu0
        self.step_seconds_total += seconds
        if self.observer is not None:
            produced = sum(self.worker.made(out) for out in outputs if isinstance(out, StepOutput))
            self.observer.on_step(len(batch), seconds, cpu_seconds, produced)
        reasons = [out.finished if isinstance(out, StepOutput) else FinishReason.ERROR for out in outputs]
        holds = [r is not None and self._holds(it.request, r) for it, r in zip(batch, reasons, strict=True)]
        self.scheduler.update_from_output(batch, reasons, holds)
        for item, out in zip(batch, outputs, strict=True):
            req = item.request
            if isinstance(out, Exception):
                self._fail(req, out)
                continue
            req.sink.on_output(req, out)
            if out.finished is not None:
                req.finish_detail = out.detail
                self._end(req, out.finished)
            elif req.is_exhausted:  # would never be scheduled again
                self._fail(req, StageError(Code.INTERNAL, f"{self.worker.name}: request {req.shown_id} "
                                                          "used its scheduled budget unfinished"))

    def _shared_failure(self, exc: Exception, batch: Sequence[ScheduledItem]) -> StageError:
        """What a step's failure is to each request in it, logged once for the step (not once
        per request); out of memory is RESOURCE_EXHAUSTED (retryable: the same request may fit later)."""
        ids = ", ".join(it.request.request_id for it in batch)
        step = f"a step of {len(batch)} requests"
        return self._stage_error(exc, f"{step} ({ids})", step)

    def _stage_error(self, exc: BaseException, what: str, said: str | None = None) -> StageError:
        """The status `exc` maps to; an unexpected one (a bug) is logged with its traceback. `what`
        failed, as the log says it (`said`: as the caller is told, where that differs)."""
        if isinstance(exc, StageError):
            return exc
        if isinstance(exc, TensorBlobError):
            return invalid(f"{self.worker.name}: {exc}")
        # out of memory (torch's, CPU or CUDA, or Python's), in a step or in one request's own work
        # (a media encoder): RESOURCE_EXHAUSTED, retryable, as the same request may fit later
        if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
            log.error("%s: out of memory in %s: %s", self.worker.name, what, exc)
            return StageError(Code.RESOURCE_EXHAUSTED, f"{self.worker.name}: out of memory in {said or what}")
        # a bug must fail the request, not the service
        log.error("%s: %s failed:\n%s", self.worker.name, what, "".join(traceback.format_exception(exc)))
        return StageError(Code.INTERNAL, f"{self.worker.name}: internal error: {exc}")

    def _fail(self, req: Request, exc: BaseException) -> None:
        """Fail one request with the status its exception maps to; the others go on."""
        err = self._stage_error(exc, f"request {req.request_id}", f"request {req.shown_id}")
        if req.error is None:
            req.error = err
        self._end(req, FinishReason.ERROR)

    def _holds(self, req: Request, reason: FinishReason | None) -> bool:
        """Does the request keep its reservation past its end until `sent`? One that ended well,
        of a worker that asks for it, whose outputs wait to be sent and whose transport has not
        said `sent` yet (whatever the order of the two); a cancelled or failed one sends nothing more."""
        if not (self.worker.holds_reservation_until_sent and reason in (FinishReason.STOP, FinishReason.LENGTH)
                and getattr(req.sink, "sends_later", False)):  # fmt: skip
            return False
        with self._cond:  # `sent` is set from the transport's thread
            return not (req.sent or req.abort_requested)

    def _end(self, req: Request, reason: FinishReason) -> None:
        """Free the request here and tell its sink; every ending goes through this once."""
        try:
            if req.state is not None:
                self.worker.close(req)
        except Exception:  # closing must never take the engine down
            log.exception("%s: close failed for %s", self.worker.name, req.request_id)
        req.state = None
        self.scheduler.finish(req, reason)  # a no-op for one a step ended (update_from_output, with its hold)
        with self._cond:
            req.inbox.clear()  # what came and was not read (feed keeps nothing once it has ended)
            if self._requests.pop(req.request_id, None) is None:
                return
        outcome = _outcome(req, reason)
        if outcome == "INVALID_ARGUMENT" and req.error is not None:  # a caller's fault: say which and why
            log.info("%s: request %s refused: %s", self.worker.name, req.request_id, req.error.message)
        if self.observer is not None:
            self.observer.on_finished(outcome)
        req.sink.on_finished(req)
