"""The gateway's media decoding: every format it promises, resampling, frame sampling, the
limits, and errors that name the message and part."""

from __future__ import annotations

from pathlib import Path

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


def test_a_video_longer_than_its_frames_allow_is_sampled_more_sparsely() -> None:
    """A video longer than max_video_frames at video_fps gets max_video_frames frames spread over
    its length (as Qwen's own video readers sample it; it was refused), at the rate that says."""
    # 8 frames at 4 fps (2 s), at most 2 frames: 1 fps, times 0.5 and 1.5 -> frames 2 and 6
    clip = decode_video(media.encode_video(_solid_frames(8), 4), MediaConfig(max_video_frames=2))
    greys = [round(float(f.mean())) for f in clip.frames]
    assert clip.fps == 1.0 and len(greys) == 2
    assert all(abs(g - (20 + 25 * k)) < 6 for g, k in zip(greys, (2, 6), strict=True)), greys


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
        (lambda: decode_video(media.encode_video(_solid_frames(8), 4, container_format="m4v"),  # no length
                              MediaConfig(max_video_frames=3)), "more than 3 frames"),
        (lambda: decode_video_frames([media.encode_image(media.image(8, 8))] * 2, 0.001, LIMITS),
         "2 frames at 0.001 per second are 2000 s, over the limit of 600 s"),
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


# ---- real-world files: what phones, editors and other tools upload ---------------------------


def _wav(samples: np.ndarray, rate: int, codec: str = "pcm_s16le", fmt: str = "wav", **options: str) -> bytes:
    """Float samples [channels, n] -> a file of `codec` in `fmt` (WAV), as many channels as rows."""
    import io
    from fractions import Fraction

    import av

    layout = {1: "mono", 2: "stereo", 6: "5.1"}[samples.shape[0]]
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt, options=options) as container:
        stream = container.add_stream(codec, rate=rate, layout=layout)
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples, np.float32), format="fltp", layout=layout)
        frame.sample_rate, frame.pts, frame.time_base = rate, 0, Fraction(1, rate)
        resampler = av.AudioResampler(format=stream.format.name, layout=layout, rate=rate,
                                      frame_size=stream.codec_context.frame_size or None)  # fmt: skip
        for f in [*resampler.resample(frame), *resampler.resample(None)]:
            container.mux(stream.encode(f))
        container.mux(stream.encode(None))
    return buf.getvalue()


def test_channels_are_mixed_down_by_their_mean() -> None:
    """As librosa's and transformers' loaders do (FFmpeg's own mono mix of float audio made stereo
    3 dB louder and 5.1 3.4 times): equal channels keep their level, a silent one halves it."""
    sine = 0.5 * np.sin(2 * np.pi * 440 * np.arange(RATE) / RATE).astype(np.float32)
    for channels, expected in (([sine, sine], 0.5), ([sine, np.zeros_like(sine)], 0.25), ([sine] * 6, 0.5)):
        out = decode_audio(_wav(np.stack(channels), RATE), RATE, LIMITS).samples
        assert out.shape == sine.shape and abs(float(np.abs(out).max()) - expected) < 0.01, (len(channels), expected)


def test_a_stream_that_changes_its_layout_or_rate_midway_decodes_whole() -> None:
    """ADTS AAC going mono to stereo, MP3 going 44.1 to 22.05 kHz: valid streams (each was refused,
    "Frame does not match AudioResampler setup"); the resampler follows them."""
    def tone(rate: int, channels: int) -> np.ndarray:
        return np.stack([media.tone(1.0, rate)] * channels)

    joined = {
        "aac": _wav(tone(RATE, 1), RATE, "aac", "adts") + _wav(tone(RATE, 2), RATE, "aac", "adts"),
        "mp3": b"".join(_wav(tone(rate, 1), rate, "libmp3lame", "mp3", id3v2_version="0", write_xing="0")
                        for rate in (44_100, 22_050)),
    }  # fmt: skip
    for name, data in joined.items():
        out = decode_audio(data, RATE, LIMITS)
        assert abs(out.seconds - 2.0) < 0.25, (name, out.seconds)


def test_playlists_and_concat_files_open_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FFmpeg guesses the format from the bytes: an uploaded ffconcat file named files of the
    server's disk (relative to its working directory), which came back decoded (an SDP file bound
    UDP ports). No protocol is open to the demuxer now; a plain file still decodes."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local.wav").write_bytes(media.encode_audio(media.tone(0.5), RATE))
    (tmp_path / "local.png").write_bytes(media.encode_image(media.image(16, 16)))
    assert decode_audio((tmp_path / "local.wav").read_bytes(), RATE, LIMITS).samples.size > 0
    with pytest.raises(MediaError, match="cannot decode the audio"):
        decode_audio(b"ffconcat version 1.0\nfile local.wav\n", RATE, LIMITS)
    with pytest.raises(MediaError, match="cannot decode the video"):
        decode_video(b"ffconcat version 1.0\nfile local.png\n", LIMITS)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: _wav(np.array([[0.1, np.nan, 0.2] * 100], np.float32), RATE, "pcm_f32le"), "NaN or infinite"),
    (lambda: pcm_audio(np.zeros(1, "<f4").tobytes(), 48_000, RATE, LIMITS), "less than one at"),
])  # fmt: skip
def test_audio_without_usable_samples_is_refused(make: object, message: str) -> None:
    with pytest.raises(MediaError, match=message):
        data = make()  # type: ignore[operator]
        decode_audio(data, RATE, LIMITS)


def test_images_come_upright_and_opaque_as_transformers_loads_them() -> None:
    """EXIF orientation 6 (a phone held upright) turns the stored pixels; transparency lies on
    white (transformers' `convert_to_rgb`), not on black."""
    import io

    from PIL import Image

    stored = np.zeros((32, 64, 3), np.uint8)
    stored[:, :32] = (255, 0, 0)  # left half red
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to show
    buf = io.BytesIO()
    Image.fromarray(stored).save(buf, "JPEG", exif=exif.tobytes(), quality=95)
    upright = decode_image(buf.getvalue(), LIMITS).pixels
    assert upright.shape == (64, 32, 3)
    assert upright[:32, :, 0].mean() > 200 and upright[32:, :, 0].mean() < 50  # the left half is now on top
    rgba = np.zeros((8, 8, 4), np.uint8)  # transparent black, with an opaque black dot
    rgba[4, 4, 3] = 255
    out = decode_image(media.encode_image(rgba, "png"), LIMITS).pixels
    assert (out[0, 0] == 255).all() and (out[4, 4] == 0).all()


@pytest.mark.parametrize("fmt", ["ICNS", "BLP", "TGA"])
def test_only_the_image_formats_clients_send_are_opened(fmt: str) -> None:
    """Pillow's other decoders are attack surface, and some fail with exceptions of their own kinds
    (a broken ICNS raised SyntaxError, a BLP NotImplementedError: each was a 500)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB" if fmt != "BLP" else "P", (16, 16)).save(buf, fmt)
    with pytest.raises(MediaError, match="cannot decode the image"):
        decode_image(buf.getvalue(), LIMITS)


def _rotated_mp4(data: bytes) -> bytes:
    """An MP4 whose track matrix says: turn 90 degrees clockwise to show (a phone's portrait video)."""
    import struct

    i = data.find(b"tkhd")
    version = data[i + 4]
    at = i + 8 + (8 + 8 + 4 + 4 + 8 if version == 1 else 4 + 4 + 4 + 4 + 4) + 8 + 2 + 2 + 2 + 2
    matrix = struct.pack(">9i", 0, 0x10000, 0, -0x10000, 0, 0, 0, 0, 0x40000000)
    return data[:at] + matrix + data[at + 36 :]


def test_video_frames_come_upright_and_timed_from_their_first() -> None:
    frames = np.zeros((4, 48, 64, 3), np.uint8)
    frames[:, :, :32] = (255, 0, 0)  # left half red
    clip = decode_video(_rotated_mp4(media.encode_video(frames, 2)), LIMITS)
    assert clip.frames.shape == (4, 64, 48, 3)
    assert clip.frames[:, :32, :, 0].mean() > 200 and clip.frames[:, 32:, :, 0].mean() < 50  # the left half on top


def test_a_clip_that_starts_late_is_sampled_from_its_start() -> None:
    """A cut clip's first frame at 50 s: sampling starts there (it gave 100 copies of frame 0,
    and past 600 s the clip was refused as too long)."""
    data = media.encode_video(_solid_frames(8), 4, first_pts=200)  # 8 frames at 4 fps from 50 s
    greys = [round(float(f.mean())) for f in decode_video(data, LIMITS).frames]
    assert len(greys) == 4 and all(abs(g - (20 + 25 * k)) < 6 for g, k in zip(greys, (1, 3, 5, 7), strict=True))


def test_a_stream_that_changes_its_frame_size_midway_keeps_the_first() -> None:
    """Two MPEG-TS segments joined (64x48, then 96x64): every frame at the first size (was a bare
    ValueError from stacking frames of two sizes)."""
    a = media.encode_video(np.full((4, 48, 64, 3), 60, np.uint8), 2, container_format="mpegts")
    b = media.encode_video(np.full((4, 64, 96, 3), 200, np.uint8), 2, container_format="mpegts",
                           first_pts=4)  # its times go on  # fmt: skip
    clip = decode_video(a + b, LIMITS)
    assert clip.frames.shape[1:] == (48, 64, 3) and clip.frames.shape[0] >= 6
    assert clip.frames[0].mean() < 100 and clip.frames[-1].mean() > 150


def test_video_limits_are_read_from_the_headers_first() -> None:
    long = media.encode_video(media.video(12, 32, 48), 4)  # 3 s
    with pytest.raises(MediaError, match=r"3 s long, over the limit of 2 s"):
        decode_video(long, MediaConfig(max_video_seconds=2))
    with pytest.raises(MediaError, match=r"frames of 48x32, over 1000 pixels"):
        decode_video(long, MediaConfig(max_image_pixels=1000))


def test_a_video_codec_ffmpeg_cannot_decode_is_refused_saying_so() -> None:
    """PyAV gives such a stream no codec context (reading its size was an AttributeError: a 500)."""
    data = media.encode_video(_solid_frames(2)[:, :32, :32], 2, container_format="matroska")
    assert decode_video(data, LIMITS).frames.shape[1:] == (32, 32, 3)
    at = data.find(b"V_MPEG4")
    with pytest.raises(MediaError, match="no decoder for the video's codec"):
        decode_video(data[:at] + b"V_QQQQQ" + data[at + 7 :], LIMITS)


def test_the_length_limit_is_the_video_streams_not_its_sound_tracks() -> None:
    """The container's duration is its longest stream's: a 2 s video with 4 s of sound is 2 s."""
    data = media.encode_video(media.video(4, 32, 48), 2, media.tone(4.0, RATE))
    assert decode_video(data, MediaConfig(max_video_seconds=3)).frames.shape[0] == 4


def test_avif_images_decode() -> None:
    from PIL import Image

    Image.init()
    if "AVIF" not in Image.OPEN:
        pytest.skip("this Pillow was built without AVIF")
    pixels = media.image(16, 24, seed=3)
    out = decode_image(media.encode_image(pixels, "avif"), LIMITS).pixels
    assert out.shape == (16, 24, 3) and np.abs(out.astype(int) - pixels.astype(int)).mean() < 20
