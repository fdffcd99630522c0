"""The tiny built-in Qwen3-Omni checkpoint: real architecture, small sizes, seeded weights.

`write_tiny_checkpoint(dir)` writes a Hugging Face-layout directory (config.json,
generation_config.json, the weights in the published (default) or fused layout, tokenizer files) that
`Qwen3OmniMoeForConditionalGeneration.from_pretrained` loads. Everything is derived from
constants in this file, so two runs give byte-identical files.

How the weights are made to say something (random init with transformers' 0.02 std makes
every layer a near no-op, so greedy decoding repeats one token and code2wav is near silent):
every matrix is redrawn from one seeded generator with std 1/sqrt(fan_in) (embeddings std 1),
so activations keep unit scale through the stack. Then two rows are biased so that the stop
conditions happen within a few dozen steps for some prompts and not others: the thinker's
`<|im_end|>` row of lm_head and the talker's codec-EOS row of codec_head. The constants below
were chosen by running the built-in prompts (tests/test_parity.py checks the output is not
trivial: text ids vary, codes vary across frames and groups, audio is not silent, and some
prompts stop on EOS while others hit the token limit).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnistage.models import tiny_files

SEED = 20261121
# Bias scales for the stop rows (see module docstring).
THINKER_EOS_ROW_SCALE = 1.6
TALKER_EOS_ROW_SCALE = 1.4
# code2wav: residual units' second conv is damped so activations stay near unit scale through
# the upsampling stack (undamped they grow ~4x per block and fp32 rounding of the large
# intermediate values alone reaches 3e-5 at the output); the last conv sets the loudness.
CODE2WAV_RESIDUAL_SCALE = 0.25
CODE2WAV_OUT_SCALE = 0.3

# Special tokens, named as in Qwen3-Omni's tokenizer.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
]
# Role words are single ordinary tokens in Qwen's vocabulary; the config names their ids.
ROLE_WORDS = ["system", "user", "assistant"]
# Qwen's tool-calling tags: added tokens, not special ones, as in Qwen3-Omni's tokenizer (a call
# starts with one token, which ends the talker's input: services/thinker/worker.py); the
# vocabulary's last ids
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


@dataclass(frozen=True)
class TinyShape:
    """What a tiny checkpoint can vary; the defaults are the built-in checkpoint. Every id and
    size the stages use follows from these, so a second shape checks nothing is tuned to one."""

    first_special_id: int = 256  # special tokens, then the role words, from here on
    thinker_vocab: int = 512
    hidden: int = 64  # thinker width (and the audio/vision towers' output)
    talker_hidden: int = 64  # talker and code predictor width
    codebook: int = 128  # code2wav codebook; talker vocab = codebook + 1024 (control range)
    num_code_groups: int = 16
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)
    speakers: tuple[str, ...] = ("chelsie", "ethan", "aiden")
    # the thinker's and talker's M-RoPE sections: Qwen3-Omni interleaves them, so they need not
    # fill the head (the published [24, 20, 20] fills a head of 128; transformers' default)
    mrope_section: tuple[int, ...] = (2, 3, 3)

    def special_id(self, name: str) -> int:
        return self.first_special_id + (SPECIAL_TOKENS + ROLE_WORDS).index(name)

    def codec_id(self, real_id: int) -> int:
        """Codec control ids keep the real checkpoint's offsets above the codebook (real: 2048)."""
        return real_id - 2048 + self.codebook

    @property
    def talker_vocab(self) -> int:
        return self.codebook + 1024


DEFAULT = TinyShape()
# Another valid checkpoint of the family: other special ids, widths, code groups, codebook,
# samples per frame, voices, and the published M-RoPE sections over a smaller head.
VARIANT = TinyShape(first_special_id=300, thinker_vocab=560, hidden=48, talker_hidden=32, codebook=96,
                    num_code_groups=8, upsample_rates=(8, 5, 3), upsampling_ratios=(2,), speakers=("vivian", "ryan"),
                    mrope_section=(24, 20, 20))


def thinker_eos_id(shape: TinyShape = DEFAULT) -> int:
    return shape.special_id("<|im_end|>")


# The tokenizer's named tokens: the processor's placeholders and their start/end tokens.
NAMED_TOKENS = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}
# Qwen2-VL-style patches (16-pixel patches, 2x2 merged, 2 frames per temporal patch) over small images.
VISION_PREPROCESSOR = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
}


def _moe_text_config(vocab: int, hidden: int, max_positions: int, mrope_section: tuple[int, ...],
                     **extra: Any) -> dict[str, Any]:  # fmt: skip
    """The thinker's and the talker's MoE text stacks share these small sizes."""
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "max_position_embeddings": max_positions,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": list(mrope_section)},
        **extra,
    }


def tiny_config_dict(shape: TinyShape = DEFAULT, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The full Qwen3OmniMoeConfig as a plain dict (what config.json will hold), with `overrides`
    merged in."""
    sid = shape.special_id
    audio_token = sid("<|audio_pad|>")
    image_token = sid("<|image_pad|>")
    video_token = sid("<|video_pad|>")
    vision_start = sid("<|vision_start|>")
    audio_start = sid("<|audio_start|>")
    text = _moe_text_config(shape.thinker_vocab, shape.hidden, max_positions=2048, mrope_section=shape.mrope_section)
    thinker = {
        "text_config": text,
        "audio_config": {
            "num_mel_bins": 128,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "d_model": 32,
            "output_dim": shape.hidden,
            "downsample_hidden_size": 16,
            "max_source_positions": 1500,
        },
        "vision_config": {
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": shape.hidden,
            "num_position_embeddings": 256,
            "deepstack_visual_indexes": [0],
        },
        "audio_token_id": audio_token,
        "image_token_id": image_token,
        "video_token_id": video_token,
        "audio_start_token_id": audio_start,
        "vision_start_token_id": vision_start,
        "user_token_id": sid("user"),
        "position_id_per_seconds": 13,  # as the real checkpoint and the processor
    }
    cid = shape.codec_id
    talker = {
        "text_config": _moe_text_config(
            shape.talker_vocab, shape.talker_hidden, max_positions=4096, mrope_section=shape.mrope_section,
            shared_expert_intermediate_size=64,
        ),
        "code_predictor_config": {
            "vocab_size": shape.codebook,
            "hidden_size": shape.talker_hidden,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_code_groups": shape.num_code_groups,
            "max_position_embeddings": 64,
        },
        "num_code_groups": shape.num_code_groups,
        "thinker_hidden_size": shape.hidden,
        "accept_hidden_layer": 1,
        "codec_eos_token_id": cid(2150),
        "codec_nothink_id": cid(2155),
        "codec_think_bos_id": cid(2156),
        "codec_think_eos_id": cid(2157),
        "codec_pad_id": cid(2148),
        "codec_bos_id": cid(2149),
        "audio_token_id": audio_token,
        "image_token_id": image_token,
        "video_token_id": video_token,
        "vision_start_token_id": vision_start,
        "audio_start_token_id": audio_start,
        "spatial_merge_size": 2,
        "position_id_per_seconds": 13,
        "speaker_id": {name: cid(2301 + i) for i, name in enumerate(shape.speakers)},
    }
    code2wav = {
        "codebook_size": shape.codebook,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_quantizers": shape.num_code_groups,
        "sliding_window": 72,
        "max_position_embeddings": 8000,
        "upsample_rates": list(shape.upsample_rates),
        "upsampling_ratios": list(shape.upsampling_ratios),
        "decoder_dim": 64,
        # the real 0.01 would make the pre-transformer a near no-op on random weights
        "layer_scale_initial_scale": 0.5,
    }
    return tiny_files.merge({
        "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
        "model_type": "qwen3_omni_moe",
        "thinker_config": thinker,
        "talker_config": talker,
        "code2wav_config": code2wav,
        "enable_audio_output": True,
        "im_start_token_id": sid("<|im_start|>"),
        "im_end_token_id": sid("<|im_end|>"),
        "tts_pad_token_id": sid("<tts_pad>"),
        "tts_bos_token_id": sid("<tts_text_bos>"),
        "tts_eos_token_id": sid("<tts_text_eod>"),
        "system_token_id": sid("system"),
        "user_token_id": sid("user"),
        "assistant_token_id": sid("assistant"),
    }, overrides or {})  # fmt: skip


def _fan_in(name: str, shape: torch.Size) -> int:
    if "experts" in name:  # [experts, out, in]
        return int(shape[-1])
    n = 1
    for s in shape[1:]:
        n *= int(s)
    return max(n, 1)


@torch.no_grad()
def build_tiny_model(shape: TinyShape = DEFAULT, overrides: dict[str, Any] | None = None) -> torch.nn.Module:
    """Construct the tiny model in memory with its seeded weights."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    config = Qwen3OmniMoeConfig(**tiny_config_dict(shape, overrides))
    torch.manual_seed(SEED)
    model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(SEED)
    for name, param in sorted(model.named_parameters()):
        if param.dim() < 2:
            continue
        std = 1.0 if "embed" in name else _fan_in(name, param.shape) ** -0.5
        param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)
    lm_head = model.thinker.lm_head.weight
    # Special tokens other than the stop token are rare in real replies: damp their rows.
    lm_head[shape.first_special_id : shape.first_special_id + len(SPECIAL_TOKENS)] *= 0.3
    lm_head[thinker_eos_id(shape)] *= THINKER_EOS_ROW_SCALE / 0.3
    codec_head = model.talker.codec_head.weight
    codec_head[config.talker_config.codec_eos_token_id] *= TALKER_EOS_ROW_SCALE
    for block in model.code2wav.decoder[1:-2]:
        for unit in block.block[2:]:
            unit.conv2.conv.weight *= CODE2WAV_RESIDUAL_SCALE
    model.code2wav.decoder[-1].conv.weight *= CODE2WAV_OUT_SCALE
    for block in model.code2wav.upsample:  # ConvNeXt layer scale starts at 1e-6: let the block act
        block[1].gamma.fill_(0.5)
    return model


def processor_files(shape: TinyShape = DEFAULT) -> dict[str, str]:
    """The tokenizer (special tokens and role words from `shape.first_special_id` on) and the
    processor's configs."""
    return tiny_files.processor_files(vocab_size=shape.thinker_vocab, first_special_id=shape.first_special_id,
                                      special_tokens=SPECIAL_TOKENS, role_words=ROLE_WORDS, named_tokens=NAMED_TOKENS,
                                      vision=VISION_PREPROCESSOR, processor_class="Qwen3OmniMoeProcessor",
                                      tools=TOOL_TOKENS)  # fmt: skip


LAYOUTS = ("published", "fused")


def write_tiny_checkpoint(
    out_dir: Path | str,
    *,
    shape: TinyShape = DEFAULT,
    layout: str = "published",
    dtype: str = "float32",
    overrides: dict[str, Any] | None = None,
    settings: Mapping[str, Any] | None = None,
    shard_bytes: int = 4 << 20,
) -> dict[str, Any]:
    """Write the checkpoint into `out_dir`; return a summary (parameters, files, bytes, sha256).

    `layout`: `published` (what transformers' `save_pretrained` writes and published checkpoints
    look like: MoE experts stored one by one, weights in shards of at most `shard_bytes` with a
    `model.safetensors.index.json`) or `fused` (one `model.safetensors` in the in-memory layout,
    experts fused). `dtype`: the storage dtype (`float32` or `bfloat16`). `overrides`: nested
    changes to the config (other sizes, ids, code groups), merged into `tiny_config_dict()`;
    `settings`: more of them by dotted path (`omnistage make-tiny --set`), each naming a key the
    config has.
    """
    from safetensors.torch import save_file

    if settings:
        given = tiny_files.dotted_overrides(tiny_config_dict(shape, overrides), settings)
        overrides = tiny_files.merge(overrides or {}, given)

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(shape, overrides).to(torch_dtype)
    if layout == "published":
        model.save_pretrained(out, max_shard_size=shard_bytes)
    else:
        state = {k: v.detach().contiguous().clone() for k, v in sorted(model.state_dict().items())}
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    generation = {
        "do_sample": False,
        "eos_token_id": thinker_eos_id(shape),
        "pad_token_id": shape.special_id("<|endoftext|>"),
    }
    tiny_files.write_configs(out, model, dtype, generation)
    for name, text in processor_files(shape).items():
        (out / name).write_text(text)
    return tiny_files.summary(out, model, layout, dtype)
