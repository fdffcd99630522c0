"""Continuous-batching scheduler shared by every stage (DESIGN.md §4, issue 6).

One class, configured per stage, decides which requests take part in the next batched forward
step and how many tokens each contributes. It is pure bookkeeping: no torch, no gRPC, no time.

Token model. A request has ``num_prompt_tokens`` of input (which may grow while input streams in,
through ``extend_input``) and may generate up to ``max_new_tokens``. ``num_computed_tokens`` counts
what is in its cache: input tokens consumed by prefill steps plus one per decode step. A step for a
request is either

* a *prefill* of ``n`` pending input tokens (``n`` up to the step's remaining token budget with
  chunked prefill; otherwise the whole pending input, and a prompt larger than
  ``max_num_batched_tokens`` is rejected at ``add``), or
* a *decode* of exactly one token, which generates one token (``num_generated += 1``).

``schedule()`` advances these counters for what it returns (the engine runs every scheduled
request, or fails it). The scheduler stops scheduling decodes at ``max_new_tokens`` (or when the
cache reservation is used up); the engine calls ``finish()`` when its worker is done (EOS, stop
string, last audio chunk), which may be earlier. A request with nothing left to compute
(``is_exhausted``) stays admitted until the engine finishes or fails it.

Policy per step, within ``max_num_batched_tokens`` tokens and ``max_num_seqs`` requests:

1. decodes of admitted requests (one token each), in admission order;
2. pending prefill of admitted requests (a long prompt continues its chunks), in admission order;
3. admission of waiting requests, first come first served. A waiting request is admitted only if
   the cache can hold it to its maximum length given what admitted requests have reserved; if the
   first runnable waiting request cannot be admitted (cache, budget, or without chunked prefill a
   prompt that does not fit the rest of the step), nothing behind it is admitted either, so the
   head is never starved. Waiting requests with nothing to run yet (no input so far, or marked
   waiting for input) are passed over without blocking the queue and keep their arrival order.

Cache accounting. On admission a request reserves ``max_tokens`` tokens: the most its input can
grow to (its prompt when the input is complete, else ``max_input_tokens`` if given, else
``max_model_len``) plus ``max_new_tokens``, capped at ``max_model_len``. When its input completes
the reservation shrinks to the real prompt plus ``max_new_tokens`` (capped). It is released on
``finish``/``abort``/``fail``. An admitted request never exceeds its reservation, so admission never
lets in a request that cannot finish. There is no preemption.

States: ``WAITING`` (not admitted, nothing reserved) -> ``RUNNING`` <-> ``WAITING_FOR_INPUT``
(admitted: not runnable until ``extend_input`` or ``mark_runnable``) -> ``FINISHED`` /
``ABORTED`` / ``FAILED``. An admitted request never goes back to ``WAITING``.

Threading. The engine thread is the only caller of every method except ``stats()``, so the
scheduler needs no locking for correctness; an internal lock is still taken by each public method
so that ``stats()`` (the metrics / ``Info`` RPC on the event loop) sees a consistent snapshot. It is
uncontended in practice.

Engine sketch (one iteration of the engine loop)::

    for each newly opened request:   sched.add(id, n_prompt, max_new, input_complete=..., ...)
    for each input chunk fed:        sched.extend_input(id, n, complete=chunk.finished)
                                     (and mark_waiting_for_input / mark_runnable from worker.ready)
    for each abort:                  sched.abort(id); worker.close(state)
    out = sched.schedule()
    if out.scheduled:
        results = worker.step_batch([(states[i], n, is_prefill) for i, n, is_prefill in out])
        for each request whose worker output says done: sched.finish(id)
        for each request whose step raised:              sched.fail(id)
    else:
        wait for input
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple


class RequestState(enum.Enum):
    """Same names and values as ``services.runtime.engine.RequestState``."""

    WAITING = "WAITING"  # not admitted yet: nothing reserved, no step run
    RUNNING = "RUNNING"  # admitted and (unless exhausted) schedulable
    WAITING_FOR_INPUT = "WAITING_FOR_INPUT"  # admitted, keeps its reservation, skipped until input
    FINISHED = "FINISHED"
    ABORTED = "ABORTED"
    FAILED = "FAILED"


DONE_STATES = (RequestState.FINISHED, RequestState.ABORTED, RequestState.FAILED)
ADMITTED_STATES = (RequestState.RUNNING, RequestState.WAITING_FOR_INPUT)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"SchedulerConfig.{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int  # requests per step
    max_num_batched_tokens: int  # tokens per step (prefill chunks + decodes)
    max_model_len: int  # prompt + generated tokens of one request
    cache_capacity_tokens: int | None  # tokens the cache holds over all admitted requests; None: unbounded
    chunked_prefill: bool = True

    def __post_init__(self) -> None:
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_model_len", self.max_model_len)
        if self.cache_capacity_tokens is not None:
            _positive_int("cache_capacity_tokens", self.cache_capacity_tokens)
        if not isinstance(self.chunked_prefill, bool):
            raise ValueError(f"SchedulerConfig.chunked_prefill must be a bool, got {self.chunked_prefill!r}")


class RequestRejected(ValueError):
    """``add`` refused a request that could never run to completion under this configuration.

    ``resource_exhausted`` is True when the request is valid but larger than the stage's cache
    (answer RESOURCE_EXHAUSTED); False when it breaks a model limit (answer INVALID_ARGUMENT).
    """

    def __init__(self, message: str, *, resource_exhausted: bool) -> None:
        super().__init__(message)
        self.resource_exhausted = resource_exhausted


@dataclass(eq=False)
class SchedulerRequest:
    """One request's scheduling state. Callers read it; only the scheduler writes it."""

    request_id: str
    arrival: int  # arrival order (0, 1, 2, ...)
    num_prompt_tokens: int  # input so far; grows with extend_input
    max_new_tokens: int
    input_complete: bool
    stream_decode: bool  # may decode while its input is still streaming (the talker)
    max_input_tokens: int  # the most num_prompt_tokens can become
    max_tokens: int  # cache reservation: most tokens it can ever hold (capped at max_model_len)
    num_computed_tokens: int = 0  # in its cache: consumed input + decode steps
    num_generated: int = 0  # decode steps scheduled
    state: RequestState = RequestState.WAITING
    blocked: bool = False  # mark_waiting_for_input: skipped until extend_input / mark_runnable
    reserved_tokens: int = 0  # cache tokens held now (0 unless admitted)

    @property
    def num_pending_input(self) -> int:
        """Input tokens received but not yet prefilled."""
        return self.num_prompt_tokens - (self.num_computed_tokens - self.num_generated)

    @property
    def decode_limit(self) -> int:
        """How many decode steps it may take given its reservation and the input still to come."""
        return max(0, min(self.max_new_tokens, self.max_tokens - self.max_input_tokens))

    @property
    def can_decode(self) -> bool:
        return (
            self.num_pending_input == 0
            and (self.input_complete or self.stream_decode)
            and self.num_generated < self.decode_limit
        )

    @property
    def is_runnable(self) -> bool:
        """Has new input to consume or can decode, and is not marked waiting for input."""
        if self.state in DONE_STATES or self.blocked:
            return False
        return self.num_pending_input > 0 or self.can_decode

    @property
    def is_exhausted(self) -> bool:
        """Input complete and consumed, no decode left: only finish()/fail() remains."""
        return (
            self.state not in DONE_STATES
            and self.input_complete
            and self.num_pending_input == 0
            and self.num_generated >= self.decode_limit
        )


class ScheduledItem(NamedTuple):
    request_id: str
    num_tokens: int
    is_prefill: bool


@dataclass
class ScheduleOutput:
    scheduled: list[ScheduledItem] = field(default_factory=list)  # decodes first, then prefills
    admitted: list[str] = field(default_factory=list)  # request ids admitted in this step
    num_batched_tokens: int = 0

    def __iter__(self) -> Iterator[ScheduledItem]:
        return iter(self.scheduled)

    def __len__(self) -> int:
        return len(self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


def _non_negative_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


class Scheduler:
    """See the module docstring for the policy. Engine thread only, except ``stats()``."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._requests: dict[str, SchedulerRequest] = {}  # every non-terminal request
        self._waiting: dict[str, SchedulerRequest] = {}  # not admitted, in arrival order
        self._admitted: dict[str, SchedulerRequest] = {}  # RUNNING / WAITING_FOR_INPUT, admission order
        self._reserved = 0
        self._next_arrival = 0
        self._totals: dict[str, int] = dict.fromkeys(
            (
                "added", "rejected", "admitted", "finished", "aborted", "failed",
                "steps", "scheduled_requests", "scheduled_tokens", "prefill_tokens", "decode_tokens",
            ),
            0,
        )  # fmt: skip

    # ---- requests --------------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        num_prompt_tokens: int,
        max_new_tokens: int,
        input_complete: bool = True,
        *,
        max_input_tokens: int | None = None,
        stream_decode: bool = False,
    ) -> SchedulerRequest:
        """Queue a request (WAITING). Raises ``RequestRejected`` (a ValueError) if it can never run.

        ``max_input_tokens`` bounds how far a streaming input can grow (default ``max_model_len``);
        a tighter bound means a smaller cache reservation, and is needed for ``stream_decode``
        to have room to decode before the input completes. ``stream_decode`` lets the request
        decode while its input is still incomplete (within the room its bound leaves).
        """
        cfg = self.config
        with self._lock:
            if not isinstance(request_id, str) or not request_id:
                raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} is already scheduled")
            _non_negative_int("num_prompt_tokens", num_prompt_tokens)
            _non_negative_int("max_new_tokens", max_new_tokens)
            if max_input_tokens is not None:
                _non_negative_int("max_input_tokens", max_input_tokens)
            if max_input_tokens is not None and max_input_tokens < num_prompt_tokens:
                raise ValueError(
                    f"request {request_id!r}: max_input_tokens={max_input_tokens} is below the "
                    f"{num_prompt_tokens} input tokens already given"
                )
            if input_complete:
                bound = num_prompt_tokens  # max_input_tokens is moot
            elif max_input_tokens is None:
                bound = cfg.max_model_len
            else:
                bound = max_input_tokens
            try:
                explicit = input_complete or max_input_tokens is not None
                max_tokens = self._check_fits(request_id, num_prompt_tokens, bound, max_new_tokens, explicit)
            except RequestRejected:
                self._totals["rejected"] += 1
                raise
            req = SchedulerRequest(
                request_id=request_id,
                arrival=self._next_arrival,
                num_prompt_tokens=num_prompt_tokens,
                max_new_tokens=max_new_tokens,
                input_complete=input_complete,
                stream_decode=stream_decode,
                max_input_tokens=bound,
                max_tokens=max_tokens,
            )
            self._next_arrival += 1
            self._requests[request_id] = req
            self._waiting[request_id] = req
            self._totals["added"] += 1
            return req

    def _check_fits(
        self, request_id: str, num_prompt_tokens: int, bound: int, max_new_tokens: int, explicit_bound: bool
    ) -> int:
        cfg = self.config
        mml = cfg.max_model_len
        if num_prompt_tokens > mml:
            raise RequestRejected(
                f"request {request_id!r}: input of {num_prompt_tokens} tokens exceeds max_model_len={mml}",
                resource_exhausted=False,
            )
        if bound > mml:
            raise RequestRejected(
                f"request {request_id!r}: max_input_tokens={bound} exceeds max_model_len={mml}",
                resource_exhausted=False,
            )
        if explicit_bound and max_new_tokens > 0 and bound == mml:
            what = "input" if bound == num_prompt_tokens else "max_input_tokens"
            raise RequestRejected(
                f"request {request_id!r}: {what} of {bound} tokens fills max_model_len={mml}, "
                f"leaving no room for max_new_tokens={max_new_tokens}",
                resource_exhausted=False,
            )
        if not cfg.chunked_prefill and num_prompt_tokens > cfg.max_num_batched_tokens:
            raise RequestRejected(
                f"request {request_id!r}: prompt of {num_prompt_tokens} tokens exceeds max_num_batched_tokens="
                f"{cfg.max_num_batched_tokens} and chunked prefill is off",
                resource_exhausted=False,
            )
        max_tokens = min(cfg.max_model_len, bound + max_new_tokens)
        cap = cfg.cache_capacity_tokens
        if cap is not None and max_tokens > cap:
            raise RequestRejected(
                f"request {request_id!r}: needs {max_tokens} tokens of cache ({bound} input + max_new_tokens="
                f"{max_new_tokens}, capped at max_model_len={cfg.max_model_len}) but cache_capacity_tokens={cap}",
                resource_exhausted=True,
            )
        return max_tokens

    def extend_input(self, request_id: str, n: int, complete: bool) -> SchedulerRequest:
        """``n`` more input tokens arrived (``complete``: that was the last). Wakes the request.

        Raises ValueError (state unchanged) if the input was already complete or would grow past
        the request's ``max_input_tokens``; the engine should then fail the request.
        """
        with self._lock:
            req = self._get(request_id)
            _non_negative_int("n", n)
            if req.input_complete:
                raise ValueError(f"request {request_id!r}: input extended after it was complete")
            new_total = req.num_prompt_tokens + n
            if new_total > req.max_input_tokens:
                raise ValueError(
                    f"request {request_id!r}: input grows to {new_total} tokens, past its bound of "
                    f"{req.max_input_tokens} (max_input_tokens or max_model_len={self.config.max_model_len})"
                )
            req.num_prompt_tokens = new_total
            req.blocked = False
            if complete:
                req.input_complete = True
                req.max_input_tokens = new_total
                new_max = min(self.config.max_model_len, new_total + req.max_new_tokens)
                if req.reserved_tokens:
                    self._reserved -= req.reserved_tokens - new_max
                    req.reserved_tokens = new_max
                req.max_tokens = new_max
            self._refresh(req)
            return req

    def mark_waiting_for_input(self, request_id: str) -> SchedulerRequest:
        """Skip the request until ``extend_input`` or ``mark_runnable`` (e.g. the worker needs more
        input than one token to step: a full_payload edge, code2wav's chunk). Keeps its reservation.
        """
        return self._set_blocked(request_id, True)

    def mark_runnable(self, request_id: str) -> SchedulerRequest:
        """Undo ``mark_waiting_for_input``; it runs again if it has input to consume or can decode."""
        return self._set_blocked(request_id, False)

    def _set_blocked(self, request_id: str, blocked: bool) -> SchedulerRequest:
        with self._lock:
            req = self._get(request_id)
            req.blocked = blocked
            self._refresh(req)
            return req

    def finish(self, request_id: str) -> SchedulerRequest:
        return self._terminate(request_id, RequestState.FINISHED, "finished")

    def abort(self, request_id: str) -> SchedulerRequest:
        return self._terminate(request_id, RequestState.ABORTED, "aborted")

    def fail(self, request_id: str) -> SchedulerRequest:
        return self._terminate(request_id, RequestState.FAILED, "failed")

    def get(self, request_id: str) -> SchedulerRequest | None:
        """The live (non-terminal) request, or None."""
        with self._lock:
            return self._requests.get(request_id)

    def __contains__(self, request_id: object) -> bool:
        with self._lock:
            return request_id in self._requests

    def __len__(self) -> int:
        """Live (non-terminal) requests."""
        with self._lock:
            return len(self._requests)

    def has_runnable(self) -> bool:
        """Could ``schedule()`` return something now (ignoring cache and budget limits)?"""
        with self._lock:
            return any(r.is_runnable for r in self._requests.values())

    # ---- the step ----------------------------------------------------------------------------

    def schedule(self) -> ScheduleOutput:
        """Pick this step's requests and token counts, and advance their counters as if run."""
        cfg = self.config
        with self._lock:
            out = ScheduleOutput()
            budget = cfg.max_num_batched_tokens
            slots = cfg.max_num_seqs

            # 1. decodes of admitted requests
            for req in self._admitted.values():
                if not slots or not budget:
                    break
                if req.is_runnable and req.num_pending_input == 0:
                    out.scheduled.append(ScheduledItem(req.request_id, 1, False))
                    budget -= 1
                    slots -= 1

            # 2. pending prefill of admitted requests
            head_blocked = False
            for req in self._admitted.values():
                if not slots or not budget:
                    break
                if not req.is_runnable or req.num_pending_input == 0:
                    continue
                n = self._prefill_tokens(req, budget)
                if n == 0:  # without chunking it does not fit: it goes first next step
                    head_blocked = True
                    break
                out.scheduled.append(ScheduledItem(req.request_id, n, True))
                budget -= n
                slots -= 1

            # 3. FCFS admission
            cap = cfg.cache_capacity_tokens
            if not head_blocked:
                for req in list(self._waiting.values()):
                    if not slots or not budget:
                        break
                    if not req.is_runnable:
                        continue  # nothing to run yet: does not hold up the queue
                    if cap is not None and self._reserved + req.max_tokens > cap:
                        break
                    if req.num_pending_input:
                        n = self._prefill_tokens(req, budget)
                        if n == 0:
                            break
                        out.scheduled.append(ScheduledItem(req.request_id, n, True))
                    else:
                        n = 1
                        out.scheduled.append(ScheduledItem(req.request_id, 1, False))
                    budget -= n
                    slots -= 1
                    del self._waiting[req.request_id]
                    self._admitted[req.request_id] = req
                    req.state = RequestState.RUNNING
                    req.reserved_tokens = req.max_tokens
                    self._reserved += req.max_tokens
                    self._totals["admitted"] += 1
                    out.admitted.append(req.request_id)

            # advance the counters
            for item in out.scheduled:
                req = self._requests[item.request_id]
                if item.is_prefill:
                    req.num_computed_tokens += item.num_tokens
                    self._totals["prefill_tokens"] += item.num_tokens
                else:
                    req.num_computed_tokens += 1
                    req.num_generated += 1
                    self._totals["decode_tokens"] += 1
                self._refresh(req)
            out.num_batched_tokens = cfg.max_num_batched_tokens - budget
            if out.scheduled:
                self._totals["steps"] += 1
                self._totals["scheduled_requests"] += len(out.scheduled)
                self._totals["scheduled_tokens"] += out.num_batched_tokens
            return out

    def _prefill_tokens(self, req: SchedulerRequest, budget: int) -> int:
        """Tokens of pending input to prefill now; 0 when (without chunking) it does not fit."""
        pending = req.num_pending_input
        if self.config.chunked_prefill:
            return min(pending, budget)
        # Whole pending input, or wait. Streamed input that piled up past a full step's budget
        # could never fit, so it is taken max_num_batched_tokens at a time.
        n = min(pending, self.config.max_num_batched_tokens)
        return n if n <= budget else 0

    # ---- metrics -----------------------------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        """Queue metrics; safe to call from any thread."""
        with self._lock:
            running = sum(1 for r in self._admitted.values() if r.state is RequestState.RUNNING)
            cap = self.config.cache_capacity_tokens
            stats: dict[str, int | float] = {
                "running": running,
                "waiting": len(self._waiting),
                "waiting_for_input": len(self._admitted) - running,
                "reserved_tokens": self._reserved,
                "cache_capacity_tokens": cap or 0,
                "cache_usage": self._reserved / cap if cap else 0.0,
            }
            stats.update({f"total_{k}": v for k, v in self._totals.items()})
            return stats

    # ---- internals ---------------------------------------------------------------------------

    def _get(self, request_id: str) -> SchedulerRequest:
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"request {request_id!r} is not scheduled (unknown or already done)")
        return req

    def _refresh(self, req: SchedulerRequest) -> None:
        """State of an admitted request after a change; WAITING ones stay WAITING until admitted."""
        if req.state not in ADMITTED_STATES:
            return
        if not req.is_runnable and (req.blocked or not req.input_complete):
            req.state = RequestState.WAITING_FOR_INPUT
        else:
            req.state = RequestState.RUNNING

    def _terminate(self, request_id: str, state: RequestState, total: str) -> SchedulerRequest:
        with self._lock:
            req = self._get(request_id)
            del self._requests[request_id]
            self._waiting.pop(request_id, None)
            if self._admitted.pop(request_id, None) is not None:
                self._reserved -= req.reserved_tokens
                req.reserved_tokens = 0
            req.state = state
            self._totals[total] += 1
            return req
