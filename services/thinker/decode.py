"""The thinker's decode role (`thinker.disaggregated`): it takes a request's KV cache and first
token from the prefill role (services/thinker/prefill.py), rebuilds the cache and goes on as the
thinker from the second token: text up, the prompt and every token down to the talker."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from omnistage.config import DeployConfig
from omnistage.engine import Demand, OutChunk, Request, ScheduledItem, StepOutput
from omnistage.models import Checkpoint
from omnistage.v1 import stage_pb2
from omnistage.wire import Code, DecodedChunk, StageError, invalid
from services import edges
from services.thinker.prefill import role_checks
from services.thinker.worker import FINISH_REASONS, ThinkerWorker


@dataclass
class _Incoming:
    """A request's KV cache as it arrives: per layer keys and values of every prompt position."""

    prompt_tokens: int = 0  # from the header chunk
    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # made when the first KV comes
    forward: list[OutChunk] = field(default_factory=list)  # to the talker before the first decode
    stopped_on: str | None = None  # the handoff's: the first token was the last


class DecodeWorker(ThinkerWorker):
    """A request's cache is reserved from its header chunk (no KV, its size and the roles'
    checks: edges.kv_header) before any KV is read (`holds_input_until_admitted`), so requests
    waiting for room hold no cache; the cache is made when its first KV chunk comes. It keeps
    no view of what it receives (the KV is copied into place as it comes, the handoff's tensors
    are copied out), and it answers only once it has it all, so the prefill role releases a
    request's shared memory at its first answer (`downstream_consumes_input_first`)."""

    name = "thinker-decode"
    holds_input_until_admitted = True

    def __init__(self, thinker: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(thinker, *args, **kwargs)
        self.checks = role_checks(thinker)
        self.layout = thinker.kv_layout()

    def open(self, req: Request) -> None:
        super().open(req)
        req.state.role = _Incoming()

    def feed(self, req: Request, chunk: DecodedChunk) -> None:
        state, inc = req.state, req.state.role
        if chunk.finished:
            self._adopt(req, chunk)
            return
        if not inc.prompt_tokens:  # the header: the cache's size, before any of it
            if chunk.offset != 0 or chunk.length != 0:
                raise invalid(f"{self.name}: the first chunk must be the KV header (offset 0, length 0), got offset "
                              f"{chunk.offset}, length {chunk.length}")  # fmt: skip
            inc.prompt_tokens = edges.check_kv_meta(self.name, chunk.meta, self.checks)
            if inc.prompt_tokens >= state.max_len:
                raise invalid(f"{self.name}: a prompt of {inc.prompt_tokens} tokens exceeds the model maximum "
                              f"of {state.max_len - 1}")  # fmt: skip
            return
        end = chunk.offset + chunk.length
        if end > inc.prompt_tokens:
            raise invalid(f"{self.name}: KV chunk [{chunk.offset}, {end}) past the prompt's {inc.prompt_tokens} tokens")
        if not inc.kv:  # the request is admitted (its input is read only then): room for the whole cache
            shape = (1, int(self.layout["kv_heads"]), inc.prompt_tokens, int(self.layout["head_dim"]))
            dtype, device = getattr(torch, str(self.layout["dtype"])), self.thinker.device
            inc.kv = [(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
                      for _ in range(int(self.layout["layers"]))]  # fmt: skip
        for (k, v), (dk, dv) in zip(edges.read_kv(self.name, chunk, self.layout), inc.kv, strict=True):
            dk[:, :, chunk.offset : end].copy_(k)  # out of the received bytes, into place
            dv[:, :, chunk.offset : end].copy_(v)

    def _adopt(self, req: Request, chunk: DecodedChunk) -> None:
        state, inc = req.state, req.state.role
        start: stage_pb2.Start = req.params
        h = edges.read_handoff(self.name, chunk, inc.prompt_tokens, self.spec.thinker_hidden, start.want_audio)
        gen = state.chooser.generator
        if h.generator_state is not None and gen is not None and h.generator_state.numel() != gen.get_state().numel():
            # a CUDA generator's state (Philox) is not a CPU one's (Mersenne twister): set_state would fail
            raise StageError(Code.FAILED_PRECONDITION, f"{self.name}: the prefill role's sampler state "
                             f"({h.generator_state.numel()} bytes) does not fit this role's {gen.device.type} "
                             f"generator ({gen.get_state().numel()} bytes): sampled requests need both roles on "
                             "the same device type")  # fmt: skip
        try:
            self.thinker.adopt(state, h.prompt_ids, h.token_id, h.stopped_on, h.last_position, h.generator_state,
                               inc.kv)  # fmt: skip
        except ValueError as e:
            raise invalid(f"{self.name}: {e}") from None
        inc.stopped_on = h.stopped_on
        if start.want_audio:  # what the single thinker sends the talker after its prefill
            p = h.talker_prompt
            assert p is not None
            inc.forward = [edges.thinker_prompt_chunk(p.ids, p.embeds, p.hidden, p.rope),
                           *self.spoken(state, 0, h.token_id, h.embed, h.stopped_on is not None,
                                        _last_row(p.hidden) if self.talker_needs_hidden else None)]  # fmt: skip
        inc.kv = []

    def demand(self, req: Request) -> Demand | None:
        # known from the KV header: a request that can never fit is refused before any of its
        # cache comes (it waits for input until the handoff)
        state, n = req.state, req.state.role.prompt_tokens
        if not n:
            return None
        return Demand(n, self.reply_reservation(n, state.sampling.max_tokens, state.max_len), n)

    def reply_reservation(self, prompt_tokens: int, max_tokens: int, max_len: int) -> int:
        left = min(max_tokens, max_len - prompt_tokens) - 1  # the prefill made the first token
        return max(left, 1)  # a request that ended at its first token still takes one step: the forwarding

    def ready(self, req: Request) -> bool:
        return req.input_finished and bool(req.state.prompt_ids)

    def execute(self, batch: Sequence[ScheduledItem]) -> list[StepOutput | Exception]:
        """Decode steps; a request whose first token (the prefill's) was its last only forwards."""
        forward_only = [it.request.state.finished for it in batch]  # before the step changes it
        stepped = iter(super().execute([it for it, f in zip(batch, forward_only, strict=True) if not f]))
        results: list[StepOutput | Exception] = []
        for item, only in zip(batch, forward_only, strict=True):
            state = item.request.state
            if only:
                reason = state.role.stopped_on or "max_tokens"
                out: StepOutput | Exception = StepOutput(finished=FINISH_REASONS[reason], detail=reason)
            else:
                out = next(stepped)
            if isinstance(out, StepOutput):  # the talker gets the prompt and first token before the rest
                out.down[:0], state.role.forward = state.role.forward, []
            results.append(out)
        return results


def build_worker(cfg: DeployConfig, ckpt: Checkpoint) -> DecodeWorker:
    return DecodeWorker.build(cfg, ckpt)


def _last_row(hidden: torch.Tensor | None) -> torch.Tensor | None:
    """The first token's hidden state: that of the prompt's last position (which produced it)."""
    return None if hidden is None else hidden[-1]
