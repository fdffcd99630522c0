"""Media in client requests, decoded with well-kept libraries: PyAV (FFmpeg) for audio files,
video files and resampling, Pillow for images. Everything a request can carry is bounded before
decoding (bytes) and after (seconds, frames, pixels) by the deploy file's `media` limits, and
every failure names the message and the part: `messages[1].parts[0] (audio): cannot decode ...`.

`decode_messages` turns a request's chat messages into the family input builder's form (see
`omnistage/models/qwen3_omni/processor.py`): text as is, media as arrays.
"""

from __future__ import annotations

import functools
import io
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.media_cache import DecodedCache
from omnistage.config import MediaConfig as Limits
from omnistage.quoting import quoted
from omnistage.v1 import gateway_pb2

__all__ = ["AudioClip", "Budget", "ImageInput", "Limits", "MediaError", "VideoClip", "decode_audio", "decode_image",
           "decode_messages", "decode_video", "decode_video_frames", "pcm_audio"]  # fmt: skip

ROLES = ("system", "user", "assistant", "tool")  # ("tool": a tool call's result)


class MediaError(ValueError):
    """A media part that cannot be used; the message says which one and why."""


@dataclass
class AudioClip:
    samples: np.ndarray  # float32 mono at `sample_rate`
    sample_rate: int

    @property
    def seconds(self) -> float:
        return self.samples.shape[0] / self.sample_rate


@dataclass
class ImageInput:
    pixels: np.ndarray  # uint8 [H, W, 3]


@dataclass
class VideoClip:
    frames: np.ndarray  # uint8 [T, H, W, 3], sampled at `fps`
    fps: float
    audio: AudioClip | None = None  # its sound track, when asked for and present
    notes: list[str] = field(default_factory=list)


class Budget:
    """What one request's media may decode to, over all its parts: pixels at 3 bytes (RGB),
    audio at 4 bytes a sample. Checked before each image or frame is converted, so a few KB
    of highly compressed images cannot claim gigabytes (the per-image pixel limit alone lets
    128 tiny blank frames decode to 24 GB)."""

    def __init__(self, limit: int, cancelled: threading.Event | None = None) -> None:
        self.limit = limit
        self.used = 0
        self.cancelled = cancelled  # set when the request is gone: decoding stops at the next piece

    def take(self, nbytes: int) -> None:
        if self.cancelled is not None and self.cancelled.is_set():
            raise MediaError("the request was cancelled while its media decoded")
        if self.used + nbytes > self.limit:
            raise MediaError(f"the request's media decode to more than {self.limit} bytes "
                             f"(media.max_decoded_bytes)")  # fmt: skip
        self.used += nbytes


_REPR = re.compile(r" ?<[\w.]+ object at 0x[0-9a-f]+>")  # "<_io.BytesIO object at 0x7f...>"


def _why(e: Exception) -> str:
    """A decoder's exception for a client to read: its kind and message, without the reprs of
    this process's objects that some put in it (Pillow names the BytesIO it was given)."""
    return f"{type(e).__name__}: {_REPR.sub('', str(e))}"


def _check_size(data: bytes, limits: Limits) -> None:
    if not data:
        raise MediaError("empty")
    if len(data) > limits.max_part_bytes:
        raise MediaError(f"{len(data)} bytes, over the limit of {limits.max_part_bytes}")


def _open(data: bytes) -> Any:
    """FFmpeg's demuxer over uploaded bytes, with no protocol it may open: a playlist or concat
    file (ffconcat, HLS, SDP) would otherwise have it read this server's files or bind sockets."""
    import av

    return av.open(io.BytesIO(data), mode="r", container_options={"protocol_whitelist": "none"})


def _resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Mono float32 `samples` at `rate` -> `target` Hz, with FFmpeg's resampler (swresample)."""
    import av

    if rate == target:
        return samples.astype(np.float32, copy=False)
    resampler = av.AudioResampler(format="flt", layout="mono", rate=target)
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples, dtype=np.float32)[None], format="flt",
                                       layout="mono")  # fmt: skip
    frame.sample_rate = rate
    out = [f.to_ndarray() for f in resampler.resample(frame)] + [f.to_ndarray() for f in resampler.resample(None)]
    return np.concatenate(out, axis=1)[0] if out else np.zeros(0, np.float32)


def _decode_stream_audio(container: object, target_rate: int, max_seconds: float) -> np.ndarray:
    """The first audio stream as mono float32 at `target_rate`: resampled with its channels
    kept, then their mean (as librosa's and transformers' loaders mix down; FFmpeg's own mono
    mix of float audio does not normalize, so stereo came out 3 dB louder and 6 channels 3.4x)."""
    import av

    parts: list[np.ndarray] = []
    total = 0
    limit = int(max_seconds * target_rate)

    def take(frames: list[Any]) -> None:
        nonlocal total
        for out in frames:
            arr = out.to_ndarray()  # [channels, samples], planar
            mono = arr[0] if arr.shape[0] == 1 else arr.mean(axis=0, dtype=np.float32)
            total += mono.shape[0]
            if total > limit:
                raise MediaError(f"longer than the limit of {max_seconds:g} s of audio")
            parts.append(mono)

    resampler, setup = None, None
    for frame in container.decode(audio=0):  # type: ignore[attr-defined]
        now = (frame.format.name, frame.layout.name, frame.sample_rate)
        if now != setup:  # a valid stream may change its layout or rate midway (ADTS AAC, mp3)
            if resampler is not None:
                take(resampler.resample(None))
            resampler, setup = av.AudioResampler(format="fltp", layout=frame.layout, rate=target_rate), now
        take(resampler.resample(frame))
    if resampler is not None:
        take(resampler.resample(None))
    samples = np.concatenate(parts).astype(np.float32, copy=False) if parts else np.zeros(0, np.float32)
    if not np.isfinite(samples).all():
        raise MediaError("the audio holds NaN or infinite samples")
    return samples


def decode_audio(data: bytes, target_rate: int, limits: Limits) -> AudioClip:
    """An encoded audio file (wav, flac, mp3, ogg/opus, ... anything FFmpeg reads) -> mono
    float32 at `target_rate`."""
    import av

    _check_size(data, limits)
    try:
        with _open(data) as container:
            if not container.streams.audio:
                raise MediaError("no audio stream in the file")
            samples = _decode_stream_audio(container, target_rate, limits.max_audio_seconds)
    except MediaError:
        raise
    except (av.FFmpegError, ValueError, OSError) as e:
        raise MediaError(f"cannot decode the audio ({_why(e)})") from None
    if samples.shape[0] == 0:
        raise MediaError("the audio has no samples")
    return AudioClip(samples, target_rate)


def pcm_audio(f32le: bytes, sample_rate: int, target_rate: int, limits: Limits) -> AudioClip:
    """Raw mono float32 little-endian samples at `sample_rate` -> `target_rate`."""
    _check_size(f32le, limits)
    if len(f32le) % 4:
        raise MediaError(f"{len(f32le)} bytes is not a whole number of float32 samples")
    if not 1000 <= sample_rate <= 384_000:
        raise MediaError(f"sample_rate {sample_rate} is not a usable rate (1000..384000 Hz)")
    samples = np.frombuffer(f32le, dtype="<f4")
    if not np.isfinite(samples).all():
        raise MediaError("the samples hold NaN or infinity")
    if samples.shape[0] / sample_rate > limits.max_audio_seconds:
        raise MediaError(f"longer than the limit of {limits.max_audio_seconds:g} s of audio")
    resampled = _resample(samples, sample_rate, target_rate)
    if resampled.shape[0] == 0:
        raise MediaError(f"{samples.shape[0]} sample(s) at {sample_rate} Hz is less than one at {target_rate} Hz")
    return AudioClip(resampled, target_rate)


# What Pillow may open: the formats images are sent in. Its other decoders (ICNS, BLP, ... 40 in
# all) are more attack surface than use, and some fail with exceptions of their own kinds.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "AVIF")  # JPEG's opens MPO too


@functools.cache
def _image_formats() -> tuple[str, ...]:
    """`IMAGE_FORMATS` this Pillow has (one built without AVIF has none): looked up once."""
    from PIL import Image

    Image.init()
    return tuple(f for f in IMAGE_FORMATS if f in Image.OPEN)


def decode_image(data: bytes, limits: Limits, budget: Budget | None = None) -> ImageInput:
    """An encoded image (png, jpeg, webp, gif, bmp, tiff, avif) -> RGB uint8: turned as its EXIF
    orientation says (as transformers' `load_image`), transparency on white (as the Qwen image
    processors' `convert_to_rgb`, and vLLM)."""
    from PIL import Image, ImageOps
    from transformers.image_transforms import convert_to_rgb

    _check_size(data, limits)
    budget = budget or Budget(limits.max_decoded_bytes)
    try:
        with Image.open(io.BytesIO(data), formats=_image_formats()) as img:
            if img.width * img.height > limits.max_image_pixels:
                raise MediaError(f"{img.width}x{img.height} pixels, over the limit of {limits.max_image_pixels}")
            budget.take(img.width * img.height * 3)
            img.load()
            ImageOps.exif_transpose(img, in_place=True)  # (a copy of a large image is memory the budget misses)
            pixels = np.asarray(convert_to_rgb(img, return_numpy=True))
    except MediaError:
        raise
    except Exception as e:  # a decoder's failure, whatever its kind (SyntaxError, NotImplementedError, ...)
        raise MediaError(f"cannot decode the image ({_why(e)})") from None
    return ImageInput(pixels)


def decode_video(data: bytes, limits: Limits, audio_rate: int | None = None, budget: Budget | None = None
                 ) -> VideoClip:  # fmt: skip
    """A video file (mp4, webm, mkv, ... anything FFmpeg reads) -> frames sampled at
    `limits.video_fps` (the frame shown at (k + 0.5) / fps for k = 0, 1, ...; times from the
    first frame's; a video longer than `max_video_frames` at that rate is sampled at
    `max_video_frames` over its length), upright as its display matrix says and all of the first frame's size, and,
    with `audio_rate`, its sound track as mono float32 at that rate (None when the video is
    silent). Frames are sampled while decoding, so memory holds only the kept ones."""
    import av

    _check_size(data, limits)
    budget = budget or Budget(limits.max_decoded_bytes)
    fps = limits.video_fps
    picks: list[np.ndarray] = []
    size: tuple[int, int] | None = None  # (width, height) every kept frame is scaled to: the first's

    spread = False  # frames spread over the length its headers give (a long video): a frame past them is left out

    def keep(frame: Any) -> None:
        nonlocal size
        if len(picks) >= limits.max_video_frames:
            if spread:  # (it ran a little past its headers' length)
                return
            raise MediaError(f"more than {limits.max_video_frames} frames at {fps:g} per second (the limit of "
                             f"{limits.max_video_frames / fps:g} s of video; its headers give no length to spread "
                             "them over)")  # fmt: skip
        size = size or (frame.width, frame.height)
        budget.take(size[0] * size[1] * 3)
        # a stream may change its size midway (joined segments): the model takes one size
        pixels = frame.to_ndarray(format="rgb24", width=size[0], height=size[1])
        turns = round(getattr(frame, "rotation", 0) / 90) % 4  # counterclockwise, as FFmpeg's display matrix
        picks.append(np.ascontiguousarray(np.rot90(pixels, turns)) if turns else pixels)

    try:
        with _open(data) as container:
            if not container.streams.video:
                raise MediaError("no video stream in the file")
            stream = container.streams.video[0]
            if stream.codec_context is None:  # PyAV: FFmpeg has no decoder for it
                raise MediaError("no decoder for the video's codec")
            # what the headers say, before anything is decoded
            width, height = stream.codec_context.width, stream.codec_context.height
            if width * height > limits.max_image_pixels:
                raise MediaError(f"frames of {width}x{height}, over {limits.max_image_pixels} pixels")
            # the video stream's own length (the container's is its longest stream's, a sound track's)
            seconds = (float(stream.duration * stream.time_base) if stream.duration and stream.time_base else
                       container.duration / 1e6 if container.duration else 0.0)  # fmt: skip
            if seconds > limits.max_video_seconds:
                raise MediaError(f"{seconds:g} s long, over the limit of {limits.max_video_seconds:g} s of video")
            if seconds * fps > limits.max_video_frames:  # a long video: fewer frames a second, as Qwen's own
                fps = limits.max_video_frames / seconds  # video readers take it (max_video_frames over its length)
                spread = True
            rate = float(stream.average_rate or 25)
            prev, prev_t, t, step, start = None, 0.0, 0.0, 1.0 / rate, None
            for n, frame in enumerate(container.decode(video=0)):
                t = float(frame.time) if frame.time is not None else n / rate
                start = t if start is None else start
                t -= start  # a stream may start late (MPEG-TS at 0.2 s, a cut clip at 50 s)
                if t > limits.max_video_seconds:
                    raise MediaError(f"longer than the limit of {limits.max_video_seconds:g} s of video")
                if frame.width * frame.height > limits.max_image_pixels:
                    raise MediaError(f"frames of {frame.width}x{frame.height}, over {limits.max_image_pixels} pixels")
                if prev is not None:
                    step = max(t - prev_t, 1e-6)
                while (len(picks) + 0.5) / fps < t:  # sample times this frame passes: the previous one showed
                    keep(prev if prev is not None else frame)
                prev, prev_t = frame, t
            if prev is None:
                raise MediaError("the video has no frames")
            end = t + step  # the last frame shows until here
            while (len(picks) + 0.5) / fps < end or not picks:
                keep(prev)
        audio = None
        if audio_rate is not None:
            with _open(data) as container:
                if container.streams.audio:
                    samples = _decode_stream_audio(container, audio_rate, limits.max_audio_seconds)
                    budget.take(samples.nbytes)
                    audio = AudioClip(samples, audio_rate) if samples.shape[0] else None
    except MediaError:
        raise
    except (av.FFmpegError, ValueError, OSError) as e:
        raise MediaError(f"cannot decode the video ({_why(e)})") from None
    return VideoClip(np.stack(picks), fps, audio)


def decode_video_frames(images: list[bytes], fps: float, limits: Limits, budget: Budget | None = None
                        ) -> VideoClip:  # fmt: skip
    """A video given as its frames (each an encoded image) at `fps` frames per second."""
    if not images:
        raise MediaError("no frames")
    if sum(len(d) for d in images) > limits.max_part_bytes:
        raise MediaError(f"{sum(len(d) for d in images)} bytes of frames, over the limit of {limits.max_part_bytes}")
    if not 0 < fps <= 240:
        raise MediaError(f"fps {fps} is not a usable frame rate (0..240)")
    if len(images) > limits.max_video_frames:
        raise MediaError(f"{len(images)} frames, over the limit of {limits.max_video_frames}")
    if len(images) / fps > limits.max_video_seconds:
        raise MediaError(f"{len(images)} frames at {fps:g} per second are {len(images) / fps:g} s, over the limit "
                         f"of {limits.max_video_seconds:g} s of video")  # fmt: skip
    budget = budget or Budget(limits.max_decoded_bytes)
    frames = []
    for k, data in enumerate(images):
        try:
            frames.append(decode_image(data, limits, budget).pixels)
        except MediaError as e:
            raise MediaError(f"frame {k}: {e}") from None
    if len({f.shape for f in frames}) > 1:
        raise MediaError("the frames differ in size")
    return VideoClip(np.stack(frames), fps)


def _decode_part(part: gateway_pb2.ContentPart, limits: Limits, audio_rate: int, with_sound: bool, budget: Budget
                 ) -> dict[str, Any]:  # fmt: skip
    kind = part.WhichOneof("kind")
    if kind == "text":
        return {"type": "text", "text": part.text}
    if kind == "audio":
        if part.audio.WhichOneof("source") == "pcm":
            clip = pcm_audio(part.audio.pcm.f32le, part.audio.pcm.sample_rate, audio_rate, limits)
        elif part.audio.WhichOneof("source") == "file":
            clip = decode_audio(part.audio.file, audio_rate, limits)
        else:
            raise MediaError("empty: neither file nor pcm is set")
        budget.take(clip.samples.nbytes)
        return {"type": "audio", "audio": clip.samples}
    if kind == "image":
        return {"type": "image", "image": decode_image(part.image.file, limits, budget).pixels}
    if kind == "video":
        source = part.video.WhichOneof("source")
        if source == "file":
            video = decode_video(part.video.file, limits, audio_rate if with_sound else None, budget)
        elif source == "frames":
            video = decode_video_frames(list(part.video.frames.images), part.video.frames.fps, limits, budget)
        else:
            raise MediaError("empty: neither file nor frames is set")
        if with_sound and video.audio is None:
            raise MediaError("use_audio_in_video needs each video to be a file with a sound track; this one has none")
        return {"type": "video", "video": video.frames, "fps": video.fps,
                "audio": None if video.audio is None else video.audio.samples}  # fmt: skip
    raise MediaError("empty part: set one of text, audio, image or video")


def _decode_or_reuse(part: gateway_pb2.ContentPart, limits: Limits, audio_rate: int, with_sound: bool,
                     budget: Budget, cache: DecodedCache | None) -> dict[str, Any]:  # fmt: skip
    """`_decode_part`, or what it gave for the same part before (charged to the budget alike)."""
    if cache is None or part.WhichOneof("kind") in (None, "text"):
        return _decode_part(part, limits, audio_rate, with_sound, budget)
    # (a sound track is asked of videos only: an audio or image part's entry serves both; a video's
    # decode with it differs, or is refused: frames have none)
    sound = with_sound and part.WhichOneof("kind") == "video"
    key = cache.key(part.SerializeToString(deterministic=True), audio_rate, sound, limits)
    found = cache.get(key)
    if found is not None:
        entry, nbytes = found
        budget.take(nbytes)
        return entry
    entry = _decode_part(part, limits, audio_rate, with_sound, budget)
    cache.put(key, entry)
    return entry


def _tool_fields(m: gateway_pb2.ChatMessage) -> dict[str, Any]:
    """A message's tool calls (an assistant's) and the call it answers (a tool's), in the shape
    chat templates read them (OpenAI's: `tool_calls[].function.{name, arguments}`)."""
    out: dict[str, Any] = {}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]  # fmt: skip
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def decode_messages(request: gateway_pb2.GenerateRequest, limits: Limits, audio_rate: int,
                    cancelled: threading.Event | None = None, cache: DecodedCache | None = None
                    ) -> tuple[list[dict[str, Any]], bool]:  # fmt: skip
    """The request's chat messages with their media decoded, and whether any part is media.
    Raises MediaError naming the message and part (also once `cancelled` is set: it runs in a
    worker thread, which a client's hang-up cannot stop otherwise). `cache`: decoded parts kept
    across requests (media_cache.py)."""
    messages: list[dict[str, Any]] = []
    media = 0
    videos = 0
    budget = Budget(limits.max_decoded_bytes, cancelled)
    for i, m in enumerate(request.messages):
        if m.role not in ROLES:
            raise MediaError(f"messages[{i}]: unknown role {quoted(m.role)}; expected one of {', '.join(ROLES)}")
        if m.tool_calls and m.role != "assistant":
            raise MediaError(f"messages[{i}].tool_calls: only assistant messages make tool calls")
        extra = _tool_fields(m)
        if not m.parts:
            messages.append({"role": m.role, "content": m.content, **extra})
            continue
        parts = []
        for j, part in enumerate(m.parts):
            kind = part.WhichOneof("kind")
            where = f"messages[{i}].parts[{j}]" + (f" ({kind})" if kind else "")
            if kind not in (None, "text") and m.role != "user":
                raise MediaError(f"{where}: only user messages take audio, images and video")
            try:
                parts.append(_decode_or_reuse(part, limits, audio_rate, request.use_audio_in_video, budget, cache))
            except MediaError as e:
                raise MediaError(f"{where}: {e}") from None
            media += kind not in (None, "text")
            videos += kind == "video"
        messages.append({"role": m.role, "content": parts, **extra})
    if request.use_audio_in_video and not videos:
        raise MediaError("use_audio_in_video: the request has no video")
    if not media:  # text parts only: plain text content
        for m in messages:
            if not isinstance(m["content"], str):
                m["content"] = "".join(p["text"] for p in m["content"])
    return messages, bool(media)
