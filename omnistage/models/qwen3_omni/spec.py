"""Qwen3-Omni's ids and sizes: what the stages of one checkpoint must agree on, read from its
config, and the tokenizer checks that keep the two in step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omnistage.quoting import quoted

MODEL_TYPE = "qwen3_omni_moe"
SAMPLE_RATE = 24_000
# `generate()`'s default voice; a checkpoint without it defaults to its first speaker.
DEFAULT_SPEAKER = "ethan"

# Token text for each special id the config names; the tokenizer must agree (checked at load).
# The TTS tokens are spelled without bars in the published tokenizers (`<tts_pad>`, ids 151671-3).
SPECIAL_TOKEN_TEXT = {
    "im_start_token_id": "<|im_start|>",
    "im_end_token_id": "<|im_end|>",
    "tts_pad_token_id": "<tts_pad>",
    "tts_bos_token_id": "<tts_text_bos>",
    "tts_eos_token_id": "<tts_text_eod>",
}
THINKER_SPECIAL_TOKEN_TEXT = {
    "audio_token_id": "<|audio_pad|>",
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
}
ROLE_WORD_IDS = {"system_token_id": "system", "user_token_id": "user", "assistant_token_id": "assistant"}

CONTROL_IDS = 1024  # the talker vocabulary's top ids, its control ids: generate() hard-codes 1024


@dataclass(frozen=True)
class FamilySpec:
    """The ids and sizes of one Qwen3-Omni checkpoint that the stages need to agree on."""

    im_start_id: int
    im_end_id: int
    user_id: int
    assistant_id: int
    system_id: int
    tts_pad_id: int
    tts_bos_id: int
    tts_eos_id: int
    multimodal_ids: tuple[int, ...]
    thinker_vocab: int
    thinker_hidden: int
    accept_hidden_layer: int
    talker_vocab: int
    talker_hidden: int
    num_code_groups: int
    codebook_size: int
    codec_eos_id: int
    codec_pad_id: int
    codec_bos_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    speakers: dict[str, int]
    max_positions: int
    # the talker reads the thinker's hidden states only at audio/image/video positions
    talker_needs_hidden: bool = False
    # code2wav is causal: a frame's audio is final once the frame is there (no look-ahead)
    code2wav_causal: bool = True
    audio_start_id: int = -1  # an audio's opening token: with the pads, what a prompt holds only with media

    @property
    def default_speaker(self) -> str:
        return DEFAULT_SPEAKER if DEFAULT_SPEAKER in self.speakers else min(self.speakers, default="")

    @classmethod
    def from_config(cls, config: Any) -> FamilySpec:
        thinker = config.thinker_config
        talker = config.talker_config
        c2w = config.code2wav_config
        return cls(
            im_start_id=config.im_start_token_id,
            im_end_id=config.im_end_token_id,
            user_id=config.user_token_id,
            assistant_id=config.assistant_token_id,
            system_id=config.system_token_id,
            tts_pad_id=config.tts_pad_token_id,
            tts_bos_id=config.tts_bos_token_id,
            tts_eos_id=config.tts_eos_token_id,
            multimodal_ids=(thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id),
            audio_start_id=getattr(thinker, "audio_start_token_id", -1),
            thinker_vocab=thinker.text_config.vocab_size,
            thinker_hidden=thinker.text_config.hidden_size,
            accept_hidden_layer=talker.accept_hidden_layer,
            talker_vocab=talker.text_config.vocab_size,
            talker_hidden=talker.text_config.hidden_size,
            num_code_groups=talker.num_code_groups,
            codebook_size=c2w.codebook_size,
            codec_eos_id=talker.codec_eos_token_id,
            codec_pad_id=talker.codec_pad_id,
            codec_bos_id=talker.codec_bos_id,
            codec_nothink_id=talker.codec_nothink_id,
            codec_think_bos_id=talker.codec_think_bos_id,
            codec_think_eos_id=talker.codec_think_eos_id,
            speakers={k.lower(): int(v) for k, v in (talker.speaker_id or {}).items()},
            max_positions=thinker.text_config.max_position_embeddings,
        )

    def talker_stop_ids(self) -> tuple[int, ...]:
        """`generate()`'s talker EOS id: codec end."""
        return (self.codec_eos_id,)

    def talker_suppressed_ids(self) -> list[int]:
        """`generate()` forbids the talker's control range except codec EOS."""
        return [i for i in range(self.talker_vocab - CONTROL_IDS, self.talker_vocab) if i != self.codec_eos_id]

    def speaker_id(self, speaker: str) -> int:
        try:
            return self.speakers[speaker.lower()]
        except KeyError:
            known = ", ".join(sorted(self.speakers)) or "none"
            raise ValueError(f"unknown speaker {quoted(speaker)} (this checkpoint has: {known})") from None




def check_tokenizer(tok: Any, config: Any) -> list[str]:
    """Where the tokenizer's special ids disagree with the config (empty: they agree)."""
    expected: dict[str, tuple[str, int]] = {}
    for field_name, text in SPECIAL_TOKEN_TEXT.items():
        expected[field_name] = (text, getattr(config, field_name))
    for field_name, text in THINKER_SPECIAL_TOKEN_TEXT.items():
        expected[f"thinker_config.{field_name}"] = (text, getattr(config.thinker_config, field_name))
    problems = []
    for field_name, (text, want) in expected.items():
        got = tok.convert_tokens_to_ids(text)
        if got != want:
            problems.append(f"{text} is id {got} in the tokenizer but {field_name}={want} in config.json")
    for field_name, word in ROLE_WORD_IDS.items():
        want = getattr(config, field_name)
        got = tok.encode(word, add_special_tokens=False)
        if got != [want]:
            problems.append(f"{word!r} encodes to {got} but {field_name}={want} in config.json")
    return problems


def check_config(config: Any, speech: bool = True) -> list[str]:
    """Where the parts of a Qwen3-Omni config disagree (a served model would say nothing wrong
    and sound wrong): code groups, codebooks, widths, layers and special ids each part assumes.
    Without `speech`, the thinker's ids alone."""
    thinker, talker, c2w = config.thinker_config, config.talker_config, config.code2wav_config
    cp = talker.code_predictor_config
    text = thinker.text_config
    problems = encoder_width_problems(thinker)
    if not speech:
        return problems + _thinker_id_problems(config, text.vocab_size)

    def agree(what: str, values: dict[str, Any]) -> None:
        if len(set(values.values())) > 1:
            problems.append(f"{what}: " + ", ".join(f"{k}={v}" for k, v in values.items()))

    agree("number of code groups", {"talker_config.num_code_groups": talker.num_code_groups,
                                    "talker_config.code_predictor_config.num_code_groups": cp.num_code_groups,
                                    "code2wav_config.num_quantizers": c2w.num_quantizers})  # fmt: skip
    if talker.num_code_groups < 2:  # the first code is the talker's; the code predictor makes the rest
        problems.append(f"talker_config.num_code_groups={talker.num_code_groups}: a frame has at least 2 codes "
                        "(the talker's and the code predictor's)")  # fmt: skip
    agree("talker width", {"talker_config.text_config.hidden_size": talker.text_config.hidden_size,
                           "talker_config.code_predictor_config.hidden_size": cp.hidden_size})  # fmt: skip
    if not talker.speaker_id:
        problems.append("talker_config.speaker_id names no voice: the talker cannot speak (set "
                        "enable_audio_output: false to serve text only)")  # fmt: skip
    agree("codebook size", {"talker_config.code_predictor_config.vocab_size": cp.vocab_size,
                            "code2wav_config.codebook_size": c2w.codebook_size})  # fmt: skip
    agree("thinker width", {"thinker_config.text_config.hidden_size": text.hidden_size,
                            "talker_config.thinker_hidden_size": talker.thinker_hidden_size})  # fmt: skip
    if not 0 <= talker.accept_hidden_layer <= text.num_hidden_layers:
        problems.append(f"talker_config.accept_hidden_layer={talker.accept_hidden_layer} is not a layer of the "
                        f"thinker (0..{text.num_hidden_layers})")  # fmt: skip
    talker_vocab = talker.text_config.vocab_size
    if (codes := talker_vocab - CONTROL_IDS) > cp.vocab_size:  # what generate() leaves the talker to make
        problems.append(f"talker_config.text_config.vocab_size={talker_vocab} leaves the talker ids "
                        f"{cp.vocab_size}..{codes - 1}, below its {CONTROL_IDS} control ids (those generate() "
                        f"suppresses), that are no code of the codebook (talker_config.code_predictor_config."
                        f"vocab_size={cp.vocab_size})")  # fmt: skip
    codec_ids = {k: getattr(talker, k) for k in ("codec_eos_token_id", "codec_pad_id", "codec_bos_id",
                                                   "codec_nothink_id", "codec_think_bos_id", "codec_think_eos_id")}
    codec_ids |= {f"speaker_id.{k}": v for k, v in (talker.speaker_id or {}).items()}
    for name, value in codec_ids.items():
        if not 0 <= int(value) < talker_vocab:
            problems.append(f"talker_config.{name}={value} is outside the talker vocabulary (0..{talker_vocab - 1})")
    return problems + _thinker_id_problems(config, text.vocab_size)


def encoder_width_problems(thinker: Any) -> list[str]:
    """The audio and vision towers' output widths against the thinker's (Qwen2.5-Omni's fields
    have the same names): their embeddings take the place of the prompt's media tokens (a wider
    audio output fills the slots scrambled, without an error)."""
    width = thinker.text_config.hidden_size
    towers = {"audio_config.output_dim": getattr(getattr(thinker, "audio_config", None), "output_dim", width),
              "vision_config.out_hidden_size": getattr(getattr(thinker, "vision_config", None), "out_hidden_size",
                                                       width)}  # fmt: skip
    return [f"thinker_config.{name}={value} is not the thinker's width (thinker_config.text_config.hidden_size="
            f"{width}): its embeddings take the place of media tokens" for name, value in towers.items()
            if value != width]  # fmt: skip


def _thinker_id_problems(config: Any, vocab: int) -> list[str]:
    names = (*SPECIAL_TOKEN_TEXT, *ROLE_WORD_IDS)
    return [f"{name}={getattr(config, name)} is outside the thinker vocabulary (0..{vocab - 1})"
            for name in names if not 0 <= int(getattr(config, name)) < vocab]  # fmt: skip
