"""A Qwen3-Omni checkpoint with the real model's widths and a few of its layers, seeded weights
(the tiny checkpoint's recipe, omnistage.models.qwen3_omni.tiny), for GPU figures that the
64-wide tiny checkpoint cannot give: the published Qwen3-Omni-30B-A3B's thinker (2048 wide,
32 heads of 128, 128 experts of 768, top 8), talker (1024 wide, 128 experts of 384 and a shared
expert of 768), code predictor (1024 wide, all 5 layers, 16 code groups) and code2wav (all of it:
1024 wide, 8 layers, decoder 1536), with 2 thinker and 2 talker layers instead of 48 and 20.
The vocabulary stays small (4096 instead of 151,936), so the thinker's lm_head is 1/37 of the
real one. Usage: python -m benchmarks.gpu.wide_checkpoint OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from omnistage.models.qwen3_omni.tiny import TinyShape, write_tiny_checkpoint

LAYERS = 2
WIDE = TinyShape(thinker_vocab=4096, hidden=2048, talker_hidden=1024, codebook=2048)
ROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [24, 20, 20]}
OVERRIDES: dict[str, Any] = {
    "thinker_config": {"text_config": {
        "num_hidden_layers": LAYERS, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "intermediate_size": 768, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
        "rope_parameters": ROPE,
    }},
    "talker_config": {
        "text_config": {
            "num_hidden_layers": LAYERS, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128,
            "intermediate_size": 2048, "moe_intermediate_size": 384, "num_experts": 128, "num_experts_per_tok": 8,
            "shared_expert_intermediate_size": 768, "rope_parameters": ROPE,
        },
        "code_predictor_config": {
            "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 5, "num_attention_heads": 16,
            "num_key_value_heads": 8, "head_dim": 128,
        },
    },
    "code2wav_config": {
        "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 3072,
        "num_hidden_layers": 8, "decoder_dim": 1536,
    },
}  # fmt: skip


def write_wide_checkpoint(out_dir: Path, dtype: str = "bfloat16") -> dict[str, Any]:
    return write_tiny_checkpoint(out_dir, shape=WIDE, overrides=OVERRIDES, dtype=dtype, shard_bytes=2 << 30)


if __name__ == "__main__":
    summary = write_wide_checkpoint(Path(sys.argv[1]))
    print({k: v for k, v in summary.items() if k != "files"})
