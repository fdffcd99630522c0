"""Qwen2.5-Omni (`qwen2_5_omni`): thinker, talker (one codebook), token2wav (DiT + BigVGAN).

The thinker has Qwen3-Omni's interface in transformers (a text model under
`model.language_model`, the same encoders' calls and M-RoPE positions, minus deepstack), so it
runs on Qwen3-Omni's thinker (`qwen3_omni/thinker.py`) with this family's audio-tower lengths.
The talker, token2wav, the voices (`spk_dict.pt`) and the prompt glue are this folder's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import torch

from omnistage.models.checkpoint import (
    Checkpoint,
    CheckpointError,
    generation_defaults,
    load_part,
    read_tensor_rows,
    special_token_ids,
)
from omnistage.models.family import Family
from omnistage.models.qwen2_5_omni import spec
from omnistage.models.sampling import SamplingParams

log = logging.getLogger(__name__)

# Where the thinker's token embedding lives (transformers 5 layout, then the original one).
THINKER_EMBED_KEYS = ("thinker.model.language_model.embed_tokens.weight", "thinker.model.embed_tokens.weight")
# generate()'s talker defaults (talker_do_sample, talker_top_k, talker_top_p, talker_temperature,
# talker_repetition_penalty, talker_max_new_tokens)
TALKER_DEFAULTS = SamplingParams(do_sample=True, temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05,
                                 max_tokens=4096)  # fmt: skip


def audio_rows(lengths: torch.Tensor, audio_config: Any) -> torch.Tensor:
    """The audio tower's output rows for audios of `lengths` feature frames (transformers'
    `Qwen2_5OmniAudioEncoder._get_feat_extract_output_lengths`)."""
    del audio_config
    after_cnn = (lengths - 1) // 2 + 1
    return (after_cnn - 2) // 2 + 1


def load_voices(path: Path) -> dict[str, spec.Voice]:
    """`spk_dict.pt`: per voice its DiT conditioning, reference mel and text-bos id."""
    file = path / "spk_dict.pt"
    if not file.is_file():
        raise CheckpointError(f"{path}: missing spk_dict.pt (the voices of Qwen2.5-Omni's token2wav)")
    try:
        raw = torch.load(file, weights_only=True, map_location="cpu")
        return {str(name): spec.Voice(torch.as_tensor(v["cond"]), torch.as_tensor(v["ref_mel"]), int(v["bos_token"]))
                for name, v in raw.items()}  # fmt: skip
    except Exception as e:  # a damaged or foreign file: say which and why (torch's first line), refuse the checkpoint
        why = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        raise CheckpointError(f"{file}: not a voice table ({type(e).__name__}: {why})") from None


class Qwen25Omni(Family):
    model_type = spec.MODEL_TYPE
    display_name = "Qwen2.5-Omni"
    sample_rate = spec.SAMPLE_RATE
    part_configs: ClassVar[dict[str, str]] = {
        "thinker": "thinker_config", "talker": "talker_config", "code2wav": "token2wav_config"
    }  # fmt: skip

    def load_config(self, path: Path) -> Any:
        from transformers import Qwen2_5OmniConfig

        return Qwen2_5OmniConfig.from_pretrained(path, local_files_only=True)

    def spec(self, config: Any, path: Path | None = None, speech: bool = True) -> spec.FamilySpec:
        text = config.thinker_config.text_config
        windows = spec.window_problems(text, "thinker_config.text_config", text.max_position_embeddings)
        if speech:  # the talker's requests: a thinker prompt, then the frames it makes for it
            reach = text.max_position_embeddings + config.talker_config.max_position_embeddings
            windows += spec.window_problems(config.talker_config, "talker_config", reach)
        if windows:
            raise CheckpointError(f"{path / 'config.json' if path else 'config.json'}: " + "; ".join(windows))
        voices = load_voices(path) if path is not None else {}
        problems = spec.check_voices(voices, config) if path is not None else []
        if problems:
            raise CheckpointError(f"{path}: spk_dict.pt disagrees with config.json: " + "; ".join(problems))
        out = spec.FamilySpec.from_config(config, voices)
        if path is not None:  # the chat tokens: in the tokenizer only (config.json does not name them)
            ids = special_token_ids(path, (spec.IM_START, spec.IM_END))
            out = replace(out, im_start_id=ids[spec.IM_START], im_end_id=ids[spec.IM_END])
        return out

    def part_class(self, part: str) -> Any:
        import transformers

        return getattr(transformers, {
            "thinker": "Qwen2_5OmniThinkerForConditionalGeneration",
            "talker": "Qwen2_5OmniTalkerForConditionalGeneration",
            "code2wav": "Qwen2_5OmniToken2WavModel",
        }[part])  # fmt: skip

    def weight_prefix(self, part: str) -> str:
        return "token2wav." if part == "code2wav" else f"{part}."

    def key_mapping(self, part: str) -> dict[str, str] | None:
        # token2wav's class has no prefix of its own in a full checkpoint
        return {r"^token2wav\.": ""} if part == "code2wav" else None

    def check_config(self, config: Any, speech: bool = True) -> list[str]:
        return spec.check_config(config) if speech else []

    def check_tokenizer(self, tokenizer: Any, config: Any) -> list[str]:
        return spec.check_tokenizer(tokenizer, config)

    def prompt_ids(self, tokenizer: Any, messages: list[dict[str, str]],
                   template_kwargs: Mapping[str, Any] | None = None) -> list[int]:  # fmt: skip
        from omnistage.models.qwen3_omni.prompt import build_prompt_ids

        return build_prompt_ids(tokenizer, messages, template_kwargs)

    def input_builder(self, ckpt: Checkpoint, tokenizer: Any) -> Any:
        from omnistage.models.qwen2_5_omni.processor import InputBuilder

        return InputBuilder(ckpt, tokenizer)

    def thinker(self, ckpt: Checkpoint, dtype: str, device: str, batching: str = "exact") -> Any:
        from omnistage.models.qwen3_omni.thinker import Thinker

        model = load_part(ckpt, "thinker", dtype, device)
        return Thinker(model, ckpt.spec, self.row_modules(), batching, audio_rows=audio_rows)

    def talker(self, ckpt: Checkpoint, dtype: str, device: str, batching: str = "exact",
               cuda_graphs: int = 0) -> Any:  # fmt: skip
        from omnistage.models.qwen2_5_omni.talker import Talker

        if cuda_graphs:  # one codebook: no per-frame loop; its step is the talker forward alone
            log.info("talker.cuda_graphs: Qwen2.5-Omni's talker has no code predictor loop to capture")
        model = load_part(ckpt, "talker", dtype, device)
        s = ckpt.spec
        ids = sorted({s.text_eos_id, s.text_pad_id, *s.speakers.values()})
        rows = read_tensor_rows(ckpt, THINKER_EMBED_KEYS, ids, (s.thinker_vocab, s.thinker_hidden))
        return Talker(model, s, dict(zip(ids, rows.to(model.dtype), strict=True)), self.row_modules(), batching)

    def code2wav(self, ckpt: Checkpoint, dtype: str, device: str, batching: str = "exact") -> Any:
        from omnistage.models.qwen2_5_omni.token2wav import Token2Wav

        # generate() always runs token2wav in float32 (it casts it back if loaded otherwise)
        del dtype
        model = load_part(ckpt, "code2wav", "float32", device)
        return Token2Wav(model, ckpt.spec, ckpt.spec.voices, batching)  # voices read once, with the spec

    def thinker_defaults(self, ckpt: Checkpoint) -> SamplingParams:
        return generation_defaults(ckpt, stop_ids=(ckpt.spec.im_end_id,))

    def talker_defaults(self) -> SamplingParams:
        return TALKER_DEFAULTS

    def reference(self, model_dir: Path, device: str = "cpu", dtype: str = "float32") -> Any:
        from omnistage.models.qwen2_5_omni.reference import Reference

        return Reference(model_dir, device, dtype)

    def write_tiny(self, out_dir: Path, **options: Any) -> dict[str, Any]:
        from omnistage.models.qwen2_5_omni.tiny import write_tiny_checkpoint

        return write_tiny_checkpoint(out_dir, **options)


FAMILY = Qwen25Omni()

__all__ = ["FAMILY", "Qwen25Omni", "audio_rows", "load_voices"]
