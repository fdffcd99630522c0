"""Qwen2.5-Omni's ids and sizes: what the stages of one checkpoint must agree on, read from its
config (and its voices from `spk_dict.pt`), and the checks that keep the config, the tokenizer
and the voices in step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omnistage.models.qwen3_omni.spec import encoder_width_problems
from omnistage.quoting import quoted

MODEL_TYPE = "qwen2_5_omni"
SAMPLE_RATE = 24_000
DEFAULT_SPEAKER = "Chelsie"  # generate()'s default voice

# Token text for each special id the thinker config names; the tokenizer must agree.
THINKER_SPECIAL_TOKEN_TEXT = {
    "audio_token_index": "<|AUDIO|>",
    "image_token_index": "<|IMAGE|>",
    "video_token_index": "<|VIDEO|>",
    "audio_start_token_id": "<|audio_bos|>",
    "audio_end_token_id": "<|audio_eos|>",
}
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


@dataclass(frozen=True)
class Voice:
    """One voice of `spk_dict.pt`: the DiT's conditioning, its reference mel and the thinker id
    the talker's prompt starts the reply with."""

    cond: Any  # [enc_emb_dim] float
    ref_mel: Any  # [1, T, mel_dim] float
    bos_token: int


@dataclass(frozen=True)
class FamilySpec:
    """The ids and sizes of one Qwen2.5-Omni checkpoint that the stages need to agree on."""

    im_start_id: int
    im_end_id: int
    multimodal_ids: tuple[int, ...]
    thinker_vocab: int
    thinker_hidden: int
    accept_hidden_layer: int  # the talker reads the thinker's last layer (after its norm)
    talker_vocab: int
    codec_bos_id: int
    codec_eos_id: int
    codec_pad_id: int
    codec_mask_id: int
    text_bos_id: int
    text_eos_id: int
    text_pad_id: int
    codebook_size: int  # the DiT's code embeddings (codes 0..codebook_size-1)
    max_positions: int
    max_frames: int  # the longest utterance token2wav decodes (its DiT's positions / repeats)
    voices: dict[str, Voice] = field(default_factory=dict, repr=False, compare=False)  # spk_dict.pt
    num_code_groups: int = 1  # one codebook
    # Qwen2.5's talker reads the thinker's last hidden state of every position and token.
    talker_needs_hidden: bool = True
    # token2wav's DiT looks ahead: a frame's audio waits for later frames
    code2wav_causal: bool = False
    audio_start_id: int = -1  # an audio's opening token: with the pads, what a prompt holds only with media

    @property
    def speakers(self) -> dict[str, int]:
        """Voice name -> the thinker id its talker prompt starts the reply with."""
        return {name: v.bos_token for name, v in self.voices.items()}

    @property
    def tts_pad_id(self) -> int:
        return self.text_pad_id

    @property
    def default_speaker(self) -> str:
        if self.has_speaker(DEFAULT_SPEAKER):
            return self.speaker_name(DEFAULT_SPEAKER)
        return min(self.speakers, default="")

    def has_speaker(self, speaker: str) -> bool:
        return any(s.lower() == speaker.lower() for s in self.speakers)

    def speaker_name(self, speaker: str) -> str:
        """The voice's name as `spk_dict.pt` spells it (voices are matched case-insensitively)."""
        for name in self.speakers:
            if name.lower() == speaker.lower():
                return name
        known = ", ".join(sorted(self.speakers)) or "none"
        raise ValueError(f"unknown speaker {quoted(speaker)} (this checkpoint has: {known})")

    def speaker_id(self, speaker: str) -> int:
        return self.speakers[self.speaker_name(speaker)]

    def talker_stop_ids(self) -> tuple[int, ...]:
        """`generate()`'s talker EOS ids (8292 and 8294 in the published checkpoint): codec pad and
        codec end."""
        return (self.codec_pad_id, self.codec_eos_id)

    @classmethod
    def from_config(cls, config: Any, voices: dict[str, Voice] | None = None) -> FamilySpec:
        thinker, talker = config.thinker_config, config.talker_config
        text = thinker.text_config
        dit = config.token2wav_config.dit_config
        return cls(
            im_start_id=-1,  # from the tokenizer (the config does not name it): see with_tokenizer
            im_end_id=-1,
            multimodal_ids=(thinker.audio_token_index, thinker.image_token_index, thinker.video_token_index),
            audio_start_id=getattr(thinker, "audio_start_token_id", -1),
            thinker_vocab=text.vocab_size,
            thinker_hidden=text.hidden_size,
            accept_hidden_layer=text.num_hidden_layers,
            talker_vocab=talker.vocab_size,
            codec_bos_id=talker.tts_codec_start_token_id,
            codec_eos_id=talker.tts_codec_end_token_id,
            codec_pad_id=talker.tts_codec_pad_token_id,
            codec_mask_id=talker.tts_codec_mask_token_id,
            text_bos_id=talker.tts_text_start_token_id,
            text_eos_id=talker.tts_text_end_token_id,
            text_pad_id=talker.tts_text_pad_token_id,
            codebook_size=dit.num_embeds + 1,  # transformers' DiTCodecEmbedding has num_embeds + 1 rows
            max_positions=text.max_position_embeddings,
            max_frames=dit.max_position_embeddings // dit.repeats,  # generate()'s token2wav refuses more
            voices=dict(voices or {}),
        )


def check_config(config: Any) -> list[str]:
    """Where the parts of a Qwen2.5-Omni config disagree (a served model would say nothing wrong
    and sound wrong)."""
    thinker, talker = config.thinker_config, config.talker_config
    dit, bigvgan = config.token2wav_config.dit_config, config.token2wav_config.bigvgan_config
    text = thinker.text_config
    problems = encoder_width_problems(thinker)
    if talker.embedding_size != text.hidden_size:
        problems.append(f"thinker width: thinker_config.text_config.hidden_size={text.hidden_size}, "
                        f"talker_config.embedding_size={talker.embedding_size}")  # fmt: skip
    if dit.mel_dim != bigvgan.mel_dim:
        problems.append(f"mel bins: token2wav_config.dit_config.mel_dim={dit.mel_dim}, "
                        f"token2wav_config.bigvgan_config.mel_dim={bigvgan.mel_dim}")  # fmt: skip
    for name in ("tts_codec_start_token_id", "tts_codec_end_token_id", "tts_codec_pad_token_id",
                 "tts_codec_mask_token_id"):  # fmt: skip
        value = getattr(talker, name)
        if not 0 <= int(value) < talker.vocab_size:
            problems.append(f"talker_config.{name}={value} is outside the talker vocabulary "
                            f"(0..{talker.vocab_size - 1})")  # fmt: skip
    if not dit.num_embeds <= talker.vocab_size:
        problems.append(f"token2wav_config.dit_config.num_embeds={dit.num_embeds} exceeds the talker vocabulary "
                        f"{talker.vocab_size}")  # fmt: skip
    for name in ("tts_text_start_token_id", "tts_text_end_token_id", "tts_text_pad_token_id"):
        value = getattr(talker, name)
        if not 0 <= int(value) < text.vocab_size:
            problems.append(f"talker_config.{name}={value} is outside the thinker vocabulary "
                            f"(0..{text.vocab_size - 1})")  # fmt: skip
    return problems


def window_problems(text: Any, name: str, reach: int) -> list[str]:
    """A text stack (`name`: where its config is) with sliding-window layers whose window the
    `reach` positions its requests can see outgrow (`use_sliding_window`): transformers masks
    those layers to the window; omnistage's steps attend over every position, so it would answer
    otherwise, without a word. (Sliding layers with no window fail in transformers too.)"""
    window = getattr(text, "sliding_window", None)
    kinds = list(getattr(text, "layer_types", None) or [])
    layers = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
    if not layers or (window is not None and window >= reach):
        return []
    where = f"{len(layers)} of its {len(kinds)} layers"
    if window is None:
        return [f"{name}: {where} are sliding_attention with no sliding_window"]
    return [f"{name}: sliding-window attention ({name}.sliding_window={window}, below the {reach} positions its "
            f"requests can reach, on {where}) is not supported"]


def check_voices(voices: dict[str, Voice], config: Any) -> list[str]:
    """Where `spk_dict.pt` disagrees with the config."""
    dit = config.token2wav_config.dit_config
    vocab = config.thinker_config.text_config.vocab_size
    problems = []
    if not voices:
        problems.append("spk_dict.pt has no voices")
    for name, v in voices.items():
        if tuple(v.cond.shape) not in ((dit.enc_emb_dim,), (1, dit.enc_emb_dim)):
            problems.append(f"voice {name!r}: cond is {list(v.cond.shape)}, expected [{dit.enc_emb_dim}]")
        if v.ref_mel.dim() != 3 or v.ref_mel.shape[0] != 1 or v.ref_mel.shape[2] != dit.mel_dim:
            problems.append(f"voice {name!r}: ref_mel is {list(v.ref_mel.shape)}, expected [1, T, {dit.mel_dim}]")
        if not 0 <= v.bos_token < vocab:
            problems.append(f"voice {name!r}: bos_token {v.bos_token} is outside the thinker vocabulary")
    return problems


def check_tokenizer(tok: Any, config: Any) -> list[str]:
    """Where the tokenizer's special ids disagree with the config (empty: they agree)."""
    problems = []
    for field_name, text in THINKER_SPECIAL_TOKEN_TEXT.items():
        want = getattr(config.thinker_config, field_name)
        got = tok.convert_tokens_to_ids(text)
        if got != want:
            problems.append(f"{text} is id {got} in the tokenizer but thinker_config.{field_name}={want} in "
                            "config.json")  # fmt: skip
    for text in (IM_START, IM_END):
        got = tok.convert_tokens_to_ids(text)
        if got is None or got == tok.unk_token_id:
            problems.append(f"the tokenizer has no {text} token")
    return problems
