"""The monolithic reference: transformers' `Qwen3OmniMoeForConditionalGeneration.generate()` on a
checkpoint (see models/reference.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omnistage.models.reference import MonolithicReference


class Reference(MonolithicReference):
    def __init__(self, model_dir: Path, device: str = "cpu", dtype: str = "float32") -> None:
        from transformers import Qwen3OmniMoeForConditionalGeneration
        from transformers.utils import logging as hf_logging

        super().__init__(device)
        hf_logging.set_verbosity_error()
        model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        self.model = model.to(device).eval()
        if hasattr(self.model, "code2wav"):  # a text-only checkpoint has none
            self.record_codes(self.model.code2wav, "chunked_decode", lambda codes: codes[0])  # [1, G, T] -> [G, T]

    @property
    def default_speaker(self) -> str:
        from omnistage.models.qwen3_omni.spec import FamilySpec

        return FamilySpec.from_config(self.model.config).default_speaker

    def family_arguments(self, audio: bool, inputs: dict[str, Any]) -> dict[str, Any]:
        return {"return_audio": audio}
