"""The model layer's multimodal pieces: the processor (its video port against transformers' own
image processor), the input checks, the in-process pipeline against generate() on a checkpoint
of other sizes and ids, and chunked multimodal prefill."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks import media
from omnistage.models import CheckpointError, load_tokenizer, open_checkpoint
from omnistage.models.qwen3_omni.multimodal import MultimodalInputs, feature_output_lengths
from omnistage.models.qwen3_omni.processor import load_processor
from omnistage.models.sampling import SamplingParams
from services.pipeline import PipelineRequest
from tests.conftest import talker_audio_policy

RATE = 16_000


def _builder(pipeline: Any) -> Any:
    return pipeline.family.input_builder(pipeline.checkpoint, pipeline.tokenizer)


def _messages(kind: str) -> tuple[list[dict[str, Any]], bool]:
    tone, img, vid = media.tone(2.0, RATE, seed=1), media.image(60, 90, seed=2), media.video(4, 48, 64, seed=3)
    parts: dict[str, list[dict[str, Any]]] = {
        "audio": [{"type": "audio", "audio": tone}],
        "image": [{"type": "image", "image": img}],
        "video": [{"type": "video", "video": vid[:2], "fps": 2.0, "audio": None}],
        "image+video": [{"type": "image", "image": img},
                        {"type": "video", "video": vid[:2], "fps": 2.0, "audio": None}],
        "audio-in-video": [{"type": "video", "video": vid, "fps": 2.0, "audio": tone}],
    }  # fmt: skip
    content = [*parts[kind], {"type": "text", "text": "What is it?"}]
    return [{"role": "user", "content": content}], kind == "audio-in-video"


@pytest.mark.parametrize("switches", [{}, {"do_normalize": False}, {"do_rescale": False, "do_normalize": False},
                                      {"do_resize": False}])  # fmt: skip
def test_video_port_equals_transformers_image_processor(pipeline: Any, switches: dict[str, bool]) -> None:
    """A video of two equal frames is one temporal patch of that image: the numpy port of
    Qwen2-VL's video processor gives transformers' image processor's patches, with the
    processor's switches as a checkpoint's config (or a call) sets them."""
    from omnistage.models.qwen3_omni.processor import FrameVideoProcessor

    processor = _builder(pipeline).processor
    factor = processor.video_processor.patch_size * processor.video_processor.merge_size
    img = media.image(2 * factor, 3 * factor, seed=4) if switches.get("do_resize") is False else \
        media.image(50, 70, seed=4)  # fmt: skip
    size = {"shortest_edge": 32 * 32, "longest_edge": 128 * 128}  # the tiny image processor's bounds
    image = processor.image_processor(images=[img], return_tensors="pt", **switches)
    video = processor.video_processor(videos=[np.stack([img, img])], size=size, return_tensors="pt", **switches)
    assert torch.equal(image["image_grid_thw"], video["video_grid_thw"])
    assert torch.allclose(image["pixel_values"], video["pixel_values_videos"], atol=1e-6, rtol=0)
    if switches:  # the same switches from a checkpoint's config
        port = processor.video_processor
        configured = FrameVideoProcessor(patch_size=port.patch_size, merge_size=port.merge_size, size=size,
                                         temporal_patch_size=port.temporal_patch_size, image_mean=port.image_mean,
                                         image_std=port.image_std, **switches)  # fmt: skip
        again = configured(videos=[np.stack([img, img])], return_tensors="pt")
        assert torch.equal(again["pixel_values_videos"], video["pixel_values_videos"])
    if switches.get("do_resize") is False:
        with pytest.raises(ValueError, match="no multiple of"):
            processor.video_processor(videos=[np.stack([img[:-1], img[:-1]])], size=size, **switches)


def test_thin_images_and_tiny_audio_reach_the_processor_as_meant(pipeline: Any) -> None:
    """An image 1 or 3 pixels high is [H, W, 3], not channels first (its grid came out turned);
    audio too short for the feature extractor's STFT is refused saying so (was a torch padding
    RuntimeError), and the shortest it takes goes through."""
    from PIL import Image

    builder = _builder(pipeline)
    for height, width in ((1, 64), (3, 64), (64, 1)):
        img = media.image(height, width, seed=5)
        _, got = builder.build([{"role": "user", "content": [{"type": "image", "image": img}]}])
        ref = builder.processor.image_processor(images=[Image.fromarray(img)], return_tensors="pt")
        assert torch.equal(got["image_grid_thw"], ref["image_grid_thw"]), (height, width)
    least = builder.min_audio_samples
    with pytest.raises(ValueError, match=rf"audio of {least - 1} samples .* is too short"):
        builder.build([{"role": "user", "content": [{"type": "audio", "audio": np.zeros(least - 1, np.float32)}]}])
    _, got = builder.build([{"role": "user", "content": [{"type": "audio", "audio": np.zeros(least, np.float32)}]}])
    assert got["input_features"].shape[-1] >= 1


@pytest.mark.parametrize("family", ["qwen3_omni", "qwen2_5_omni"])
def test_a_part_the_processor_cannot_take_is_named(pipeline: Any, q25_dir: Path, family: str) -> None:
    """What the processor refuses names the part, as the gateway's media checks do (it said
    `messages: cannot build the model inputs`): an image or video past the aspect-ratio limit,
    audio too short for the features (the longest: the others are padded to it), and finite
    audio far outside [-1, 1] whose features overflow (the thinker refused it, naming no part)."""
    from omnistage.models import PartRefused

    if family == "qwen3_omni":
        builder = _builder(pipeline)
    else:
        ckpt = open_checkpoint(q25_dir)
        builder = ckpt.family.input_builder(ckpt, load_tokenizer(ckpt))
    tone, img, vid = media.tone(1.0, RATE, seed=1), media.image(40, 40, seed=2), media.video(2, 32, 32, seed=3)
    thin, thin_video = media.image(2, 402, seed=4), media.video(2, 2, 402, seed=5)  # aspect 201

    def refusal(*parts: dict[str, Any], in_video: bool = False) -> str:
        content = [{"type": "text", "text": "hi"}, *parts]
        with pytest.raises(PartRefused) as e:
            builder.build([{"role": "user", "content": "first"}, {"role": "user", "content": content}], in_video)
        return str(e.value)

    def video(frames: np.ndarray, sound: np.ndarray | None = None) -> dict[str, Any]:
        return {"type": "video", "video": frames, "fps": 2.0, "audio": sound}

    image, audio = {"type": "image", "image": img}, {"type": "audio", "audio": tone}
    assert refusal(image, {"type": "image", "image": thin}).startswith(
        "messages[1].parts[2] (image): absolute aspect ratio must be smaller than 200")
    assert refusal(image, video(vid), video(thin_video)).startswith("messages[1].parts[3] (video): absolute aspect")
    short = {"type": "audio", "audio": np.zeros(builder.min_audio_samples - 1, np.float32)}
    assert refusal(image, short, {"type": "audio", "audio": np.zeros(3, np.float32)}).startswith(
        "messages[1].parts[2] (audio): audio of")
    loud = {"type": "audio", "audio": np.full(RATE, 1e30, np.float32)}
    assert refusal(audio, loud).startswith("messages[1].parts[2] (audio): its features hold NaN or infinite")
    assert refusal(audio, video(vid, np.full(RATE, 1e30, np.float32)), in_video=True).startswith(
        "messages[1].parts[2] (video)'s sound track: its features hold NaN")
    assert builder.build([{"role": "user", "content": [image, audio, video(vid)]}])[0]  # (the same parts, fine)


@pytest.mark.parametrize("kind", ["audio", "image", "video", "image+video", "audio-in-video"])
def test_processor_expands_each_placeholder(checkpoints: Any, kind: str) -> None:
    """On the variant checkpoint (other special ids): one placeholder row per encoder row."""
    pipeline, _ = checkpoints("variant")
    cfg = pipeline.checkpoint.config.thinker_config
    messages, in_video = _messages(kind)
    ids, inputs = _builder(pipeline).build(messages, in_video)
    ids_t = torch.tensor(ids)
    mm = MultimodalInputs.from_mapping(inputs, in_video)
    mm.check(ids_t, cfg)  # agrees with itself
    if mm.feature_attention_mask is not None:
        rows = int(feature_output_lengths(mm.feature_attention_mask.sum(-1), cfg.audio_config.n_window).sum())
        assert int((ids_t == cfg.audio_token_id).sum()) == rows > 0
    for grid, token in ((mm.image_grid_thw, cfg.image_token_id), (mm.video_grid_thw, cfg.video_token_id)):
        if grid is not None:
            assert int((ids_t == token).sum()) == int((grid.prod(-1) // 4).sum()) > 0
    assert ids[-3:] == pipeline.tokenizer.encode("<|im_start|>assistant\n")


def test_videos_at_different_rates_cannot_carry_their_audio(pipeline: Any) -> None:
    """transformers' processor interleaves every video's audio chunks by one frame rate, while
    each video's positions use its own: with `use_audio_in_video` the rates must agree."""
    tone, vid = media.tone(1.0, RATE, seed=1), media.video(4, 48, 64, seed=3)

    def messages(*rates: float) -> list[dict[str, Any]]:
        videos = [{"type": "video", "video": vid, "fps": r, "audio": tone} for r in rates]
        return [{"role": "user", "content": [*videos, {"type": "text", "text": "What is it?"}]}]

    with pytest.raises(ValueError, match=r"videos at different frame rates \(2, 1.5 fps\) cannot carry their audio"):
        _builder(pipeline).build(messages(2.0, 1.5), True)
    ids, inputs = _builder(pipeline).build(messages(1.5, 1.5), True)
    assert inputs["video_grid_thw"].shape[0] == 2 and ids
    assert _builder(pipeline).build(messages(2.0, 1.5), False)[0]  # without their audio: each its own rate


def test_inputs_that_disagree_are_refused(pipeline: Any) -> None:
    cfg = pipeline.checkpoint.config.thinker_config
    messages, _ = _messages("image+video")
    ids, inputs = _builder(pipeline).build(messages)
    audio_ids, audio_inputs = _builder(pipeline).build(_messages("audio")[0])
    cases = [
        (ids, {**inputs, "video_second_per_grid": torch.tensor([float("nan")])}, "video_second_per_grid must be"),
        (ids, {**inputs, "image_grid_thw": torch.tensor([[1, 3, 4]])}, "multiples of 2"),
        (ids, {k: v for k, v in inputs.items() if k != "video_grid_thw"}, "come together"),
        (_without_first(ids, cfg.video_token_id), inputs, "video placeholders but the video inputs give"),
        (audio_ids, {**audio_inputs, "feature_attention_mask": audio_inputs["feature_attention_mask"] * 2}, "0 and 1"),
        (audio_ids, {**audio_inputs, "input_features": audio_inputs["input_features"] * float("nan")},
         "input_features holds NaN"),
        (ids, {**inputs, "pixel_values": inputs["pixel_values"] / 0}, "pixel_values holds NaN or infinite"),
        (audio_ids, {k: v for k, v in audio_inputs.items() if k != "input_features"}, "come together"),
        ([i for i in audio_ids], {}, "audio placeholders but no input_features"),
    ]  # fmt: skip
    for case_ids, tensors, message in cases:
        with pytest.raises(ValueError) as e:
            MultimodalInputs.from_mapping(tensors).check(torch.tensor(case_ids), cfg)
        assert message in str(e.value), str(e.value)


def _without_first(ids: list[int], token: int) -> list[int]:
    i = ids.index(token)
    return ids[:i] + ids[i + 1 :]


def test_a_checkpoint_without_its_processor_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "no-processor"
    shutil.copytree(tiny_dir, copy)
    (copy / "preprocessor_config.json").unlink()
    ckpt = open_checkpoint(copy)
    with pytest.raises(CheckpointError, match=r"missing preprocessor_config\.json"):
        load_processor(ckpt, load_tokenizer(ckpt))


def test_a_processor_saved_by_transformers_5_is_read(pipeline: Any, tiny_dir: Path, tmp_path: Path) -> None:
    """transformers 5's save_pretrained writes one processor_config.json (a block per
    sub-processor) and chat_template.jinja, no preprocessor_config.json: the checkpoint's media
    inputs come out the same (before, it was refused and a stack served text only)."""
    copy = tmp_path / "resaved"
    shutil.copytree(tiny_dir, copy)
    for name in ("preprocessor_config.json", "video_preprocessor_config.json", "chat_template.json"):
        (copy / name).unlink()
    saved = tmp_path / "saved"
    _builder(pipeline).processor.save_pretrained(saved)
    assert not (saved / "preprocessor_config.json").exists(), "transformers saves the older layout again"
    for name in ("processor_config.json", "chat_template.jinja"):
        shutil.copy(saved / name, copy / name)
    ckpt = open_checkpoint(copy)
    resaved = ckpt.family.input_builder(ckpt, load_tokenizer(ckpt))
    for kind in ("audio", "image+video", "audio-in-video"):
        messages, in_video = _messages(kind)
        (ids, inputs), (ids2, inputs2) = _builder(pipeline).build(messages, in_video), resaved.build(messages, in_video)
        assert ids2 == ids and inputs2.keys() == inputs.keys()
        for key, value in inputs.items():
            assert torch.equal(inputs2[key], value), key


@pytest.mark.parametrize("kind", ["audio", "image", "image+video", "audio-in-video"])
def test_variant_checkpoint_matches_generate(checkpoints: Any, kind: str) -> None:
    pipeline, reference = checkpoints("variant")
    messages, in_video = _messages(kind)
    ids, inputs = _builder(pipeline).build(messages, in_video)
    mm = MultimodalInputs.from_mapping(inputs, in_video)
    thinker = pipeline.thinker_defaults().with_overrides(max_tokens=12)
    events = list(pipeline.run(PipelineRequest(ids, thinker, SamplingParams(max_tokens=16), multimodal=inputs,
                                               use_audio_in_video=in_video)))  # fmt: skip
    done = events[-1]
    eos = pipeline.spec.im_end_id
    try:
        # generate() has no talker audio_config for audio with video (documented policy)
        with talker_audio_policy(reference, mm.input_features is not None and mm.video_grid_thw is not None):
            ref_ids, ref_codes, _ = reference.generate(ids, 12, 16, eos, **mm.generate_kwargs())
    except RuntimeError as e:
        # generate() fails when the talker's first code is codec EOS (it stacks an empty list of
        # codes); the pipeline then gives no frames. The text must still be generate()'s.
        assert "non-empty TensorList" in str(e)
        ref_ids, ref_codes = reference.generate(ids, 12, 16, eos, audio=False, **mm.generate_kwargs())[0], None
        assert done.codes.shape[1] == 0 and done.talker_stopped_on == "stop_id"
    assert done.token_ids == ref_ids
    if ref_codes is not None:
        assert torch.equal(done.codes, ref_codes)


def test_chunked_multimodal_prefill_is_close_to_one_forward(pipeline: Any) -> None:
    """A prompt prefilled over several steps (chunks cutting through the video's rows) attends
    to its earlier chunks through the cache. It is not bitwise (GEMM results depend on how many
    rows a call has, ~1e-6): only a prompt prefilled in one forward equals generate() exactly."""
    messages, _ = _messages("image+video")
    ids, inputs = _builder(pipeline).build(messages)
    thinker = pipeline.thinker

    def prefill(chunk: int) -> Any:
        state = thinker.new_state(pipeline.thinker_defaults())
        thinker.set_prompt(state, ids, inputs)
        pos = 0
        while True:
            n = min(chunk, len(ids) - pos)
            (step,) = thinker.step([(state, pos, n)])
            pos += n
            if step.prompt is not None:
                thinker.release(state)
                return step
    whole, chunked = prefill(len(ids)), prefill(13)
    assert chunked.token.token_id == whole.token.token_id
    assert torch.equal(chunked.prompt.embeds, whole.prompt.embeds)
    assert torch.allclose(chunked.prompt.hidden, whole.prompt.hidden, atol=1e-4, rtol=0)


def test_talker_refuses_media_sizes_that_do_not_fit_the_prompt(pipeline: Any) -> None:
    """Sizes that cannot place the talker prompt's positions fail that request when its prompt
    arrives (not a later shared step)."""
    ids, _ = _builder(pipeline).build(_messages("image")[0])
    talker = pipeline.talker
    state = talker.new_state(pipeline.family.talker_defaults(), pipeline.spec.default_speaker)
    rows = torch.zeros(len(ids), pipeline.spec.thinker_hidden)
    wrong = {"video_grid_thw": torch.tensor([[1, 2, 2]]), "video_second_per_grid": torch.tensor([1.0])}
    with pytest.raises(ValueError, match="sizes do not fit its placeholders"):
        talker.set_prompt(state, torch.tensor(ids), rows, rows, wrong)
    right = _builder(pipeline).build(_messages("image")[0])[1]
    talker.set_prompt(state, torch.tensor(ids), rows, rows, {"image_grid_thw": right["image_grid_thw"]})
    assert state.prompt_positions is not None and state.prompt_positions.shape[0] == 4


@pytest.mark.parametrize("kind", ["audio", "image+video", "audio-in-video"])
def test_talker_refuses_sizes_that_place_positions_but_disagree_with_the_prompt(pipeline: Any, kind: str) -> None:
    """Sizes from which positions can be computed, but not the prompt's: one image's grid twice
    as high, one audio longer, an item more or fewer. Each is INVALID_ARGUMENT material (a
    ValueError naming what disagrees) when the prompt arrives, where it gave wrong positions."""
    messages, in_video = _messages(kind)
    ids, inputs = _builder(pipeline).build(messages, use_audio_in_video=in_video)
    mm = MultimodalInputs.from_mapping(inputs, use_audio_in_video=in_video)
    right = mm.rope().tensors()
    talker = pipeline.talker
    assert talker.check_sizes  # the talker's config names the thinker's placeholder ids
    rows = torch.zeros(len(ids), pipeline.spec.thinker_hidden)

    def prompt(rope: dict[str, torch.Tensor]) -> None:
        state = talker.new_state(pipeline.family.talker_defaults(), pipeline.spec.default_speaker)
        talker.set_prompt(state, torch.tensor(ids), rows, rows, rope)

    prompt(right)  # the right sizes place the prompt
    wrongs: list[tuple[dict[str, torch.Tensor], str]] = []
    if "audio_lengths" in right:
        longer = right["audio_lengths"].clone()
        longer[0] += 400
        wrongs += [({**right, "audio_lengths": longer}, "audio placeholders"),
                   ({**right, "audio_lengths": right["audio_lengths"].repeat(2)}, "audio")]  # fmt: skip
    for name in ("image_grid_thw", "video_grid_thw"):
        if name in right:
            higher = right[name].clone()
            higher[0, 1] *= 2
            wrongs.append(({**right, name: higher}, f"{name.split('_')[0]} placeholders"))
    if "image_grid_thw" in right:
        wrongs.append(({k: v for k, v in right.items() if k != "image_grid_thw"}, "image"))
    assert wrongs
    for rope, what in wrongs:
        with pytest.raises(ValueError, match=f"sizes do not fit its placeholders: .*{what}"):
            prompt(rope)
