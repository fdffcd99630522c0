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
from typing import Any

import torch

from omnistage.families.qwen3_omni import (
    ASSISTANT_HEADER_LEN,
    SAMPLE_RATE,
    assistant_start,
    build_prompt_ids,
    messages_from_prompt,
    tts_special_embeds,
    tts_special_ids,
)
from omnistage.loader import (
    THINKER_EMBED_KEYS,
    Checkpoint,
    load_part,
    load_tokenizer,
    open_checkpoint,
    read_tensor_rows,
)
from services.code2wav.runner import Code2WavRunner, StreamingMode
from services.runtime.sampling import TALKER_DEFAULTS, SamplingParams
from services.talker.runner import TalkerRunner
from services.thinker.runner import ThinkerRunner, TokenOutput


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
        self.talker = TalkerRunner(talker_model, self.spec, self._tts_embeds(talker_model))
        self.code2wav = Code2WavRunner(load_part(self.checkpoint, "code2wav", dtype, device), self.spec)

    def _tts_embeds(self, talker_model: Any) -> torch.Tensor:
        rows = read_tensor_rows(self.checkpoint, THINKER_EMBED_KEYS, tts_special_ids(self.spec))
        return tts_special_embeds(talker_model, rows)

    def thinker_defaults(self) -> SamplingParams:
        return default_thinker_sampling(self.checkpoint)

    def prompt_ids(self, prompt: str, system: str | None = None) -> list[int]:
        if not prompt.strip():
            raise ValueError("empty prompt: nothing to generate from")
        return build_prompt_ids(self.tokenizer, messages_from_prompt(prompt, system))

    def run(self, req: PipelineRequest) -> Iterator[TextEvent | AudioEvent | DoneEvent]:
        return run_request(self, req)


def default_thinker_sampling(ckpt: Checkpoint) -> SamplingParams:
    """The checkpoint's generation_config for the thinker, stopping on `<|im_end|>`."""
    import json

    gen_file = ckpt.path / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    return SamplingParams(
        do_sample=bool(gen.get("do_sample", False)),
        temperature=float(gen.get("temperature", 1.0) or 1.0),
        top_k=int(gen.get("top_k", 0) or 0) if gen.get("do_sample") else 0,
        top_p=float(gen.get("top_p", 1.0) or 1.0),
        repetition_penalty=float(gen.get("repetition_penalty", 1.0) or 1.0),
        max_tokens=1024,
        stop_ids=(ckpt.spec.im_end_id,),
    )


def run_request(pipe: InProcessPipeline, req: PipelineRequest) -> Iterator[TextEvent | AudioEvent | DoneEvent]:
    t0 = time.perf_counter()
    spec = pipe.spec
    th = pipe.thinker.new_request(req.prompt_ids, req.thinker)
    timings: dict[str, float] = {}

    prompt, tok = pipe.thinker.prefill(th)
    timings["thinker_prefill_s"] = time.perf_counter() - t0
    tokens: list[TokenOutput] = [tok]
    yield TextEvent(tok.token_id, pipe.tokenizer.decode([tok.token_id]), time.perf_counter() - t0)

    talk = None
    wav_stream = None
    stream_prompt = None  # layer-0 embeds of the prompt's assistant header
    frames: list[torch.Tensor] = []
    emitted_frames = 0
    emitted_samples = 0
    if req.want_audio:
        talk = pipe.talker.new_request(req.talker, req.speaker)
        stream_prompt = prompt.embeds[assistant_start(prompt.ids, spec) :]
        wav_stream = pipe.code2wav.open_stream(req.code2wav_streaming, req.left_context_frames)
    talker_started = False

    def stream_element(k: int) -> tuple[torch.Tensor, bool] | None:
        """Assistant-stream element k (prompt header, then generated tokens) and whether it is
        the thinker's last token; None if the thinker has not produced it yet."""
        assert stream_prompt is not None
        if k < stream_prompt.shape[0]:
            return stream_prompt[k], False
        i = k - stream_prompt.shape[0]
        if i < len(tokens):
            return tokens[i].embed, tokens[i].is_last
        return None

    def pump_talker(thinker_done: bool) -> Iterator[AudioEvent]:
        nonlocal talker_started, emitted_frames, emitted_samples
        assert talk is not None and stream_prompt is not None
        if not talker_started:
            needed = [stream_element(k) for k in range(ASSISTANT_HEADER_LEN + 1)]
            if any(e is None for e in needed):
                return
            if any(last for _, last in needed):  # the reference cannot speak a 1-token reply
                talk.finished, talk.stopped_on = True, "no_text"
                return
            t = time.perf_counter()
            pipe.talker.prefill(
                talk, prompt.ids, prompt.embeds, prompt.hidden, torch.stack([e for e, _ in needed])
            )
            timings["talker_prefill_s"] = time.perf_counter() - t
            talker_started = True
        while not talk.finished:
            if talk.pending_frame is None:  # the frame is ready before the next token is needed
                talk.pending_frame = pipe.talker.residuals(talk)
                frames.append(talk.pending_frame)
                target = req.first_chunk_frames if emitted_frames == 0 else req.chunk_frames
                if len(frames) - emitted_frames >= target:
                    yield from flush_audio(final=False)
            element = stream_element(ASSISTANT_HEADER_LEN + 1 + talk.step)
            if element is None and not thinker_done:
                return  # wait for thinker token g+1
            embed, is_last = element if element is not None else (None, False)
            pipe.talker.advance(talk, talk.pending_frame, pipe.talker.prompts.trailing_embed(embed, is_last))
            talk.pending_frame = None

    def flush_audio(final: bool) -> Iterator[AudioEvent]:
        nonlocal emitted_frames, emitted_samples
        if len(frames) == emitted_frames or wav_stream is None:
            return
        new = torch.stack(frames[emitted_frames:], dim=1)
        pcm = pipe.code2wav.push([wav_stream], [new])[0]
        emitted_frames = len(frames)
        if pcm.numel():
            yield AudioEvent(pcm, emitted_samples, time.perf_counter() - t0)
            emitted_samples += int(pcm.shape[0])

    while True:
        if talk is not None and not talk.finished:
            yield from pump_talker(thinker_done=tok.is_last)
        if tok.is_last:
            break
        tok = pipe.thinker.decode(th)
        tokens.append(tok)
        yield TextEvent(tok.token_id, pipe.tokenizer.decode([tok.token_id]), time.perf_counter() - t0)
    timings["thinker_total_s"] = time.perf_counter() - t0
    pipe.thinker.release(th)
    if talk is not None:
        while not talk.finished:
            yield from pump_talker(thinker_done=True)
        yield from flush_audio(final=True)
        pipe.talker.release(talk)
    if wav_stream is not None:
        pipe.code2wav.close(wav_stream)
    timings["total_s"] = time.perf_counter() - t0
    codes = torch.stack(frames, dim=1) if frames else torch.zeros((spec.num_code_groups, 0), dtype=torch.long)
    yield DoneEvent(
        token_ids=[t.token_id for t in tokens],
        codes=codes,
        thinker_stopped_on=tokens[-1].stopped_on,
        talker_stopped_on=talk.stopped_on if talk is not None else None,
        timings=timings,
    )


def write_wav(path: str | Path, pcm: torch.Tensor, sample_rate: int = SAMPLE_RATE) -> None:
    """16-bit PCM WAV (stdlib `wave`), the format every player reads."""
    import wave

    data = (pcm.clamp(-1, 1) * 32767).round().to(torch.int16).numpy().tobytes()
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(data)
