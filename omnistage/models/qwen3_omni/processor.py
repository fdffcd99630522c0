"""The checkpoint's own processor (`Qwen3OmniMoeProcessor`): chat template, placeholder expansion,
Whisper features for audio, Qwen2-VL patches for images and video.

Built from the checkpoint's configs (`preprocessor_config.json`, `video_preprocessor_config.json`)
with backends that run without torchvision (no CPU build of torchvision exists for this torch):
transformers' PIL backend of the Qwen2-VL image processor, and `FrameVideoProcessor` below, a port
of `Qwen2VLVideoProcessor`'s resize, rescale, normalize and patchify to numpy + Pillow. The video
frames arrive already sampled (the gateway decodes and samples them), so the processor never
loads a video file itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from omnistage.models.checkpoint import Checkpoint, CheckpointError
from omnistage.models.family import PartRefused
from omnistage.models.qwen3_omni.prompt import holds_special_text

__all__ = ["MODEL_INPUTS", "FrameVideoProcessor", "InputBuilder", "load_processor"]


def _video_processor_base() -> type:
    from transformers.video_processing_utils import BaseVideoProcessor

    return BaseVideoProcessor


SWITCHES = ("do_resize", "do_rescale", "do_normalize")


class FrameVideoProcessor(_video_processor_base()):  # type: ignore[misc]
    """Qwen2-VL video patches from sampled frames: each video `[T, H, W, 3]` uint8 is resized
    (bicubic) to `smart_resize` of its frame size, rescaled, normalized (each as the config's
    `do_resize`, `do_rescale`, `do_normalize` say; default on), padded to a whole number of
    temporal patches with its last frame, and cut into `[grid_t * grid_h * grid_w,
    3 * temporal_patch_size * patch_size**2]` rows, in Qwen2VLVideoProcessor's order."""

    model_input_names: ClassVar[list[str]] = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self, **config: Any) -> None:
        super().__init__()
        self.size = self._size(config, {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768})
        self.patch_size = int(config.get("patch_size", 14))
        self.temporal_patch_size = int(config.get("temporal_patch_size", 2))
        self.merge_size = int(config.get("merge_size", 2))
        self.image_mean = np.asarray(config.get("image_mean", [0.48145466, 0.4578275, 0.40821073]), np.float32)
        self.image_std = np.asarray(config.get("image_std", [0.26862954, 0.26130258, 0.27577711]), np.float32)
        self.rescale_factor = float(config.get("rescale_factor", 1 / 255))
        # the checkpoint's switches, as transformers' video processors take them (a call may override them)
        self.switches = {k: bool(v) if (v := config.get(k)) is not None else True for k in SWITCHES}  # null: default

    @staticmethod
    def _size(options: dict[str, Any], default: dict[str, int]) -> dict[str, int]:
        """Pixel bounds: `size`, overridden by `min_pixels` / `max_pixels` (Qwen2-VL's names)."""
        size = dict(options.get("size") or default)
        if options.get("min_pixels") is not None:
            size["shortest_edge"] = options["min_pixels"]
        if options.get("max_pixels") is not None:
            size["longest_edge"] = options["max_pixels"]
        return size

    def __call__(self, videos: Any, **kwargs: Any) -> Any:
        """Call options override the config as in transformers' video processors (the omni
        processor passes its own default `size` this way)."""
        from transformers.feature_extraction_utils import BatchFeature

        size = self._size(kwargs, self.size)
        switches = {k: bool(v if (v := kwargs.get(k)) is not None else self.switches[k]) for k in SWITCHES}
        patches, grids = [], []
        for video in videos if isinstance(videos, list | tuple) else [videos]:
            p, grid = self._one(np.asarray(video), size, **switches)
            patches.append(p)
            grids.append(grid)
        data = {"pixel_values_videos": np.concatenate(patches), "video_grid_thw": np.asarray(grids, dtype=np.int64)}
        return BatchFeature(data=data, tensor_type=kwargs.get("return_tensors"))

    def _one(self, video: np.ndarray, size: dict[str, int], do_resize: bool, do_rescale: bool, do_normalize: bool
             ) -> tuple[np.ndarray, list[int]]:  # fmt: skip
        from PIL import Image
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize  # (no torchvision)

        if video.ndim != 4 or video.shape[-1] != 3 or video.dtype != np.uint8:
            raise ValueError(f"a video must be uint8 frames [T, H, W, 3], got {video.dtype} {list(video.shape)}")
        t, h, w, _ = video.shape
        factor = self.patch_size * self.merge_size
        if do_resize:
            rh, rw = smart_resize(h, w, factor, size["shortest_edge"], size["longest_edge"])
            video = np.stack([np.asarray(Image.fromarray(f).resize((rw, rh), Image.Resampling.BICUBIC)) for f in video])
        elif h % factor or w % factor:  # transformers' reshape would fail on it
            raise ValueError(f"video frames of {w}x{h} are no multiple of {factor} pixels each way, which a processor "
                             "that does not resize (do_resize: false) needs")  # fmt: skip
        else:
            rh, rw = h, w
        x = video.astype(np.float32)
        if do_rescale:
            x = x * self.rescale_factor
        if do_normalize:
            x = (x - self.image_mean) / self.image_std
        x = x.transpose(0, 3, 1, 2)  # [T, C, H, W]
        if pad := -t % self.temporal_patch_size:
            x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
        tp, ps, ms = self.temporal_patch_size, self.patch_size, self.merge_size
        grid_t, grid_h, grid_w = x.shape[0] // tp, rh // ps, rw // ps
        x = x.reshape(grid_t, tp, 3, grid_h // ms, ms, ps, grid_w // ms, ms, ps)
        x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return x.reshape(grid_t * grid_h * grid_w, 3 * tp * ps * ps), [grid_t, grid_h, grid_w]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read the processor config ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: the processor config must be a JSON object")
    return data


def _processor_class(base_name: str) -> type:
    import transformers

    base = getattr(transformers, base_name)

    class Processor(base):  # type: ignore[misc, valid-type]
        """The family's processor class, taking `FrameVideoProcessor` as its video processor (its
        own class check looks the base video class up in transformers, absent without torchvision)."""

        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and isinstance(argument, FrameVideoProcessor):
                return FrameVideoProcessor
            return super().check_argument_for_proper_class(argument_name, argument)

    return Processor


def load_processor(ckpt: Checkpoint, tokenizer: Any, base_name: str = "Qwen3OmniMoeProcessor") -> Any:
    """The checkpoint's processor (transformers' `base_name`, Qwen3OmniMoeProcessor by default),
    from its own configs (nothing downloaded)."""
    from transformers import Qwen2VLImageProcessorPil, WhisperFeatureExtractor

    # transformers 5 saves one processor_config.json with a block per sub-processor (and reads it
    # first); earlier ones a preprocessor_config.json and a video_preprocessor_config.json
    pre, video_file, joint = (ckpt.path / name for name in ("preprocessor_config.json",
                                                            "video_preprocessor_config.json", "processor_config.json"))
    nested = _read_json(joint) if joint.is_file() else {}
    if not pre.is_file() and not all(isinstance(nested.get(k), dict) for k in ("feature_extractor", "image_processor")):
        raise CheckpointError(f"{ckpt.path}: missing preprocessor_config.json (the processor's audio and image "
                              "settings; or a processor_config.json with feature_extractor and image_processor "
                              "blocks)")  # fmt: skip
    if isinstance(nested.get("video_processor"), dict):
        video_config = nested["video_processor"]
    elif video_file.is_file() or pre.is_file():
        video_config = _read_json(video_file if video_file.is_file() else pre)
    else:
        video_config = nested["image_processor"]  # as a preprocessor_config.json stands in for both
    try:
        features = WhisperFeatureExtractor.from_pretrained(ckpt.path, local_files_only=True)
        images = Qwen2VLImageProcessorPil.from_pretrained(ckpt.path, local_files_only=True)
        videos = FrameVideoProcessor(**video_config)
        processor = _processor_class(base_name)(image_processor=images, video_processor=videos,
                                                feature_extractor=features, tokenizer=tokenizer,
                                                chat_template=tokenizer.chat_template)  # fmt: skip
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as e:  # AttributeError: a named token missing
        raise CheckpointError(f"{ckpt.path}: cannot build the processor: {e}") from None
    processor.validate_inputs = _unmarked_validation(processor.validate_inputs)
    return processor


def _unmarked_validation(validate: Callable[..., None]) -> Callable[..., None]:
    """transformers' omni processors (5.23, `OmniModalProcessorMixin.__call__`) count a control token
    marked as the client's text (`sanitize_control_tokens`) as a media placeholder when they check
    the placeholders against the media, though they neither expand nor encode it as one (the plain
    `ProcessorMixin.__call__` drops the marked ones first): so does this."""
    from transformers.processing_utils import _MARKED_RE

    def validate_unmarked(*args: Any, text: Any = None, **kwargs: Any) -> None:
        if kwargs.get("sanitize_control_tokens") and text is not None:
            text = [_MARKED_RE.sub("", t) for t in (text if isinstance(text, list) else [text])]
        validate(*args, text=text, **kwargs)

    return validate_unmarked


# transformers' names of the processor outputs the model takes besides the ids
MODEL_INPUTS = ("input_features", "feature_attention_mask", "pixel_values", "image_grid_thw", "pixel_values_videos",
                "video_grid_thw", "video_second_per_grid")  # fmt: skip


def processor_problems(processor: Any, thinker: Any) -> list[str]:
    """Where the processor's settings disagree with the towers that take what it makes (empty:
    they agree)."""
    wants = [("feature_extractor", "feature_size", "audio_config", "num_mel_bins")]
    for part in ("image_processor", "video_processor"):
        wants += [(part, "patch_size", "vision_config", "patch_size"),
                  (part, "temporal_patch_size", "vision_config", "temporal_patch_size"),
                  (part, "merge_size", "vision_config", "spatial_merge_size")]  # fmt: skip
    problems = []
    for part, name, tower, field in wants:
        got = getattr(getattr(processor, part, None), name, None)
        want = getattr(getattr(thinker, tower, None), field, None)
        if got is not None and want is not None and got != want:
            problems.append(f"{part}.{name}={got}, thinker_config.{tower}.{field}={want}")
    return problems


class InputBuilder:
    """Chat messages with decoded media -> prompt ids and model inputs, with the checkpoint's
    processor, for this checkpoint's model config (audio window, positions per second).

    A message is `{"role": ..., "content": str | [part, ...]}`, a part one of
    `{"type": "text", "text": str}`, `{"type": "audio", "audio": float32 [samples]}` (mono at
    `sampling_rate`), `{"type": "image", "image": uint8 [H, W, 3]}`, `{"type": "video",
    "video": uint8 [T, H, W, 3], "fps": float, "audio": float32 [samples] | None}` (its sound
    track, used with `use_audio_in_video`).
    """

    processor_class = "Qwen3OmniMoeProcessor"

    def __init__(self, ckpt: Checkpoint, tokenizer: Any) -> None:
        self.processor = load_processor(ckpt, tokenizer, self.processor_class)
        thinker = ckpt.config.thinker_config
        if problems := processor_problems(self.processor, thinker):  # (else each media request fails, blamed on it)
            raise CheckpointError(f"{ckpt.path}: the processor's files disagree with config.json: "
                                  + "; ".join(problems))  # fmt: skip
        self.n_window = int(thinker.audio_config.n_window)
        self.position_id_per_seconds = float(thinker.position_id_per_seconds)
        fe = self.processor.feature_extractor
        self.sampling_rate = int(fe.sampling_rate)
        # the longest audio the feature extractor takes whole (it pads or cuts to n_samples)
        self.max_audio_seconds = float(fe.n_samples) / self.sampling_rate
        # its STFT reflects n_fft / 2 samples at each end, so the longest clip (it pads the others to
        # it) needs more than that
        self.min_audio_samples = int(getattr(fe, "n_fft", 400)) // 2 + 1

    @staticmethod
    def digests(inputs: Mapping[str, Any], use_audio_in_video: bool = False) -> torch.Tensor:
        """A digest of each media item of `build`'s inputs (`multimodal.media_digests`): what the
        thinker's prefix cache tells items apart by, made here off its engine thread."""
        from omnistage.models.qwen3_omni.multimodal import MultimodalInputs, media_digests

        return media_digests(MultimodalInputs.from_mapping(inputs, use_audio_in_video))

    def options(self) -> dict[str, Any]:
        """The processor call's settings from this checkpoint's config."""
        return {"n_window": self.n_window, "position_id_per_seconds": self.position_id_per_seconds}

    @staticmethod
    def _check_size(hw: tuple[int, ...], processor: Any, resizes: bool, at: str) -> None:
        """The processor's own resize rule (transformers' `smart_resize`) on an image's or a
        video's size, before the processor runs: its refusal (an aspect ratio past 200) names
        the part. (Its pixel bounds do not matter here: they only pick the size.)"""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize  # (no torchvision)

        if not resizes:
            return
        try:
            smart_resize(int(hw[0]), int(hw[1]), processor.patch_size * processor.merge_size)
        except ValueError as e:
            raise PartRefused(f"{at}: {e}") from None

    def build(self, messages: list[dict[str, Any]], use_audio_in_video: bool = False,
              template_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], dict[str, Any]]:  # fmt: skip
        """(prompt ids, model inputs as torch tensors under MODEL_INPUTS names); `template_kwargs`:
        the request's own variables for the chat template."""
        audios: list[np.ndarray] = []
        audio_sources: list[int | None] = []  # per audio: None (its own part) or the video it comes from
        audio_parts: list[str] = []  # per audio, the part it comes from (for errors)
        images: list[np.ndarray] = []
        videos: list[np.ndarray] = []
        fps: list[float] = []
        rendered = []
        for i, message in enumerate(messages):
            content = message["content"]
            if isinstance(content, str):
                rendered.append(message)
                continue
            parts = []
            for j, part in enumerate(content):
                kind = part["type"]
                if kind == "text":  # adjacent ones as one: the template writes them with nothing between
                    if parts and parts[-1]["type"] == "text":  # (so a special token split over two is seen)
                        parts[-1] = {"type": "text", "text": parts[-1]["text"] + part["text"]}
                    else:
                        parts.append({"type": "text", "text": part["text"]})
                    continue
                at = f"messages[{i}].parts[{j}] ({kind})"
                if kind == "audio":
                    audios.append(part["audio"])
                    audio_sources.append(None)
                    audio_parts.append(at)
                elif kind == "image":
                    images_in = self.processor.image_processor
                    self._check_size(part["image"].shape[:2], images_in, bool(images_in.do_resize), at)
                    images.append(part["image"])
                elif kind == "video":
                    videos_in = self.processor.video_processor
                    self._check_size(part["video"].shape[1:3], videos_in, videos_in.switches["do_resize"], at)
                    if use_audio_in_video:
                        audios.append(part["audio"])
                        audio_sources.append(len(videos))
                        audio_parts.append(f"{at}'s sound track")
                    videos.append(part["video"])
                    fps.append(float(part["fps"]))
                else:
                    raise ValueError(f"unknown content part type {kind!r}")
                parts.append({"type": kind, kind: kind})  # the template emits the placeholder
            rendered.append({**message, "content": parts})  # (its other fields: an assistant's tool calls)
        # A special token's text in what the client wrote is its text (prompt.build_prompt_ids): marked
        # here as transformers' own apply_chat_template(sanitize_control_tokens=True) marks it, the
        # processor neither expands it as a placeholder nor encodes it as the token.
        variables = dict(template_kwargs or {})
        sanitize = holds_special_text(self.processor.tokenizer, rendered, variables)
        if sanitize:
            template = self.processor._resolve_chat_template(None)
            marked, _, _, variables = self.processor.tokenizer._mark_chat_inputs(
                template, [rendered], None, None, variables, True, False)  # fmt: skip
            rendered = marked[0]
        text = self.processor.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False, **variables)
        kwargs: dict[str, Any] = {**self.options(), "sanitize_control_tokens": sanitize}
        if audios:
            longest = max(range(len(audios)), key=lambda k: len(audios[k]))  # the others are padded to it
            if (n := len(audios[longest])) < self.min_audio_samples:
                raise PartRefused(f"{audio_parts[longest]}: audio of {n} samples ({1000 * n / self.sampling_rate:.1f} "
                                  f"ms) is too short: the feature extractor needs at least {self.min_audio_samples}")
            kwargs["audio"] = audios
        if images:
            kwargs["images"] = images
            # [H, W, 3] arrays: an image 1 or 3 pixels high would otherwise be taken as channels first
            kwargs["images_kwargs"] = {"input_data_format": "channels_last"}
        if videos:
            if use_audio_in_video and len(set(fps)) > 1:
                # the processor interleaves each video's audio by one rate for all (transformers takes
                # one fps): the placeholders would not be where the positions put them
                raise ValueError(f"videos at different frame rates ({', '.join(f'{f:g}' for f in fps)} fps) cannot "
                                 "carry their audio in one request (use_audio_in_video)")  # fmt: skip
            kwargs["videos"] = videos
            kwargs["videos_kwargs"] = {"fps": fps[0]}
            if use_audio_in_video:
                kwargs["load_audio_from_video"] = True
                kwargs["audio_from_video_indices"] = audio_sources
        out = self.processor(text=[text], return_tensors="pt", **kwargs)
        if audios:  # finite samples far outside [-1, 1] overflow the log-mel features
            finite = torch.isfinite(out["input_features"]).flatten(1).all(1)
            if not bool(finite.all()):
                bad = audio_parts[int((~finite).nonzero()[0])]
                raise PartRefused(f"{bad}: its features hold NaN or infinite values (samples far outside [-1, 1])")
        ids = [int(i) for i in out["input_ids"][0].tolist()]
        inputs = {k: out[k] for k in MODEL_INPUTS if out.get(k) is not None}
        if videos:
            # one fps per call: each video's own seconds per temporal patch
            tp = self.processor.video_processor.temporal_patch_size
            inputs["video_second_per_grid"] = torch.tensor([tp / f for f in fps], dtype=torch.float32)
        return ids, inputs
