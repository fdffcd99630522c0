"""Qwen2.5-Omni's talker, stepping many requests at once: one packed forward per step (see
models/batching.py), each request with its own KV cache. One codebook: a step gives one code.

It follows `Qwen2_5OmniForConditionalGeneration.generate` exactly. With thinker tokens
t_0..t_{N-1}, write h(g) for the thinker's last-layer hidden state at the position that fed t_g
and e(g) for t_g's embedding; the talker reads r_g = h(g) + e(g).
  * Prompt (L + 2 rows, L the thinker prompt): per prompt position its last-layer hidden state
    plus its embedding (zero at audio/image/video placeholders), the embedding of the voice's
    bos id, then r_0. Its last row gives code 0.
  * Step k >= 1 feeds embed(code k-1) + the k-th reply element: r_k while k <= N-2, then the
    embedding of tts_text_end, then that of tts_text_pad for ever.
  * `generate()` gives the talker no attention mask (it drops an all-ones one), so positions
    are plain text positions, and the codec pad/bos ids of its input ids are never embedded:
    they only enter the repetition penalty's history (the prompt's ids: codec_mask per prompt
    position, codec_pad, codec_bos).
  * It stops when a code is a stop id (codec pad or end; no frame for it) or after `max_tokens`
    codes, or at the longest utterance token2wav decodes (`spec.max_frames`: generate() fails
    past it). The thinker's last token is never read (its position is never fed).
  * A code past token2wav's codebook that is no stop id (another control id: only the start id
    is suppressed, as in generate(), whose token2wav then fails) fails the request as a model
    failure, before it reaches code2wav.

Streaming: h(g) arrives with token g+1 (the thinker gives each token with the hidden state of
the position that produced it), so the prompt waits for t_1 and step k for t_{k+1} or the end
of the text. A thinker that gives a single token leaves nothing to speak ("no_text"), where
`generate()` fails.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from omnistage.models.batching import PackedBatching, PackedCache
from omnistage.models.qwen2_5_omni.spec import FamilySpec
from omnistage.models.sampling import SamplingParams, TokenChooser, choose_rows

__all__ = ["Talker", "TalkerState"]


def text_positions(start: int, length: int, device: torch.device | str) -> torch.Tensor:
    """Position ids `[4, 1, length]` of text rows (the text axis and the three M-RoPE axes)."""
    return torch.arange(start, start + length, device=device).view(1, 1, -1).expand(4, 1, -1)


@dataclass
class TalkerState:
    """One request's talker state: what the thinker has sent so far and the talker's progress."""

    sampling: SamplingParams
    speaker: str
    chooser: TokenChooser
    prompt: torch.Tensor | None = None  # [L, H] hidden + embeds of the thinker prompt
    prompt_len: int = 0
    # generated tokens: (embedding, hidden state of the position that produced the token)
    tokens: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    text_done: bool = False  # the thinker's last token has arrived
    started: bool = False
    step: int = 0  # codes produced so far
    cache: Any = None
    code: int | None = None  # the last code, fed back next step
    history: list[int] = field(default_factory=list)  # prompt ids then codes (repetition penalty)
    frames: int = 0  # frames handed out
    stopped_on: str | None = None  # "stop_id" | "max_tokens" | "no_text" | "error" once finished
    error: str | None = None  # why this request failed (no distribution, or a code token2wav cannot take)

    @property
    def finished(self) -> bool:
        return self.stopped_on is not None

    def add_token(self, embed: torch.Tensor, is_last: bool, hidden: torch.Tensor | None = None) -> None:
        if hidden is None:
            raise ValueError("a thinker token without its hidden state (Qwen2.5-Omni's talker reads it)")
        self.tokens.append((embed, hidden))
        self.text_done = self.text_done or is_last

    def can_step(self, text_done: bool) -> bool:
        """Can a step make progress, given whether the thinker has sent its last token?"""
        if self.finished or self.prompt is None:
            return False
        done = text_done or self.text_done
        if not self.started:
            return len(self.tokens) >= 2 or done
        return len(self.tokens) >= self.step + 2 or done

    def reply(self, g: int) -> torch.Tensor:
        """r_g = h(g) + e(g); h(g) came with token g+1."""
        return self.tokens[g + 1][1] + self.tokens[g][0]


class Talker:
    def __init__(self, model: Any, spec: FamilySpec, text_embeds: Mapping[int, torch.Tensor],
                 row_modules: tuple[type, ...] = (), batching: str = "exact") -> None:  # fmt: skip
        """`text_embeds`: thinker embedding rows by id, for tts_text_end, tts_text_pad and each
        voice's bos id (the talker stage never loads the thinker)."""
        self.model = model
        self.spec = spec
        self.device = next(model.parameters()).device
        self.text_embeds = {i: e.to(self.device) for i, e in text_embeds.items()}
        self.codec_embedding = model.get_input_embeddings()
        self.suppress = [spec.codec_bos_id]  # generate()'s suppress_tokens
        self.batching = PackedBatching(model, row_modules, batching)

    def new_state(self, sampling: SamplingParams, speaker: str) -> TalkerState:
        name = self.spec.speaker_name(speaker)  # unknown speaker: clear error before any model work
        if not sampling.stop_ids:
            sampling = sampling.with_overrides(stop_ids=self.spec.talker_stop_ids())
        return TalkerState(sampling, name, TokenChooser(sampling, self.suppress, device=str(self.device)))

    def set_prompt(self, state: TalkerState, ids: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor | None,
                   rope: Mapping[str, torch.Tensor] | None = None) -> None:  # fmt: skip
        """The thinker's prompt: ids `[L]`, embeddings and last-layer hidden states `[L, H]`.
        `rope` (the media's sizes) is not needed: the talker's positions are plain."""
        del rope
        if hidden is None:
            raise ValueError("the thinker prompt has no hidden states (Qwen2.5-Omni's talker reads them)")
        ids = ids.view(-1)
        mm = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        for mm_id in self.spec.multimodal_ids:
            mm |= ids == mm_id
        # generate() zeroes the placeholders' embeddings (its encoders' rows), not their hidden states
        embeds = embeds.masked_fill(mm.view(-1, 1).to(embeds.device), 0)
        state.prompt = hidden + embeds
        state.prompt_len = int(ids.shape[0])
        spec = self.spec
        state.history = [spec.codec_mask_id] * state.prompt_len + [spec.codec_pad_id, spec.codec_bos_id]

    # ---- one step for many requests ----------------------------------------------------------

    @torch.no_grad()
    def step(self, items: Sequence[tuple[TalkerState, bool]]) -> list[torch.Tensor | None]:
        """One packed forward for every `(state, text_done)` that can step: a talker prompt or the
        last code fed back. Returns each state's new frame (`[1]` code) or None."""
        frames: list[torch.Tensor | None] = [None] * len(items)
        rows: list[tuple[int, TalkerState, torch.Tensor]] = []
        for i, (state, text_done) in enumerate(items):
            state.text_done = state.text_done or text_done
            if not state.can_step(state.text_done):
                continue
            embeds = self._prompt_rows(state) if not state.started else self._next_row(state)
            if embeds is not None:
                rows.append((i, state, embeds))
        if rows:
            for (i, _, _), code in zip(rows, self._forward([(s, e) for _, s, e in rows]), strict=True):
                if code is not None:
                    frames[i] = torch.tensor([code], dtype=torch.long)
        return frames

    def _prompt_rows(self, state: TalkerState) -> torch.Tensor | None:
        if len(state.tokens) < 2:  # the thinker's only token was its last: nothing to speak
            state.stopped_on = "no_text"
            return None
        assert state.prompt is not None
        bos = self.text_embeds[self.spec.speaker_id(state.speaker)]
        rows = torch.cat([state.prompt.to(self.device), bos.view(1, -1), state.reply(0).view(1, -1).to(self.device)])
        state.prompt = state.prompt[:0].clone()  # only this prefill reads the [L, H] rows: not held for the speech
        return rows.unsqueeze(0)

    def _next_row(self, state: TalkerState) -> torch.Tensor:
        k = state.step
        n = len(state.tokens)
        if k + 1 < n:  # r_k, with h(k) from token k+1
            element = state.reply(k).to(self.device)
        elif k + 1 == n:  # the thinker's last token is never read: text end in its place
            element = self.text_embeds[self.spec.text_eos_id]
        else:
            element = self.text_embeds[self.spec.text_pad_id]
        assert state.code is not None
        code = torch.tensor([[state.code]], device=self.device)
        return self.codec_embedding(code) + element.view(1, 1, -1).to(self.model.dtype)

    def _forward(self, items: list[tuple[TalkerState, torch.Tensor]]) -> list[int | None]:
        """One packed talker forward over `(state, embeds [1, n, H])`; each state's next code."""
        model = self.model
        lengths = [int(e.shape[1]) for _, e in items]
        positions = []
        for (state, _), n in zip(items, lengths, strict=True):
            if state.cache is None:
                state.cache = self.batching.new_cache(model.config)
            positions.append(text_positions(state.cache.get_seq_length(), n, self.device))
            state.started = True
        cache = PackedCache([state.cache for state, _ in items], lengths)
        with self.batching.step(lengths, cache):
            inputs = model.thinker_to_talker_proj(torch.cat([e for _, e in items], dim=1).to(model.dtype))
            out = model.model(inputs_embeds=inputs, position_ids=torch.cat(positions, dim=-1), past_key_values=cache,
                              use_cache=True)  # fmt: skip
            logits_all = model.codec_head(out.last_hidden_state)[0].float()  # every row, as generate() does
        lasts = [end - 1 for end in itertools.accumulate(lengths)]
        states = [state for state, _ in items]
        # every request's code at once, as its own `choose` picks it (one host sync for the step)
        codes = choose_rows([s.chooser for s in states], logits_all[lasts], [s.history for s in states])
        return [self._take(state, code) for state, code in zip(states, codes, strict=True)]

    def _take(self, state: TalkerState, code: int | RuntimeError) -> int | None:
        if isinstance(code, RuntimeError):  # this request alone fails; the others go on
            state.stopped_on = "error"
            state.error = f"no code could be chosen from this request's logits: {code}"
            return None
        state.history.append(code)
        state.step += 1
        if state.chooser.is_stop(code):
            state.stopped_on = "stop_id"
            return None
        if code >= self.spec.codebook_size:  # a control id: token2wav has no row for it (generate() fails too)
            state.stopped_on = "error"
            state.error = (f"made codec id {code} at frame {state.frames}, outside token2wav's codebook "
                           f"[0, {self.spec.codebook_size}) (a control id: only the start id is suppressed, as in "
                           "generate(), whose token2wav fails on it too)")
            return None
        state.code = code
        state.frames += 1
        if state.step >= state.sampling.max_tokens or state.frames >= self.spec.max_frames:
            state.stopped_on = "max_tokens"
        return code

    def release(self, state: TalkerState) -> None:
        self.batching.free_cache(state.cache)
        state.cache = None
        state.prompt = None
        state.tokens = []
        if state.stopped_on is None:
            state.stopped_on = "released"
