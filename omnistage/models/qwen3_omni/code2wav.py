"""Qwen3-Omni's code2wav: codec frames -> 24 kHz float32 PCM, full or streamed.

Streaming modes:
  * `exact` (default): the stateful incremental decoder (code2wav_streaming.py); the
    concatenated stream equals a full decode of the same frames and each frame is computed once.
  * `windowed`: each chunk is decoded from scratch with `left_context_frames` earlier frames
    and the context's samples are dropped (what other stacks do; approximate, recomputes context).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from omnistage.models.qwen3_omni.code2wav_streaming import Code2WavStreamState, IncrementalCode2Wav
from omnistage.models.qwen3_omni.spec import FamilySpec

__all__ = ["Code2Wav", "Code2WavStream", "StreamingMode"]

StreamingMode = Literal["exact", "windowed"]


@dataclass
class Code2WavStream:
    """One request's stream: frames waiting to be decoded and the decoder's state."""

    mode: StreamingMode
    left_context_frames: int = 25
    pending: list[torch.Tensor] = field(default_factory=list)  # frames [num_code_groups] not yet decoded
    frames_in: int = 0  # frames decoded so far
    state: Code2WavStreamState | None = None  # exact mode
    context: torch.Tensor | None = None  # windowed mode: the last left_context_frames frames
    windowed_samples: int = 0  # windowed mode: samples emitted
    input_done: bool = False  # set by the stage: no more frames will come
    closed: bool = False

    @property
    def samples_out(self) -> int:
        """Samples emitted so far: the stream position of the next sample."""
        return self.state.samples_emitted if self.state is not None else self.windowed_samples


class Code2Wav:
    def __init__(self, model: Any, spec: FamilySpec) -> None:
        self.model = model
        self.spec = spec
        self.device = next(model.parameters()).device
        self.incremental = IncrementalCode2Wav(model)
        self.samples_per_frame = int(model.total_upsample)

    def validate_codes(self, codes: torch.Tensor) -> None:
        if codes.dim() != 2 or codes.shape[0] != self.spec.num_code_groups:
            raise ValueError(f"codes must be [{self.spec.num_code_groups}, frames], got {list(codes.shape)}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.spec.codebook_size):
            lo, hi = int(codes.min()), int(codes.max())
            raise ValueError(f"codes must lie in [0, {self.spec.codebook_size}), got {lo}..{hi}")

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Full decode of `[num_code_groups, frames]` codes to `[samples]` float32 PCM."""
        self.validate_codes(codes)
        if codes.shape[1] == 0:
            return torch.zeros(0, dtype=torch.float32)
        wav = self.model(codes.unsqueeze(0).to(self.device))
        return wav.reshape(-1).float().cpu()

    def open_stream(self, mode: StreamingMode = "exact", left_context_frames: int = 25, speaker: str | None = None,
                    seed: int | None = None) -> Code2WavStream:  # fmt: skip
        """`speaker`, `seed`: unused (this decoder has no voice conditioning and draws nothing)."""
        del speaker, seed
        if mode not in ("exact", "windowed"):
            raise ValueError(f"code2wav streaming must be 'exact' or 'windowed', got {mode!r}")
        stream = Code2WavStream(mode=mode, left_context_frames=left_context_frames)
        if mode == "exact":
            stream.state = self.incremental.new_state()
        return stream

    def ready_frames(self, stream: Code2WavStream) -> int:
        """Pending frames whose audio can be final now: all of them (the decoder is causal)."""
        return len(stream.pending)

    @torch.no_grad()
    def decode_pending(self, streams: Sequence[Code2WavStream]) -> list[tuple[int, torch.Tensor]]:
        """Decode each stream's pending frames: `(first_sample, pcm)` per stream. Exact streams
        are decoded together in one batched step."""
        codes = [torch.stack(s.pending, dim=1) if s.pending else self._no_frames() for s in streams]
        starts = [s.samples_out for s in streams]
        for s, c in zip(streams, codes, strict=True):
            if s.closed:
                raise RuntimeError("decode on a closed code2wav stream")
            self.validate_codes(c)
        out: list[torch.Tensor | None] = [None] * len(streams)
        exact = [i for i, s in enumerate(streams) if s.mode == "exact"]
        if exact:
            pcm = self.incremental.step(
                [streams[i].state for i in exact],  # type: ignore[misc]
                [codes[i].to(self.device) for i in exact],
            )
            for i, p in zip(exact, pcm, strict=True):
                out[i] = p.float().cpu()
        for i, s in enumerate(streams):
            if s.mode == "windowed":
                out[i] = self._windowed(s, codes[i])
                s.windowed_samples += int(out[i].shape[0])  # type: ignore[union-attr]
        for s, c in zip(streams, codes, strict=True):
            s.frames_in += int(c.shape[1])
            s.pending = []
        return [(start, o if o is not None else torch.zeros(0)) for start, o in zip(starts, out, strict=True)]

    def _no_frames(self) -> torch.Tensor:
        return torch.zeros((self.spec.num_code_groups, 0), dtype=torch.long)

    def _windowed(self, s: Code2WavStream, new: torch.Tensor) -> torch.Tensor:
        if new.shape[1] == 0:
            return torch.zeros(0)
        ctx = s.context if s.context is not None else new[:, :0]
        s.context = torch.cat((ctx, new), dim=1)[:, max(0, ctx.shape[1] + new.shape[1] - s.left_context_frames) :]
        wav = self.model(torch.cat((ctx, new), dim=1).unsqueeze(0).to(self.device)).reshape(-1)
        return wav[ctx.shape[1] * self.samples_per_frame :].float().cpu()

    def close(self, stream: Code2WavStream) -> None:
        """Free the stream's state (request finished, cancelled or failed)."""
        if stream.state is not None:
            self.incremental.close([stream.state])
        stream.context = None
        stream.pending = []
        stream.closed = True
