"""Qwen3-Omni's code2wav: codec frames -> 24 kHz float32 PCM, full or streamed.

`generate()` decodes a reply in segments (`chunked_decode(codes, 300, 25)`): frames
[300k, 300(k+1)) from scratch with the 25 frames before them as context, whose samples are cut,
and each segment drops the samples its last frame still owes (555 on the published checkpoint).
Past 300 frames (24 s) that is not a full decode of the reply; `decode` and the exact stream
are `generate()`'s.

Streaming modes:
  * `exact` (default): the stateful incremental decoder (code2wav_streaming.py), a fresh state per
    segment primed with its context; the concatenated stream equals `generate()`'s decode and each
    frame is computed once (twice for the 25 context frames of each later segment).
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

__all__ = ["SEGMENT_CONTEXT_FRAMES", "SEGMENT_FRAMES", "Code2Wav", "Code2WavStream", "StreamingMode"]

StreamingMode = Literal["exact", "windowed"]
SEGMENT_FRAMES, SEGMENT_CONTEXT_FRAMES = 300, 25  # generate()'s chunked_decode(codes, 300, 25)


@dataclass
class Code2WavStream:
    """One request's stream: frames waiting to be decoded and the decoder's state."""

    mode: StreamingMode
    left_context_frames: int = 25
    pending: list[torch.Tensor] = field(default_factory=list)  # frames [num_code_groups] not yet decoded
    frames_in: int = 0  # frames decoded so far
    state: Code2WavStreamState | None = None  # exact mode: the current segment's decoder state
    segment_frames: int = 0  # exact mode: frames of the current segment fed to `state`
    skip_samples: int = 0  # exact mode: samples of the segment's context still to cut
    context: torch.Tensor | None = None  # the last frames decoded (windowed: left_context_frames; exact: 25)
    samples_out: int = 0  # samples emitted so far: the stream position of the next sample
    input_done: bool = False  # set by the stage: no more frames will come
    closed: bool = False


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
        wav = self.model.chunked_decode(codes.unsqueeze(0).to(self.device), SEGMENT_FRAMES, SEGMENT_CONTEXT_FRAMES)
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
    def decode_pending(self, streams: Sequence[Code2WavStream], max_frames: int | None = None
                       ) -> list[tuple[int, torch.Tensor]]:  # fmt: skip
        """Decode each stream's pending frames, at most `max_frames` of each (the rest stay
        pending): `(first_sample, pcm)` per stream. Exact streams are decoded together in one
        batched step."""
        if max_frames is not None and max_frames < 1:
            raise ValueError(f"max_frames must be >= 1, got {max_frames}")
        codes = [torch.stack(s.pending[:max_frames], dim=1) if s.pending else self._no_frames() for s in streams]
        starts = [s.samples_out for s in streams]
        for s, c in zip(streams, codes, strict=True):
            if s.closed:
                raise RuntimeError("decode on a closed code2wav stream")
            self.validate_codes(c)
        out: list[torch.Tensor] = [torch.zeros(0)] * len(streams)
        exact = {i: codes[i] for i, s in enumerate(streams) if s.mode == "exact" and codes[i].shape[1]}
        pieces: dict[int, list[torch.Tensor]] = {i: [] for i in exact}
        while exact:  # one batched step per segment a stream's frames reach into
            feeds = {i: self._segment_feed(streams[i], c) for i, c in exact.items()}
            pcm = self.incremental.step([streams[i].state for i in feeds],  # type: ignore[misc]
                                        [f.to(self.device) for f, _ in feeds.values()])  # fmt: skip
            for (i, (_, taken)), p in zip(feeds.items(), pcm, strict=True):
                s = streams[i]
                cut = min(s.skip_samples, int(p.shape[0]))  # the context's samples
                s.skip_samples -= cut
                pieces[i].append(p[cut:].float().cpu())
                exact[i] = exact[i][:, taken:]
            exact = {i: c for i, c in exact.items() if c.shape[1]}
        for i, parts in pieces.items():
            out[i] = torch.cat(parts) if parts else torch.zeros(0)
        for i, s in enumerate(streams):
            if s.mode == "windowed":
                out[i] = self._windowed(s, codes[i])
        for s, c, o in zip(streams, codes, out, strict=True):
            s.frames_in += int(c.shape[1])
            s.samples_out += int(o.shape[0])
            s.pending = s.pending[int(c.shape[1]) :]
        return list(zip(starts, out, strict=True))

    def _segment_feed(self, s: Code2WavStream, codes: torch.Tensor) -> tuple[torch.Tensor, int]:
        """What of `codes` goes to the stream's decoder state in this step, and how many of
        `codes` that is: up to the end of the current segment; a full segment first gives way to
        a fresh state, fed the segment's context before its frames (generate()'s segments)."""
        if s.segment_frames == SEGMENT_FRAMES:
            assert s.state is not None and s.context is not None
            self.incremental.close([s.state])
            s.state, s.segment_frames = self.incremental.new_state(), 0
            s.skip_samples = int(s.context.shape[1]) * self.samples_per_frame
            prime = s.context
        else:
            prime = codes[:, :0]
        taken = min(int(codes.shape[1]), SEGMENT_FRAMES - s.segment_frames)
        new = codes[:, :taken]
        s.segment_frames += taken
        recent = new if s.context is None else torch.cat((s.context, new), dim=1)
        s.context = recent[:, -SEGMENT_CONTEXT_FRAMES:]
        return torch.cat((prime, new), dim=1), taken

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
