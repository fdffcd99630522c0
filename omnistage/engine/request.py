"""One request inside one stage: the only object that describes it.

The engine creates it when a call opens, the worker hangs its model state on it
(`state`: KV cache, talker progress, code2wav stream state), the scheduler reads and
updates its progress, and its `status` says where it is:

    WAITING_FOR_INPUT --(worker can step)--> WAITING --(admitted)--> RUNNING
           ^                                                            |
           +---------------(worker needs more input) <------------------+
    any live status --> FINISHED_STOPPED | FINISHED_LENGTH | FINISHED_ABORTED | FAILED

A live request's status follows from two facts: whether the scheduler has admitted it (it
holds a cache reservation) and whether its worker can step now (`ready`).
"""

from __future__ import annotations

import collections
import enum
import time
from dataclasses import dataclass, field
from typing import Any

from omnistage.wire import DecodedChunk, StageError

__all__ = ["FinishReason", "Request", "RequestStatus"]


class FinishReason(enum.Enum):
    STOP = "stop"  # the model stopped by itself (stop id, codec EOS, end of the audio)
    LENGTH = "length"  # a max-tokens limit
    ABORT = "abort"  # the caller cancelled
    ERROR = "error"  # a failure ended it


class RequestStatus(enum.Enum):
    WAITING = "WAITING"  # can step, not admitted yet: nothing reserved
    RUNNING = "RUNNING"  # admitted and can step
    WAITING_FOR_INPUT = "WAITING_FOR_INPUT"  # its worker needs more input before it can step
    FINISHED_STOPPED = "FINISHED_STOPPED"
    FINISHED_LENGTH = "FINISHED_LENGTH"
    FINISHED_ABORTED = "FINISHED_ABORTED"
    FAILED = "FAILED"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @classmethod
    def for_reason(cls, reason: FinishReason) -> RequestStatus:
        return _BY_REASON[reason]

    @property
    def finish_reason(self) -> FinishReason | None:
        return _REASON.get(self)


_FINISHED = frozenset((
    RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED, RequestStatus.FAILED
))  # fmt: skip
_BY_REASON = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.ERROR: RequestStatus.FAILED,
}
_REASON = {v: k for k, v in _BY_REASON.items()}


@dataclass(eq=False)
class Request:
    request_id: str
    params: Any  # what the stage was asked (its Start message); opaque to the engine
    arrival: int = 0  # arrival order, set by the engine
    caller_id: str = ""  # the id its caller knows it by, when `request_id` adds to it (error messages)
    status: RequestStatus = RequestStatus.WAITING_FOR_INPUT

    sink: Any = None  # where its outputs go (an `EngineSink`)

    # ---- input, fed by the caller's stream -------------------------------------------------
    inbox: collections.deque[DecodedChunk | None] = field(default_factory=collections.deque)  # None: closed
    next_offset: int = 0  # the offset the next input chunk must have
    input_closed: bool = False  # the caller sent its finished chunk or closed its side
    input_finished: bool = False  # ... and the worker has taken every chunk before that
    last_input: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # time.monotonic() by which it must be done (None: none)
    stalled_since: float | None = None  # paused since then: its caller is not reading (backpressure)
    abort_requested: bool = False

    # ---- scheduling (written by the scheduler) ----------------------------------------------
    num_prompt_tokens: int = 0  # input tokens to prefill (0 for stages that only decode)
    max_new_tokens: int = 0  # most decode steps
    num_computed_tokens: int = 0  # in its cache: prefilled input plus one per decode step
    num_output_tokens: int = 0  # decode steps taken
    decode_limit: int = 0  # decode steps its cache reservation allows (max_new_tokens, capped)
    reserved_tokens: int = 0  # cache tokens it holds (0 unless admitted)
    queued: bool = False  # known to the scheduler (its demand is known)
    admitted: bool = False  # holds a cache reservation
    reserve_early: bool = False  # admitted before its worker can step (its input is cache)
    told_admitted: bool = False  # ... and its sink told so (its input is read from then)
    sent: bool = False  # its transport is done with it (`Engine.sent`): nothing to hold a reservation for
    ready: bool = False  # its worker can step now
    started: bool = False  # it has been in a step

    # ---- the model's state and the outcome --------------------------------------------------
    state: Any = None  # per-model state, owned by the worker
    finish_detail: str = ""  # what made it stop, e.g. "stop_id", "max_tokens"
    error: StageError | None = None

    @property
    def shown_id(self) -> str:
        """The id error messages name: the caller's."""
        return self.caller_id or self.request_id

    @property
    def num_pending_prompt(self) -> int:
        """Prompt tokens not yet prefilled."""
        return self.num_prompt_tokens - (self.num_computed_tokens - self.num_output_tokens)

    @property
    def is_exhausted(self) -> bool:
        """Prompt prefilled and every decode step taken: only finishing remains."""
        return self.num_pending_prompt == 0 and self.num_output_tokens >= self.decode_limit

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason
