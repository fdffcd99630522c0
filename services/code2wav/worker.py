"""code2wav stage: codec frames in; float32 audio chunks up.

Chunking: a request's pending frames are decoded once its next chunk's worth of them
(`Code2WavConfig.chunk_target`: `first_chunk_frames`, then growing to `chunk_frames`) are final,
or whatever is left once its input has finished, at most `max_frames_per_step` of them a step;
every request due in a step is decoded in one batched call. A chunk the talker marks decode_now
(an idle pipeline's short first chunk) is decoded at once, as far as it is final.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omnistage.config import Code2WavConfig, DeployConfig
from omnistage.engine import FinishReason, Request, ScheduledItem, StageWorker, StepOutput
from omnistage.models import Checkpoint
from omnistage.v1 import stage_pb2
from omnistage.wire import DecodedChunk, invalid
from services import edges


class Code2WavWorker(StageWorker):
    name = "code2wav"

    def __init__(self, code2wav: Any, cfg: Code2WavConfig, sample_rate: int) -> None:
        self.code2wav = code2wav  # the family's code2wav (e.g. omnistage/models/qwen3_omni/code2wav.py)
        self.spec = code2wav.spec
        self.cfg = cfg
        self.sample_rate = sample_rate
        self.decode_now: set[str] = set()  # requests whose talker asked for what they have at once

    def open(self, req: Request) -> None:
        start: stage_pb2.Start = req.params
        params = start.sampling.get(self.name)
        seed = params.seed if params is not None and params.HasField("seed") else None  # a sampled vocoder's noise
        try:
            req.state = self.code2wav.open_stream(self.cfg.streaming, self.cfg.left_context_frames,
                                                  speaker=start.speaker or None, seed=seed)  # fmt: skip
        except ValueError as e:
            raise invalid(f"code2wav: {e}") from None

    def feed(self, req: Request, chunk: DecodedChunk) -> None:
        if edges.is_end(chunk):
            return
        codes = edges.read_frames(self.name, chunk, self.spec.num_code_groups)
        try:
            self.code2wav.validate_codes(codes)
        except ValueError as e:
            raise invalid(f"code2wav: tensor 'codes': {e}") from None
        if edges.meta_flag(self.name, chunk, edges.DECODE_NOW):
            self.decode_now.add(req.request_id)
        req.state.pending.extend(codes[:, t].clone() for t in range(codes.shape[1]))

    def _due(self, req: Request) -> bool:
        stream = req.state
        stream.input_done = req.input_finished
        if not stream.pending:
            return False
        # the family's decoder says how many pending frames can be final now (a look-ahead holds some back)
        target = 1 if req.request_id in self.decode_now else self.cfg.chunk_target(stream.frames_in)
        return req.input_finished or self.code2wav.ready_frames(stream) >= target

    def ready(self, req: Request) -> bool:
        start: stage_pb2.Start = req.params
        if start.mode == stage_pb2.FULL_PAYLOAD and not req.input_finished:
            return False
        return req.input_finished or self._due(req)

    def execute(self, batch: Sequence[ScheduledItem]) -> list[StepOutput | Exception]:
        """Every due request's frames go through one batched decode."""
        due = [it.request for it in batch if self._due(it.request)]
        self.decode_now.difference_update(r.request_id for r in due)
        decoded = dict(zip(due, self.code2wav.decode_pending([r.state for r in due], self.cfg.max_frames_per_step),
                           strict=True))  # fmt: skip
        outputs: list[StepOutput | Exception] = []
        for item in batch:
            req, out = item.request, StepOutput()
            if req in decoded and decoded[req][1].numel():
                first, pcm = decoded[req]
                out.up.append(edges.audio_chunk(first, pcm, self.sample_rate))
            if req.input_finished and not req.state.pending:
                out.up.append(edges.end_chunk(req.state.samples_out))
                out.finished = FinishReason.STOP
            outputs.append(out)
        return outputs

    def close(self, req: Request) -> None:
        self.decode_now.discard(req.request_id)
        self.code2wav.close(req.state)


def build_worker(cfg: DeployConfig, ckpt: Checkpoint) -> Code2WavWorker:
    stage = cfg.stage("code2wav")
    assert isinstance(stage, Code2WavConfig)
    code2wav = ckpt.family.code2wav(ckpt, stage.dtype, stage.device, stage.batching)
    return Code2WavWorker(code2wav, stage, ckpt.sample_rate)
