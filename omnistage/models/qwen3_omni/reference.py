"""The monolithic reference: transformers' `Qwen3OmniMoeForConditionalGeneration.generate()` on a
checkpoint, greedy, with its code2wav input recorded (the parity tests and the bench's baseline)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class Reference:
    def __init__(self, model_dir: Path) -> None:
        from transformers import Qwen3OmniMoeForConditionalGeneration
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.last_codes: torch.Tensor | None = None
        original = self.model.code2wav.chunked_decode

        def recording(codes: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            self.last_codes = codes.clone()
            return original(codes, *args, **kwargs)

        self.model.code2wav.chunked_decode = recording

    @property
    def default_speaker(self) -> str:
        from omnistage.models.qwen3_omni.spec import FamilySpec

        return FamilySpec.from_config(self.model.config).default_speaker

    def generate(self, prompt_ids: list[int], thinker_max: int, talker_max: int, eos_id: int, audio: bool = True,
                 speaker: str | None = None, seed: int = 0, talker_repetition_penalty: float = 1.0,
                 **inputs: Any) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
        """Greedy: (generated ids, codes `[G, T]` or None, wav `[samples]` or None). `inputs`:
        multimodal model inputs. `seed` is the global seed first (nothing draws from it when
        greedy; kept so every family's reference takes the same arguments)."""
        self.last_codes = None
        torch.manual_seed(seed)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=torch.tensor([prompt_ids]),
                speaker=speaker or self.default_speaker,
                **inputs,
                thinker_max_new_tokens=thinker_max,
                talker_max_new_tokens=talker_max,
                talker_do_sample=False,
                talker_repetition_penalty=talker_repetition_penalty,
                thinker_eos_token_id=eos_id,
                return_audio=audio,
            )
        if not audio:
            seq = out.sequences if hasattr(out, "sequences") else out
            return seq[0, len(prompt_ids) :].tolist(), None, None
        seq, wav = out
        codes = self.last_codes[0] if self.last_codes is not None else None
        return seq[0, len(prompt_ids) :].tolist(), codes, wav.reshape(-1)
