"""The monolithic reference: transformers' `Qwen2_5OmniForConditionalGeneration.generate()` on a
checkpoint (see models/reference.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omnistage.models.reference import MonolithicReference


class Reference(MonolithicReference):
    def __init__(self, model_dir: Path, device: str = "cpu", dtype: str = "float32") -> None:
        from transformers import Qwen2_5OmniForConditionalGeneration
        from transformers.utils import logging as hf_logging

        super().__init__(device)
        hf_logging.set_verbosity_error()
        model = Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        self.model = model.to(device).eval()
        self.record_codes(self.model.token2wav, "forward", lambda codes: codes)  # [1, T]

    @property
    def default_speaker(self) -> str:
        return "Chelsie" if "Chelsie" in self.model.speaker_map else min(self.model.speaker_map)

    def family_arguments(self, audio: bool, inputs: dict[str, Any]) -> dict[str, Any]:
        talker = self.model.talker
        out: dict[str, Any] = {
            "talker_eos_token_id": [talker.codec_pad_token, talker.codec_eos_token],
            "generation_mode": "audio" if audio else "text",
        }
        # generate() hands its shared keyword arguments, pixels included, to the talker, whose
        # generate() refuses them (transformers 5.23): an image or video prompt could not get
        # audio. The talker reads only the thinker's states, so give it none (as its own
        # `talker_` arguments, which generate() lets override the shared ones).
        for name in ("pixel_values", "pixel_values_videos"):
            if inputs.get(name) is not None:
                out[f"talker_{name}"] = None
        return out
