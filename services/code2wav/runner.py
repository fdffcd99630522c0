"""code2wav runner: codec frames -> 24 kHz float32 PCM, full or streamed.

Streaming modes (`code2wav_streaming`):
  * `exact` (default): the stateful incremental decoder (services/code2wav/streaming.py); the
    concatenated stream equals a full decode of the same frames and each frame is computed once.
  * `windowed`: each chunk is decoded from scratch with `left_context_frames` earlier frames
    and the context's samples are dropped (what other stacks do; approximate, recomputes context).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from omnistage.families.qwen3_omni import FamilySpec
from services.code2wav.streaming import Code2WavStreamState, IncrementalCode2Wav

StreamingMode = Literal["exact", "windowed"]


@dataclass
class Code2WavStream:
    mode: StreamingMode
    left_context_frames: int = 25
    state: Code2WavStreamState | None = None  # exact mode
    context: torch.Tensor | None = None  # windowed mode: the last left_context_frames frames
    frames_in: int = 0
    samples_out: int = 0
    closed: bool = False


class Code2WavRunner:
    def __init__(self, model: Any, spec: FamilySpec) -> None:
        self.model = model
        self.spec = spec
        self.device = next(model.parameters()).device
        self.incremental = IncrementalCode2Wav(model)

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

    def open_stream(self, mode: StreamingMode = "exact", left_context_frames: int = 25) -> Code2WavStream:
        if mode not in ("exact", "windowed"):
            raise ValueError(f"code2wav_streaming must be 'exact' or 'windowed', got {mode!r}")
        stream = Code2WavStream(mode=mode, left_context_frames=left_context_frames)
        if mode == "exact":
            stream.state = self.incremental.new_state()
        return stream

    @torch.no_grad()
    def push(self, streams: list[Code2WavStream], codes: list[torch.Tensor]) -> list[torch.Tensor]:
        """Feed each stream its new frames `[num_code_groups, n_i]`; returns each stream's new
        samples. Exact streams are decoded together in one batched step."""
        for s, c in zip(streams, codes, strict=True):
            if s.closed:
                raise RuntimeError("push on a closed code2wav stream")
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
        result = [o if o is not None else torch.zeros(0) for o in out]
        for s, c, p in zip(streams, codes, result, strict=True):
            s.frames_in += int(c.shape[1])
            s.samples_out += int(p.shape[0])
        return result

    def _windowed(self, s: Code2WavStream, new: torch.Tensor) -> torch.Tensor:
        if new.shape[1] == 0:
            return torch.zeros(0)
        ctx = s.context if s.context is not None else new[:, :0]
        s.context = torch.cat((ctx, new), dim=1)[:, max(0, ctx.shape[1] + new.shape[1] - s.left_context_frames) :]
        wav = self.model(torch.cat((ctx, new), dim=1).unsqueeze(0).to(self.device)).reshape(-1)
        return wav[ctx.shape[1] * self.spec.samples_per_frame :].float().cpu()

    def close(self, stream: Code2WavStream) -> None:
        """Free the stream's state (request finished, cancelled or failed)."""
        if stream.state is not None:
            self.incremental.close([stream.state])
            stream.state = None
        stream.context = None
        stream.closed = True


class Code2WavSession:
    """One request's chunking policy: decode when `first_chunk_frames` (then `chunk_frames`) new
    frames are waiting, or whatever is left once the input has finished."""

    def __init__(
        self,
        runner: Code2WavRunner,
        mode: StreamingMode = "exact",
        chunk_frames: int = 25,
        first_chunk_frames: int = 4,
        left_context_frames: int = 25,
    ) -> None:
        self.runner = runner
        self.stream = runner.open_stream(mode, left_context_frames)
        self.chunk_frames = chunk_frames
        self.first_chunk_frames = first_chunk_frames
        self.pending: list[torch.Tensor] = []  # frames [num_code_groups] not yet decoded
        self.samples_out = 0

    def add_frame(self, frame: torch.Tensor) -> None:
        self.pending.append(frame)

    def due(self, input_finished: bool) -> bool:
        if not self.pending:
            return False
        target = self.first_chunk_frames if self.stream.frames_in == 0 else self.chunk_frames
        return input_finished or len(self.pending) >= target

    def decode_due(self) -> tuple[int, torch.Tensor]:
        """Decode the pending frames: `(first_sample, pcm)`."""
        return Code2WavSession.decode_many([self])[0]

    @staticmethod
    def decode_many(sessions: list[Code2WavSession]) -> list[tuple[int, torch.Tensor]]:
        """Decode several requests' pending frames in one batched step (one runner, one push)."""
        if not sessions:
            return []
        codes = [torch.stack(s.pending, dim=1) for s in sessions]
        pcms = sessions[0].runner.push([s.stream for s in sessions], codes)
        out = []
        for s, pcm in zip(sessions, pcms, strict=True):
            s.pending = []
            out.append((s.samples_out, pcm))
            s.samples_out += int(pcm.shape[0])
        return out

    def close(self) -> None:
        self.runner.close(self.stream)
