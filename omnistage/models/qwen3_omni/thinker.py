"""Qwen3-Omni's thinker, stepping many requests at once: chunked prefill and greedy or sampled
decode, one packed forward per step (models/batching.py), each request with its own KV cache.

Per new token it gives the token id, its layer-0 embedding (what the talker projects) and the
`accept_hidden_layer` hidden state of the position that produced it; when a prompt's prefill
completes, the embeddings and accept-layer hidden states of every prompt position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from omnistage.models.batching import ExactBatching, PackedCache
from omnistage.models.qwen3_omni.prompt import text_positions
from omnistage.models.qwen3_omni.spec import FamilySpec
from omnistage.models.sampling import SamplingParams, TokenChooser

__all__ = ["PromptOutput", "Thinker", "ThinkerState", "ThinkerStep", "TokenOutput"]


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
    stopped_on: str | None = None  # "stop_id" | "max_tokens" when this is the last token

    @property
    def is_last(self) -> bool:
        return self.stopped_on is not None


@dataclass
class ThinkerState:
    """One request's thinker state; its progress (tokens in the cache) is the engine's count."""

    sampling: SamplingParams
    chooser: TokenChooser
    max_len: int  # prompt + generated tokens it may reach (the model's positions, or less)
    prompt_ids: list[int] = field(default_factory=list)  # empty until the prompt arrives
    cache: Any = None
    history: list[int] = field(default_factory=list)  # prompt then generated ids (repetition penalty)
    prompt_parts: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # prefill chunks' rows
    finished: bool = False

    @property
    def generated(self) -> int:
        return len(self.history) - len(self.prompt_ids)


@dataclass
class ThinkerStep:
    prompt: PromptOutput | None = None  # when the prefill completed in this step
    token: TokenOutput | None = None  # None after a prefill chunk that is not the last


class Thinker:
    def __init__(self, model: Any, spec: FamilySpec, row_modules: tuple[type, ...] = ()) -> None:
        self.model = model
        self.spec = spec
        self.device = next(model.parameters()).device
        self.embedding = model.get_input_embeddings()
        self.batching = ExactBatching(model, row_modules)

    def validate_prompt(self, prompt_ids: Sequence[int], max_len: int | None = None) -> None:
        """Refuse a prompt before any model work: empty, too long, or out of vocabulary."""
        limit = min(self.spec.max_positions, max_len or self.spec.max_positions)
        if not prompt_ids:
            raise ValueError("empty prompt: nothing to generate from")
        if len(prompt_ids) >= limit:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens exceeds the model maximum of {limit - 1}")
        bad = [i for i in prompt_ids if not 0 <= i < self.spec.thinker_vocab]
        if bad:
            raise ValueError(f"prompt ids outside the vocabulary (0..{self.spec.thinker_vocab - 1}): {bad[:8]}")

    def new_state(self, sampling: SamplingParams, max_len: int | None = None) -> ThinkerState:
        """`max_len`: a cap below the model's positions on prompt + generated tokens (it stops
        there as at max_tokens)."""
        limit = min(self.spec.max_positions, max_len or self.spec.max_positions)
        return ThinkerState(sampling, TokenChooser(sampling, device=str(self.device)), limit)

    def set_prompt(self, state: ThinkerState, prompt_ids: Sequence[int]) -> None:
        if state.prompt_ids:
            raise ValueError("the prompt was already received")
        self.validate_prompt(prompt_ids, state.max_len)
        state.prompt_ids = list(prompt_ids)

    def _emit(self, state: ThinkerState, logits: torch.Tensor, hidden_row: torch.Tensor) -> TokenOutput:
        history = torch.tensor(state.history, device=self.device)
        token = state.chooser.choose(logits, history)
        state.history.append(token)
        stopped_on = None
        if state.chooser.is_stop(token):
            stopped_on = "stop_id"
        elif state.generated >= state.sampling.max_tokens or len(state.history) >= state.max_len:
            stopped_on = "max_tokens"
        state.finished = stopped_on is not None
        embed = self.embedding(torch.tensor([token], device=self.device))[0]
        return TokenOutput(state.generated - 1, token, embed, hidden_row, stopped_on)

    @torch.no_grad()
    def step(self, items: Sequence[tuple[ThinkerState, int, int]]) -> list[ThinkerStep]:
        """One forward for every `(state, position, n)`: `position` is how many tokens the
        request has in its cache; `n` prompt tokens from there (a prefill chunk) or, past the
        prompt, one decode step."""
        ids: list[int] = []
        positions = []
        for state, pos, n in items:
            if state.finished:
                raise RuntimeError("thinker request already finished")
            if state.cache is None:
                state.cache = DynamicCache(config=self.model.config.text_config)
                state.history = list(state.prompt_ids)
            if pos < len(state.prompt_ids):
                if n < 1 or pos + n > len(state.prompt_ids):
                    raise ValueError(f"prefill chunk [{pos}, {pos + n}) outside a prompt of {len(state.prompt_ids)}")
                ids += state.prompt_ids[pos : pos + n]
            else:
                if n != 1 or pos != len(state.history) - 1:
                    want = len(state.history) - 1
                    raise ValueError(f"decode step at position {pos} of {n} tokens; expected 1 at {want}")
                ids.append(state.history[-1])
            positions.append(text_positions(pos, n, self.device))
        lengths = [n for _, _, n in items]
        cache = PackedCache([state.cache for state, _, _ in items], lengths)
        with self.batching.step(lengths, cache):
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
        for state, pos, n in items:
            end = start + n
            logits, accept = out.logits[0, end - 1], accept_all[start:end]
            result = ThinkerStep()
            if pos < len(state.prompt_ids):
                state.prompt_parts.append((embeds_all[start:end], accept))
                if pos + n == len(state.prompt_ids):
                    result.prompt = PromptOutput(
                        ids=torch.tensor(state.prompt_ids, dtype=torch.long),
                        embeds=torch.cat([e for e, _ in state.prompt_parts]),
                        hidden=torch.cat([h for _, h in state.prompt_parts]),
                    )
                    state.prompt_parts = []
                    result.token = self._emit(state, logits, accept[-1])
            else:
                result.token = self._emit(state, logits, accept[-1])
            results.append(result)
            start = end
        return results

    def release(self, state: ThinkerState) -> None:
        state.cache = None
        state.prompt_parts = []
        state.finished = True
