"""Talker runner: talker + code predictor, one codec frame per step, for one request.

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

    def _forward(self, req: TalkerRequest, embeds: torch.Tensor) -> None:
        past = req.cache.get_seq_length()
        out = self.model(
            inputs_embeds=embeds,
            position_ids=self._positions(past, embeds.shape[1]),
            past_key_values=req.cache,
            use_cache=True,
            output_hidden_states=True,
            generation_step=req.step,  # required by the talker's forward during decode
        )
        req.past_hidden = out.hidden_states[0][-1][:, -1:]
        assert req.chooser is not None
        code0 = req.chooser.choose(out.logits[0, -1], torch.tensor(req.history, dtype=torch.long))
        req.history.append(code0)
        if req.chooser.is_stop(code0):
            req.finished, req.stopped_on, req.code0 = True, "stop_id", None
        elif len(req.history) >= req.sampling.max_tokens:
            req.finished, req.stopped_on, req.code0 = True, "max_tokens", None
        else:
            req.code0 = code0

    @torch.no_grad()
    def prefill(
        self,
        req: TalkerRequest,
        prompt_ids: torch.Tensor,
        prompt_embeds: torch.Tensor,
        prompt_hidden: torch.Tensor | None,
        assistant_stream_embeds: torch.Tensor,
    ) -> None:
        """Run the talker prompt; afterwards `req.code0` holds frame 0's code-0 (unless finished)."""
        embeds, _ids = self.prompts.prefill_embeds(
            prompt_ids, prompt_embeds, prompt_hidden, assistant_stream_embeds, req.speaker
        )
        req.cache = DynamicCache(config=self.model.config.text_config)
        self._forward(req, embeds.to(self.model.dtype))

    @torch.no_grad()
    def residuals(self, req: TalkerRequest) -> torch.Tensor:
        """Complete the current frame: `[num_code_groups]` codes (code-0 then 15 residuals)."""
        assert req.code0 is not None and req.past_hidden is not None and req.residual_chooser is not None
        cp = self.code_predictor
        code0 = torch.tensor([[req.code0]], device=self.device)
        cache = DynamicCache(config=cp.config)
        embeds = torch.cat((req.past_hidden, self.codec_embedding(code0)), dim=1)
        codes = [req.code0]
        out = cp(inputs_embeds=embeds, past_key_values=cache, use_cache=True)
        empty = torch.empty(0, dtype=torch.long)
        for j in range(1, self.spec.num_code_groups):
            code = req.residual_chooser.choose(out.logits[0, -1], empty)
            codes.append(code)
            if j == self.spec.num_code_groups - 1:
                break
            out = cp(
                input_ids=torch.tensor([[code]], device=self.device),
                past_key_values=cache,
                use_cache=True,
                generation_steps=j,
            )
        return torch.tensor(codes, dtype=torch.long)

    @torch.no_grad()
    def advance(self, req: TalkerRequest, frame: torch.Tensor, trailing: torch.Tensor) -> None:
        """Feed the completed frame plus the step's trailing text (`[1, 1, H]`)."""
        codes = frame.to(self.device)
        parts = [self.codec_embedding(codes[:1].view(1, 1))]
        for j in range(1, self.spec.num_code_groups):
            parts.append(self.residual_embeddings[j - 1](codes[j : j + 1].view(1, 1)))
        # Summed as generate() does: one [1, G, H] tensor reduced over G (same float order).
        embeds = torch.cat(parts, dim=1).sum(1, keepdim=True) + trailing.to(self.model.dtype)
        req.step += 1
        self._forward(req, embeds)

    def release(self, req: TalkerRequest) -> None:
        req.cache = None
        req.past_hidden = None
        req.finished = True
