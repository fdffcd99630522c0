"""The in-process staged pipeline: thinker -> talker -> code2wav for one request, streaming.

No gRPC: the three runners are chained in one process, in the order the services will run
them (the talker one thinker token behind, code2wav every `chunk_frames` frames). It is the
reference the services are checked against, and the baseline for the gRPC overhead.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from omnistage.families.qwen3_omni import (
    SAMPLE_RATE,
    build_prompt_ids,
    messages_from_prompt,
)
from omnistage.loader import (
    Checkpoint,
    load_part,
    load_tokenizer,
    open_checkpoint,
    talker_tts_embeds,
    thinker_sampling_defaults,
)
from services.code2wav.runner import Code2WavRunner, Code2WavSession, StreamingMode
from services.runtime.sampling import TALKER_DEFAULTS, SamplingParams
from services.talker.runner import TalkerRunner
from services.talker.session import TalkerSession
from services.thinker.runner import ThinkerRunner


@dataclass
class TextEvent:
    token_id: int
    text: str
    t: float  # seconds since the request started


@dataclass
class AudioEvent:
    pcm: torch.Tensor  # float32 [samples] at SAMPLE_RATE
    first_sample: int
    t: float


@dataclass
class DoneEvent:
    token_ids: list[int]
    codes: torch.Tensor  # [num_code_groups, frames]
    thinker_stopped_on: str | None
    talker_stopped_on: str | None
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class PipelineRequest:
    prompt_ids: list[int]
    thinker: SamplingParams
    talker: SamplingParams = TALKER_DEFAULTS
    want_audio: bool = True
    speaker: str = "ethan"
    chunk_frames: int = 25
    first_chunk_frames: int = 4
    left_context_frames: int = 25
    code2wav_streaming: StreamingMode = "exact"


class InProcessPipeline:
    """Loads the three parts of one checkpoint and runs requests through them."""

    def __init__(self, model_dir: str | Path, dtype: str = "float32", device: str = "cpu") -> None:
        self.checkpoint: Checkpoint = open_checkpoint(model_dir)
        self.spec = self.checkpoint.spec
        self.tokenizer = load_tokenizer(self.checkpoint)
        self.thinker = ThinkerRunner(load_part(self.checkpoint, "thinker", dtype, device), self.spec)
        talker_model = load_part(self.checkpoint, "talker", dtype, device)
        self.talker = TalkerRunner(talker_model, self.spec, talker_tts_embeds(self.checkpoint, talker_model))
        self.code2wav = Code2WavRunner(load_part(self.checkpoint, "code2wav", dtype, device), self.spec)

    def thinker_defaults(self) -> SamplingParams:
        return thinker_sampling_defaults(self.checkpoint)

    def prompt_ids(self, prompt: str, system: str | None = None) -> list[int]:
        if not prompt.strip():
            raise ValueError("empty prompt: nothing to generate from")
        return build_prompt_ids(self.tokenizer, messages_from_prompt(prompt, system))

    def run(self, req: PipelineRequest) -> Iterator[TextEvent | AudioEvent | DoneEvent]:
        return run_request(self, req)


def run_request(pipe: InProcessPipeline, req: PipelineRequest) -> Iterator[TextEvent | AudioEvent | DoneEvent]:
    t0 = time.perf_counter()
    th = pipe.thinker.new_request(req.prompt_ids, req.thinker)
    timings: dict[str, float] = {}
    talk: TalkerSession | None = None
    wav: Code2WavSession | None = None
    frames: list[torch.Tensor] = []

    def audio(input_finished: bool) -> Iterator[AudioEvent]:
        assert wav is not None
        if wav.due(input_finished):
            first, pcm = wav.decode_due()
            if pcm.numel():
                yield AudioEvent(pcm, first, time.perf_counter() - t0)

    def pump_talker() -> Iterator[AudioEvent]:
        assert talk is not None and wav is not None
        while talk.can_progress():
            frame = talk.step()
            if frame is not None:
                frames.append(frame)
                wav.add_frame(frame)
                yield from audio(input_finished=False)

    try:
        prompt, tok = pipe.thinker.prefill(th)
        timings["thinker_prefill_s"] = time.perf_counter() - t0
        tokens = [tok.token_id]
        yield TextEvent(tok.token_id, pipe.tokenizer.decode([tok.token_id]), time.perf_counter() - t0)
        if req.want_audio:
            talk = TalkerSession(pipe.talker, req.talker, req.speaker)
            talk.set_prompt(prompt.ids, prompt.embeds, prompt.hidden)
            wav = Code2WavSession(
                pipe.code2wav, req.code2wav_streaming, req.chunk_frames, req.first_chunk_frames, req.left_context_frames
            )
        while True:
            if talk is not None:
                talk.add_token(tok.embed, tok.is_last)
                yield from pump_talker()
            if tok.is_last:
                break
            tok = pipe.thinker.decode(th)
            tokens.append(tok.token_id)
            yield TextEvent(tok.token_id, pipe.tokenizer.decode([tok.token_id]), time.perf_counter() - t0)
        timings["thinker_total_s"] = time.perf_counter() - t0
        if talk is not None:
            yield from pump_talker()
            yield from audio(input_finished=True)
        timings["total_s"] = time.perf_counter() - t0
        codes = torch.stack(frames, dim=1) if frames else torch.zeros((pipe.spec.num_code_groups, 0), dtype=torch.long)
        yield DoneEvent(
            token_ids=tokens,
            codes=codes,
            thinker_stopped_on=tok.stopped_on,
            talker_stopped_on=talk.stopped_on if talk is not None else None,
            timings=timings,
        )
    finally:
        pipe.thinker.release(th)
        if talk is not None:
            talk.close()
        if wav is not None:
            wav.close()


def write_wav(path: str | Path, pcm: torch.Tensor, sample_rate: int = SAMPLE_RATE) -> None:
    """16-bit PCM WAV (stdlib `wave`), the format every player reads."""
    import wave

    data = (pcm.clamp(-1, 1) * 32767).round().to(torch.int16).numpy().tobytes()
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(data)
