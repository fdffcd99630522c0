"""The thinker's prefill role (`thinker.disaggregated`): it runs each prompt (chunked prefill as
the thinker does) and its first token, and streams the request's KV cache to the decode role
as it is made, one chunk per prefill step, then a handoff with the first token; the first
token's text goes up from here. Its cache is freed once the handoff is made; its reservation
lasts until the stream has taken the last of its KV (a decode role with no room for it holds it
back), so `cache_capacity_tokens` bounds the KV waiting here as well as the KV being made."""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

from omnistage.config import DeployConfig
from omnistage.engine import Demand, FinishReason, Request, ScheduledItem, StepOutput
from omnistage.models import Checkpoint
from omnistage.models.fingerprint import weights_fingerprint
from omnistage.v1 import stage_pb2
from services import edges
from services.thinker.worker import ThinkerWorker


def role_checks(thinker: Any) -> dict[str, str]:
    """What the two roles must agree on (edges.KV_CHECKS), from this process's thinker."""
    layout = thinker.kv_layout()
    return {"omnistage_version": version("omnistage"), "thinker_fingerprint": weights_fingerprint(thinker.model),
            "kv_layout": ",".join(f"{k}={v}" for k, v in layout.items())}  # fmt: skip


class PrefillWorker(ThinkerWorker):
    name = "thinker-prefill"
    holds_reservation_until_sent = True  # its KV waits here while the decode role has no room
    downstream_consumes_input_first = True  # the decode role answers once it has copied the KV in
    reserves_reply = False  # the prompt and its first token (demand): the decode role reserves the reply

    def __init__(self, thinker: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(thinker, *args, **kwargs)
        self.checks = role_checks(thinker)
        # its KV chunks are views of the cache, which can wait to be sent after the request ends
        # here: a pooled range would be reused under them (and a prefill role has no decodes)
        thinker.pool_kv = False

    def open(self, req: Request) -> None:
        super().open(req)
        req.state.cache_new_tokens = 1  # its cache holds the prompt (as its demand says), not the decode's tokens

    def sends_down(self, req: Request) -> bool:
        return True  # every prefill chunk's KV, then the handoff, to the decode role

    def demand(self, req: Request) -> Demand | None:
        state = req.state
        if not state.prompt_ids:
            return None
        return Demand(len(state.prompt_ids), 1)  # the prompt and its first token; decode does the rest

    def _output(self, item: ScheduledItem, step: Any) -> StepOutput:
        req, state = item.request, item.request.state
        start: stage_pb2.Start = req.params
        pos, n = req.num_computed_tokens, item.num_tokens
        out = StepOutput(down=[edges.kv_chunk(pos, self.thinker.kv_rows(state, pos, n))])
        if pos == 0:  # first the header: the decode role reserves the cache before any of it comes
            out.down.insert(0, edges.kv_header({**self.checks, edges.PROMPT_TOKENS: len(state.prompt_ids)}))
        tok = step.token
        if tok is None:  # a prefill chunk that is not the last
            return out
        self.end_at_stop_text(state, tok)
        last_position, generator_state = self.thinker.decode_state(state)
        talker_prompt = self.talker_prompt(step.prompt) if start.want_audio else None
        out.down.append(edges.handoff_chunk(len(state.prompt_ids), state.prompt_ids, tok.token_id, tok.embed,
                                            tok.stopped_on, last_position, generator_state, talker_prompt))  # fmt: skip
        out.up.append(edges.text_chunk(tok.index, tok.token_id, tok.stopped_on, tok.logprobs))
        # its part is done either way: the decode role goes on (or only forwards, after a last token)
        out.finished = FinishReason.LENGTH if tok.stopped_on == "max_tokens" else FinishReason.STOP
        out.detail = tok.stopped_on or "handed_off"
        return out


def build_worker(cfg: DeployConfig, ckpt: Checkpoint) -> PrefillWorker:
    return PrefillWorker.build(cfg, ckpt)
