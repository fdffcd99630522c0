"""Talker runner: talker + code predictor, one codec frame per step, for many requests at
once (one packed talker forward and one batched code-predictor pass per step; see
services/runtime/packed.py for why a request's numbers do not depend on its batch).

It follows `Qwen3OmniMoeForConditionalGeneration.generate` exactly:
  * prefill on the talker prompt gives code-0 of frame 0;
  * each step predicts the 15 residual codes of the current frame with the code predictor
    (input: the talker's last-layer hidden state of the last position and embed(code-0)),
    then feeds the sum of the frame's 16 code embeddings plus the step's trailing text to
    the talker, which gives code-0 of the next frame;
  * it stops when code-0 is a stop id (codec EOS; no frame for it) or when `max_tokens`
    code-0 tokens exist (the last one gets no residuals, so max_tokens - 1 frames).

The frame is available before the trailing text is needed, so a frame is handed out as soon
as its residuals exist and the talker waits for thinker token g+1 only for the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from omnistage.families.qwen3_omni import FamilySpec, TalkerPromptBuilder
from services.runtime.packed import PackedCache, packed, use_packed_kernels
from services.runtime.sampling import CODE_PREDICTOR_SAMPLED, GREEDY, SamplingParams, TokenChooser


@dataclass
class TalkerRequest:
    sampling: SamplingParams
    speaker: str = "ethan"
    cache: Any = None
    code0: int | None = None  # code-0 of the frame whose residuals come next
    past_hidden: torch.Tensor | None = None  # [1, 1, H] talker last layer, last position
    history: list[int] = field(default_factory=list)  # generated code-0 ids (repetition penalty)
    step: int = 0  # talker decode step g (indexes trailing text)
    pending_frame: torch.Tensor | None = None  # completed frame not yet fed back
    finished: bool = False
    stopped_on: str | None = None
    chooser: TokenChooser | None = None
    residual_chooser: TokenChooser | None = None


class TalkerRunner:
    def __init__(self, model: Any, spec: FamilySpec, tts_special_embeds: torch.Tensor) -> None:
        self.model = model
        self.spec = spec
        self.device = next(model.parameters()).device
        self.prompts = TalkerPromptBuilder(model, spec, tts_special_embeds.to(self.device, model.dtype))
        self.suppress = spec.talker_suppressed_ids()
        cp = model.code_predictor
        self.code_predictor = cp
        self.codec_embedding = model.get_input_embeddings()
        self.residual_embeddings = cp.get_input_embeddings()
        use_packed_kernels(model)

    def new_request(self, sampling: SamplingParams, speaker: str = "ethan") -> TalkerRequest:
        self.spec.speaker_id(speaker)  # unknown speaker: clear error before any model work
        if not sampling.stop_ids:
            sampling = sampling.with_overrides(stop_ids=[self.spec.codec_eos_id])
        req = TalkerRequest(sampling=sampling, speaker=speaker)
        req.chooser = TokenChooser(sampling, self.suppress, device=str(self.device))
        # The code predictor samples exactly when the talker does (as generate() mirrors it).
        residual = CODE_PREDICTOR_SAMPLED if sampling.do_sample else GREEDY
        if sampling.seed is not None:
            residual = residual.with_overrides(seed=sampling.seed + 1)
        req.residual_chooser = TokenChooser(residual, device=str(self.device))
        return req

    def _positions(self, start: int, length: int) -> torch.Tensor:
        pos = torch.arange(start, start + length, device=self.device)
        return pos.view(1, 1, -1).expand(4, 1, -1)

    @torch.no_grad()
    def forward_many(self, items: list[tuple[TalkerRequest, torch.Tensor]]) -> None:
        """One packed talker forward over `(request, embeds [1, n, H])`: a talker prompt (n > 1)
        or one fed-back frame. Afterwards each request's `code0` is its next frame's code-0."""
        lengths = [int(e.shape[1]) for _, e in items]
        positions = []
        for (req, _), n in zip(items, lengths, strict=True):
            if req.cache is None:
                req.cache = DynamicCache(config=self.model.config.text_config)
            positions.append(self._positions(req.cache.get_seq_length(), n))
        cache = PackedCache([req.cache for req, _ in items], lengths)
        with packed(lengths, cache):
            out = self.model(
                inputs_embeds=torch.cat([e for _, e in items], dim=1).to(self.model.dtype),
                position_ids=torch.cat(positions, dim=-1),
                past_key_values=cache,
                use_cache=True,
                output_hidden_states=True,
                generation_step=0,  # only echoed back by the talker's forward
            )
        last_layer = out.hidden_states[0][-1]
        end = 0
        for (req, _), n in zip(items, lengths, strict=True):
            end += n
            req.past_hidden = last_layer[:, end - 1 : end]
            self._choose_code0(req, out.logits[0, end - 1])

    def _choose_code0(self, req: TalkerRequest, logits: torch.Tensor) -> None:
        assert req.chooser is not None
        code0 = req.chooser.choose(logits, torch.tensor(req.history, dtype=torch.long))
        req.history.append(code0)
        if req.chooser.is_stop(code0):
            req.finished, req.stopped_on, req.code0 = True, "stop_id", None
        elif len(req.history) >= req.sampling.max_tokens:
            req.finished, req.stopped_on, req.code0 = True, "max_tokens", None
        else:
            req.code0 = code0

    def prefill_embeds(
        self,
        req: TalkerRequest,
        prompt_ids: torch.Tensor,
        prompt_embeds: torch.Tensor,
        prompt_hidden: torch.Tensor | None,
        assistant_stream_embeds: torch.Tensor,
    ) -> torch.Tensor:
        """The talker prompt `[1, n, H]` for `forward_many`."""
        embeds, _ids = self.prompts.prefill_embeds(
            prompt_ids, prompt_embeds, prompt_hidden, assistant_stream_embeds, req.speaker
        )
        return embeds.to(self.model.dtype)

    @torch.no_grad()
    def residuals_many(self, reqs: list[TalkerRequest]) -> list[torch.Tensor]:
        """Complete each request's current frame: `[num_code_groups]` codes (code-0 then the 15
        residuals), the code predictor running all requests along its batch axis."""
        for req in reqs:
            assert req.code0 is not None and req.past_hidden is not None and req.residual_chooser is not None
        cp = self.code_predictor
        batch = len(reqs)
        code0 = torch.tensor([[req.code0] for req in reqs], device=self.device)
        cache = DynamicCache(config=cp.config)
        embeds = torch.cat((torch.cat([req.past_hidden for req in reqs]), self.codec_embedding(code0)), dim=1)
        codes = [code0.view(-1).tolist()]
        with packed([2] * batch, batch_axis=True):
            out = cp(inputs_embeds=embeds, past_key_values=cache, use_cache=True)
        empty = torch.empty(0, dtype=torch.long)
        for j in range(1, self.spec.num_code_groups):
            step = [req.residual_chooser.choose(out.logits[b, -1], empty) for b, req in enumerate(reqs)]  # type: ignore[union-attr]
            codes.append(step)
            if j == self.spec.num_code_groups - 1:
                break
            with packed([1] * batch, batch_axis=True):
                out = cp(
                    input_ids=torch.tensor(step, device=self.device).view(batch, 1),
                    past_key_values=cache,
                    use_cache=True,
                    generation_steps=j,
                )
        return list(torch.tensor(codes, dtype=torch.long).t().unbind(0))

    def advance_embeds(self, req: TalkerRequest, frame: torch.Tensor, trailing: torch.Tensor) -> torch.Tensor:
        """The completed frame plus the step's trailing text (`[1, 1, H]`), for `forward_many`."""
        codes = frame.to(self.device)
        parts = [self.codec_embedding(codes[:1].view(1, 1))]
        for j in range(1, self.spec.num_code_groups):
            parts.append(self.residual_embeddings[j - 1](codes[j : j + 1].view(1, 1)))
        # Summed as generate() does: one [1, G, H] tensor reduced over G (same float order).
        return torch.cat(parts, dim=1).sum(1, keepdim=True) + trailing.to(self.model.dtype)

    def release(self, req: TalkerRequest) -> None:
        req.cache = None
        req.past_hidden = None
        req.finished = True
