"""The GPU bench's checkpoint with the real model's widths is a valid Qwen3-Omni config with those
widths (the weights themselves are only built on the GPU machine: about 2 billion parameters)."""

from transformers import Qwen3OmniMoeConfig

from benchmarks.gpu.wide_checkpoint import LAYERS, OVERRIDES, WIDE
from omnistage.models.qwen3_omni.spec import FamilySpec
from omnistage.models.qwen3_omni.tiny import tiny_config_dict


def test_the_wide_checkpoint_has_the_published_widths_and_few_layers() -> None:
    config = Qwen3OmniMoeConfig(**tiny_config_dict(WIDE, OVERRIDES))
    thinker, talker = config.thinker_config.text_config, config.talker_config.text_config
    predictor, code2wav = config.talker_config.code_predictor_config, config.code2wav_config
    assert (thinker.hidden_size, thinker.num_experts, thinker.moe_intermediate_size) == (2048, 128, 768)
    assert (talker.hidden_size, talker.num_experts, talker.moe_intermediate_size) == (1024, 128, 384)
    assert (predictor.hidden_size, predictor.num_hidden_layers, code2wav.decoder_dim) == (1024, 5, 1536)
    assert thinker.num_hidden_layers == talker.num_hidden_layers == LAYERS
    for text in (thinker, talker):  # multimodal rope: the sections cover half a head
        assert sum(text.rope_parameters["mrope_section"]) == text.head_dim // 2
    assert config.talker_config.thinker_hidden_size == thinker.hidden_size
    assert config.talker_config.accept_hidden_layer < thinker.num_hidden_layers
    spec = FamilySpec.from_config(config)
    assert spec.num_code_groups == predictor.num_code_groups == 16
