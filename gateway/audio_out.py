"""The reply's audio in the format a client asked for (`AudioFormat` in gateway.proto).

PCM streams as it comes; MP3, Opus (in Ogg) and AAC (in ADTS) stream as the encoded pieces of one file, made by
FFmpeg's encoders through PyAV as samples arrive; WAV and FLAC are whole-file formats and come
in one piece at the end. Every encoder takes mono float32 samples at the model's rate.
`Tempo` changes the audio's speed before it is encoded (OpenAI's speech `speed`).
"""

from __future__ import annotations

import io
from fractions import Fraction
from typing import Any

import numpy as np

from omnistage.v1 import gateway_pb2

__all__ = ["FORMAT_NAMES", "MAX_SPEED", "MIN_SPEED", "AudioEncoder", "Tempo", "format_from_name"]

F = gateway_pb2.AudioFormat
# names as OpenAI's API spells them (`audio.format`, `response_format`) -> formats
FORMAT_NAMES = {"pcm_f32le": F.PCM_F32LE, "pcm16": F.PCM16, "wav": F.WAV, "mp3": F.MP3, "flac": F.FLAC,
                "opus": F.OPUS, "aac": F.AAC}  # fmt: skip
STREAMED = {F.PCM_F32LE, F.PCM16, F.MP3, F.OPUS, F.AAC}
MIME = {F.PCM_F32LE: "audio/L32", F.PCM16: "audio/pcm", F.WAV: "audio/wav", F.MP3: "audio/mpeg", F.FLAC: "audio/flac",
        F.OPUS: "audio/ogg", F.AAC: "audio/aac"}  # fmt: skip
# streamed encoded formats: (FFmpeg muxer, encoder, bit rate: None for the encoder's default)
_ENCODED = {F.MP3: ("mp3", "libmp3lame", 64_000), F.OPUS: ("ogg", "libopus", None), F.AAC: ("adts", "aac", 64_000)}


def format_from_name(name: str) -> int:
    try:
        return FORMAT_NAMES[name]
    except KeyError:
        raise ValueError(f"unknown audio format {name!r}; expected one of {', '.join(FORMAT_NAMES)}") from None


MIN_SPEED, MAX_SPEED = 0.25, 4.0  # OpenAI's range for speech `speed`
_ATEMPO_RANGE = (0.5, 2.0)  # one atempo filter's factors (FFmpeg's documented range)
# atempo gives out a frame once it has filled an output buffer sized from its input frames: fed a
# model chunk whole (25 frames: 48,000 samples), it would hold that chunk back until the next one
# (two with chained filters). Fed pieces of about its window, it holds back about a window.
_TEMPO_PIECE = 1024


def _atempo_factors(speed: float) -> list[float]:
    """`speed` as a product of factors each one atempo filter takes (4.0: 2.0 x 2.0)."""
    low, high = _ATEMPO_RANGE
    factors = []
    while speed > high:
        factors.append(high)
        speed /= high
    while speed < low:
        factors.append(low)
        speed /= low
    return [*factors, speed]


class Tempo:
    """Mono float32 samples played `speed` times as fast, their pitch kept: FFmpeg's atempo
    (WSOLA) through PyAV, as they stream. `push(samples)` -> the samples ready now; `finish()`
    -> the rest (the filter holds back a window's worth)."""

    def __init__(self, speed: float, sample_rate: int) -> None:
        import av

        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise ValueError(f"speed {speed:g} is outside {MIN_SPEED:g} to {MAX_SPEED:g}")
        self.sample_rate = sample_rate
        self._graph = av.filter.Graph()
        source = self._graph.add_abuffer(format="flt", sample_rate=sample_rate, layout="mono",
                                         time_base=Fraction(1, sample_rate))  # fmt: skip
        stages = [self._graph.add("atempo", f"{f:.9g}") for f in _atempo_factors(speed)]
        self._graph.link_nodes(source, *stages, self._graph.add("abuffersink")).configure()
        self._pts = 0

    def push(self, samples: np.ndarray) -> np.ndarray:
        import av

        samples = np.ascontiguousarray(samples, dtype=np.float32)
        out: list[np.ndarray] = []
        for at in range(0, samples.size, _TEMPO_PIECE):
            piece = samples[at : at + _TEMPO_PIECE]
            frame = av.AudioFrame.from_ndarray(piece[None], format="flt", layout="mono")
            frame.sample_rate = self.sample_rate
            frame.pts = self._pts
            frame.time_base = Fraction(1, self.sample_rate)
            self._pts += piece.size
            self._graph.push(frame)
            self._pull(out)
        return _joined(out)

    def finish(self) -> np.ndarray:
        self._graph.push(None)
        out: list[np.ndarray] = []
        self._pull(out)
        return _joined(out)

    def _pull(self, out: list[np.ndarray]) -> None:
        """Onto `out`, the frames the filters have ready."""
        import av

        while True:
            try:
                frame = self._graph.pull()
            except (av.BlockingIOError, av.EOFError):  # nothing more now / ever
                return
            out.append(frame.to_ndarray().reshape(-1))


def _joined(pieces: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(pieces).astype(np.float32, copy=False) if pieces else np.zeros(0, np.float32)


def _pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767).round().astype("<i2").tobytes()


class _Sink(io.RawIOBase):
    """A write-only file for FFmpeg's muxer: collects what it writes until taken."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.parts.append(bytes(b))
        return len(b)

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out


class AudioEncoder:
    """`push(samples)` -> the bytes ready now; `finish()` -> the rest."""

    def __init__(self, fmt: int, sample_rate: int) -> None:
        if fmt not in MIME:
            raise ValueError(f"unknown audio format {fmt}")
        self.format = fmt
        self.sample_rate = sample_rate
        self.streams = fmt in STREAMED
        self._held: list[np.ndarray] = []  # whole-file formats
        self._muxer: Any = None
        self._pts = 0
        if fmt in _ENCODED:
            self._open(fmt)

    def _open(self, fmt: int) -> None:
        import av

        self._sink = _Sink()
        container, codec, bit_rate = _ENCODED[fmt]
        # a small I/O buffer so every encoded packet reaches the sink (and the client) at once
        # (Ogg pages flushed every 20 ms instead of every second); bitexact: the Ogg stream's serial
        # number fixed, not random, so the same reply is the same bytes (as every other format)
        options = {"page_duration": "20000", "fflags": "+bitexact"} if fmt == F.OPUS else {}
        self._muxer = av.open(self._sink, mode="w", format=container, buffer_size=512, options=options)
        self._stream = self._muxer.add_stream(codec, rate=self.sample_rate, layout="mono")
        if bit_rate is not None:
            self._stream.bit_rate = bit_rate
        self._resampler = av.AudioResampler(format=self._stream.format.name, layout="mono", rate=self.sample_rate)

    def push(self, samples: np.ndarray) -> bytes:
        samples = np.ascontiguousarray(samples, dtype=np.float32)
        if self.format == F.PCM_F32LE:
            return samples.astype("<f4").tobytes()
        if self.format == F.PCM16:
            return _pcm16(samples)
        if self._muxer is None:
            self._held.append(samples)
            return b""
        return self._encode(samples)

    def _encode(self, samples: np.ndarray | None) -> bytes:
        import av

        frames = []
        if samples is not None and samples.size:
            frame = av.AudioFrame.from_ndarray(samples[None], format="flt", layout="mono")
            frame.sample_rate = self.sample_rate
            frame.pts = self._pts
            frame.time_base = Fraction(1, self.sample_rate)
            self._pts += samples.size
            frames = self._resampler.resample(frame)
        elif samples is None:
            frames = self._resampler.resample(None)
        for f in frames:
            for packet in self._stream.encode(f):
                self._muxer.mux(packet)
        if samples is None:
            for packet in self._stream.encode(None):
                self._muxer.mux(packet)
        return self._sink.take()

    def finish(self) -> bytes:
        """The rest of the stream, or the whole file."""
        if self.format in (F.PCM_F32LE, F.PCM16):
            return b""
        if self._muxer is not None:
            tail = self._encode(None)
            self._muxer.close()
            return tail + self._sink.take()
        samples = np.concatenate(self._held) if self._held else np.zeros(0, np.float32)
        self._held = []
        if self.format == F.WAV:
            return _wav(samples, self.sample_rate)
        return _flac(samples, self.sample_rate)


def _wav(samples: np.ndarray, rate: int) -> bytes:
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(_pcm16(samples))
    return buf.getvalue()


def _flac(samples: np.ndarray, rate: int) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="flac") as container:
        stream = container.add_stream("flac", rate=rate, layout="mono")
        stream.format = "s16"
        frame = av.AudioFrame.from_ndarray(np.frombuffer(_pcm16(samples), "<i2")[None], format="s16", layout="mono")
        frame.sample_rate = rate
        if samples.size:  # (no audio: the header alone; a second flush of the encoder raised EOFError)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buf.getvalue()
