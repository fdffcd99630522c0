"""The tiny built-in Qwen2.5-Omni checkpoint: real architecture, small sizes, seeded weights.

`write_tiny_checkpoint(dir)` writes a Hugging Face-layout directory that
`Qwen2_5OmniForConditionalGeneration.from_pretrained` loads: config.json, generation_config.json,
the weights in shards with an index (what `save_pretrained` writes and the published checkpoint
looks like), `spk_dict.pt` (each voice's conditioning, reference mel and text-bos id) and the
tokenizer and processor files. Everything is derived from constants in this file, so two runs
give byte-identical files.

As for Qwen3-Omni (see that family's tiny.py), every matrix is redrawn from one seeded generator
with std 1/sqrt(fan_in) so activations keep unit scale, and the stop rows are biased so that
some prompts stop on EOS within a few dozen steps and others hit the token limit.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnistage.models import tiny_files

SEED = 20261123
THINKER_EOS_ROW_SCALE = 1.6
TALKER_EOS_ROW_SCALE = 1.8
# The DiT's velocity is centred on MEL_LEVEL (a quiet log-mel level, inside the vocoder's input
# range: random weights otherwise push every mel bin into its clamp, and every waveform is the
# same), with its variation scaled by DIT_OUT_SCALE; BigVGAN's last conv sets the loudness.
MEL_LEVEL = -4.0
DIT_OUT_SCALE = 0.5
BIGVGAN_OUT_SCALE = 0.005

# Special tokens, named as in Qwen2.5-Omni's tokenizer.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
]
ROLE_WORDS = ["system", "user", "assistant"]
# Ids past the text vocabulary's last merge that only the talker's prompt uses (the published
# checkpoint keeps them above its tokenizer's tokens): text pad/bos/eos, then one bos per voice.
TTS_TEXT_OFFSETS = {"tts_text_pad_token_id": 1, "tts_text_start_token_id": 2, "tts_text_end_token_id": 3}


@dataclass(frozen=True)
class TinyShape:
    """What a tiny checkpoint can vary; the defaults are the built-in checkpoint."""

    first_special_id: int = 256
    thinker_vocab: int = 512
    hidden: int = 64  # thinker width (= the talker's embedding width)
    talker_hidden: int = 32
    codebook: int = 128  # token2wav codes; talker vocab = codebook + 256 (control ids above it)
    block_size: int = 4  # DiT attention block, in mel frames
    repeats: int = 2  # mel frames per code
    upsample_rates: tuple[int, ...] = (5, 3, 2, 2, 2, 2)  # BigVGAN: 240 samples per mel frame
    speakers: tuple[str, ...] = ("Chelsie", "Ethan")

    def special_id(self, name: str) -> int:
        return self.first_special_id + (SPECIAL_TOKENS + ROLE_WORDS).index(name)

    def codec_id(self, real_id: int) -> int:
        """Codec control ids keep the real checkpoint's offsets above its codebook (real: 8192)."""
        return real_id - 8192 + self.codebook

    def tts_id(self, offset: int) -> int:
        return self.thinker_vocab - 16 + offset

    @property
    def talker_vocab(self) -> int:
        return self.codebook + 256


DEFAULT = TinyShape()
# Another valid checkpoint of the family: other special ids, widths, codebook, DiT blocks, samples
# per mel frame and voices.
VARIANT = TinyShape(first_special_id=300, thinker_vocab=560, hidden=48, talker_hidden=48, codebook=96,
                    block_size=6, upsample_rates=(5, 4, 3, 2), speakers=("Ethan", "Aria", "Noah"))  # fmt: skip


def thinker_eos_id(shape: TinyShape = DEFAULT) -> int:
    return shape.special_id("<|im_end|>")


NAMED_TOKENS = {
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}
VISION_PREPROCESSOR = {
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "size": {"shortest_edge": 28 * 28, "longest_edge": 112 * 112},
}


def _text_config(vocab: int, hidden: int, max_positions: int) -> dict[str, Any]:
    half = hidden // 4 // 2  # 4 heads: half a head's rotary dims, split over the three M-RoPE axes
    sections = [2, 3, 3] if half == 8 else [half - 2 * (half // 3), half // 3, half // 3]
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": max_positions,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": sections},
    }


def tiny_config_dict(shape: TinyShape = DEFAULT, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The full Qwen2_5OmniConfig as a plain dict (what config.json holds), with `overrides`
    merged in."""
    sid, cid = shape.special_id, shape.codec_id
    tokens = {
        "audio_token_index": sid("<|AUDIO|>"),
        "image_token_index": sid("<|IMAGE|>"),
        "video_token_index": sid("<|VIDEO|>"),
        "audio_start_token_id": sid("<|audio_bos|>"),
        "audio_end_token_id": sid("<|audio_eos|>"),
        "vision_start_token_id": sid("<|vision_bos|>"),
        "vision_end_token_id": sid("<|vision_eos|>"),
    }
    thinker = {
        "text_config": _text_config(shape.thinker_vocab, shape.hidden, 2048),
        "audio_config": {
            "num_mel_bins": 128,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "d_model": 32,
            "output_dim": shape.hidden,
            "max_source_positions": 1500,
            "n_window": 100,
        },
        "vision_config": {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": shape.hidden,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },
        "user_token_id": sid("user"),
        **{k: v for k, v in tokens.items() if k != "vision_end_token_id"},  # the thinker's config has none
    }
    talker_text = _text_config(shape.talker_vocab, shape.talker_hidden, 4096)
    talker = {
        **talker_text,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
        "embedding_size": shape.hidden,
        **tokens,
        "tts_codec_start_token_id": cid(8293),
        "tts_codec_end_token_id": cid(8294),
        "tts_codec_pad_token_id": cid(8292),
        "tts_codec_mask_token_id": cid(8296),
        **{name: shape.tts_id(offset) for name, offset in TTS_TEXT_OFFSETS.items()},
        "spatial_merge_size": 2,
    }
    dit = {
        "hidden_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "head_dim": 16,
        "ff_mult": 2,
        "emb_dim": 16,
        "block_size": shape.block_size,
        "look_ahead_layers": [2],
        "look_backward_layers": [0, 3],
        "repeats": shape.repeats,
        "num_embeds": shape.codebook + 1,
        "mel_dim": 80,
        "enc_emb_dim": 16,
        "enc_dim": 16,
        "enc_channels": [16, 16, 16, 16, 48],
        "enc_kernel_sizes": [5, 3, 3, 3, 1],
        "enc_dilations": [1, 2, 3, 4, 1],
        "enc_attention_channels": 8,
        "enc_res2net_scale": 2,
        "enc_se_channels": 8,
        "max_position_embeddings": 8192,
        "dropout": 0.0,
    }
    bigvgan = {
        "mel_dim": 80,
        "upsample_initial_channel": 128,
        "resblock_kernel_sizes": [3],
        "resblock_dilation_sizes": [[1, 3, 5]],
        "upsample_rates": list(shape.upsample_rates),
        "upsample_kernel_sizes": [2 * r + (1 if r % 2 else 0) for r in shape.upsample_rates],
    }
    return tiny_files.merge({
        "architectures": ["Qwen2_5OmniForConditionalGeneration"],
        "model_type": "qwen2_5_omni",
        "thinker_config": thinker,
        "talker_config": talker,
        "token2wav_config": {"dit_config": dit, "bigvgan_config": bigvgan},
        "enable_audio_output": True,
    }, overrides or {})  # fmt: skip


def _fan_in(shape: torch.Size) -> int:
    n = 1
    for s in shape[1:]:
        n *= int(s)
    return max(n, 1)


@torch.no_grad()
def build_tiny_model(shape: TinyShape = DEFAULT, overrides: dict[str, Any] | None = None) -> torch.nn.Module:
    """Construct the tiny model in memory with its seeded weights."""
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration
    from transformers.utils import logging as hf_logging

    # transformers checks the talker's tts_text ids (thinker ids) against the talker's vocabulary
    # and warns, for the published checkpoint too: quiet while this builds
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        config = Qwen2_5OmniConfig(**tiny_config_dict(shape, overrides))
    finally:
        hf_logging.set_verbosity(verbosity)
    torch.manual_seed(SEED)
    model = Qwen2_5OmniForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(SEED)
    for name, param in sorted(model.named_parameters()):
        if param.dim() < 2:
            continue
        std = 1.0 if "embed" in name else _fan_in(param.shape) ** -0.5
        param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)
    lm_head = model.thinker.lm_head.weight
    lm_head[shape.first_special_id : shape.first_special_id + len(SPECIAL_TOKENS)] *= 0.3
    lm_head[shape.thinker_vocab - 16 :] *= 0.3  # ids only the talker's prompt uses
    lm_head[thinker_eos_id(shape)] *= THINKER_EOS_ROW_SCALE / 0.3
    codec_head = model.talker.codec_head.weight
    codec_head[shape.codebook :] *= 0.3  # control ids are rare as codes
    codec_head[config.talker_config.tts_codec_end_token_id] *= TALKER_EOS_ROW_SCALE / 0.3
    dit_out = model.token2wav.code2wav_dit_model.proj_out
    dit_out.weight *= DIT_OUT_SCALE
    dit_out.bias.fill_(MEL_LEVEL)
    model.token2wav.code2wav_bigvgan_model.conv_post.weight *= BIGVGAN_OUT_SCALE
    return model


def speaker_dict(shape: TinyShape, config: Any) -> dict[str, dict[str, Any]]:
    """`spk_dict.pt`'s contents: per voice its conditioning vector, a reference mel and the
    text-bos id the talker's prompt starts its reply with."""
    gen = torch.Generator().manual_seed(SEED + 1)
    dit = config.token2wav_config.dit_config
    out = {}
    for i, name in enumerate(shape.speakers):
        out[name] = {
            "cond": torch.randn(dit.enc_emb_dim, generator=gen),
            "ref_mel": torch.randn(1, 24 + 8 * i, dit.mel_dim, generator=gen) * 0.5 - 4.0,
            "bos_token": shape.tts_id(4 + i),
        }
    return out


def processor_files(shape: TinyShape = DEFAULT) -> dict[str, str]:
    return tiny_files.processor_files(vocab_size=shape.thinker_vocab, first_special_id=shape.first_special_id,
                                      special_tokens=SPECIAL_TOKENS, role_words=ROLE_WORDS, named_tokens=NAMED_TOKENS,
                                      vision=VISION_PREPROCESSOR, processor_class="Qwen2_5OmniProcessor")  # fmt: skip


def write_tiny_checkpoint(out_dir: Path | str, *, shape: TinyShape = DEFAULT, layout: str = "published",
                          dtype: str = "float32", shard_bytes: int = 1 << 20,
                          settings: Mapping[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """Write the checkpoint into `out_dir` in the published layout (shards and an index); return
    a summary (parameters, files, bytes, sha256). `settings`: config changes by dotted path
    (`omnistage make-tiny --set`), each naming a key the config has."""
    if layout != "published":  # a dense model: nothing to fuse
        raise ValueError(f"Qwen2.5-Omni's tiny checkpoint has one layout, 'published'; got {layout!r}")
    overrides = tiny_files.dotted_overrides(tiny_config_dict(shape), settings) if settings else None
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(shape, overrides).to(torch_dtype)
    model.save_pretrained(out, max_shard_size=shard_bytes)
    generation = {
        "do_sample": False,
        "eos_token_id": thinker_eos_id(shape),
        "pad_token_id": shape.special_id("<|endoftext|>"),
    }
    tiny_files.write_configs(out, model, dtype, generation)
    buf = io.BytesIO()
    torch.save(speaker_dict(shape, model.config), buf)
    (out / "spk_dict.pt").write_bytes(buf.getvalue())
    for name, text in processor_files(shape).items():
        (out / name).write_text(text)
    return tiny_files.summary(out, model, layout, dtype)
