"""The in-process staged pipeline: the stage workers chained in one process, no gRPC.

Each stage's worker runs behind its own engine (scheduler and all), stepped from this thread;
chunks pass between them as they would over the wire, minus the encoding. It is the reference
the served stack is checked against and the baseline for what gRPC and processes cost.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import Any

import torch

from omnistage.config import DeployConfig
from omnistage.engine import Engine, OutChunk, Request, StepOutput
from omnistage.models import SamplingParams, load_tokenizer, open_checkpoint
from omnistage.models.sampling import TokenLogprobs
from omnistage.v1 import stage_pb2
from omnistage.wire import DecodedChunk, StageError
from omnistage.wire.tensor_blob import LENGTH_KEY
from services import edges


@dataclass
class TextEvent:
    token_id: int
    text: str
    t: float  # seconds since the request started
    logprobs: TokenLogprobs | None = None  # where the thinker's sampling asks for them


@dataclass
class AudioEvent:
    pcm: torch.Tensor  # float32 [samples]
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
    talker: SamplingParams | None = None  # None: the family's defaults
    want_audio: bool = True
    speaker: str = ""  # empty: the checkpoint's default voice
    full_payload: bool = False  # every stage waits for its whole input (else async_chunk)
    multimodal: dict[str, torch.Tensor] = field(default_factory=dict)  # the processor's audio/image/video tensors
    use_audio_in_video: bool = False
    code2wav_seed: int | None = None  # a sampled vocoder's noise (Qwen2.5-Omni's DiT); None: 0


def received(chunk: OutChunk) -> DecodedChunk:
    """What the next stage would decode from `chunk`."""
    return DecodedChunk(dict(chunk.tensors), {**chunk.meta, LENGTH_KEY: chunk.length}, chunk.offset, 0, chunk.finished)


class InProcessPipeline:
    """Loads every stage of one checkpoint and runs requests through them, one at a time."""

    def __init__(self, model_dir: str | Path, cfg: DeployConfig | None = None) -> None:
        self.cfg = cfg or DeployConfig()
        self.checkpoint = open_checkpoint(model_dir)
        self.checkpoint.check_serves(self.cfg.audio_output)
        self.family = self.checkpoint.family
        self.spec = self.checkpoint.spec
        self.tokenizer = load_tokenizer(self.checkpoint)
        self.chain = self.cfg.chain()  # the thinker's two roles too, when the config splits it
        self.workers = {s.name: import_module(s.worker).build_worker(self.cfg, self.checkpoint) for s in self.chain}
        self.engines = {name: self._engine(name, worker) for name, worker in self.workers.items()}

    def _engine(self, name: str, worker: Any) -> Engine:
        """The stage's engine with its config's scheduling limits, as a stage process has it."""
        c = self.cfg.stage(name)
        return Engine(worker, 0, **c.engine_limits(), background=False)

    # the family's parts, as each stage holds them
    @property
    def thinker(self) -> Any:
        return self.workers[self.chain[0].name].thinker

    @property
    def talker(self) -> Any:
        return self.workers["talker"].talker

    @property
    def code2wav(self) -> Any:
        return self.workers["code2wav"].code2wav

    def thinker_defaults(self) -> SamplingParams:
        return self.family.thinker_defaults(self.checkpoint)

    def prompt_ids(self, prompt: str, system: str | None = None) -> list[int]:
        if not prompt.strip():
            raise ValueError("empty prompt: nothing to generate from")
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        return self.family.prompt_ids(self.tokenizer, messages)

    def run(self, req: PipelineRequest) -> Iterator[TextEvent | AudioEvent | DoneEvent]:
        return _Run(self, req).events()


class _Run:
    """One request through the chain; each stage's sink routes its outputs to the next."""

    def __init__(self, pipe: InProcessPipeline, req: PipelineRequest) -> None:
        if req.want_audio and not pipe.cfg.audio_output:
            raise ValueError("want_audio: this pipeline serves text only (audio_output: false)")
        self.pipe = pipe
        self.t0 = time.perf_counter()
        start = stage_pb2.Start(request_id=uuid.uuid4().hex, want_audio=req.want_audio, speaker=req.speaker)
        if req.full_payload:
            start.mode = stage_pb2.FULL_PAYLOAD
        start.sampling["thinker"].CopyFrom(edges.sampling_proto(req.thinker))
        if req.talker is not None:
            start.sampling["talker"].CopyFrom(edges.sampling_proto(req.talker))
        if req.code2wav_seed is not None:
            start.sampling["code2wav"].seed = req.code2wav_seed
        self.start = start
        self.prompt = edges.prompt_chunk(req.prompt_ids, req.multimodal, req.use_audio_in_video)
        self.pending: list[TextEvent | AudioEvent] = []
        self.requests: dict[str, Request] = {}
        self.ended: dict[str, Request] = {}
        self.tokens: list[int] = []
        self.frames: list[torch.Tensor] = []
        self.timings: dict[str, float] = {}

    def _open(self, name: str, start: stage_pb2.Start) -> Request:
        req = self.pipe.engines[name].open(start.request_id, start, _Sink(self, name))
        self.requests[name] = req
        return req

    def output(self, name: str, req: Request, out: StepOutput) -> None:
        t = time.perf_counter() - self.t0
        out.wait()  # the chunks' copies to the host (from a CUDA stage) are complete
        for c in out.up:
            if edges.IDS in c.tensors:
                logprobs = edges.read_logprobs(name, received(c))
                for i, token in enumerate(c.tensors[edges.IDS].tolist()):
                    self.tokens.append(int(token))
                    self.pending.append(TextEvent(int(token), self.pipe.tokenizer.decode([int(token)]), t,
                                                  None if logprobs is None else logprobs[i]))  # fmt: skip
            elif edges.CODES in c.tensors:
                self.frames.extend(c.tensors[edges.CODES].unbind(1))
            elif edges.AUDIO in c.tensors and c.tensors[edges.AUDIO].numel():
                self.pending.append(AudioEvent(c.tensors[edges.AUDIO], c.offset, t))
        downstream = self.pipe.cfg.downstream(name)
        if out.down and downstream is not None:
            down = self.requests.get(downstream)
            if down is None:
                mode = edges.edge_mode(self.pipe.cfg.edge_mode(name, downstream))
                down = self._open(downstream, edges.downstream_start(self.start, mode))
            for c in out.down:
                self.pipe.engines[downstream].feed(down, received(c))

    def finished(self, name: str, req: Request) -> None:
        self.ended[name] = req
        self.timings[f"{name}_total_s"] = time.perf_counter() - self.t0
        downstream = self.pipe.cfg.downstream(name)
        down = self.requests.get(downstream) if downstream else None
        if down is not None and downstream not in self.ended:
            engine = self.pipe.engines[downstream]  # type: ignore[index]
            if req.error is not None:
                engine.abort(down)
            else:
                engine.close_input(down)

    def events(self) -> Iterator[TextEvent | AudioEvent | DoneEvent]:
        head = self.pipe.chain[0].name
        first = self._open(head, self.start)
        self.pipe.engines[head].feed(first, received(self.prompt))
        self.pipe.engines[head].close_input(first)
        try:
            while len(self.ended) < len(self.requests):
                progressed = False
                for s in self.pipe.chain:
                    progressed |= self.pipe.engines[s.name].run_once()
                yield from self.pending
                self.pending = []
                if not progressed and len(self.ended) < len(self.requests):
                    raise RuntimeError("in-process pipeline stalled: no stage can make progress")
            for req in self.ended.values():
                if req.error is not None:
                    raise req.error
        finally:
            for name, req in self.requests.items():
                if name not in self.ended:
                    self.pipe.engines[name].abort(req)
                    self.pipe.engines[name].run_once()
        groups = self.pipe.spec.num_code_groups
        codes = torch.stack(self.frames, dim=1) if self.frames else torch.zeros((groups, 0), dtype=torch.long)
        last_thinker = next(s.name for s in reversed(self.pipe.chain) if s.stream == "thinker")  # decode, if split
        thinker, talker = self.ended.get(last_thinker), self.ended.get("talker")
        self.timings["total_s"] = time.perf_counter() - self.t0
        yield DoneEvent(
            token_ids=self.tokens,
            codes=codes,
            thinker_stopped_on=thinker.finish_detail if thinker else None,
            talker_stopped_on=talker.finish_detail if talker else None,
            timings=self.timings,
        )


class _Sink:
    def __init__(self, run: _Run, name: str) -> None:
        self.run = run
        self.name = name

    def on_output(self, req: Request, out: StepOutput) -> None:
        self.run.output(self.name, req, out)

    def on_finished(self, req: Request) -> None:
        self.run.finished(self.name, req)


__all__ = ["AudioEvent", "DoneEvent", "InProcessPipeline", "PipelineRequest", "StageError", "TextEvent", "received"]
