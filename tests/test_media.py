"""The gateway's media decoding: every format it promises, resampling, frame sampling, the
limits, and errors that name the message and part."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import media
from gateway.client import build_request, frames_part, image_part, pcm_part, text_part
from gateway.media import (
    MediaError,
    decode_audio,
    decode_image,
    decode_messages,
    decode_video,
    decode_video_frames,
    pcm_audio,
)
from omnistage.config import MediaConfig
from omnistage.v1 import gateway_pb2

RATE = 16_000
LIMITS = MediaConfig()


def _dominant_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(samples.size)))
    return float(np.argmax(spectrum) * rate / samples.size)


@pytest.mark.parametrize("fmt", list(media.AUDIO_FORMATS))
def test_every_audio_format_decodes_to_the_clip(fmt: str) -> None:
    clip = media.tone(2.0, RATE, 440.0, seed=1)
    out = decode_audio(media.encode_audio(clip, RATE, fmt), RATE, LIMITS)
    assert out.sample_rate == RATE and out.samples.dtype == np.float32
    if fmt in ("wav", "flac"):  # lossless 16-bit
        assert out.samples.shape == clip.shape
        assert np.abs(out.samples - clip).max() < 2 / 32767
    else:  # lossy, with the codec's own delay and padding
        assert abs(out.samples.size - clip.size) < 0.1 * RATE
        assert abs(_dominant_hz(out.samples, RATE) - 440.0) < 5
        rms = float(np.sqrt(np.mean(out.samples**2)))
        assert 0.8 < rms / float(np.sqrt(np.mean(clip**2))) < 1.25


def test_raw_pcm_is_resampled_to_the_feature_rate() -> None:
    rate = 44_100
    t = np.arange(rate) / rate
    clip = (0.5 * np.sin(2 * np.pi * 1000 * t)).astype(np.float32)
    out = pcm_audio(clip.astype("<f4").tobytes(), rate, RATE, LIMITS)
    assert abs(out.samples.size - RATE) <= 32
    assert abs(_dominant_hz(out.samples, RATE) - 1000) < 5
    assert 0.3 < float(np.abs(out.samples).max()) < 0.6


@pytest.mark.parametrize("fmt", media.IMAGE_FORMATS)
def test_every_image_format_decodes(fmt: str) -> None:
    pixels = media.image(30, 50, seed=2)
    out = decode_image(media.encode_image(pixels, fmt), LIMITS).pixels
    assert out.shape == (30, 50, 3) and out.dtype == np.uint8
    diff = np.abs(out.astype(int) - pixels.astype(int))
    assert (diff.max() == 0) if fmt == "png" else (diff.mean() < 12)


def _solid_frames(n: int) -> np.ndarray:
    """n frames, frame k a solid grey of 20 + 25 k (told apart after lossy coding)."""
    return np.stack([np.full((32, 48, 3), 20 + 25 * k, np.uint8) for k in range(n)])


def test_video_frames_are_sampled_at_the_configured_rate() -> None:
    # 8 frames at 4 fps (2 s); sampled at 2 fps: times 0.25, 0.75, 1.25, 1.75 -> frames 1, 3, 5, 7
    data = media.encode_video(_solid_frames(8), 4)
    clip = decode_video(data, LIMITS)
    assert clip.fps == LIMITS.video_fps and clip.audio is None
    greys = [round(float(f.mean())) for f in clip.frames]
    assert len(greys) == 4
    assert all(abs(g - (20 + 25 * k)) < 6 for g, k in zip(greys, (1, 3, 5, 7), strict=True)), greys


def test_a_video_sound_track_comes_with_its_frames() -> None:
    data = media.encode_video(media.video(6, 32, 48), 4, media.tone(1.5, RATE))
    clip = decode_video(data, LIMITS, audio_rate=RATE)
    assert clip.audio is not None and clip.audio.sample_rate == RATE
    assert abs(clip.audio.seconds - 1.5) < 0.1
    assert decode_video(data, LIMITS).audio is None  # not asked for


def test_video_given_as_frames() -> None:
    frames = [media.encode_image(f, "png") for f in _solid_frames(3)]
    clip = decode_video_frames(frames, 1.5, LIMITS)
    assert clip.frames.shape == (3, 32, 48, 3) and clip.fps == 1.5


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: decode_audio(b"", RATE, LIMITS), "empty"),
        (lambda: decode_audio(b"RIFF0000WAVEfmt garbage" * 20, RATE, LIMITS), "cannot decode the audio"),
        (lambda: decode_audio(media.encode_image(media.image(8, 8), "png"), RATE, LIMITS), "audio"),
        (lambda: decode_audio(media.encode_audio(media.tone(3.0), RATE), RATE, MediaConfig(max_audio_seconds=2)),
         "longer than the limit of 2 s"),
        (lambda: decode_audio(b"\0" * 5000, RATE, MediaConfig(max_part_bytes=4096)), "over the limit of 4096"),
        (lambda: pcm_audio(b"\0\0\0", RATE, RATE, LIMITS), "not a whole number of float32 samples"),
        (lambda: pcm_audio(np.array([np.nan], "<f4").tobytes(), RATE, RATE, LIMITS), "NaN"),
        (lambda: pcm_audio(b"\0" * 8, 0, RATE, LIMITS), "sample_rate 0"),
        (lambda: decode_image(b"not an image" * 10, LIMITS), "cannot decode the image"),
        (lambda: decode_image(media.encode_image(media.image(40, 40)), MediaConfig(max_image_pixels=1000)),
         "40x40 pixels, over the limit of 1000"),
        (lambda: decode_video(media.encode_audio(media.tone(1.0), RATE, "mp3"), LIMITS), "no video stream"),
        (lambda: decode_video(media.encode_video(_solid_frames(8), 4)[:600], LIMITS), "video"),  # truncated
        (lambda: decode_video(media.encode_video(_solid_frames(8), 4), MediaConfig(max_video_frames=3)),
         "more than 3 frames"),
        (lambda: decode_video_frames([], 2.0, LIMITS), "no frames"),
        (lambda: decode_video_frames([media.encode_image(media.image(8, 8))], 0.0, LIMITS), "fps 0"),
        (lambda: decode_video_frames([media.encode_image(media.image(8, 8)), media.encode_image(media.image(8, 10))],
                                     2.0, LIMITS), "differ in size"),
    ],
)  # fmt: skip
def test_unusable_media_are_refused_with_the_reason(call: object, message: str) -> None:
    with pytest.raises(MediaError) as e:
        call()  # type: ignore[operator]
    assert message in str(e.value)


def test_messages_name_the_part_that_fails() -> None:
    good = image_part(media.encode_image(media.image(8, 8)))
    bad = gateway_pb2.ContentPart(audio=gateway_pb2.AudioPart(file=b"junk" * 10))
    request = gateway_pb2.GenerateRequest(messages=[
        gateway_pb2.ChatMessage(role="system", content="Be brief."),
        gateway_pb2.ChatMessage(role="user", parts=[good, text_part("and"), bad]),
    ])  # fmt: skip
    with pytest.raises(MediaError, match=r"^messages\[1\]\.parts\[2\] \(audio\): cannot decode"):
        decode_messages(request, LIMITS, RATE)


def test_messages_rules() -> None:
    png = media.encode_image(media.image(8, 8))
    cases = [
        (gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="robot", content="hi")]),
         "messages[0]: unknown role 'robot'"),
        (gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="assistant", parts=[image_part(png)])]),
         "messages[0].parts[0] (image): only user messages"),
        (gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="user",
                                                                       parts=[gateway_pb2.ContentPart()])]),
         "messages[0].parts[0]: empty part"),
        (build_request("hi", images=[png], use_audio_in_video=True), "use_audio_in_video: the request has no video"),
        (gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="user", parts=[frames_part([png], 2.0)])],
                                     use_audio_in_video=True), "(video): use_audio_in_video needs"),
    ]  # fmt: skip
    for request, message in cases:
        with pytest.raises(MediaError) as e:
            decode_messages(request, LIMITS, RATE)
        assert message in str(e.value)


def test_decoded_messages_keep_order_and_text_only_parts_become_text() -> None:
    pcm = media.tone(0.5, 8000)
    request = gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="user", parts=[
        text_part("first "), pcm_part(pcm, 8000), image_part(media.encode_image(media.image(8, 8))), text_part("last"),
    ])])  # fmt: skip
    messages, has_media = decode_messages(request, LIMITS, RATE)
    assert has_media
    assert [p["type"] for p in messages[0]["content"]] == ["text", "audio", "image", "text"]
    assert messages[0]["content"][1]["audio"].size == RATE // 2
    text_only = gateway_pb2.GenerateRequest(messages=[
        gateway_pb2.ChatMessage(role="user", parts=[text_part("a "), text_part("b")]),
    ])  # fmt: skip
    assert decode_messages(text_only, LIMITS, RATE) == ([{"role": "user", "content": "a b"}], False)


def test_media_that_decode_past_the_request_budget_are_refused_before_they_are_converted() -> None:
    """Blank 1-bit PNGs of 4000x4000 are ~2 KB each and 48 MB as RGB: a request of a few of
    them (images and video frames alike) is refused on `max_decoded_bytes` once the next would
    pass it, not after every one is in memory."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (4000, 4000)).save(buf, format="PNG", optimize=True)
    blank = buf.getvalue()
    assert len(blank) < 16_384  # tiny on the wire
    limits = MediaConfig(max_decoded_bytes=100 << 20)  # two of them fit, the third does not
    request = build_request("what is this", images=[blank, blank])
    messages, _ = decode_messages(request, limits, RATE)
    assert [p["image"].shape for p in messages[0]["content"] if p["type"] == "image"] == [(4000, 4000, 3)] * 2
    with pytest.raises(MediaError, match=r"^messages\[0\]\.parts\[\d\] \(image\): .*more than 104857600 bytes "
                                         r"\(media.max_decoded_bytes\)"):  # fmt: skip
        decode_messages(build_request("what is this", images=[blank] * 3), limits, RATE)
    frames = gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="user", parts=[
        frames_part([blank] * 3, 2.0)])])  # fmt: skip
    with pytest.raises(MediaError, match=r"\(video\): frame 2: .*media.max_decoded_bytes"):
        decode_messages(frames, limits, RATE)


def test_a_cancelled_request_stops_decoding_at_its_next_frame() -> None:
    """Decoding runs in a worker thread a client's hang-up cannot stop: the gateway sets the
    request's event, and the next image or frame is not converted."""
    import threading

    frames = [media.encode_image(f, "png") for f in media.video(6, 32, 32, seed=8)]
    request = gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="user", parts=[
        frames_part(frames, 2.0)])])  # fmt: skip
    cancelled = threading.Event()
    messages, _ = decode_messages(request, LIMITS, RATE, cancelled)
    assert messages[0]["content"][0]["video"].shape[0] == 6  # not set: every frame
    cancelled.set()
    with pytest.raises(MediaError, match=r"\(video\): frame 0: the request was cancelled while its media decoded"):
        decode_messages(request, LIMITS, RATE, cancelled)
