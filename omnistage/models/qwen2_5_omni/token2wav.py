"""Qwen2.5-Omni's token2wav: codes -> mel (a DiT integrated over flow-matching ODE steps, with
classifier-free guidance) -> 24 kHz waveform (BigVGAN), full or streamed.

Full decode (`decode`) is transformers' own `Qwen2_5OmniToken2WavModel` with the request's
seed as the global seed, so it equals `generate()`'s waveform bit for bit when `generate()` ran
after `torch.manual_seed(seed)` (its thinker and talker draw nothing when greedy).

Noise: the DiT starts from `randn([1, frames * repeats, mel_dim])`. On CPU, `randn` fills 16
values at a time from the generator's stream, so the noise of a prefix is the prefix of the noise
whenever a prefix holds a multiple of 16 values: true for every number of mel frames when
`mel_dim` is a multiple of 16 (80 in every published checkpoint). A stream therefore draws the
noise of new frames as they arrive, from its own generator seeded with the request's seed, and
holds exactly the values the full decode would draw. (A checkpoint whose `mel_dim` is not a
multiple of 16 streams nothing before its codes end; on CUDA, `generate()` draws on the device,
which this does not reproduce.)

Streaming follows the DiT's block attention. Every attention layer sees its own block of
`block_size` mel frames, plus one block back in each `look_backward_layers` layer and one ahead in
each `look_ahead_layers` layer. One DiT pass therefore reads `back` blocks behind and `ahead`
blocks ahead of a block, and the ODE composes `evals` passes (4 per RK4 interval), so a mel block
of the full decode depends on `evals * back` blocks behind it and `evals * ahead` blocks ahead:
  * `exact`: a chunk of mel blocks is computed by integrating the ODE over a window of the
    request's codes that reaches that far on both sides (clipped at the utterance's ends, which
    the full decode clips too), so each output frame sees every input the full decode lets it
    see. It differs from the full decode only by float rounding (matrix products over other
    lengths); `tests/test_qwen2_5_omni.py` measures it. Audio is final only that many blocks
    behind the codes, which is where exactness costs latency (the published checkpoint: 36
    passes x 1 block of 24 frames = 432 codes, 8.6 s of audio).
  * `windowed`: the window reaches `context_frames` codes each side; audio is close, not equal.
BigVGAN is a stack of convolutions: its reach (in mel frames) is measured once at load by
changing one input frame, and each chunk's mel is vocoded with that much mel on each side.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

from omnistage.models.qwen2_5_omni.spec import FamilySpec, Voice

__all__ = ["Token2Wav", "Token2WavStream"]

StreamingMode = Literal["exact", "windowed"]
# generate()'s token2wav settings (Qwen2_5OmniToken2WavModel.forward's defaults)
NUM_STEPS, GUIDANCE_SCALE, SWAY = 10, 0.5, -1.0


@dataclass
class Token2WavStream:
    """One request's stream: its codes, its noise, and how far its audio has been emitted."""

    mode: StreamingMode
    context_frames: int
    voice: Voice
    generator: torch.Generator
    pending: list[torch.Tensor] = field(default_factory=list)  # frames ([1] codes) not yet emitted as audio
    codes: list[int] = field(default_factory=list)  # the frames decode_pending has seen
    noise: torch.Tensor | None = None  # [frames * repeats, mel_dim] drawn so far
    frames_in: int = 0  # frames emitted as audio
    samples_out: int = 0
    input_done: bool = False  # set by the stage: no more frames will come
    closed: bool = False


@dataclass
class _Window:
    """One stream's chunk: mel frames [c0, c1) wanted, computed in the window [w0, w1)."""

    stream: Token2WavStream
    c0: int
    c1: int
    w0: int
    w1: int
    noise: torch.Tensor  # [w1 - w0, mel_dim]
    codes: torch.Tensor  # [1, codes covering the window]


class Token2Wav:
    def __init__(self, model: Any, spec: FamilySpec, voices: dict[str, Voice], batching: str = "exact") -> None:
        """`batching`: "exact" (each request's windows alone: the full decode's numbers) or
        "fast" (every due request's window in one DiT pass per ODE step; close, not bitwise)."""
        if batching not in ("exact", "fast"):
            raise ValueError(f"batching must be 'exact' or 'fast', got {batching!r}")
        self.batching = batching
        self.model = model
        self.spec = spec
        self.voices = voices
        self.device = next(model.parameters()).device
        self.dit = model.code2wav_dit_model
        self.vocoder = model.code2wav_bigvgan_model
        cfg = self.dit.config
        self.block = int(cfg.block_size)
        self.repeats = int(cfg.repeats)
        self.mel_dim = int(cfg.mel_dim)
        self.samples_per_mel = int(math.prod(self.vocoder.config.upsample_rates))
        self.samples_per_frame = self.samples_per_mel * self.repeats
        evals = 4 * (NUM_STEPS - 1)  # RK4: four passes per interval
        # reach of the full decode, in mel blocks
        self.exact_back = evals * len(cfg.look_backward_layers)
        self.exact_ahead = evals * len(cfg.look_ahead_layers)
        self.noise_streams = self.mel_dim % 16 == 0
        self._encodings: dict[str, torch.Tensor] = {}  # voice name -> its speaker encoding
        self.vocoder_reach = self._vocoder_reach()

    # ---- checks and the full decode -----------------------------------------------------------

    def validate_codes(self, codes: torch.Tensor) -> None:
        if codes.dim() != 2 or codes.shape[0] != 1:
            raise ValueError(f"codes must be [1, frames], got {list(codes.shape)}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.spec.codebook_size):
            lo, hi = int(codes.min()), int(codes.max())
            raise ValueError(f"codes must lie in [0, {self.spec.codebook_size}), got {lo}..{hi}")

    def voice(self, speaker: str | None) -> Voice:
        return self.voices[self.spec.speaker_name(speaker or self.spec.default_speaker)]

    def _conditioning(self, voice: Voice) -> tuple[torch.Tensor, torch.Tensor]:
        """As generate() passes them: `[1, D]` and `[1, T, mel]` float32."""
        cond = voice.cond.to(self.device).float().reshape(1, -1)
        return cond, voice.ref_mel.to(self.device).float()

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, speaker: str | None = None, seed: int = 0) -> torch.Tensor:
        """Full decode of `[1, frames]` codes to `[samples]` float32 PCM, as `generate()` does it
        after `torch.manual_seed(seed)`."""
        self.validate_codes(codes)
        if codes.shape[1] == 0:
            return torch.zeros(0, dtype=torch.float32)
        cond, ref = self._conditioning(self.voice(speaker))
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(seed)
            wav = self.model(codes.to(self.device), conditioning=cond, reference_mel=ref)
        return wav.reshape(-1).float().cpu()

    # ---- streaming ----------------------------------------------------------------------------

    def open_stream(self, mode: StreamingMode = "exact", left_context_frames: int = 25, speaker: str | None = None,
                    seed: int | None = None) -> Token2WavStream:  # fmt: skip
        """`left_context_frames`: the `windowed` mode's reach, in codes, on each side."""
        if mode not in ("exact", "windowed"):
            raise ValueError(f"code2wav streaming must be 'exact' or 'windowed', got {mode!r}")
        generator = torch.Generator().manual_seed(0 if seed is None else seed)
        return Token2WavStream(mode, max(0, left_context_frames), self.voice(speaker), generator)

    def ready_frames(self, stream: Token2WavStream) -> int:
        """Frames whose audio is final now (all of them once the input is done)."""
        received = stream.frames_in + len(stream.pending)
        if stream.input_done:
            return len(stream.pending)
        if not self.noise_streams:
            return 0
        _, ahead = self._reach(stream)
        final_mel = (received * self.repeats // self.block - ahead) * self.block
        return max(0, final_mel // self.repeats - stream.frames_in)

    def _reach(self, stream: Token2WavStream) -> tuple[int, int]:
        """(behind, ahead) in mel blocks of the window a chunk is computed in."""
        if stream.mode == "exact":
            return self.exact_back, self.exact_ahead
        blocks = -(-stream.context_frames * self.repeats // self.block)
        return blocks, blocks

    def _noise(self, stream: Token2WavStream, mel_frames: int) -> torch.Tensor:
        have = 0 if stream.noise is None else stream.noise.shape[0]
        if mel_frames > have:
            new = torch.randn((mel_frames - have) * self.mel_dim, generator=stream.generator).view(-1, self.mel_dim)
            stream.noise = new if stream.noise is None else torch.cat([stream.noise, new])
        assert stream.noise is not None
        return stream.noise[:mel_frames]

    @torch.no_grad()
    def decode_pending(self, streams: Sequence[Token2WavStream], max_frames: int | None = None
                       ) -> list[tuple[int, torch.Tensor]]:  # fmt: skip
        """Emit each stream's frames whose audio is final, at most `max_frames` of each, or the
        codes its window reaches around them if more (the rest wait for the next call; a smaller
        piece would cost more than it saves: each is computed over that much context), and all
        at once where its noise cannot stream: `(first_sample, pcm)` per stream. The windows'
        ODEs run one request at a time (exact batching: each as alone) or together (fast
        batching: one DiT pass per ODE step for all of them, padded to the longest)."""
        jobs: list[_Window] = []
        for s in streams:
            if s.closed:
                raise RuntimeError("decode on a closed code2wav stream")
            merged = len(s.codes) - s.frames_in  # pending frames already in `codes`
            s.codes.extend(int(c) for frame in s.pending[merged:] for c in frame.view(-1).tolist())
            n = self.ready_frames(s)
            if max_frames is not None and not (s.input_done and not self.noise_streams):
                back, ahead = self._reach(s)
                n = min(n, max(max_frames, (back + ahead) * self.block // self.repeats))
            if n:
                jobs.append(self._window(s, s.frames_in, s.frames_in + n))
        groups = [jobs] if self.batching == "fast" and jobs else [[j] for j in jobs]
        done: dict[int, tuple[int, torch.Tensor]] = {}  # id(stream) -> (frames, pcm)
        for group in groups:
            for job, mel in zip(group, self._sample(group), strict=True):
                done[id(job.stream)] = ((job.c1 - job.c0) // self.repeats, self._vocode(job, mel))
        out = []
        for s in streams:
            start = s.samples_out
            frames, chunk = done.get(id(s), (0, torch.zeros(0)))
            s.frames_in += frames
            s.samples_out += int(chunk.shape[0])
            # frames received but not yet final stay pending (the stage's count of work left)
            s.pending = [torch.tensor([c]) for c in s.codes[s.frames_in :]]
            out.append((start, chunk))
        return out

    def _window(self, s: Token2WavStream, first: int, end: int) -> _Window:
        """The block-aligned window of mel frames whose ODE gives frames [first, end) their audio."""
        total_mel = len(s.codes) * self.repeats
        back, ahead = self._reach(s)
        c0, c1 = first * self.repeats, end * self.repeats  # mel frames wanted
        w0 = max(0, (c0 // self.block - back) * self.block)
        w1 = min(total_mel, (-(-c1 // self.block) + ahead) * self.block)
        if s.input_done and not self.noise_streams:
            w0, w1 = 0, total_mel
        noise = self._noise(s, total_mel if s.input_done else w1)[w0:w1]
        codes = torch.tensor(s.codes[w0 // self.repeats : -(-w1 // self.repeats)], device=self.device).view(1, -1)
        return _Window(s, c0, c1, w0, w1, noise, codes)

    def _vocode(self, job: _Window, mel: torch.Tensor) -> torch.Tensor:
        """BigVGAN over the wanted mel frames and `vocoder_reach` on each side (within the window)."""
        v0, v1 = max(job.w0, job.c0 - self.vocoder_reach), min(job.w1, job.c1 + self.vocoder_reach)
        wav = self.vocoder(mel[:, :, v0 - job.w0 : v1 - job.w0]).reshape(-1).float().cpu()
        a = (job.c0 - v0) * self.samples_per_mel
        return wav[a : a + (job.c1 - job.c0) * self.samples_per_mel]

    def _sample(self, jobs: Sequence[_Window]) -> list[torch.Tensor]:
        """`Qwen2_5OmniToken2WavDiTModel.sample` over each window (its noise given, its positions
        and blocks those of the full sequence): `[1, mel_dim, n]` per window. Several windows run
        as one batch padded to the longest; a padded row attends only to padding."""
        dit = self.dit
        lengths = [j.w1 - j.w0 for j in jobs]
        n, b = max(lengths), len(jobs)

        def padded(t: torch.Tensor) -> torch.Tensor:  # [1, m, d] -> [1, n, d]
            return torch.nn.functional.pad(t, (0, 0, 0, n - t.shape[1]))

        x0 = torch.cat([padded(j.noise.to(self.device, torch.float32).unsqueeze(0)) for j in jobs])
        # What every pass shares (`forward` recomputes it each time; the values are the same):
        # DiTInputEmbedding's inputs other than x, guided rows then unguided ones, with each voice's
        # speaker encoding computed once; the rotary embedding of the sequence's positions; blocks.
        enc, code, code_null, speaker, positions, blocks = [], [], [], [], [], []
        for j, m in zip(jobs, lengths, strict=True):
            cond, _ = self._conditioning(j.stream.voice)
            offset = j.w0 % self.repeats  # a block-aligned window may start inside a code's repeats
            code.append(padded(dit.text_embed(j.codes, drop_code=False)[:, offset : offset + m]))
            code_null.append(padded(dit.text_embed(j.codes, drop_code=True)[:, offset : offset + m]))
            speaker.append(padded(cond.unsqueeze(1).repeat(1, m, 1)))
            enc.append(self._voice_encoding(j.stream.voice))
            index = torch.arange(j.w0, j.w0 + n, device=self.device)
            positions.append(index)
            blocks.append(index // dit.block_size)
        guided_enc, null_enc = torch.stack([e[0] for e in enc]), torch.stack([e[1] for e in enc])
        speakers = torch.cat(speaker)
        fixed = (torch.cat([guided_enc, null_enc]).unsqueeze(1).repeat(1, n, 1), torch.cat(code + code_null),
                 torch.cat([speakers, torch.zeros_like(speakers)]))  # fmt: skip
        rope = dit.rotary_embed(x0, torch.stack(positions).repeat(2, 1))
        diff = torch.stack([bl.unsqueeze(0) - bl.unsqueeze(1) for bl in blocks])  # [b, n, n]
        if b > 1:
            valid = torch.arange(n, device=self.device)[None, :] < torch.tensor(lengths, device=self.device)[:, None]
            far = torch.full_like(diff, 1 << 30)  # outside every layer's look-back and look-ahead
            # a valid row never sees a padded one; a padded row sees only padded rows
            diff = torch.where(valid[:, None, :] == valid[:, :, None], diff, far)
        diff = diff.repeat(2, 1, 1).unsqueeze(1).expand(2 * b, dit.num_attention_heads, n, n)

        def ode(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            # Qwen2_5OmniToken2WavDiTModel.forward with guidance (apply_cfg)
            time = dit.time_embed(t.repeat(2 * b) if t.ndim == 0 else t)
            h = dit.input_embed.proj(torch.cat((torch.cat([x, x]), *fixed), dim=-1))
            for layer in dit.transformer_blocks:
                h = layer(h, time, position_embeddings=rope, block_diff=diff)
            guided, null = torch.chunk(dit.proj_out(dit.norm_out(h, time)), 2, dim=0)
            return guided + (guided - null) * GUIDANCE_SCALE

        t = torch.linspace(0, 1, NUM_STEPS, device=self.device, dtype=torch.float32)
        t += SWAY * (torch.cos(torch.pi / 2 * t) - 1 + t)
        x1 = RungeKutta4ODESolver(function=ode, initial_value=x0).integrate(t)[-1]
        return [x1[i : i + 1, :m].permute(0, 2, 1) for i, m in enumerate(lengths)]

    def _voice_encoding(self, voice: Voice) -> torch.Tensor:
        """The DiT's speaker encoder over (the voice's reference mel, zeros for the unguided
        half), `[2, D]`: the same in every pass of every request of a voice, so computed once."""
        name = next(n for n, v in self.voices.items() if v is voice)
        if name not in self._encodings:
            _, ref = self._conditioning(voice)
            self._encodings[name] = self.dit.input_embed.spk_encoder(torch.cat([ref, torch.zeros_like(ref)]))
        return self._encodings[name]

    @torch.no_grad()
    def _vocoder_reach(self) -> int:
        """How many mel frames on each side one output sample of BigVGAN depends on, measured:
        change one frame in the middle of a probe and see which samples move."""
        for half in (16, 64, 256, 1024):
            n = 2 * half + 1
            base = torch.full((1, self.mel_dim, n), -4.0, device=self.device)
            poked = base.clone()
            poked[:, :, half] += 1.0
            moved = (self.vocoder(base).reshape(-1) != self.vocoder(poked).reshape(-1)).nonzero().flatten()
            if moved.numel() == 0:
                return 0
            lo, hi = int(moved[0]) // self.samples_per_mel, int(moved[-1]) // self.samples_per_mel
            reach = max(half - lo, hi - half)
            if reach < half:
                return reach + 1
        raise ValueError("BigVGAN's reach exceeds 1024 mel frames")

    def close(self, stream: Token2WavStream) -> None:
        stream.pending = []
        stream.codes = []
        stream.noise = None
        stream.closed = True
