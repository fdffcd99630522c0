"""The Realtime API's `server_vad` turn detection (gateway/realtime.py), on the input audio's level.

A 10 ms frame is voiced when its RMS is at least the `threshold`'s level: 0 stands for -70 dBFS
and 1 for -10 dBFS, on a straight dB scale (0.5, the default, is -40 dBFS: speech at a normal
distance from a microphone is well above it, a quiet room below). Speech starts after
MIN_VOICED_MS of voiced frames in a row (a click does not start a turn) and stops after
`silence_duration_ms` of unvoiced ones, or at the longest turn the session takes. It is not a
speech model: steady noise above the level is taken for speech; a client that knows better
sends `turn_detection: null` and commits itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = ["FLOOR_DBFS", "FRAME_MS", "MIN_VOICED_MS", "TOP_DBFS", "EnergyVad", "VadEvent", "VadSettings"]

FRAME_MS = 10
MIN_VOICED_MS = 30
FLOOR_DBFS, TOP_DBFS = -70.0, -10.0  # `threshold` 0 and 1


@dataclass
class VadSettings:
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int | None = None  # a reply heard this long ago with no turn since: one more

    def event(self) -> dict[str, object]:
        return {"type": "server_vad", "threshold": self.threshold, "prefix_padding_ms": self.prefix_padding_ms,
                "silence_duration_ms": self.silence_duration_ms, "create_response": self.create_response,
                "interrupt_response": self.interrupt_response, "idle_timeout_ms": self.idle_timeout_ms}  # fmt: skip


@dataclass(frozen=True)
class VadEvent:
    kind: Literal["started", "stopped"]
    sample: int  # in the stream of all audio fed: where speech started (its first voiced frame), or
    #              where it stopped (the end of its last voiced frame)
    at: int  # the sample fed when it was known (stopped: silence_duration_ms after `sample`)


class EnergyVad:
    """Speech starts and stops in 16-bit mono PCM fed in pieces of any size (the same events for
    any split)."""

    def __init__(self, settings: VadSettings, rate: int, max_turn: int = 1 << 62) -> None:
        self.settings = settings
        self.max_turn = max_turn  # a turn's most samples: it ends there, voiced or not
        self.frame = max(1, rate * FRAME_MS // 1000)
        db = FLOOR_DBFS + settings.threshold * (TOP_DBFS - FLOOR_DBFS)
        self.level = 32768.0 * 10 ** (db / 20)  # RMS in 16-bit units
        self.min_voiced = -(-MIN_VOICED_MS // FRAME_MS)
        self.max_silent = max(1, -(-settings.silence_duration_ms // FRAME_MS))
        self.pending = b""  # a frame's first bytes
        self.fed = 0  # samples in whole frames so far
        self.speaking = False
        self.start = 0  # the turn's first voiced sample
        self.run = 0  # voiced frames in a row (not speaking) or unvoiced ones (speaking)

    def feed(self, pcm: bytes) -> list[VadEvent]:
        data = self.pending + pcm
        step = 2 * self.frame
        n = len(data) // step
        self.pending = data[n * step:]
        if not n:
            return []
        frames = np.frombuffer(data[:n * step], "<i2").reshape(n, self.frame).astype(np.float64)
        voiced = np.sqrt(np.mean(frames * frames, axis=1)) >= self.level
        events: list[VadEvent] = []
        for i, loud in enumerate(voiced.tolist()):
            end = self.fed + (i + 1) * self.frame  # this frame's end
            if not self.speaking:
                self.run = self.run + 1 if loud else 0
                if self.run >= self.min_voiced:
                    self.speaking, self.run = True, 0
                    self.start = end - self.min_voiced * self.frame
                    events.append(VadEvent("started", self.start, end))
            else:
                self.run = 0 if loud else self.run + 1
                if self.run >= self.max_silent or end - self.start >= self.max_turn:
                    self.speaking = False
                    events.append(VadEvent("stopped", end - self.run * self.frame, end))
                    self.run = 0
        self.fed += n * self.frame
        return events

    def reset(self) -> None:
        """The buffer was committed or cleared by the client: a turn in progress is forgotten (and
        a frame's first bytes, which were in it)."""
        self.speaking, self.run = False, 0
        self.fed += len(self.pending) // 2
        self.pending = b""
