"""Continuous-batching scheduler shared by every stage (schedule -> execute -> update_from_output).

One class, configured per stage, decides which requests take part in the next batched forward
and how many tokens each contributes. It is bookkeeping over `Request` objects: no torch, no
gRPC, no clock.

Token model. A queued request has `num_prompt_tokens` of input and may take up to
`max_new_tokens` decode steps. A step for a request is either a *prefill* of `n` pending prompt
tokens (chunked prefill: up to the step's remaining token budget, or with `prefill_chunk` exactly
that many, the last chunk what is left, waiting for a step with room for it; without it the whole
prompt, and a prompt larger than `max_num_batched_tokens` is refused at `add`) or a *decode* of one
token. Stages that only decode (the talker, code2wav) queue with no prompt tokens and count
steps. `update_from_output` advances the counters of what was scheduled and ends the requests
whose output says they are done; the worker may end a request before its limit (EOS).

Policy per step, within `max_num_batched_tokens` tokens and `max_num_seqs` requests:

1. decodes of admitted requests (one token each), in admission order;
2. pending prefill of admitted requests (a long prompt continues its chunks), in admission order;
3. admission of waiting requests, first come first served. A request is admitted only if the
   cache can hold it to its maximum length next to what admitted requests have reserved; if the
   first ready waiting request cannot be admitted (cache, budget, or without chunked prefill a
   prompt that does not fit the rest of the step), nothing behind it is admitted either, so the
   head is never starved. Requests whose worker cannot step yet (WAITING_FOR_INPUT) are passed
   over without holding up the queue and keep their arrival order, except those queued with
   `reserve_early` (a decode role's request, whose input is its KV cache): they are admitted in
   their turn before they can step, so that their cache is taken in only once it is reserved.

Cache accounting. On admission a request reserves `min(max_model_len, prompt + max_new_tokens)`
tokens, released when it ends, or, when it ends with `hold` (what it made still waits to leave
the process: a prefill role's KV cache), at `release`. An admitted request never exceeds its
reservation, so admission never lets in a request that cannot finish. There is no preemption.

Threading. The engine thread is the only caller of every method except `stats()`; a lock is
still taken so that `stats()` (metrics, the `Info` RPC) sees a consistent snapshot.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from omnistage.engine.request import FinishReason, Request, RequestStatus

__all__ = ["RequestRejected", "ScheduledItem", "Scheduler", "SchedulerConfig"]


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
    # With chunked prefill: every prefill chunk is this many tokens (a prompt's last one what is
    # left), so where a prompt is split depends on its length alone, not on the other requests in
    # a step (exact batching: a request's numbers as if alone). None: a chunk takes what the
    # step's budget leaves.
    prefill_chunk: int | None = None

    def __post_init__(self) -> None:
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_model_len", self.max_model_len)
        if self.cache_capacity_tokens is not None:
            _positive_int("cache_capacity_tokens", self.cache_capacity_tokens)
        if self.prefill_chunk is not None:
            _positive_int("prefill_chunk", self.prefill_chunk)
            if self.prefill_chunk > self.max_num_batched_tokens:
                raise ValueError(f"SchedulerConfig.prefill_chunk ({self.prefill_chunk}) exceeds max_num_batched_tokens "
                                 f"({self.max_num_batched_tokens})")  # fmt: skip
        if not isinstance(self.chunked_prefill, bool):
            raise ValueError(f"SchedulerConfig.chunked_prefill must be a bool, got {self.chunked_prefill!r}")


class RequestRejected(ValueError):
    """`add` refused a request that could never run to completion under this configuration
    (answered INVALID_ARGUMENT: the same request would be refused again; a smaller one may not)."""


class ScheduledItem(NamedTuple):
    request: Request
    num_tokens: int  # prompt tokens to prefill, or 1 for a decode step
    is_prefill: bool


class Scheduler:
    """See the module docstring for the policy. Engine thread only, except `stats()`."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._waiting: dict[str, Request] = {}  # queued, not admitted, in arrival order
        self._admitted: dict[str, Request] = {}  # in admission order
        self._reserved = 0  # admitted requests' reservations plus the held ones
        self._held: dict[str, int] = {}  # ended requests' reservations kept until `release`
        self._totals: dict[str, int] = dict.fromkeys(
            ("added", "rejected", "admitted", "finished", "aborted", "failed",
             "steps", "scheduled_requests", "scheduled_tokens", "prefill_tokens", "decode_tokens", "cached_tokens"),
            0,
        )  # fmt: skip

    # ---- requests ----------------------------------------------------------------------------

    def add(self, req: Request, num_prompt_tokens: int, max_new_tokens: int, num_cached_tokens: int = 0, *,
            reserve_early: bool = False) -> None:  # fmt: skip
        """Queue a request whose demand is now known. Raises `RequestRejected` if it can never run.
        `num_cached_tokens`: prompt tokens already in its cache when it arrives (a KV cache
        streamed from a prefill role); its prefill starts after them. `reserve_early`: admit it
        (reserve its cache) in arrival order before it can step: the input it waits for is that
        cache, which is taken in only once reserved."""
        for name, value in (("num_prompt_tokens", num_prompt_tokens), ("max_new_tokens", max_new_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if not 0 <= num_cached_tokens <= num_prompt_tokens:
            raise ValueError(f"num_cached_tokens {num_cached_tokens} outside 0..{num_prompt_tokens}")
        with self._lock:
            if req.queued or req.status.is_finished:
                raise ValueError(f"request {req.request_id!r} is already queued or finished")
            try:
                reservation = self._check_fits(req.shown_id, num_prompt_tokens, max_new_tokens, num_cached_tokens)
            except RequestRejected:
                self._totals["rejected"] += 1
                raise
            req.num_prompt_tokens = num_prompt_tokens
            req.num_computed_tokens = num_cached_tokens
            req.max_new_tokens = max_new_tokens
            req.reserve_early = reserve_early
            req.decode_limit = max(0, min(max_new_tokens, reservation - num_prompt_tokens))
            req.queued = True
            self._waiting[req.request_id] = req
            self._totals["added"] += 1
            self._refresh(req)

    def _check_fits(self, request_id: str, prompt: int, max_new: int, cached: int = 0) -> int:
        cfg = self.config
        mml = cfg.max_model_len
        if prompt > mml:
            raise RequestRejected(
                f"request {request_id!r}: input of {prompt} tokens exceeds max_model_len={mml}",
            )
        if max_new > 0 and prompt == mml:
            raise RequestRejected(
                f"request {request_id!r}: input of {prompt} tokens fills max_model_len={mml}, "
                f"leaving no room for max_new_tokens={max_new}",
            )
        if not cfg.chunked_prefill and prompt - cached > cfg.max_num_batched_tokens:
            raise RequestRejected(
                f"request {request_id!r}: prompt of {prompt - cached} tokens to prefill exceeds max_num_batched_tokens="
                f"{cfg.max_num_batched_tokens} and chunked prefill is off",
            )
        reservation = min(mml, prompt + max_new)
        cap = cfg.cache_capacity_tokens
        if cap is not None and reservation > cap:
            capped = f", capped at max_model_len={mml}" if prompt + max_new > mml else ""
            raise RequestRejected(
                f"request {request_id!r}: needs {reservation} tokens of cache ({prompt} input + max_new_tokens="
                f"{max_new}{capped}) but cache_capacity_tokens={cap}",
            )
        return reservation

    def set_ready(self, req: Request, ready: bool) -> None:
        """Whether the request's worker can step now (WAITING_FOR_INPUT when not)."""
        with self._lock:
            req.ready = ready
            self._refresh(req)

    def finish(self, req: Request, reason: FinishReason, *, hold: bool = False) -> None:
        """End the request (done, aborted or failed) and release its reservation; idempotent.
        `hold`: keep the reservation until `release(req.request_id)`."""
        with self._lock:
            if req.status.is_finished:
                return
            self._waiting.pop(req.request_id, None)
            if self._admitted.pop(req.request_id, None) is not None:
                if hold:
                    self._held[req.request_id] = req.reserved_tokens
                else:
                    self._reserved -= req.reserved_tokens
                req.reserved_tokens = 0
            req.admitted = False
            req.status = RequestStatus.for_reason(reason)
            if req.queued:
                key = {FinishReason.ABORT: "aborted", FinishReason.ERROR: "failed"}.get(reason, "finished")
                self._totals[key] += 1

    def release(self, request_id: str) -> None:
        """Free the reservation an ended request held (`finish(hold=True)`); a no-op otherwise."""
        with self._lock:
            self._reserved -= self._held.pop(request_id, 0)

    # ---- the step ------------------------------------------------------------------------------

    def schedule(self) -> list[ScheduledItem]:
        """This step's requests and token counts (counters advance in `update_from_output`)."""
        cfg = self.config
        with self._lock:
            out: list[ScheduledItem] = []
            budget = cfg.max_num_batched_tokens
            slots = cfg.max_num_seqs

            # 1. decodes of admitted requests
            for req in self._admitted.values():
                if not slots or not budget:
                    break
                if self._can_step(req) and req.num_pending_prompt == 0:
                    out.append(ScheduledItem(req, 1, False))
                    budget -= 1
                    slots -= 1

            # 2. pending prefill of admitted requests
            head_blocked = False
            for req in self._admitted.values():
                if not slots or not budget:
                    break
                if not self._can_step(req) or req.num_pending_prompt == 0:
                    continue
                n = self._prefill_tokens(req, budget)
                if n == 0:  # its next piece does not fit: it goes first next step
                    head_blocked = True
                    break
                out.append(ScheduledItem(req, n, True))
                budget -= n
                slots -= 1

            # 3. FCFS admission
            cap = cfg.cache_capacity_tokens
            if not head_blocked:
                for req in list(self._waiting.values()):
                    stepping = self._can_step(req)
                    if not stepping and not req.reserve_early:
                        continue  # nothing to run yet: does not hold up the queue
                    if stepping and (not slots or not budget):
                        break
                    reservation = min(cfg.max_model_len, req.num_prompt_tokens + req.max_new_tokens)
                    if cap is not None and self._reserved + reservation > cap:
                        break
                    if stepping:  # (otherwise reserved now, stepped once its input, its cache, is in)
                        n = self._prefill_tokens(req, budget) if req.num_pending_prompt else 1
                        if n == 0:
                            break
                        out.append(ScheduledItem(req, n, bool(req.num_pending_prompt)))
                        budget -= n
                        slots -= 1
                    del self._waiting[req.request_id]
                    self._admitted[req.request_id] = req
                    req.admitted = True
                    req.reserved_tokens = reservation
                    self._reserved += reservation
                    self._totals["admitted"] += 1
                    self._totals["cached_tokens"] += req.num_computed_tokens  # (in its cache before any step)
                    self._refresh(req)
            if out:
                tokens = cfg.max_num_batched_tokens - budget
                self._totals["steps"] += 1
                self._totals["scheduled_requests"] += len(out)
                self._totals["scheduled_tokens"] += tokens
            return out

    def update_from_output(self, scheduled: Sequence[ScheduledItem], finished: Sequence[FinishReason | None],
                           hold: Sequence[bool] | None = None) -> None:  # fmt: skip
        """Advance what ran; end each request whose step says it is done (`finished[i]` not None),
        keeping its reservation where `hold[i]` (see `finish`)."""
        with self._lock:
            for item in scheduled:
                req = item.request
                if item.is_prefill:
                    req.num_computed_tokens += item.num_tokens
                    self._totals["prefill_tokens"] += item.num_tokens
                else:
                    req.num_computed_tokens += 1
                    req.num_output_tokens += 1
                    self._totals["decode_tokens"] += 1
        for i, (item, reason) in enumerate(zip(scheduled, finished, strict=True)):
            if reason is not None:
                self.finish(item.request, reason, hold=bool(hold and hold[i]))

    def _can_step(self, req: Request) -> bool:
        return req.ready and (req.num_pending_prompt > 0 or req.num_output_tokens < req.decode_limit)

    def _prefill_tokens(self, req: Request, budget: int) -> int:
        """Prompt tokens to prefill now; 0 when the next piece does not fit: without chunking the
        rest of the prompt, with a fixed `prefill_chunk` that chunk."""
        pending = req.num_pending_prompt
        cfg = self.config
        if not cfg.chunked_prefill:
            want = pending
        elif cfg.prefill_chunk is None:
            return min(pending, budget)
        else:
            want = min(pending, cfg.prefill_chunk)
        return want if want <= budget else 0

    # ---- state and metrics -------------------------------------------------------------------

    def _refresh(self, req: Request) -> None:
        if req.status.is_finished:
            return
        if not req.ready:
            req.status = RequestStatus.WAITING_FOR_INPUT
        else:
            req.status = RequestStatus.RUNNING if req.admitted else RequestStatus.WAITING

    def stats(self) -> dict[str, int | float]:
        """Cache use and running totals; safe to call from any thread."""
        with self._lock:
            cap = self.config.cache_capacity_tokens
            stats: dict[str, int | float] = {
                "reserved_tokens": self._reserved,
                "held_tokens": sum(self._held.values()),
                "cache_capacity_tokens": cap or 0,
                "cache_usage": self._reserved / cap if cap else 0.0,
            }
            stats.update({f"total_{k}": v for k, v in self._totals.items()})
            return stats
