"""The contract between the engine and a stage's model: one worker per stage process.

Every method runs on the engine thread. `open`, `feed` and `execute` change state; `demand` and
`ready` only look. A worker keeps no per-request objects of its own: what it needs per request
hangs off `Request.state`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from omnistage.engine.request import FinishReason, Request
from omnistage.engine.scheduler import ScheduledItem
from omnistage.wire import DecodedChunk

__all__ = ["Demand", "OutChunk", "StageWorker", "StepOutput"]


class Demand(NamedTuple):
    """What a request queues with (`Scheduler.add`'s arguments)."""

    prompt_tokens: int  # input tokens its cache will hold (0 for stages that only decode)
    max_new_tokens: int  # most decode steps
    cached_tokens: int = 0  # of the prompt tokens, those already in its cache on arrival


@dataclass
class OutChunk:
    """A chunk before encoding; the server encodes it (inline or through shared memory)."""

    tensors: dict[str, Any]
    offset: int  # stream position of its first token, frame or sample
    length: int = 0  # stream positions it advances
    finished: bool = False  # the sender's last chunk for this request
    meta: dict[str, Any] = field(default_factory=dict)
    # a CUDA event while `tensors` are host copies still being written (engine.device_copy)
    ready: Any = field(default=None, repr=False)

    def wait(self) -> OutChunk:
        """Block until the tensors' copy to the host is complete; call before reading them."""
        ready = self.ready  # read once: a chunk may be waited for from two threads
        if ready is not None:
            ready.synchronize()
            self.ready = None
        return self


@dataclass
class StepOutput:
    """What one step produced for one request."""

    up: list[OutChunk] = field(default_factory=list)  # to the caller
    down: list[OutChunk] = field(default_factory=list)  # to the downstream stage (the first opens its call)
    finished: FinishReason | None = None  # this stage's work for the request is complete
    detail: str = ""  # what made it finish, e.g. "stop_id"

    def wait(self) -> StepOutput:
        """Block until every chunk's copy to the host is complete (see `OutChunk.wait`)."""
        for c in (*self.up, *self.down):
            c.wait()
        return self


class StageWorker(ABC):
    """A stage's model behind the engine: validates input, runs batched steps."""

    name: str
    device: torch.device = torch.device("cpu")
    # True: what a request receives after its first chunk is cache (a KV cache streamed in after
    # a header), so its cache is reserved before the rest of its input comes, and the transport
    # reads no more of its input until then (the sender waits). Its demand must be known from
    # the first chunk.
    holds_input_until_admitted: bool = False
    # True: what a request sends is large and may wait to leave the process (a prefill role's KV
    # cache, held back while the decode role has no room for it), so the request's reservation
    # lasts until the transport has sent its last output (`Engine.sent`), not only until it ends:
    # the scheduler's cache capacity then bounds what waits to be sent too.
    holds_reservation_until_sent: bool = False
    # True: the downstream stage takes in all of a request's input, keeping no view of the
    # received bytes, before it answers anything (the decode role: KV and handoff, then tokens),
    # so the request's shared memory is released at the first answer, not at the call's end. A
    # claim about the other process: it holds because the topology fixes that downstream
    # (topology.py: a prefill role's is always the decode role, whose versions the KV header checks).
    downstream_consumes_input_first: bool = False

    def wants_on_device(self, name: str) -> bool:
        """Is input tensor `name` copied to `device` as it arrives (off the engine's thread)?
        Only names the worker's code reads on the device (it must not mix them with host ones)."""
        return False

    @abstractmethod
    def open(self, req: Request) -> None:
        """Validate `req.params` and create the request's model state (raise StageError)."""

    @abstractmethod
    def feed(self, req: Request, chunk: DecodedChunk) -> None:
        """Validate and take one input chunk (raise StageError)."""

    def sends_down(self, req: Request) -> bool:
        """Will the request send chunks downstream, and end that stream with a finished chunk,
        whatever it produces? Then its downstream call is opened as its first step starts (the
        call's set-up overlaps the step) rather than when its first chunk for downstream exists.
        (A query on the opened request.)"""
        return False

    def made(self, out: StepOutput) -> int:
        """What a step made for one request, in the stage's output unit (its metrics' count):
        what went to the caller."""
        return sum(c.length for c in out.up)

    def demand(self, req: Request) -> Demand | None:
        """What to queue the request with, once known (None before). Stages with a per-token
        KV cache (the thinker) count tokens; the others count steps."""
        return Demand(0, self.max_steps(req))

    def max_steps(self, req: Request) -> int:
        return 1 << 30

    @abstractmethod
    def ready(self, req: Request) -> bool:
        """Can a step make progress now? (A query: it changes nothing.)"""

    @abstractmethod
    def execute(self, batch: Sequence[ScheduledItem]) -> list[StepOutput | Exception]:
        """One batched step over every scheduled request; a per-request failure is returned in
        that request's place."""

    @abstractmethod
    def close(self, req: Request) -> None:
        """Free everything the request holds (finished, aborted or failed)."""

    def max_model_len(self) -> int:
        return 1 << 31

    def capacity(self) -> dict[str, int]:
        return {}

    def kv_pool_tokens(self) -> int:
        """Positions per layer fast batching's pooled KV buffers hold now (0 when idle; read from
        other threads, so approximate while a step runs)."""
        return 0

    def prefix_cache_tokens(self) -> int:
        """Positions its prefix cache keeps of ended requests (the thinker's; 0 without one)."""
        return 0
