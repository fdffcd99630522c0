"""G.711 audio (telephony's: 8 kHz, one byte a sample, mu-law or A-law), both ways, through
FFmpeg's codecs (PyAV): the Realtime API's `audio/pcmu` and `audio/pcma` (beta's `g711_ulaw`,
`g711_alaw`), which phone bridges speak. In: to 16-bit PCM at 8 kHz. Out: the model's 16-bit
PCM resampled to 8 kHz and encoded, as it streams."""

from __future__ import annotations

import functools
from fractions import Fraction
from typing import Any

import numpy as np

__all__ = ["G711_RATE", "LAWS", "G711Encoder", "g711_to_pcm16"]

G711_RATE = 8_000
LAWS = {"audio/pcmu": "pcm_mulaw", "audio/pcma": "pcm_alaw"}  # format -> FFmpeg codec


def _codec(fmt: str, mode: str) -> Any:
    import av

    ctx = av.CodecContext.create(LAWS[fmt], mode)
    ctx.sample_rate, ctx.layout = G711_RATE, "mono"
    if mode == "w":
        ctx.format = "s16"
    return ctx


@functools.cache
def _table(fmt: str) -> np.ndarray:
    """Each of the 256 codes' sample, as FFmpeg's decoder gives it (decoding is a table lookup)."""
    import av

    (frame,) = _codec(fmt, "r").decode(av.Packet(bytes(range(256))))
    return frame.to_ndarray()[0].astype("<i2")


def g711_to_pcm16(data: bytes, fmt: str) -> bytes:
    """G.711 bytes (`fmt` audio/pcmu or audio/pcma) as 16-bit little-endian PCM, 8 kHz."""
    return _table(fmt)[np.frombuffer(data, np.uint8)].tobytes()


class G711Encoder:
    """16-bit PCM at `rate` in, G.711 at 8 kHz out: `push(pcm16)` -> the bytes ready now,
    `finish()` -> the rest (the resampler holds a few samples back for its filter)."""

    def __init__(self, fmt: str, rate: int) -> None:
        import av

        self.rate = rate
        self._codec = _codec(fmt, "w")
        self._resampler = av.AudioResampler(format="s16", layout="mono", rate=G711_RATE)
        self._pts = 0

    def push(self, pcm16: bytes) -> bytes:
        import av

        if not pcm16:
            return b""
        samples = np.frombuffer(pcm16, "<i2")
        frame = av.AudioFrame.from_ndarray(samples[None], format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = self.rate, self._pts, Fraction(1, self.rate)
        self._pts += samples.size
        return self._encode(self._resampler.resample(frame))

    def finish(self) -> bytes:
        return self._encode(self._resampler.resample(None)) + self._encode([None])

    def _encode(self, frames: list[Any]) -> bytes:
        return b"".join(bytes(packet) for f in frames for packet in self._codec.encode(f))
