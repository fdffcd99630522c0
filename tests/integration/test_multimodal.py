"""Audio, image and video in, through the real multi-process stack: greedy output equals
monolithic `generate()` on the same model inputs (text ids, every code group, the waveform),
alone and together with text-only requests; bad media fail their request with INVALID_ARGUMENT
naming the part, and nothing else. On the published layout: the fused one loads the same
weights, bit for bit (tests/test_tiny_and_loader.py), so a second stack on it (about 20 s
here) showed nothing more."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from benchmarks import media
from gateway.client import build_request, frames_part, generate, image_part, pcm_part, text_part, user_message
from gateway.media import decode_messages
from omnistage.cli.serve import Stack, start_stack
from omnistage.models.qwen3_omni.multimodal import MultimodalInputs
from omnistage.v1 import gateway_pb2, gateway_pb2_grpc, stage_pb2
from omnistage.wire import encode_chunks
from services import edges
from tests.conftest import talker_audio_policy
from tests.integration.conftest import info, run, stack_config, stage_call

THINKER_MAX, TALKER_MAX = 16, 24
RATE = 16_000  # the tiny processor's feature extractor
MEDIA_LIMITS = {"max_part_bytes": 1024 * 1024, "max_audio_seconds": 12.0, "max_video_frames": 8}


@pytest.fixture(scope="module")
def mm_stack(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("mm-logs")
    with start_stack(stack_config(media=MEDIA_LIMITS), model=str(tiny_dir), log_dir=logs) as s:
        yield s


@pytest.fixture(scope="module")
def ref(checkpoints: Any) -> Any:
    """(pipeline, reference, input builder) of the checkpoint."""
    pipeline, reference = checkpoints("published")
    return pipeline, reference, pipeline.family.input_builder(pipeline.checkpoint, pipeline.tokenizer)


# ---- the requests ---------------------------------------------------------------------------------

WAV = media.encode_audio(media.tone(2.0, RATE, 440.0, seed=1), RATE, "wav")
MP3 = media.encode_audio(media.tone(1.5, RATE, 300.0, seed=2), RATE, "mp3")
PNG = media.encode_image(media.image(60, 90, seed=3), "png")
JPEG = media.encode_image(media.image(40, 40, seed=4), "jpeg")
MP4_SOUND = media.encode_video(media.video(6, 48, 64, seed=5), 4, media.tone(1.5, RATE, 520.0, seed=6))
MP4_SILENT = media.encode_video(media.video(4, 48, 64, seed=7), 4)


def _case(name: str) -> gateway_pb2.GenerateRequest:
    kw: dict[str, Any] = {"thinker_max_tokens": THINKER_MAX, "talker_max_tokens": TALKER_MAX}
    if name == "audio":
        return build_request("What is this sound?", audio=[WAV], **kw)
    if name == "image":
        return build_request("Describe it.", images=[PNG], system="Be brief.", **kw)
    if name == "video":
        return build_request("What happens?", videos=[MP4_SILENT], **kw)
    if name == "audio+image":
        return build_request("Both?", audio=[MP3], images=[JPEG], **kw)
    if name == "audio-in-video":
        return build_request("And?", videos=[MP4_SOUND], use_audio_in_video=True, **kw)
    if name == "frames+pcm":
        frames = frames_part([media.encode_image(f, "png") for f in media.video(3, 32, 32, seed=8)], fps=1.5)
        pcm = pcm_part(media.tone(1.0, 22_050, 350.0, seed=9), 22_050)
        msg = gateway_pb2.ChatMessage(role="user", parts=[frames, pcm, text_part("Listen and look.")])
        return build_request("", messages=[msg], **kw)
    if name == "multi-turn":  # an earlier user turn with audio, the assistant's answer, then text
        history = [user_message("Hi", audio=[MP3]), gateway_pb2.ChatMessage(role="assistant", content="Hello there.")]
        return build_request("What did I say?", messages=history, **kw)
    raise ValueError(name)


CASES = ["audio", "image", "video", "audio+image", "audio-in-video", "frames+pcm", "multi-turn"]


def reference_output(ref: Any, request: gateway_pb2.GenerateRequest) -> tuple[list[int], dict[str, Any], Any]:
    """The gateway's own decoding and processor on `request`, then monolithic generate()."""
    pipeline, reference, builder = ref
    messages, has_media = decode_messages(request, stack_config(media=MEDIA_LIMITS).media, RATE)
    assert has_media
    ids, inputs = builder.build(messages, request.use_audio_in_video)
    mm = MultimodalInputs.from_mapping(inputs, request.use_audio_in_video)
    mixed = mm.input_features is not None and (mm.pixel_values is not None or mm.pixel_values_videos is not None)
    with talker_audio_policy(reference, mixed):
        out = reference.generate(ids, THINKER_MAX, TALKER_MAX, pipeline.spec.im_end_id, **mm.generate_kwargs())
    return ids, inputs, out


def test_the_cases_cover_what_they_claim(ref: Any) -> None:
    """Each case really puts its media in the prompt (placeholders of each kind)."""
    _, _, builder = ref
    kinds = {"audio": {"input_features"}, "image": {"pixel_values"}, "video": {"pixel_values_videos"},
             "audio+image": {"input_features", "pixel_values"},
             "audio-in-video": {"input_features", "pixel_values_videos"},
             "frames+pcm": {"input_features", "pixel_values_videos"}, "multi-turn": {"input_features"}}  # fmt: skip
    for name in CASES:
        request = _case(name)
        messages, _ = decode_messages(request, stack_config(media=MEDIA_LIMITS).media, RATE)
        _, inputs = builder.build(messages, request.use_audio_in_video)
        assert kinds[name] <= set(inputs), name


@pytest.mark.parametrize("name", CASES)
def test_media_requests_match_generate(mm_stack: Stack, ref: Any, name: str) -> None:
    request = _case(name)
    ids, inputs, (ref_ids, ref_codes, ref_wav) = reference_output(ref, request)
    assert ref_codes is not None and ref_codes.shape[1] > 0

    # Through the gateway: the same ids and waveform.
    reply = run(generate(mm_stack.gateway_address, "", timeout=120, **_request_options(request)))
    assert reply.token_ids == ref_ids
    assert reply.usage["prompt_tokens"] == len(ids)
    assert reply.usage["audio_frames"] == ref_codes.shape[1]
    assert reply.pcm.shape == tuple(ref_wav.shape)
    assert np.allclose(reply.pcm, ref_wav.numpy(), atol=1e-5, rtol=0)

    # Straight into the thinker with the same model inputs (split over several messages when
    # large): every code group of every frame.
    start = stage_pb2.Start(request_id=f"mm-{name}", want_audio=True)
    start.sampling["thinker"].max_tokens = THINKER_MAX
    start.sampling["talker"].CopyFrom(stage_pb2.SamplingParams(max_tokens=TALKER_MAX, do_sample=False,
                                                               repetition_penalty=1.0))  # fmt: skip
    chunk = edges.prompt_chunk(ids, inputs, request.use_audio_in_video)
    pieces = [p.message() for p in encode_chunks(chunk.tensors, max_bytes=1 << 20, length=chunk.length,
                                                  finished=True, meta=chunk.meta)]  # fmt: skip
    out = run(stage_call(mm_stack.addresses("thinker")[0], start, pieces, timeout=120))
    codes = torch.cat([c.tensors["codes"] for c in out["talker"] if "codes" in c.tensors], dim=1)
    assert [int(i) for c in out["thinker"] for i in c.tensors["ids"].tolist()] == ref_ids
    assert torch.equal(codes, ref_codes)


def _request_options(request: gateway_pb2.GenerateRequest) -> dict[str, Any]:
    """`generate()` options that rebuild `request` (its messages as the conversation)."""
    thinker, talker = request.sampling["thinker"], request.sampling["talker"]
    return {"messages": list(request.messages), "use_audio_in_video": request.use_audio_in_video,
            "thinker_max_tokens": thinker.max_tokens, "talker_max_tokens": talker.max_tokens}  # fmt: skip


def test_media_and_text_requests_together(mm_stack: Stack, ref: Any) -> None:
    """Media requests batched with text-only ones: each gives what it gives alone."""
    names = ["audio", "image", "audio-in-video", "multi-turn"]
    expected = [reference_output(ref, _case(n))[2] for n in names]
    texts = ["Tell me a short story about a robot.", "Numbers one two three", "hi"]
    text_expected = [run(generate(mm_stack.gateway_address, t, thinker_max_tokens=THINKER_MAX,
                                  talker_max_tokens=TALKER_MAX, timeout=120)) for t in texts]  # fmt: skip
    thinker = mm_stack.addresses("thinker")[0]
    before = run(info(thinker)).load

    async def together() -> list[Any]:
        calls = [generate(mm_stack.gateway_address, "", timeout=180, **_request_options(_case(n))) for n in names]
        calls += [generate(mm_stack.gateway_address, t, thinker_max_tokens=THINKER_MAX, talker_max_tokens=TALKER_MAX,
                           timeout=180) for t in texts]  # fmt: skip
        return await asyncio.gather(*calls)

    replies = run(together())
    for reply, (ref_ids, _, ref_wav) in zip(replies[: len(names)], expected, strict=True):
        assert reply.token_ids == ref_ids
        assert np.allclose(reply.pcm, ref_wav.numpy(), atol=1e-5, rtol=0)
    for reply, alone in zip(replies[len(names) :], text_expected, strict=True):
        assert reply.token_ids == alone.token_ids
        assert np.allclose(reply.pcm, alone.pcm, atol=1e-5, rtol=0)
    after = run(info(thinker)).load
    # the thinker stepped several of these requests at once
    steps = after.steps_total - before.steps_total
    assert after.step_requests_total - before.step_requests_total > steps


# ---- bad media ------------------------------------------------------------------------------------


def _bad(name: str) -> tuple[gateway_pb2.GenerateRequest, str]:
    """A request with one unusable part and what the error must say."""
    user = gateway_pb2.ChatMessage(role="user")
    expect = "messages[0].parts[0]"
    if name == "garbage audio":
        user.parts.extend([gateway_pb2.ContentPart(audio=gateway_pb2.AudioPart(file=b"not audio at all" * 50))])
    elif name == "truncated video":
        cut = MP4_SILENT[: len(MP4_SILENT) // 3]
        user.parts.extend([gateway_pb2.ContentPart(video=gateway_pb2.VideoPart(file=cut))])
    elif name == "unsupported image":
        user.parts.extend([image_part(b"%PDF-1.4\n" + b"0" * 400)])
    elif name == "empty audio":
        user.parts.extend([gateway_pb2.ContentPart(audio=gateway_pb2.AudioPart(file=b""))])
    elif name == "empty part":
        user.parts.extend([gateway_pb2.ContentPart()])
    elif name == "audio too long":
        user.parts.extend([pcm_part(np.zeros(13 * RATE, np.float32), RATE)])
        expect += " (audio): longer than the limit of 12"
    elif name == "over the byte limit":
        user.parts.extend([image_part(PNG + b"\0" * (MEDIA_LIMITS["max_part_bytes"]))])
        expect += " (image)"
    elif name == "bad pcm rate":
        user.parts.extend([pcm_part(np.zeros(100, np.float32), 0)])
    elif name == "media in a system message":
        system = gateway_pb2.ChatMessage(role="system", parts=[image_part(PNG)])
        user.parts.extend([text_part("hello")])
        return gateway_pb2.GenerateRequest(messages=[system, user]), "messages[0].parts[0] (image): only user"
    elif name == "silent video with use_audio_in_video":
        user.parts.extend([gateway_pb2.ContentPart(video=gateway_pb2.VideoPart(file=MP4_SILENT))])
        request = gateway_pb2.GenerateRequest(messages=[user], use_audio_in_video=True)
        return request, expect + " (video): use_audio_in_video needs"
    elif name == "too many video frames":
        frames = [media.encode_image(f, "png") for f in media.video(9, 16, 16)]
        user.parts.extend([frames_part(frames, 2.0)])
        expect += " (video): 9 frames"
    else:
        raise ValueError(name)
    user.parts.extend([text_part("What is it?")])
    return gateway_pb2.GenerateRequest(messages=[user], want_audio=True), expect


BAD = ["garbage audio", "truncated video", "unsupported image", "empty audio", "empty part", "audio too long",
       "over the byte limit", "bad pcm rate", "media in a system message", "silent video with use_audio_in_video",
       "too many video frames"]  # fmt: skip


def test_bad_media_fail_their_request_only(mm_stack: Stack) -> None:

    async def call(request: gateway_pb2.GenerateRequest) -> grpc.aio.AioRpcError | None:
        async with grpc.aio.insecure_channel(mm_stack.gateway_address) as ch:
            try:
                async for _ in gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=60):
                    pass
            except grpc.aio.AioRpcError as e:
                return e
        return None

    async def all_at_once() -> list[Any]:
        good = generate(mm_stack.gateway_address, "What is this sound?", audio=[WAV], thinker_max_tokens=8,
                        talker_max_tokens=8, timeout=120)  # fmt: skip
        return await asyncio.gather(good, *(call(_bad(name)[0]) for name in BAD))

    good, *errors = run(all_at_once())
    assert good.token_ids and good.pcm.size > 0  # a good request beside them is unaffected
    for name, err in zip(BAD, errors, strict=True):
        assert err is not None, f"{name}: accepted"
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {err.code()} {err.details()}"
        assert _bad(name)[1] in err.details(), f"{name}: {err.details()}"
    for stage in ("thinker", "talker", "code2wav"):  # nothing held anywhere
        for address in mm_stack.addresses(stage):
            load = run(info(address)).load
            assert (load.running, load.waiting, load.waiting_for_input, load.open_streams) == (0, 0, 0, 0), stage


def test_inconsistent_model_inputs_are_refused_by_the_thinker(mm_stack: Stack, ref: Any) -> None:
    """A thinker caller whose tensors disagree with the prompt's placeholders gets
    INVALID_ARGUMENT naming the disagreement, before any model work."""
    _, _, builder = ref
    messages, _ = decode_messages(_case("audio+image"), stack_config(media=MEDIA_LIMITS).media, RATE)
    ids, inputs = builder.build(messages)
    broken = [
        ({**inputs, "image_grid_thw": inputs["image_grid_thw"] * 2}, "image_grid_thw covers"),
        ({k: v for k, v in inputs.items() if k != "input_features"}, "come together"),
        ({**inputs, "input_features": inputs["input_features"][:, :5]}, "input_features must be float"),
        ({**inputs, "pixel_values": inputs["pixel_values"].long()}, "pixel_values must be float"),
    ]
    for tensors, expect in broken:
        start = stage_pb2.Start(request_id="broken", want_audio=True)
        chunk = edges.prompt_chunk(ids, tensors)
        pieces = [p.message() for p in encode_chunks(chunk.tensors, length=chunk.length, finished=True)]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            run(stage_call(mm_stack.addresses("thinker")[0], start, pieces, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert expect in e.value.details()


def test_client_command_sends_audio_and_images(mm_stack: Stack, tmp_path: Path) -> None:
    """`omnistage client "question" --audio a.mp3 --image p.png` answers with text and a WAV,
    the same as the Python client sends (audio first, then images, then the text)."""
    import json
    import subprocess
    import sys
    import wave

    (tmp_path / "q.mp3").write_bytes(MP3)
    (tmp_path / "p.png").write_bytes(PNG)
    out = tmp_path / "reply.wav"
    args = [sys.executable, "-m", "omnistage.cli", "client", "Both?", "--target", mm_stack.gateway_address,
            "--audio", str(tmp_path / "q.mp3"), "--image", str(tmp_path / "p.png"), "--max-tokens", str(THINKER_MAX),
            "--max-frames", str(TALKER_MAX), "--out", str(out), "--json"]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    expected = run(generate(mm_stack.gateway_address, "Both?", audio=[MP3], images=[PNG], timeout=120,
                            thinker_max_tokens=THINKER_MAX, talker_max_tokens=TALKER_MAX))  # fmt: skip
    assert summary["token_ids"] == expected.token_ids and summary["text"]
    with wave.open(str(out)) as w:
        assert w.getframerate() == 24000 and w.getnframes() == expected.pcm.shape[0] > 0

    missing = subprocess.run([*args[:7], "--image", str(tmp_path / "nope.png")], capture_output=True, text=True,
                             timeout=60)  # fmt: skip
    assert missing.returncode == 2 and "nope.png" in missing.stderr
