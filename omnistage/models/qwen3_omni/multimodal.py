"""Qwen3-Omni's audio, image and video input, as `generate()` uses it between the model parts.

Thinker (mirrors `Qwen3OmniMoeThinkerModel.forward` and the thinker's
`_prepare_position_ids_for_generation`):
  * the encoders run once per request, each over all of its items of one kind (all audios in
    one call, all images in one, all videos in one), as `generate()` groups them;
  * the prompt's input embeddings are the token embeddings with the encoder rows scattered
    into the placeholder rows; image and video rows also carry "deepstack" features that the
    text model adds after its first layers, at the visual placeholder rows;
  * positions are `[4, 1, L]`: text positions (0..L-1) and the three M-RoPE axes from
    `get_rope_index` (float: a video's temporal positions can be fractional). Generation then
    adds 1 on all four axes per token, from the last prompt position.
Talker: its prompt positions come from the talker's own `get_rope_index` over the talker ids
when the request has audio or any image or video grid (`generate()` gives it no
`use_audio_in_video`), plain text positions otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

__all__ = ["AudioRows", "MultimodalInputs", "PromptInputs", "RopeInputs", "encode_prompt", "feature_output_lengths",
           "talker_positions"]  # fmt: skip


def feature_output_lengths(lengths: torch.Tensor, n_window: int) -> torch.Tensor:
    """Audio-tower output rows for audios of `lengths` feature frames (transformers'
    `_get_feat_extract_output_lengths`)."""
    chunk = n_window * 2
    leave = lengths % chunk
    feat = (leave - 1) // 2 + 1
    return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + (lengths // chunk) * 13


@dataclass
class RopeInputs:
    """What the talker needs to place a multimodal prompt's positions: the items' sizes."""

    audio_lengths: torch.Tensor | None = None  # [A] feature frames per audio
    image_grid_thw: torch.Tensor | None = None  # [I, 3]
    video_grid_thw: torch.Tensor | None = None  # [V, 3]
    video_second_per_grid: torch.Tensor | None = None  # [V] float

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @property
    def empty(self) -> bool:
        return not self.tensors()


@dataclass
class MultimodalInputs:
    """The processor's outputs besides the ids (`Qwen3OmniMoeProcessor`'s names)."""

    input_features: torch.Tensor | None = None  # [A, mel, T] log-mel features, padded to the longest
    feature_attention_mask: torch.Tensor | None = None  # [A, T] 1 on each audio's frames
    pixel_values: torch.Tensor | None = None  # [patches, 3 * temporal_patch * patch**2]
    image_grid_thw: torch.Tensor | None = None  # [I, 3]
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None  # [V, 3]
    video_second_per_grid: torch.Tensor | None = None  # [V] seconds per temporal patch
    use_audio_in_video: bool = False  # each video's sound track is interleaved with its frames

    TENSOR_NAMES = ("input_features", "feature_attention_mask", "pixel_values", "image_grid_thw",
                    "pixel_values_videos", "video_grid_thw", "video_second_per_grid")  # fmt: skip

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], use_audio_in_video: bool = False) -> MultimodalInputs:
        """From a processor output (or any mapping holding some of `TENSOR_NAMES`)."""
        kwargs = {k: torch.as_tensor(data[k]) for k in cls.TENSOR_NAMES if data.get(k) is not None}
        return cls(**kwargs, use_audio_in_video=use_audio_in_video)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in self.TENSOR_NAMES if getattr(self, k) is not None}

    @property
    def empty(self) -> bool:
        return not self.tensors()

    def rope(self) -> RopeInputs:
        mask = self.feature_attention_mask
        return RopeInputs(
            audio_lengths=None if mask is None else mask.sum(-1).long(),
            image_grid_thw=self.image_grid_thw,
            video_grid_thw=self.video_grid_thw,
            video_second_per_grid=self.video_second_per_grid,
        )

    def generate_kwargs(self) -> dict[str, Any]:
        """As keyword arguments of the monolithic `generate()`."""
        return {**self.tensors(), "use_audio_in_video": self.use_audio_in_video}

    def check(self, ids: torch.Tensor, config: Any, audio_rows: AudioRows | None = None) -> None:
        """Refuse inputs that disagree with each other or with the prompt's placeholders, before
        any model work (ValueError naming the tensor). `audio_rows`: the audio tower's output
        rows per audio (default: Qwen3-Omni's tower)."""
        _Checker(ids.view(-1), self, config, audio_rows or qwen3_audio_rows).run()


# (feature frames per audio [A], the audio tower's config) -> the tower's output rows per audio [A]
AudioRows = Callable[[torch.Tensor, Any], torch.Tensor]


def qwen3_audio_rows(lengths: torch.Tensor, audio_config: Any) -> torch.Tensor:
    return feature_output_lengths(lengths, audio_config.n_window)


class _Checker:
    def __init__(self, ids: torch.Tensor, mm: MultimodalInputs, config: Any, audio_rows: AudioRows) -> None:
        self.ids, self.mm, self.config = ids, mm, config  # config: the thinker's
        self.audio_rows = audio_rows

    def count(self, token_id: int) -> int:
        return int((self.ids == token_id).sum())

    def starts_followed_by(self, start_id: int, next_id: int) -> int:
        ids = self.ids
        return int(((ids[:-1] == start_id) & (ids[1:] == next_id)).sum())

    def run(self) -> None:
        cfg, mm = self.config, self.mm
        for name in ("input_features", "pixel_values", "pixel_values_videos"):
            t = getattr(mm, name)
            if t is not None and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} holds NaN or infinite values")
        audio_items = self._audio()
        image_rows = self._vision("pixel_values", "image_grid_thw", cfg.image_token_id)
        video_rows = self._vision("pixel_values_videos", "video_grid_thw", cfg.video_token_id)
        if mm.video_grid_thw is not None:
            spg = mm.video_second_per_grid
            n = mm.video_grid_thw.shape[0]
            if spg is None or spg.shape != (n,) or not spg.dtype.is_floating_point or not bool(
                torch.isfinite(spg).all() & (spg >= 0).all()
            ):
                raise ValueError(f"video_second_per_grid must be {n} finite seconds >= 0 (one per video)")
        elif mm.video_second_per_grid is not None:
            raise ValueError("video_second_per_grid without videos")
        vision_start = cfg.vision_start_token_id
        images = 0 if mm.image_grid_thw is None else mm.image_grid_thw.shape[0]
        videos = 0 if mm.video_grid_thw is None else mm.video_grid_thw.shape[0]
        if self.starts_followed_by(vision_start, cfg.image_token_id) != images:
            raise ValueError(f"the prompt has {self.starts_followed_by(vision_start, cfg.image_token_id)} image "
                             f"placeholder run(s) but image_grid_thw has {images}")  # fmt: skip
        video_runs = self.starts_followed_by(vision_start, cfg.audio_start_token_id if mm.use_audio_in_video
                                             else cfg.video_token_id)  # fmt: skip
        if video_runs != videos:
            raise ValueError(f"the prompt has {video_runs} video placeholder run(s) but video_grid_thw has {videos}")
        if self.count(cfg.audio_start_token_id) != audio_items:
            raise ValueError(f"the prompt has {self.count(cfg.audio_start_token_id)} audio placeholder run(s) but "
                             f"{audio_items} audio input(s)")  # fmt: skip
        for name, rows, token_id in (("image", image_rows, cfg.image_token_id),
                                     ("video", video_rows, cfg.video_token_id)):  # fmt: skip
            if self.count(token_id) != rows:
                raise ValueError(f"the prompt has {self.count(token_id)} {name} placeholders but the {name} inputs "
                                 f"give {rows} rows")  # fmt: skip

    def _audio(self) -> int:
        mm, cfg = self.mm, self.config
        feats, mask = mm.input_features, mm.feature_attention_mask
        pads = self.count(cfg.audio_token_id)
        if feats is None and mask is None:
            if pads:
                raise ValueError(f"the prompt has {pads} audio placeholders but no input_features")
            return 0
        if feats is None or mask is None:
            raise ValueError("input_features and feature_attention_mask come together")
        mel = cfg.audio_config.num_mel_bins
        if feats.dim() != 3 or feats.shape[1] != mel or not feats.dtype.is_floating_point:
            raise ValueError(f"input_features must be float [audios, {mel}, frames], got {feats.dtype} "
                             f"{list(feats.shape)}")  # fmt: skip
        if mask.shape != (feats.shape[0], feats.shape[2]) or mask.dtype.is_floating_point:
            raise ValueError(f"feature_attention_mask must be integer [{feats.shape[0]}, {feats.shape[2]}], got "
                             f"{mask.dtype} {list(mask.shape)}")  # fmt: skip
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("feature_attention_mask must hold only 0 and 1")
        lengths = mask.sum(-1)
        if bool((lengths == 0).any()):
            raise ValueError("an audio input has no feature frames")
        rows = int(self.audio_rows(lengths, cfg.audio_config).sum())
        if pads != rows:
            raise ValueError(f"the prompt has {pads} audio placeholders but the audio inputs give {rows} rows")
        return int(feats.shape[0])

    def _vision(self, pixels_name: str, grid_name: str, token_id: int) -> int:
        pixels, grid = getattr(self.mm, pixels_name), getattr(self.mm, grid_name)
        if pixels is None and grid is None:
            return 0
        if pixels is None or grid is None:
            raise ValueError(f"{pixels_name} and {grid_name} come together")
        vc = self.config.vision_config
        dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
        if pixels.dim() != 2 or pixels.shape[1] != dim or not pixels.dtype.is_floating_point:
            raise ValueError(f"{pixels_name} must be float [patches, {dim}], got {pixels.dtype} {list(pixels.shape)}")
        merge = vc.spatial_merge_size
        if grid.dim() != 2 or grid.shape[1] != 3 or grid.dtype.is_floating_point or grid.shape[0] == 0:
            raise ValueError(f"{grid_name} must be integer [items, 3], got {grid.dtype} {list(grid.shape)}")
        if bool((grid <= 0).any()) or bool((grid[:, 1:] % merge != 0).any()):
            raise ValueError(f"{grid_name} must hold positive sizes with height and width multiples of {merge}")
        if int(grid.prod(-1).sum()) != pixels.shape[0]:
            raise ValueError(f"{grid_name} covers {int(grid.prod(-1).sum())} patches but {pixels_name} has "
                             f"{pixels.shape[0]}")  # fmt: skip
        return int((grid.prod(-1) // merge**2).sum())


@dataclass
class PromptInputs:
    """One multimodal prompt, ready for the text model."""

    embeds: torch.Tensor  # [L, H] input embeddings (encoder rows at the placeholders)
    positions: torch.Tensor  # [4, 1, L] float
    visual_mask: torch.Tensor | None  # [L] bool: rows that take deepstack features
    deepstack: list[torch.Tensor] | None  # per deepstack layer, [visual rows, H] in prompt order


@torch.no_grad()
def encode_prompt(thinker: Any, ids: torch.Tensor, mm: MultimodalInputs) -> PromptInputs:
    """Run the encoders over one request's items and place their rows in its prompt; `thinker`
    is a `Qwen3OmniMoeThinkerForConditionalGeneration`, `ids` `[L]`."""
    model, cfg = thinker.model, thinker.config
    device = ids.device
    ids = ids.view(1, -1)
    embeds = thinker.get_input_embeddings()(ids)
    if mm.input_features is not None:
        audio = model.get_audio_features(mm.input_features.to(device), mm.feature_attention_mask.to(device),
                                         return_dict=True).last_hidden_state  # fmt: skip
        embeds = embeds.masked_scatter((ids == cfg.audio_token_id).unsqueeze(-1), audio.to(embeds.dtype))
    visual: list[tuple[torch.Tensor, list[torch.Tensor]]] = []  # (mask [1, L], deepstack rows per layer)
    for pixels, grid, token_id, encode in (
        (mm.pixel_values, mm.image_grid_thw, cfg.image_token_id, model.get_image_features),
        (mm.pixel_values_videos, mm.video_grid_thw, cfg.video_token_id, model.get_video_features),
    ):
        if pixels is None:
            continue
        out = encode(pixels.to(device), grid.to(device), return_dict=True)
        mask = ids == token_id
        embeds = embeds.masked_scatter(mask.unsqueeze(-1), torch.cat(out.pooler_output).to(embeds.dtype))
        deep = getattr(out, "deepstack_features", None)  # Qwen2.5-Omni's vision tower has none
        if deep is not None:
            visual.append((mask, [torch.cat(f) for f in deep]))
    visual_mask = deepstack = None
    if len(visual) == 1:
        visual_mask, deepstack = visual[0]
    elif len(visual) == 2:  # images and videos: their deepstack rows joined in prompt order
        (image_mask, image_deep), (video_mask, video_deep) = visual
        visual_mask = image_mask | video_mask
        in_image, in_video = image_mask[visual_mask], video_mask[visual_mask]
        deepstack = []
        for img, vid in zip(image_deep, video_deep, strict=True):
            joint = img.new_zeros(int(visual_mask.sum()), img.shape[-1])
            joint[in_image], joint[in_video] = img, vid
            deepstack.append(joint)
    mask = mm.feature_attention_mask
    rope, _ = thinker.get_rope_index(
        ids, mm.image_grid_thw, mm.video_grid_thw, torch.ones_like(ids), mm.use_audio_in_video,
        None if mask is None else mask.sum(-1), mm.video_second_per_grid,
    )  # fmt: skip
    length = ids.shape[1]
    positions = torch.cat([torch.arange(length, device=device).view(1, 1, length).to(rope.dtype), rope.to(device)])
    return PromptInputs(embeds[0], positions, None if visual_mask is None else visual_mask[0], deepstack)


def check_rope_sizes(ids: torch.Tensor, rope: RopeInputs, config: Any, audio_rows: AudioRows = qwen3_audio_rows
                     ) -> None:  # fmt: skip
    """The talker's side of `MultimodalInputs.check`: the media sizes it is sent (for its
    positions) must give the prompt's placeholders, item for item and row for row; a size that
    disagrees would place wrong positions without an error (ValueError naming it). `config`:
    the talker's (its token ids, `spatial_merge_size`, the audio tower's `audio_config`)."""
    ids = ids.view(-1)

    def count(token_id: int) -> int:
        return int((ids == token_id).sum())

    def runs(next_id: int) -> int:  # vision starts followed by next_id
        return int(((ids[:-1] == config.vision_start_token_id) & (ids[1:] == next_id)).sum())

    merge = int(config.spatial_merge_size)
    items = {}
    for name, grid, token_id in (("image", rope.image_grid_thw, config.image_token_id),
                                 ("video", rope.video_grid_thw, config.video_token_id)):  # fmt: skip
        n, rows = 0, 0
        if grid is not None and grid.numel():
            if grid.dim() != 2 or grid.shape[1] != 3 or grid.dtype.is_floating_point:
                raise ValueError(f"{name}_grid_thw must be integer [items, 3], got {grid.dtype} {list(grid.shape)}")
            if bool((grid <= 0).any()) or bool((grid[:, 1:] % merge != 0).any()):
                raise ValueError(f"{name}_grid_thw must hold positive sizes with height and width multiples of {merge}")
            n, rows = int(grid.shape[0]), int((grid.prod(-1) // merge**2).sum())
        if count(token_id) != rows:
            raise ValueError(f"the prompt has {count(token_id)} {name} placeholders but {name}_grid_thw gives "
                             f"{rows} rows")  # fmt: skip
        items[name] = n
    if runs(config.image_token_id) != items["image"]:
        raise ValueError(f"the prompt has {runs(config.image_token_id)} image placeholder run(s) but "
                         f"image_grid_thw has {items['image']}")  # fmt: skip
    videos = runs(config.video_token_id) + runs(config.audio_start_token_id)  # a video's run may open with its audio
    if videos != items["video"]:
        raise ValueError(f"the prompt has {videos} video placeholder run(s) but video_grid_thw has {items['video']}")
    lengths, audios, rows = rope.audio_lengths, 0, 0
    if lengths is not None and lengths.numel():
        if lengths.dim() != 1 or lengths.dtype.is_floating_point or bool((lengths <= 0).any()):
            raise ValueError(f"audio_lengths must be positive integers [audios], got {lengths.dtype} "
                             f"{list(lengths.shape)}")  # fmt: skip
        audios, rows = int(lengths.shape[0]), int(audio_rows(lengths, config.audio_config).sum())
    if count(config.audio_token_id) != rows:
        raise ValueError(f"the prompt has {count(config.audio_token_id)} audio placeholders but audio_lengths gives "
                         f"{rows} rows")  # fmt: skip
    if count(config.audio_start_token_id) != audios:
        raise ValueError(f"the prompt has {count(config.audio_start_token_id)} audio placeholder run(s) but "
                         f"audio_lengths has {audios}")  # fmt: skip


def talker_positions(talker: Any, talker_ids: torch.Tensor, rope: RopeInputs) -> torch.Tensor | None:
    """The talker prompt's positions `[4, 1, n]` as `generate()` gives them, or None where
    they are plain text positions (no audio, image or video in the request)."""
    if rope.audio_lengths is None and all(g is None or g.numel() == 0 for g in (rope.image_grid_thw,
                                                                                 rope.video_grid_thw)):  # fmt: skip
        return None
    ids = talker_ids.view(1, -1)
    axes, _ = talker.get_rope_index(ids, rope.image_grid_thw, rope.video_grid_thw, torch.ones_like(ids), False,
                                    rope.audio_lengths, rope.video_second_per_grid)  # fmt: skip
    n = ids.shape[1]
    text = torch.arange(n, device=ids.device).view(1, 1, n)
    return torch.cat([text.to(axes.dtype), axes.to(ids.device)])
