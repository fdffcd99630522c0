"""Qwen3-Omni (`qwen3_omni_moe`): thinker, talker with its code predictor, code2wav."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from omnistage.models.checkpoint import Checkpoint, generation_defaults, load_part, read_tensor_rows
from omnistage.models.family import Family
from omnistage.models.qwen3_omni import prompt, spec
from omnistage.models.sampling import TALKER_DEFAULTS, SamplingParams

# Where the thinker's token embedding lives (transformers 5 layout, then the original one).
THINKER_EMBED_KEYS = ("thinker.model.language_model.embed_tokens.weight", "thinker.model.embed_tokens.weight")


class Qwen3Omni(Family):
    model_type = spec.MODEL_TYPE
    display_name = "Qwen3-Omni"
    sample_rate = spec.SAMPLE_RATE
    part_configs: ClassVar[dict[str, str]] = {
        "thinker": "thinker_config", "talker": "talker_config", "code2wav": "code2wav_config"
    }  # fmt: skip
    text_only = True  # the Thinking and Captioner checkpoints

    def load_config(self, path: Path) -> Any:
        from transformers import Qwen3OmniMoeConfig

        return Qwen3OmniMoeConfig.from_pretrained(path, local_files_only=True)

    def spec(self, config: Any, path: Path | None = None, speech: bool = True) -> spec.FamilySpec:
        out = spec.FamilySpec.from_config(config)
        # without a talker its config is transformers' default, whose layer may not be the thinker's
        return out if speech else dataclasses.replace(out, accept_hidden_layer=0)

    def part_class(self, part: str) -> Any:
        import transformers

        return getattr(transformers, {
            "thinker": "Qwen3OmniMoeThinkerForConditionalGeneration",
            "talker": "Qwen3OmniMoeTalkerForConditionalGeneration",
            "code2wav": "Qwen3OmniMoeCode2Wav",
        }[part])  # fmt: skip

    def key_mapping(self, part: str) -> dict[str, str] | None:
        # code2wav's class has no prefix of its own in a full checkpoint
        return {r"^code2wav\.": ""} if part == "code2wav" else None

    def register_conversions(self) -> None:
        # Published checkpoints store each MoE expert's weights apart; transformers fuses them
        # for the full model and the thinker (model types it knows), not for the talker class.
        from transformers.conversion_mapping import (
            get_checkpoint_conversion_mapping,
            register_checkpoint_conversion_mapping,
        )

        name = "Qwen3OmniMoeTalkerForConditionalGeneration"
        if get_checkpoint_conversion_mapping(name) is None:
            register_checkpoint_conversion_mapping(name, get_checkpoint_conversion_mapping("qwen2_moe"))

    def check_config(self, config: Any, speech: bool = True) -> list[str]:
        return spec.check_config(config, speech)

    def row_modules(self) -> tuple[type, ...]:
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m

        # the talker's MoE block as a whole, its router inside it: its shared-expert gate's
        # sigmoid is not row-independent either (see models/batching.py)
        return (m.Qwen3OmniMoeThinkerTextTopKRouter, m.Qwen3OmniMoeTalkerTextSparseMoeBlock)

    def check_tokenizer(self, tokenizer: Any, config: Any) -> list[str]:
        return spec.check_tokenizer(tokenizer, config)

    def prompt_ids(self, tokenizer: Any, messages: list[dict[str, str]],
                   template_kwargs: Mapping[str, Any] | None = None) -> list[int]:  # fmt: skip
        return prompt.build_prompt_ids(tokenizer, messages, template_kwargs)

    def input_builder(self, ckpt: Checkpoint, tokenizer: Any) -> Any:
        from omnistage.models.qwen3_omni.processor import InputBuilder

        return InputBuilder(ckpt, tokenizer)

    def thinker(self, ckpt: Checkpoint, dtype: str, device: str, batching: str = "exact") -> Any:
        from omnistage.models.qwen3_omni.thinker import Thinker

        return Thinker(load_part(ckpt, "thinker", dtype, device), ckpt.spec, self.row_modules(), batching)

    def talker(self, ckpt: Checkpoint, dtype: str, device: str, batching: str = "exact",
               cuda_graphs: int = 0) -> Any:  # fmt: skip
        from omnistage.models.qwen3_omni.talker import Talker

        model = load_part(ckpt, "talker", dtype, device)
        if getattr(model.config, "audio_config", None) is None:
            # The talker places audio in its prompt with the audio tower's window, which its config
            # lacks: generate() fails on a prompt with audio and an image or video. Give it the
            # thinker's, so such prompts get the positions generate() would give them.
            model.config.audio_config = ckpt.config.thinker_config.audio_config
        # The talker's projected tts_bos/eos/pad embeddings, from three rows of the thinker's
        # embedding table (the talker stage never loads the thinker).
        rows = read_tensor_rows(ckpt, THINKER_EMBED_KEYS, prompt.tts_special_ids(ckpt.spec),
                                (ckpt.spec.thinker_vocab, ckpt.spec.thinker_hidden))
        return Talker(model, ckpt.spec, prompt.tts_special_embeds(model, rows), self.row_modules(), batching,
                      cuda_graphs)  # fmt: skip

    def code2wav(self, ckpt: Checkpoint, dtype: str, device: str, batching: str = "exact") -> Any:
        from omnistage.models.qwen3_omni.code2wav import Code2Wav

        del batching  # its incremental decoder batches requests and stays exact (code2wav_streaming.py)

        return Code2Wav(load_part(ckpt, "code2wav", dtype, device), ckpt.spec)

    def thinker_defaults(self, ckpt: Checkpoint) -> SamplingParams:
        return generation_defaults(ckpt, stop_ids=(ckpt.spec.im_end_id,))

    def talker_defaults(self) -> SamplingParams:
        return TALKER_DEFAULTS

    def reference(self, model_dir: Path, device: str = "cpu", dtype: str = "float32") -> Any:
        from omnistage.models.qwen3_omni.reference import Reference

        return Reference(model_dir, device, dtype)

    def write_tiny(self, out_dir: Path, **options: Any) -> dict[str, Any]:
        from omnistage.models.qwen3_omni.tiny import write_tiny_checkpoint

        return write_tiny_checkpoint(out_dir, **options)


FAMILY = Qwen3Omni()

__all__ = ["FAMILY", "THINKER_EMBED_KEYS", "Qwen3Omni"]
