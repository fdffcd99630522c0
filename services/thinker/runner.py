"""Thinker runner: prefill and step-by-step greedy/sampled decode of one request with a KV cache.

Per new token it gives the token id, its layer-0 embedding (what the talker projects) and
the `accept_hidden_layer` hidden state of the position that produced it; for the prompt, the
embeddings and accept-layer hidden states of every prompt position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from omnistage.families.qwen3_omni import FamilySpec
from services.runtime.sampling import SamplingParams, TokenChooser


@dataclass
class PromptOutput:
    ids: torch.Tensor  # [L] int64
    embeds: torch.Tensor  # [L, H] layer-0 embeddings
    hidden: torch.Tensor  # [L, H] accept_hidden_layer hidden states


@dataclass
class TokenOutput:
    index: int  # 0-based position among generated tokens
    token_id: int
    embed: torch.Tensor  # [H] layer-0 embedding of token_id
    hidden: torch.Tensor  # [H] accept-layer hidden state of the position that produced token_id
    is_last: bool  # the thinker stops after this token (stop id or max_tokens)
    stopped_on: str | None = None  # "stop_id" | "max_tokens" when is_last


@dataclass
class ThinkerRequest:
    prompt_ids: list[int]
    sampling: SamplingParams
    cache: Any = None
    history: list[int] = field(default_factory=list)
    generated: int = 0
    finished: bool = False
    chooser: TokenChooser | None = None


class ThinkerRunner:
    def __init__(self, model: Any, spec: FamilySpec) -> None:
        self.model = model
        self.spec = spec
        self.device = next(model.parameters()).device
        self.embedding = model.get_input_embeddings()

    def validate_prompt(self, prompt_ids: list[int]) -> None:
        """Refuse a prompt before any model work: empty, too long, or out of vocabulary."""
        if not prompt_ids:
            raise ValueError("empty prompt: nothing to generate from")
        if len(prompt_ids) >= self.spec.max_positions:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens exceeds the model maximum of {self.spec.max_positions - 1}"
            )
        bad = [i for i in prompt_ids if not 0 <= i < self.spec.thinker_vocab]
        if bad:
            raise ValueError(f"prompt ids outside the vocabulary (0..{self.spec.thinker_vocab - 1}): {bad[:8]}")

    def new_request(self, prompt_ids: list[int], sampling: SamplingParams) -> ThinkerRequest:
        self.validate_prompt(prompt_ids)
        req = ThinkerRequest(prompt_ids=list(prompt_ids), sampling=sampling)
        req.chooser = TokenChooser(sampling, device=str(self.device))
        return req

    def _positions(self, start: int, length: int) -> torch.Tensor:
        # Text-only prompts: the same position on the text axis and the three M-RoPE axes.
        pos = torch.arange(start, start + length, device=self.device)
        return pos.view(1, 1, -1).expand(4, 1, -1)

    def _forward(self, req: ThinkerRequest, ids: list[int]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        past = req.cache.get_seq_length()
        out = self.model(
            input_ids=torch.tensor([ids], device=self.device),
            position_ids=self._positions(past, len(ids)),
            past_key_values=req.cache,
            use_cache=True,
            output_hidden_states=True,
        )
        return out.logits[0, -1], out.hidden_states

    def _emit(self, req: ThinkerRequest, logits: torch.Tensor, hidden_row: torch.Tensor) -> TokenOutput:
        assert req.chooser is not None
        history = torch.tensor(req.history, device=self.device)
        token = req.chooser.choose(logits, history)
        req.history.append(token)
        req.generated += 1
        stopped_on = None
        if req.chooser.is_stop(token):
            stopped_on = "stop_id"
        elif req.generated >= req.sampling.max_tokens or len(req.history) >= self.spec.max_positions:
            stopped_on = "max_tokens"
        req.finished = stopped_on is not None
        embed = self.embedding(torch.tensor([token], device=self.device))[0]
        return TokenOutput(
            index=req.generated - 1,
            token_id=token,
            embed=embed,
            hidden=hidden_row,
            is_last=req.finished,
            stopped_on=stopped_on,
        )

    @torch.no_grad()
    def prefill(self, req: ThinkerRequest) -> tuple[PromptOutput, TokenOutput]:
        req.cache = DynamicCache(config=self.model.config.text_config)
        req.history = list(req.prompt_ids)
        logits, hidden_states = self._forward(req, req.prompt_ids)
        accept = hidden_states[self.spec.accept_hidden_layer][0]
        prompt = PromptOutput(
            ids=torch.tensor(req.prompt_ids, dtype=torch.long),
            embeds=hidden_states[0][0],
            hidden=accept,
        )
        return prompt, self._emit(req, logits, accept[-1])

    @torch.no_grad()
    def decode(self, req: ThinkerRequest) -> TokenOutput:
        if req.finished:
            raise RuntimeError("thinker request already finished")
        logits, hidden_states = self._forward(req, [req.history[-1]])
        return self._emit(req, logits, hidden_states[self.spec.accept_hidden_layer][0, -1])

    def release(self, req: ThinkerRequest) -> None:
        req.cache = None
        req.finished = True
