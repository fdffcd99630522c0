"""The monolithic reference: transformers' `Qwen2_5OmniForConditionalGeneration.generate()` on a
checkpoint, greedy, with its talker codes recorded (the parity tests and the bench's baseline)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class Reference:
    def __init__(self, model_dir: Path, threads: int | None = None) -> None:
        from transformers import Qwen2_5OmniForConditionalGeneration
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.model = Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.last_codes: torch.Tensor | None = None
        token2wav = self.model.token2wav
        original = token2wav.forward

        def recording(code: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            self.last_codes = code.clone()
            return original(code, *args, **kwargs)

        token2wav.forward = recording

    @property
    def default_speaker(self) -> str:
        return "Chelsie" if "Chelsie" in self.model.speaker_map else min(self.model.speaker_map)

    def generate(self, prompt_ids: list[int], thinker_max: int, talker_max: int, eos_id: int, audio: bool = True,
                 speaker: str | None = None, seed: int = 0, talker_repetition_penalty: float = 1.0,
                 **inputs: Any) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
        """Greedy: (generated ids, codes `[1, T]` or None, wav `[samples]` or None). The global
        seed is `seed` first (token2wav's noise). `inputs`: multimodal model inputs."""
        talker = self.model.talker
        self.last_codes = None
        # generate() hands its shared keyword arguments, pixels included, to the talker, whose
        # generate() refuses them (transformers 5.23): an image or video prompt could not get
        # audio. The talker reads only the thinker's states, so give it none (as its own
        # `talker_` arguments, which generate() lets override the shared ones).
        for name in ("pixel_values", "pixel_values_videos"):
            if inputs.get(name) is not None:
                inputs[f"talker_{name}"] = None
        torch.manual_seed(seed)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=torch.tensor([prompt_ids]),
                speaker=speaker or self.default_speaker,
                **inputs,
                thinker_max_new_tokens=thinker_max,
                thinker_eos_token_id=eos_id,
                talker_max_new_tokens=talker_max,
                talker_do_sample=False,
                talker_repetition_penalty=talker_repetition_penalty,
                talker_eos_token_id=[talker.codec_pad_token, talker.codec_eos_token],
                generation_mode="audio" if audio else "text",
            )
        if not audio:
            seq = out.sequences if hasattr(out, "sequences") else out
            return seq[0, len(prompt_ids) :].tolist(), None, None
        seq, wav = out
        return seq[0, len(prompt_ids) :].tolist(), self.last_codes, wav.reshape(-1)
