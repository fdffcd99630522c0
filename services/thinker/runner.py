"""Thinker runner: chunked prefill and greedy/sampled decode of many requests, one packed
forward per step (services/runtime/packed.py), each request with its own KV cache.

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
from services.runtime.packed import PackedCache, packed, use_packed_kernels
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
    prefilled: int = 0  # prompt tokens in the cache
    prompt_parts: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (embeds, hidden) chunks

    @property
    def prefill_done(self) -> bool:
        return self.prefilled >= len(self.prompt_ids)


@dataclass
class StepOutput:
    prompt: PromptOutput | None = None  # when the prefill completed in this step
    token: TokenOutput | None = None  # None after a prefill chunk that is not the last


class ThinkerRunner:
    def __init__(self, model: Any, spec: FamilySpec) -> None:
        self.model = model
        self.spec = spec
        self.device = next(model.parameters()).device
        self.embedding = model.get_input_embeddings()
        use_packed_kernels(model)

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
    def step_many(self, items: list[tuple[ThinkerRequest, int]]) -> list[StepOutput]:
        """One forward for every `(request, n)`: the next `n` prompt tokens of a request still in
        prefill (chunked prefill), or one decode step (`n` = 1) of a request past it."""
        ids: list[int] = []
        positions = []
        lengths = []
        for req, n in items:
            if req.finished:
                raise RuntimeError("thinker request already finished")
            if req.cache is None:
                req.cache = DynamicCache(config=self.model.config.text_config)
                req.history = list(req.prompt_ids)
            if not req.prefill_done:
                n = min(n, len(req.prompt_ids) - req.prefilled)
                if n < 1:
                    raise ValueError(f"prefill chunk of {n} tokens")
                ids += req.prompt_ids[req.prefilled : req.prefilled + n]
                positions.append(self._positions(req.prefilled, n))
            else:
                n = 1
                ids.append(req.history[-1])
                positions.append(self._positions(len(req.history) - 1, 1))
            lengths.append(n)
        cache = PackedCache([req.cache for req, _ in items], lengths)
        with packed(lengths, cache):
            out = self.model(
                input_ids=torch.tensor([ids], device=self.device),
                position_ids=torch.cat(positions, dim=-1),
                past_key_values=cache,
                use_cache=True,
                output_hidden_states=True,
            )
        embeds_all = out.hidden_states[0][0]
        accept_all = out.hidden_states[self.spec.accept_hidden_layer][0]
        results = []
        start = 0
        for (req, _), n in zip(items, lengths, strict=True):
            end = start + n
            logits, accept = out.logits[0, end - 1], accept_all[start:end]
            result = StepOutput()
            if not req.prefill_done:
                req.prompt_parts.append((embeds_all[start:end], accept))
                req.prefilled += n
                if req.prefill_done:
                    result.prompt = PromptOutput(
                        ids=torch.tensor(req.prompt_ids, dtype=torch.long),
                        embeds=torch.cat([e for e, _ in req.prompt_parts]),
                        hidden=torch.cat([h for _, h in req.prompt_parts]),
                    )
                    req.prompt_parts = []
                    result.token = self._emit(req, logits, accept[-1])
            else:
                result.token = self._emit(req, logits, accept[-1])
            results.append(result)
            start = end
        return results

    def prefill(self, req: ThinkerRequest) -> tuple[PromptOutput, TokenOutput]:
        """The whole prompt in one step (the in-process pipeline)."""
        (result,) = self.step_many([(req, len(req.prompt_ids))])
        assert result.prompt is not None and result.token is not None
        return result.prompt, result.token

    def decode(self, req: ThinkerRequest) -> TokenOutput:
        (result,) = self.step_many([(req, 1)])
        assert result.token is not None
        return result.token

    def release(self, req: ThinkerRequest) -> None:
        req.cache = None
        req.prompt_parts = []
        req.finished = True
