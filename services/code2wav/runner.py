"""code2wav runner: codec frames -> 24 kHz float32 PCM."""

from __future__ import annotations

from typing import Any

import torch

from omnistage.families.qwen3_omni import FamilySpec


class Code2WavRunner:
    def __init__(self, model: Any, spec: FamilySpec) -> None:
        self.model = model
        self.spec = spec
        self.device = next(model.parameters()).device

    def validate_codes(self, codes: torch.Tensor) -> None:
        if codes.dim() != 2 or codes.shape[0] != self.spec.num_code_groups:
            raise ValueError(f"codes must be [{self.spec.num_code_groups}, frames], got {list(codes.shape)}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.spec.codebook_size):
            lo, hi = int(codes.min()), int(codes.max())
            raise ValueError(f"codes must lie in [0, {self.spec.codebook_size}), got {lo}..{hi}")

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Full decode of `[num_code_groups, frames]` codes to `[samples]` float32 PCM."""
        self.validate_codes(codes)
        if codes.shape[1] == 0:
            return torch.zeros(0, dtype=torch.float32)
        wav = self.model(codes.unsqueeze(0).to(self.device))
        return wav.reshape(-1).float().cpu()
