"""The checkpoint's own processor (`Qwen2_5OmniProcessor`): Qwen3-Omni's input builder (chat
template, placeholder expansion, log-mel features, image and video patches) with this family's
processor class and settings."""

from __future__ import annotations

from typing import Any

from omnistage.models.checkpoint import Checkpoint
from omnistage.models.qwen3_omni import processor as qwen3_processor


class InputBuilder(qwen3_processor.InputBuilder):
    processor_class = "Qwen2_5OmniProcessor"

    def __init__(self, ckpt: Checkpoint, tokenizer: Any) -> None:
        super().__init__(ckpt, tokenizer)
        self.seconds_per_chunk = float(ckpt.config.thinker_config.seconds_per_chunk)

    def options(self) -> dict[str, Any]:
        return {"position_id_per_seconds": self.position_id_per_seconds, "seconds_per_chunk": self.seconds_per_chunk}
