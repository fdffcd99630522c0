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

import hashlib
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from omnistage.models.prefix_cache import DIGEST_BYTES, MediaItem

__all__ = ["AudioRows", "MultimodalInputs", "PromptInputs", "RopeInputs", "encode_prompt", "feature_output_lengths",
           "media_digests", "media_items", "talker_positions"]  # fmt: skip


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

    def video_opening(self, config: Any) -> int:
        """The token after a video's vision start: its sound track's start where that is
        interleaved (`use_audio_in_video`), else its own."""
        return int(config.audio_start_token_id if self.use_audio_in_video else config.video_token_id)

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

    def run(self) -> None:
        cfg, mm = self.config, self.mm
        for name in ("input_features", "pixel_values", "pixel_values_videos"):
            t = getattr(mm, name)
            if t is not None and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} holds NaN or infinite values")
        given = {"audio": self._audio(), "image": self._vision("pixel_values", "image_grid_thw"),
                 "video": self._vision("pixel_values_videos", "video_grid_thw")}  # fmt: skip
        if mm.video_grid_thw is not None:
            spg = mm.video_second_per_grid
            n = mm.video_grid_thw.shape[0]
            if spg is None or spg.shape != (n,) or not spg.dtype.is_floating_point or not bool(
                torch.isfinite(spg).all() & (spg >= 0).all()
            ):
                raise ValueError(f"video_second_per_grid must be {n} finite seconds >= 0 (one per video)")
        elif mm.video_second_per_grid is not None:
            raise ValueError("video_second_per_grid without videos")
        _check_placeholders(self.ids, cfg, given, (mm.video_opening(cfg),),
                            {kind: (has, f"the {kind} inputs give") for kind, has in
                             (("image", "image_grid_thw has"), ("video", "video_grid_thw has"),
                              ("audio", "input_features has"))})  # fmt: skip

    def _audio(self) -> tuple[int, int]:
        """(audios, placeholder rows they give)."""
        mm, cfg = self.mm, self.config
        feats, mask = mm.input_features, mm.feature_attention_mask
        if feats is None and mask is None:
            pads = int((self.ids == cfg.audio_token_id).sum())
            if pads:
                raise ValueError(f"the prompt has {pads} audio placeholders but no input_features")
            return 0, 0
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
        return int(feats.shape[0]), int(self.audio_rows(lengths, cfg.audio_config).sum())

    def _vision(self, pixels_name: str, grid_name: str) -> tuple[int, int]:
        """(items, placeholder rows they give)."""
        pixels, grid = getattr(self.mm, pixels_name), getattr(self.mm, grid_name)
        if pixels is None and grid is None:
            return 0, 0
        if pixels is None or grid is None:
            raise ValueError(f"{pixels_name} and {grid_name} come together")
        vc = self.config.vision_config
        dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
        if pixels.dim() != 2 or pixels.shape[1] != dim or not pixels.dtype.is_floating_point:
            raise ValueError(f"{pixels_name} must be float [patches, {dim}], got {pixels.dtype} {list(pixels.shape)}")
        rows = _grid_rows(grid_name, grid, vc.spatial_merge_size)
        if int(grid.prod(-1).sum()) != pixels.shape[0]:
            raise ValueError(f"{grid_name} covers {int(grid.prod(-1).sum())} patches but {pixels_name} has "
                             f"{pixels.shape[0]}")  # fmt: skip
        return int(grid.shape[0]), rows


def _digest(flag: bool, *parts: torch.Tensor) -> bytes:
    h = hashlib.blake2b(bytes([flag]), digest_size=DIGEST_BYTES)
    for t in parts:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{list(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy() if t.numel() else b"")  # (its buffer, not a copy)
    return h.digest()


def media_digests(mm: MultimodalInputs) -> torch.Tensor:
    """A digest of each item's model inputs `[items, DIGEST_BYTES]` uint8, audios first, then
    images, then videos, each in prompt order: the prefix cache's key of an item (models/
    prefix_cache.py). An audio's covers its features up to its last frame and its mask there;
    a video's its seconds per patch too; each the `use_audio_in_video` flag (it moves positions).
    The gateway makes them (off the thinker's engine thread) and sends them with the prompt."""
    out: list[bytes] = []
    flag = mm.use_audio_in_video
    features, mask = mm.input_features, mm.feature_attention_mask
    if features is not None and mask is not None:
        for k in range(features.shape[0]):
            frames = mask[k].nonzero()
            last = int(frames[-1]) + 1 if frames.numel() else 0
            out.append(_digest(flag, features[k, :, :last], mask[k, :last]))
    for pixels, grid, seconds in ((mm.pixel_values, mm.image_grid_thw, None),
                                  (mm.pixel_values_videos, mm.video_grid_thw, mm.video_second_per_grid)):  # fmt: skip
        if pixels is None or grid is None:
            continue
        offsets = [0, *itertools.accumulate(grid.prod(-1).tolist())]
        for k in range(grid.shape[0]):
            extra = () if seconds is None else (seconds[k : k + 1],)
            out.append(_digest(flag, pixels[offsets[k] : offsets[k + 1]], grid[k], *extra))
    return torch.tensor([list(d) for d in out], dtype=torch.uint8).view(len(out), DIGEST_BYTES)


def media_items(ids: torch.Tensor, mm: MultimodalInputs, config: Any, digests: torch.Tensor,
                audio_rows: AudioRows | None = None) -> list[MediaItem]:  # fmt: skip
    """Where each audio, image and video of a checked prompt lies, with its digest (`digests`:
    `media_digests`' rows), by start: from its start token, or its first placeholder where one
    comes before it, to its last placeholder (a video with its sound track interleaved spans that
    too), so that no placeholder of an item lies outside its span."""
    ids = ids.view(-1).cpu()
    where = torch.arange(ids.numel())

    def spans(starts: torch.Tensor, token_id: int, rows: list[int]) -> list[tuple[int, int]]:
        pads = where[ids == token_id].tolist()
        out, used = [], 0
        for start, n in zip(starts.tolist(), rows, strict=True):
            out.append((min(int(start), pads[used]), max(int(start) + 1, pads[used + n - 1] + 1)))
            used += n
        return out

    found: list[tuple[str, int, int]] = []  # (kind, start, end), audios, images, videos in order
    audio_span: dict[int, tuple[int, int]] = {}  # an audio's start token -> its span (a video's sound track)
    opens = _item_starts(ids, config, (mm.video_opening(config),))  # as `MultimodalInputs.check` counts items
    if mm.input_features is not None and mm.feature_attention_mask is not None:
        rows = (audio_rows or qwen3_audio_rows)(mm.feature_attention_mask.sum(-1), config.audio_config).tolist()
        starts = opens["audio"]
        for token, span in zip(starts.tolist(), spans(starts, config.audio_token_id, rows), strict=True):
            found.append(("audio", *span))
            audio_span[token] = span
    merge = int(config.vision_config.spatial_merge_size)
    for kind, grid, token_id in (("image", mm.image_grid_thw, config.image_token_id),
                                 ("video", mm.video_grid_thw, config.video_token_id)):  # fmt: skip
        if grid is None:
            continue
        starts = opens[kind]
        for token, (start, end) in zip(starts.tolist(), spans(starts, token_id, (grid.prod(-1) // merge**2).tolist()),
                                       strict=True):  # fmt: skip
            sound = audio_span.get(token + 1, (start, end))  # its interleaved sound track
            found.append((kind, min(start, sound[0]), max(end, sound[1])))
    if digests.shape != (len(found), DIGEST_BYTES):
        raise ValueError(f"media digests of shape {list(digests.shape)}; the prompt has {len(found)} items "
                         f"([{len(found)}, {DIGEST_BYTES}] expected)")  # fmt: skip
    rows = [bytes(row) for row in digests.cpu().tolist()]
    items = [MediaItem(kind, start, end, row) for (kind, start, end), row in zip(found, rows, strict=True)]
    return sorted(items, key=lambda item: item.start)


@dataclass
class PromptInputs:
    """One multimodal prompt, ready for the text model."""

    embeds: torch.Tensor  # [L, H] input embeddings (encoder rows at the placeholders)
    positions: torch.Tensor  # [4, 1, L] float
    visual_mask: torch.Tensor | None  # [L] bool: rows that take deepstack features
    deepstack: list[torch.Tensor] | None  # per deepstack layer, [visual rows, H] in prompt order


@torch.no_grad()
def encode_prompt(thinker: Any, ids: torch.Tensor, mm: MultimodalInputs, start: int = 0,
                  skip: Mapping[str, int] | None = None) -> PromptInputs:  # fmt: skip
    """Run the encoders over one request's items and place their rows in its prompt; `thinker`
    is a `Qwen3OmniMoeThinkerForConditionalGeneration`, `ids` `[L]`. With `start` (a cached
    prefix: models/prefix_cache.py), only the rows from there are wanted: the first `skip[kind]`
    items of each kind ("audio", "image", "video"), which lie before it, are not encoded, and
    the rows before it are the token embeddings."""
    model, cfg = thinker.model, thinker.config
    device = ids.device
    ids = ids.view(1, -1)
    skip = skip or {}
    embeds = thinker.get_input_embeddings()(ids)
    wanted = torch.arange(ids.shape[1], device=device).view(1, -1) >= start
    features, mask = mm.input_features, mm.feature_attention_mask
    if features is not None and mask is not None and (first := skip.get("audio", 0)) < features.shape[0]:
        audio = model.get_audio_features(features[first:].to(device), mask[first:].to(device),
                                         return_dict=True).last_hidden_state  # fmt: skip
        embeds = embeds.masked_scatter(((ids == cfg.audio_token_id) & wanted).unsqueeze(-1), audio.to(embeds.dtype))
    visual: list[tuple[torch.Tensor, list[torch.Tensor]]] = []  # (mask [1, L], deepstack rows per layer)
    for kind, pixels, grid, token_id, encode in (
        ("image", mm.pixel_values, mm.image_grid_thw, cfg.image_token_id, model.get_image_features),
        ("video", mm.pixel_values_videos, mm.video_grid_thw, cfg.video_token_id, model.get_video_features),
    ):
        if pixels is None or grid is None or (first := skip.get(kind, 0)) >= grid.shape[0]:
            continue
        if first:
            pixels, grid = pixels[int(grid[:first].prod(-1).sum()) :], grid[first:]
        out = encode(pixels.to(device), grid.to(device), return_dict=True)
        mask = (ids == token_id) & wanted
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
    merge = int(config.spatial_merge_size)
    given = {}
    for kind, grid in (("image", rope.image_grid_thw), ("video", rope.video_grid_thw)):
        present = grid is not None and grid.numel() > 0
        given[kind] = (int(grid.shape[0]), _grid_rows(f"{kind}_grid_thw", grid, merge)) if present else (0, 0)
    lengths = rope.audio_lengths
    given["audio"] = (0, 0)
    if lengths is not None and lengths.numel():
        if lengths.dim() != 1 or lengths.dtype.is_floating_point or bool((lengths <= 0).any()):
            raise ValueError(f"audio_lengths must be positive integers [audios], got {lengths.dtype} "
                             f"{list(lengths.shape)}")  # fmt: skip
        given["audio"] = (int(lengths.shape[0]), int(audio_rows(lengths, config.audio_config).sum()))
    # a video's run opens with its video token, or with its audio when that is interleaved
    _check_placeholders(ids.view(-1), config, given, (config.video_token_id, config.audio_start_token_id),
                        {kind: (f"{name} has", f"{name} gives") for kind, name in
                         (("image", "image_grid_thw"), ("video", "video_grid_thw"), ("audio", "audio_lengths"))})


def _grid_rows(name: str, grid: torch.Tensor, merge: int) -> int:
    """The placeholder rows an `[items, 3]` grid gives after the spatial merge (ValueError
    naming `name` when it is no such grid)."""
    if grid.dim() != 2 or grid.shape[1] != 3 or grid.dtype.is_floating_point or grid.shape[0] == 0:
        raise ValueError(f"{name} must be integer [items, 3], got {grid.dtype} {list(grid.shape)}")
    if bool((grid <= 0).any()) or bool((grid[:, 1:] % merge != 0).any()):
        raise ValueError(f"{name} must hold positive sizes with height and width multiples of {merge}")
    return int((grid.prod(-1) // merge**2).sum())


def _item_starts(ids: torch.Tensor, config: Any, video_next: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Where each kind's items open in a prompt `[L]`, in order: an audio at its start token, an
    image at a vision start followed by its token, a video at one followed by one of
    `video_next` (`MultimodalInputs.video_opening`; the talker's check takes either)."""
    ids = ids.view(-1)
    where = torch.arange(ids.numel(), device=ids.device)
    after = torch.cat([ids[1:], ids.new_full((1,), -1)])
    vision = ids == config.vision_start_token_id
    return {"audio": where[ids == config.audio_start_token_id],
            "image": where[vision & (after == config.image_token_id)],
            "video": where[vision & torch.isin(after, torch.tensor(video_next, device=ids.device))]}


def _check_placeholders(ids: torch.Tensor, config: Any, given: Mapping[str, tuple[int, int]],
                        video_next: tuple[int, ...], source: Mapping[str, tuple[str, str]]) -> None:  # fmt: skip
    """The prompt's placeholders against what the inputs give, per kind (image, video, audio):
    `(items, rows)`. An item is a run (an image or video: a vision start followed by its token,
    a video's by one of `video_next`; an audio: its start token), a row one placeholder.
    `source[kind]` says what gives the items and what the rows, in the messages."""

    def count(token_id: int) -> int:
        return int((ids == token_id).sum())

    opens = _item_starts(ids, config, video_next)
    found = {kind: (int(opens[kind].numel()), count(token_id)) for kind, token_id in (
        ("image", config.image_token_id), ("video", config.video_token_id), ("audio", config.audio_token_id))}
    for kind in ("image", "video", "audio"):
        (runs_found, rows_found), (items, rows) = found[kind], given[kind]
        has, gives = source[kind]
        if runs_found != items:
            raise ValueError(f"the prompt has {runs_found} {kind} placeholder run(s) but {has} {items}")
        if rows_found != rows:
            raise ValueError(f"the prompt has {rows_found} {kind} placeholders but {gives} {rows} rows")


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
