"""Deterministic media for benchmarks and tests, made on the spot (nothing large is checked in):
tones, noise images and videos, encoded with the same libraries the gateway decodes with
(PyAV/FFmpeg for audio and video, Pillow for images)."""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np

__all__ = ["AUDIO_FORMATS", "IMAGE_FORMATS", "encode_audio", "encode_image", "encode_video", "image", "tone", "video"]

# container and codec per audio format the gateway is expected to read
AUDIO_FORMATS = {"wav": ("wav", "pcm_s16le"), "flac": ("flac", "flac"), "mp3": ("mp3", "libmp3lame"),
                 "opus": ("ogg", "libopus")}  # fmt: skip
IMAGE_FORMATS = ("png", "jpeg", "webp")


def tone(seconds: float, rate: int = 16_000, freq: float = 440.0, seed: int = 0) -> np.ndarray:
    """A chord with a little noise, mono float32 in [-1, 1]: something an audio tower can tell apart."""
    t = np.arange(round(seconds * rate)) / rate
    rng = np.random.default_rng(seed)
    wave = 0.25 * np.sin(2 * np.pi * freq * t) + 0.1 * np.sin(2 * np.pi * 1.5 * freq * t)
    wave *= 0.6 + 0.4 * np.sin(2 * np.pi * 0.5 * t)  # a slow swell, so frames differ
    return (wave + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


def encode_audio(samples: np.ndarray, rate: int, fmt: str = "wav") -> bytes:
    """Mono float32 samples -> an encoded file (`AUDIO_FORMATS`)."""
    import av

    container_format, codec = AUDIO_FORMATS[fmt]
    out_rate = 48_000 if codec == "libopus" else rate  # Opus runs at 48 kHz
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container_format) as container:
        stream = container.add_stream(codec, rate=out_rate, layout="mono")
        _write_audio(container, stream, samples, rate)
    return buf.getvalue()


def _write_audio(container: object, stream: object, samples: np.ndarray, rate: int) -> None:
    import av

    resampler = av.AudioResampler(format=stream.format.name, layout="mono", rate=stream.rate)  # type: ignore[attr-defined]
    frame_size = 1024
    for start in range(0, samples.shape[0], frame_size):
        piece = np.ascontiguousarray(samples[start : start + frame_size], dtype=np.float32)[None]
        frame = av.AudioFrame.from_ndarray(piece, format="flt", layout="mono")
        frame.sample_rate = rate
        frame.pts = start
        frame.time_base = Fraction(1, rate)
        for f in resampler.resample(frame):
            container.mux(stream.encode(f))  # type: ignore[attr-defined]
    for f in resampler.resample(None):
        container.mux(stream.encode(f))  # type: ignore[attr-defined]
    container.mux(stream.encode(None))  # type: ignore[attr-defined]


def image(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A smooth gradient with noise, uint8 [H, W, 3]."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], axis=-1)
    return np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)


def encode_image(pixels: np.ndarray, fmt: str = "png") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt.upper(), **({"quality": 95} if fmt in ("jpeg", "webp") else {}))
    return buf.getvalue()


def video(frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """`frames` images moving across, uint8 [T, H, W, 3]."""
    base = image(height, width * 2, seed)
    shift = max(1, width // max(frames, 1))
    return np.stack([base[:, i * shift : i * shift + width] for i in range(frames)])


def encode_video(frames: np.ndarray, fps: int, sound: np.ndarray | None = None, sound_rate: int = 16_000,
                 container_format: str = "mp4", first_pts: int = 0) -> bytes:  # fmt: skip
    """uint8 frames [T, H, W, 3] (even H and W) at `fps` -> an MP4 (or `container_format`:
    matroska, mpegts, ...) of MPEG-4 part 2 video, its first frame at `first_pts` / fps seconds,
    with `sound` (mono float32 at `sound_rate`) as an AAC track."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container_format) as container:
        vstream = container.add_stream("mpeg4", rate=fps)
        vstream.width, vstream.height = int(frames.shape[2]), int(frames.shape[1])
        vstream.pix_fmt = "yuv420p"
        vstream.bit_rate = 2_000_000
        astream = container.add_stream("aac", rate=sound_rate, layout="mono") if sound is not None else None
        for i, f in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")
            frame.pts = first_pts + i
            for packet in vstream.encode(frame):
                container.mux(packet)
        for packet in vstream.encode(None):
            container.mux(packet)
        if astream is not None and sound is not None:
            _write_audio(container, astream, sound, sound_rate)
    return buf.getvalue()
