"""Qwen3-Omni's talker and code predictor, stepping many requests at once: one packed talker
forward and one batched code-predictor pass per step (see models/batching.py for why a
request's numbers do not depend on its batch).

It follows `Qwen3OmniMoeForConditionalGeneration.generate` exactly:
  * prefill on the talker prompt gives code-0 of frame 0;
  * each step predicts the residual codes of the current frame with the code predictor
    (input: the talker's last-layer hidden state of the last position and embed(code-0)),
    then feeds the sum of the frame's code embeddings plus the step's trailing text to the
    talker, which gives code-0 of the next frame;
  * it stops when code-0 is a stop id (codec EOS; no frame for it) or when `max_tokens`
    code-0 tokens exist (the last one gets no residuals, so max_tokens - 1 frames).

Ordering, as thinker outputs arrive: the talker prefills once the assistant stream has its
header plus the first generated token; talker step g needs assistant-stream element
`HEADER + 1 + g` (thinker token g+1), or the knowledge that the thinker has finished (then
tts_pad). A frame is handed out as soon as its residuals exist, before the next thinker token
is needed, so the talker runs one token behind the thinker.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from omnistage.models.batching import PackedBatching, PackedCache
from omnistage.models.qwen3_omni.code_predictor import CodePredictorLoop, ResidualChoice
from omnistage.models.qwen3_omni.multimodal import RopeInputs, check_rope_sizes, talker_positions
from omnistage.models.qwen3_omni.prompt import (
    ASSISTANT_HEADER_LEN,
    TalkerPromptBuilder,
    assistant_start,
    talker_input_ids,
    text_positions,
)
from omnistage.models.qwen3_omni.spec import FamilySpec
from omnistage.models.sampling import (
    CODE_PREDICTOR_SAMPLED,
    GREEDY,
    SamplingParams,
    TokenChooser,
    choose_rows,
)

__all__ = ["Talker", "TalkerState"]


@dataclass
class TalkerState:
    """One request's talker state: what the thinker has sent so far and the talker's progress."""

    sampling: SamplingParams
    speaker: str
    chooser: TokenChooser
    residual_chooser: TokenChooser
    # inputs
    prompt: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None  # ids, embeds, hidden
    rope: RopeInputs = field(default_factory=RopeInputs)  # the prompt's audio/image/video sizes
    header: torch.Tensor | None = None  # layer-0 embeds of the prompt's assistant header
    tokens: list[tuple[torch.Tensor, bool]] = field(default_factory=list)  # generated tokens: (embed, is_last)
    # progress
    started: bool = False  # the talker prompt has run
    step: int = 0  # talker decode step g (indexes trailing text)
    cache: Any = None
    code0: int | None = None  # code-0 of the frame whose residuals come next
    past_hidden: torch.Tensor | None = None  # [1, 1, H] talker last layer, last position
    history: list[int] = field(default_factory=list)  # generated code-0 ids (repetition penalty)
    pending_frame: torch.Tensor | None = None  # completed frame not yet fed back
    prompt_positions: torch.Tensor | None = None  # [4, 1, n] of a multimodal talker prompt
    last_position: torch.Tensor | None = None  # [4, 1, 1] position of the last row fed
    frames: int = 0  # frames handed out
    stopped_on: str | None = None  # "stop_id" | "max_tokens" | "no_text" | "error" once finished
    error: str | None = None  # why this request failed (its logits were no distribution)

    @property
    def finished(self) -> bool:
        return self.stopped_on is not None

    def set_prompt(self, ids: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor | None, spec: FamilySpec,
                   rope: RopeInputs | None = None) -> None:  # fmt: skip
        self.prompt = (ids, embeds, hidden)
        self.header = embeds[assistant_start(ids, spec) :].clone()  # not a view: the prompt is freed after prefill
        self.rope = rope or RopeInputs()

    def add_token(self, embed: torch.Tensor, is_last: bool, hidden: torch.Tensor | None = None) -> None:
        del hidden  # this talker reads the thinker's hidden states at media positions only (its prompt)
        self.tokens.append((embed, is_last))

    def _element(self, k: int) -> tuple[torch.Tensor, bool] | None:
        assert self.header is not None
        if k < self.header.shape[0]:
            return self.header[k], False
        i = k - self.header.shape[0]
        return self.tokens[i] if i < len(self.tokens) else None

    def can_step(self, text_done: bool) -> bool:
        """Can a step make progress, given whether the thinker has sent its last token?"""
        if self.finished or self.prompt is None:
            return False
        if not self.started:
            return self._element(ASSISTANT_HEADER_LEN) is not None or text_done
        if self.pending_frame is None:
            return self.code0 is not None  # its frame's residuals are due
        return text_done or self._element(ASSISTANT_HEADER_LEN + 1 + self.step) is not None


class Talker:
    def __init__(self, model: Any, spec: FamilySpec, tts_special_embeds: torch.Tensor,
                 row_modules: tuple[type, ...] = (), batching: str = "exact",
                 cuda_graphs: int = 0) -> None:  # fmt: skip
        """`cuda_graphs`: on CUDA, the largest batch whose code-predictor loop replays a captured
        graph, greedy or sampled (0: none; code_predictor.py)."""
        self.model = model
        self.spec = spec
        self.device = next(model.parameters()).device
        self.prompts = TalkerPromptBuilder(model, spec, tts_special_embeds.to(self.device, model.dtype))
        self.suppress = spec.talker_suppressed_ids()
        self.codec_embedding = model.get_input_embeddings()
        self.batching = PackedBatching(model, row_modules, batching)
        self.code_predictor = CodePredictorLoop(model.code_predictor, self.batching, spec.num_code_groups)
        # The sizes are checked against the placeholders the talker's positions look for; where its
        # config names other ids than the thinker's, generate() places them as text, and so do we.
        cfg = model.config
        talker_ids = tuple(getattr(cfg, k, None) for k in ("audio_token_id", "image_token_id", "video_token_id"))
        self.check_sizes = talker_ids == tuple(spec.multimodal_ids)
        if cuda_graphs:
            like = torch.zeros(1, 2, spec.talker_hidden, dtype=model.dtype, device=self.device)
            # the code predictor's sampled rows all sample its defaults (`new_state`)
            sampled = TokenChooser(CODE_PREDICTOR_SAMPLED, device=str(self.device))
            self.code_predictor.capture(cuda_graphs, like, sampled)

    def set_prompt(self, state: TalkerState, ids: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor | None,
                   rope: Mapping[str, torch.Tensor] | None = None) -> None:  # fmt: skip
        """The thinker's prompt: ids, layer-0 embeddings, accept-layer hidden states (with
        audio/image/video), and `rope`, the items' sizes (RopeInputs' fields). The talker
        prompt's positions are placed here, so sizes that disagree with the placeholders fail
        this request when it arrives (ValueError), not a step."""
        if hidden is None and bool(torch.isin(ids.view(-1).cpu(), torch.tensor(self.spec.multimodal_ids)).any()):
            raise ValueError("the prompt has audio/image/video placeholders but no thinker hidden states")
        state.set_prompt(ids, embeds, hidden, self.spec, RopeInputs(**(rope or {})))
        try:
            if self.check_sizes:
                check_rope_sizes(ids.cpu(), RopeInputs(**{k: v.cpu() for k, v in state.rope.tensors().items()}),
                                 self.model.config)  # fmt: skip
            talker_ids = talker_input_ids(ids, self.spec).to(self.device)
            state.prompt_positions = talker_positions(self.model, talker_ids, state.rope)
        except (IndexError, RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"the prompt's audio/image/video sizes do not fit its placeholders: {e}") from None

    def new_state(self, sampling: SamplingParams, speaker: str) -> TalkerState:
        self.spec.speaker_id(speaker)  # unknown speaker: clear error before any model work
        if not sampling.stop_ids:
            sampling = sampling.with_overrides(stop_ids=self.spec.talker_stop_ids())
        # The code predictor samples exactly when the talker does (as generate() mirrors it).
        residual = CODE_PREDICTOR_SAMPLED if sampling.do_sample else GREEDY
        if sampling.seed is not None:
            residual = residual.with_overrides(seed=sampling.seed + 1)
        return TalkerState(
            sampling=sampling,
            speaker=speaker,
            chooser=TokenChooser(sampling, self.suppress, device=str(self.device)),
            residual_chooser=TokenChooser(residual, device=str(self.device)),
        )

    # ---- one step for many requests ----------------------------------------------------------

    @torch.no_grad()
    def step(self, items: Sequence[tuple[TalkerState, bool]]) -> list[torch.Tensor | None]:
        """One step for every `(state, text_done)`: one packed talker forward runs every talker
        prompt and every completed frame whose trailing text is known, each giving its next
        frame's code-0; then a batched code-predictor pass completes those frames. Returns each
        state's new frame (`[num_code_groups]` codes) or None. (A frame is out in the step that
        chose its code-0, so the first frame comes with the prompt's step.)"""
        rows: list[tuple[TalkerState, torch.Tensor]] = []
        advancing: list[tuple[TalkerState, tuple[torch.Tensor | None, bool]]] = []  # (state, its trailing text)
        for state, text_done in items:
            if state.finished:
                continue
            if not state.started:
                embeds = self._prefill_rows(state, text_done)
                if embeds is not None:
                    state.started = True
                    rows.append((state, embeds))
            elif state.pending_frame is not None:
                trailing = self._trailing(state, text_done)
                if trailing is not None:
                    advancing.append((state, trailing))
        if advancing:
            sums = self._frame_sums([s.pending_frame for s, _ in advancing])  # type: ignore[misc]
            trailing = self.prompts.trailing_embeds([t for _, t in advancing], self.batching)
            for (state, _), fed in zip(advancing, (sums + trailing.to(self.model.dtype)).split(1), strict=True):
                rows.append((state, fed))
                state.pending_frame = None
                state.step += 1
        if rows:
            self._forward(rows)
        frames: list[torch.Tensor | None] = [None] * len(items)
        due = [i for i, (s, _) in enumerate(items) if s.code0 is not None and s.pending_frame is None]
        if due:
            for i, frame in zip(due, self._residuals([items[i][0] for i in due]), strict=True):
                state = items[i][0]
                state.pending_frame = frames[i] = frame
                state.frames += 1
        return frames

    def _prefill_rows(self, state: TalkerState, text_done: bool) -> torch.Tensor | None:
        """The talker prompt `[1, n, H]` once the assistant stream has its header plus the first
        generated token; None (and, if the thinker gave only one token, finished) before that."""
        needed = [state._element(k) for k in range(ASSISTANT_HEADER_LEN + 1)]
        if any(e is None for e in needed) or any(last for _, last in needed):  # type: ignore[misc]
            if text_done:
                # The reference cannot speak a reply of a single token: no audio, no error.
                state.stopped_on = "no_text"
            return None
        assert state.prompt is not None
        ids, embeds, hidden = state.prompt
        stream = torch.stack([e for e, _ in needed])  # type: ignore[misc]
        prompt, _ = self.prompts.prefill_embeds(ids, embeds, hidden, stream, state.speaker)
        # only the prefill reads the thinker's prompt rows ([L, H] each): not held for the whole speech
        state.prompt = (ids, embeds.new_empty((0, embeds.shape[1])), None)
        return prompt.to(self.model.dtype)

    def _trailing(self, state: TalkerState, text_done: bool) -> tuple[torch.Tensor | None, bool] | None:
        """The trailing text fed with the pending frame at step g, once it is known: thinker
        token g+1 and whether it is the last (`(None, False)`: the thinker has ended)."""
        element = state._element(ASSISTANT_HEADER_LEN + 1 + state.step)
        if element is None and not text_done:
            return None
        assert state.pending_frame is not None
        return element if element is not None else (None, False)

    def _forward(self, items: list[tuple[TalkerState, torch.Tensor]]) -> None:
        """One packed talker forward over `(state, embeds [1, n, H])`: a talker prompt (n > 1)
        or one fed-back frame. Afterwards each state's `code0` is its next frame's code-0."""
        lengths = [int(e.shape[1]) for _, e in items]
        positions = []
        for (state, _), n in zip(items, lengths, strict=True):
            if state.cache is None:  # the prompt
                state.cache = self.batching.new_cache(self.model.config.text_config)
                position = state.prompt_positions
                if position is None:
                    position = text_positions(0, n, self.device)
                state.prompt_positions = None
            else:  # a fed-back frame: every axis steps on by one, as in generate()
                assert state.last_position is not None and n == 1
                position = state.last_position + 1
            state.last_position = position[..., -1:]
            positions.append(position)
        cache = PackedCache([state.cache for state, _ in items], lengths)
        with self.batching.step(lengths, cache):
            out = self.model(
                inputs_embeds=torch.cat([e for _, e in items], dim=1).to(self.model.dtype),
                position_ids=torch.cat(positions, dim=-1),
                past_key_values=cache,
                use_cache=True,
                output_hidden_states=True,
                generation_step=0,  # only echoed back by the talker's forward
            )
        last_layer = out.hidden_states[0][-1]
        ends = torch.tensor(lengths, device=self.device).cumsum(0) - 1
        for (state, _), end in zip(items, ends.tolist(), strict=True):
            state.past_hidden = last_layer[:, end : end + 1]
        states = [state for state, _ in items]
        code0s = choose_rows([s.chooser for s in states], out.logits[0].index_select(0, ends),
                             [s.history for s in states])  # fmt: skip
        for state, code0 in zip(states, code0s, strict=True):
            if isinstance(code0, RuntimeError):  # this request alone fails; the others go on
                state.code0, state.stopped_on = None, "error"
                state.error = f"no code could be chosen from this request's logits: {code0}"
                continue
            self._take_code0(state, code0)

    @staticmethod
    def _take_code0(state: TalkerState, code0: int) -> None:
        state.history.append(code0)
        state.code0 = None
        if state.chooser.is_stop(code0):
            state.stopped_on = "stop_id"
        elif len(state.history) >= state.sampling.max_tokens:
            state.stopped_on = "max_tokens"
        else:
            state.code0 = code0

    def _residuals(self, states: list[TalkerState]) -> list[torch.Tensor]:
        """Complete each state's current frame: `[num_code_groups]` codes (code-0 then the
        residuals), the code predictor running all requests along its batch axis."""
        code0 = torch.tensor([[s.code0] for s in states], device=self.device)
        first = torch.cat((torch.cat([s.past_hidden for s in states]), self.codec_embedding(code0)), dim=1)  # type: ignore[misc]
        choosers = [s.residual_chooser for s in states]
        choice = None  # greedy: one argmax per group for the batch, on the device
        if not all(c.plain_greedy for c in choosers):
            # every row through the same ops, each sampled row with its own uniforms, the ids left
            # on the device (no host sync per group)
            choice = ResidualChoice(choosers, self.spec.num_code_groups, self.device)
        residuals = self.code_predictor.run(first, choice)  # [G - 1, B]
        codes = torch.cat((code0.view(1, -1), residuals)).t().cpu()  # [B, G]: one copy to the host
        return list(codes.unbind(0))

    def _frame_sums(self, frames: list[torch.Tensor]) -> torch.Tensor:
        """Each completed frame's summed code embeddings, `[B, 1, H]`: one embedding lookup per
        group for all frames, summed over the groups as generate() sums a frame (one
        `[., G, H]` tensor reduced over G, the same float order for every row)."""
        codes = torch.stack(frames).to(self.device)  # [B, G]
        parts = [self.codec_embedding(codes[:, :1])]
        for j in range(1, self.spec.num_code_groups):
            parts.append(self.code_predictor.embeddings[j - 1](codes[:, j : j + 1]))
        return torch.cat(parts, dim=1).sum(1, keepdim=True)

    def release(self, state: TalkerState) -> None:
        self.batching.free_cache(state.cache)
        state.cache = None
        state.past_hidden = None
        state.pending_frame = None
        if state.stopped_on is None:
            state.stopped_on = "released"
