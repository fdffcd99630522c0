"""Qwen3-Omni prompt glue: what the monolithic `generate()` does between the model parts.

Talker prompt (mirrors `Qwen3OmniMoeForConditionalGeneration.generate`):
  * user positions: every position of a user turn (system and earlier assistant turns are
    dropped); text positions take `text_projection(embed)`, audio/image/video placeholders
    take `hidden_projection(hidden[accept_hidden_layer])`;
  * 9 assistant positions: text side `proj(<|im_start|> assistant \\n)`, 4 x tts_pad,
    tts_bos, `proj(first generated token)`; codec side zeros(3) + codec embeddings of
    [nothink, think_bos, think_eos, speaker, codec_pad, codec_bos];
  * trailing text, one entry per talker decode step g: `proj(token g+1)` while token g+1 is
    not the thinker's last token, `tts_eos` in place of the last token, then `tts_pad`.
    The thinker's last token is never spoken (reference behaviour, kept for parity).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from omnistage.models.qwen3_omni.spec import FamilySpec

# Number of fixed assistant positions at the end of the talker prefill.
ASSISTANT_PREFIX_LEN = 9
# Tokens of "<|im_start|>assistant\n" that precede the first generated token.
ASSISTANT_HEADER_LEN = 3


def text_positions(start: int, length: int, device: torch.device | str) -> torch.Tensor:
    """M-RoPE position ids `[4, 1, length]` of text tokens: the same position on the text axis
    and the three rotary axes."""
    pos = torch.arange(start, start + length, device=device)
    return pos.view(1, 1, -1).expand(4, 1, -1)


def build_prompt_ids(tokenizer: Any, messages: list[dict[str, str]],
                     template_kwargs: Mapping[str, Any] | None = None) -> list[int]:  # fmt: skip
    """Chat messages -> prompt ids ending with the assistant header, via the checkpoint's template
    (`template_kwargs`: the request's own variables for it). A special token's text in what a
    client wrote (`<|im_end|>`, `<|audio_pad|>`) is its text, as OpenAI reads it: only the template's
    own are encoded as tokens (transformers' `sanitize_control_tokens`, for the prompts that hold
    such text: the others are rendered and encoded as transformers does without it)."""
    variables = dict(template_kwargs or {})
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        sanitize_control_tokens=holds_special_text(tokenizer, messages, variables),
                                        **variables)  # fmt: skip
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    if out and isinstance(out[0], list):
        out = out[0]
    return [int(i) for i in out]


@functools.lru_cache(maxsize=8)
def _specials_pattern(tokens: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


def holds_special_text(tokenizer: Any, *values: Any) -> bool:
    """Whether a string in `values` (messages, template variables: strings, lists and dict values,
    as transformers marks them) holds the text of one of the tokenizer's special tokens: what
    must be sanitized. Looking first keeps the other prompts as transformers encodes them
    unsanitized (its sanitizing also drops the two private-use characters it marks with, U+F0000
    and U+F0001, from everything the client wrote)."""
    pattern = _specials_pattern(tuple(t.content for t in tokenizer.added_tokens_decoder.values() if t.special))

    todo = list(values)  # (walked without recursion: a client's tool schema may nest deep)
    while todo:
        obj = todo.pop()
        if isinstance(obj, str) and pattern.search(obj) is not None:
            return True
        if isinstance(obj, Mapping):
            todo.extend(obj.values())
        elif isinstance(obj, list | tuple):
            todo.extend(obj)
    return False


def messages_from_prompt(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    return messages


def user_positions(prompt_ids: torch.Tensor, spec: FamilySpec) -> torch.Tensor:
    """Indices of the prompt positions that belong to user turns, in order.

    Same rule as `generate()`: a position belongs to the turn opened by the closest
    `<|im_start|>` at or before it, and the turn's role is the token after that start.
    """
    ids = prompt_ids.view(1, -1)
    n = ids.shape[1]
    pos = torch.arange(n).unsqueeze(0)
    starts = torch.where(ids == spec.im_start_id, pos, pos.new_full((), -1))
    prev = torch.cummax(starts, dim=-1).values.clamp_min(0)
    role = ids.gather(1, (prev + 1).clamp_max(n - 1))
    return torch.nonzero((role == spec.user_id)[0], as_tuple=False).flatten()


def talker_input_ids(prompt_ids: torch.Tensor, spec: FamilySpec) -> torch.Tensor:
    """The ids `generate()` gives the talker (`[1, U + 9]`): the user turns' ids, then tts_pad
    for each assistant position. They place the talker prompt's positions."""
    ids = prompt_ids.view(-1)
    assistant = torch.full((ASSISTANT_PREFIX_LEN,), spec.tts_pad_id, dtype=torch.long, device=ids.device)
    return torch.cat((ids[user_positions(ids, spec)], assistant)).unsqueeze(0)


def assistant_start(prompt_ids: torch.Tensor, spec: FamilySpec) -> int:
    """Position of the last `<|im_start|>assistant` in the prompt."""
    ids = prompt_ids.view(-1)
    mask = (ids[:-1] == spec.im_start_id) & (ids[1:] == spec.assistant_id)
    hits = torch.nonzero(mask, as_tuple=False).flatten()
    if hits.numel() == 0:
        raise ValueError("prompt has no '<|im_start|>assistant' header: nothing for the talker to speak")
    return int(hits[-1])


class TalkerPromptBuilder:
    """Builds the talker's inputs from thinker outputs for one request, incrementally.

    `talker` is a loaded `Qwen3OmniMoeTalkerForConditionalGeneration`; `tts_special_embeds` is
    `tts_special_embeds(talker, ...)`, `[1, 3, H]`. Thinker embeddings arrive as arguments.
    """

    def __init__(self, talker: Any, spec: FamilySpec, tts_special_embeds: torch.Tensor) -> None:
        self.talker = talker
        self.spec = spec
        # proj(embed([tts_bos, tts_eos, tts_pad])) as [1, 3, H], computed once per stage.
        self.tts_bos, self.tts_eos, self.tts_pad = tts_special_embeds.chunk(3, dim=1)

    @torch.no_grad()
    def prefill_embeds(
        self,
        prompt_ids: torch.Tensor,
        prompt_embeds: torch.Tensor,
        prompt_hidden: torch.Tensor | None,
        assistant_stream_embeds: torch.Tensor,
        speaker: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Talker prefill: `(inputs_embeds [1, U+9, H], talker_input_ids [1, U+9])`.

        `prompt_embeds`/`prompt_hidden`: thinker layer-0 embeddings and accept-layer hidden
        states of the prompt positions, `[L, Ht]`. `assistant_stream_embeds`: layer-0
        embeddings of the assistant stream from its header up to and including the first
        generated token (`[ASSISTANT_HEADER_LEN + 1, Ht]` for a prompt ending in the header).
        """
        spec = self.spec
        talker = self.talker
        dtype = talker.dtype
        ids = prompt_ids.view(-1)
        user_idx = user_positions(ids, spec)
        mm_mask = torch.zeros(ids.shape[0], dtype=torch.bool)
        for mm_id in spec.multimodal_ids:
            mm_mask |= ids == mm_id
        user_embeds = torch.empty((ids.shape[0], spec.talker_hidden), dtype=dtype, device=prompt_embeds.device)
        if mm_mask.any():
            if prompt_hidden is None:
                raise ValueError("prompt has audio/image/video placeholders but no thinker hidden states")
            user_embeds[mm_mask] = talker.hidden_projection(prompt_hidden[mm_mask].unsqueeze(0))[0].to(dtype)
        user_embeds[~mm_mask] = talker.text_projection(prompt_embeds[~mm_mask].unsqueeze(0))[0].to(dtype)
        user_part = user_embeds[user_idx].unsqueeze(0)

        assistant_hidden = talker.text_projection(assistant_stream_embeds[: ASSISTANT_HEADER_LEN + 1].unsqueeze(0))
        text_side = torch.cat(
            (
                assistant_hidden[:, :3],
                self.tts_pad.expand(1, 4, -1),
                self.tts_bos,
                assistant_hidden[:, 3:4],
            ),
            dim=1,
        )
        codec_ids = torch.tensor(
            [
                [
                    spec.codec_nothink_id,
                    spec.codec_think_bos_id,
                    spec.codec_think_eos_id,
                    spec.speaker_id(speaker),
                    spec.codec_pad_id,
                    spec.codec_bos_id,
                ]
            ],
            device=text_side.device,
        )
        codec_side = torch.cat(
            (
                torch.zeros((1, 3, spec.talker_hidden), device=text_side.device, dtype=dtype),
                talker.get_input_embeddings()(codec_ids),
            ),
            dim=1,
        )
        assistant_part = text_side + codec_side
        return torch.cat((user_part, assistant_part), dim=1), talker_input_ids(ids, spec)

    @torch.no_grad()
    def trailing_embeds(self, elements: Sequence[tuple[torch.Tensor | None, bool]], batching: Any) -> torch.Tensor:
        """Trailing text for one talker step of several requests, `[B, 1, H]`.

        Each element: the layer-0 embedding `[Ht]` of thinker token g+1 for the request's step
        g, or None once the thinker has no token g+1 (then tts_pad); and whether token g+1 is
        the thinker's final token, which is replaced by tts_eos. The tokens are projected in one
        call, as a packed step of one row each (`batching`, models/batching.py): in exact mode
        each row is what projecting it alone gives, in fast mode one GEMM.
        """
        project = [i for i, (embed, last) in enumerate(elements) if embed is not None and not last]
        projected = None
        if project:
            rows = torch.stack([elements[i][0] for i in project]).unsqueeze(1)  # type: ignore[misc]
            with batching.step([1] * len(project), batch_axis=True):
                projected = self.talker.text_projection(rows)
            if len(project) == len(elements):
                return projected  # type: ignore[no-any-return]
        pieces = []
        at = {i: j for j, i in enumerate(project)}
        for i, (embed, _) in enumerate(elements):
            if i in at:
                assert projected is not None
                pieces.append(projected[at[i] : at[i] + 1])
            else:
                pieces.append(self.tts_pad if embed is None else self.tts_eos)
        return torch.cat(pieces)


@torch.no_grad()
def tts_special_embeds(talker: Any, thinker_rows: torch.Tensor) -> torch.Tensor:
    """`text_projection` of the thinker embeddings of [tts_bos, tts_eos, tts_pad] (`[3, Ht]`
    in that order, see `TTS_SPECIAL_ORDER`), as `[1, 3, H]`."""
    return talker.text_projection(thinker_rows.to(talker.device, talker.dtype).unsqueeze(0))


def tts_special_ids(spec: FamilySpec) -> list[int]:
    return [spec.tts_bos_id, spec.tts_eos_id, spec.tts_pad_id]
