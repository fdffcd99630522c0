"""Small random-weight code2wav models for the streaming tests."""

from __future__ import annotations

import functools

import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from benchmarks.code2wav import scale_weights
from omnistage.models.qwen3_omni.code2wav_streaming import tiny_code2wav_config


def config_a() -> Qwen3OmniMoeCode2WavConfig:
    """Tiny, short sliding window (8), 2 layers, the real 1920-samples-per-frame upsampling."""
    return tiny_code2wav_config(hidden_size=32, num_hidden_layers=2, sliding_window=8, decoder_dim=64)


def config_b() -> Qwen3OmniMoeCode2WavConfig:
    """Long sliding window (the real 72), 4 layers, smaller upsampling (24 samples per frame)."""
    return tiny_code2wav_config(
        hidden_size=64,
        num_hidden_layers=4,
        sliding_window=72,
        decoder_dim=32,
        upsample_rates=(4, 3),
        upsampling_ratios=(2,),
    )


CONFIGS = {"A": config_a, "B": config_b}
# Per-config matrix gain: the largest that keeps the full decode's own fp32 rounding error
# (vs float64) around 1e-6, with output std ~0.25-0.4 and almost no clamping.
GAINS = {"A": 0.7, "B": 0.6}


@functools.cache
def make_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> Qwen3OmniMoeCode2Wav:
    torch.manual_seed(seed)
    model = Qwen3OmniMoeCode2Wav(CONFIGS[name]()).eval()
    scale_weights(model, GAINS[name])
    return model.to(dtype)


def random_codes(config: Qwen3OmniMoeCode2WavConfig, frames: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.codebook_size, (config.num_quantizers, frames), generator=gen)
