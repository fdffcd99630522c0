"""code2wav stage: codec frames in; 24 kHz float32 audio chunks up."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnistage.families.qwen3_omni import SAMPLE_RATE
from omnistage.loader import Checkpoint, load_part
from omnistage.v1 import stage_pb2
from services.code2wav.runner import Code2WavRunner, Code2WavSession
from services.runtime.config import Code2WavConfig, DeployConfig
from services.runtime.engine import Emit, OutChunk, StageWorker, StepItem, invalid
from services.runtime.tensor_blob import DecodedChunk
from services.runtime.validate import INT_DTYPES, check_names, tensor


@dataclass
class Code2WavState:
    session: Code2WavSession
    full_payload: bool
    pending_audio: tuple[int, torch.Tensor] | None = None  # decoded by step_batch for step


class Code2WavWorker(StageWorker):
    stage = "code2wav"

    def __init__(self, runner: Code2WavRunner, cfg: Code2WavConfig) -> None:
        self.runner = runner
        self.cfg = cfg

    def open(self, start: stage_pb2.Start) -> Code2WavState:
        c = self.cfg
        session = Code2WavSession(self.runner, c.streaming, c.chunk_frames, c.first_chunk_frames, c.left_context_frames)
        return Code2WavState(session=session, full_payload=start.mode == stage_pb2.FULL_PAYLOAD)

    def feed(self, state: Code2WavState, chunk: DecodedChunk) -> None:
        if not chunk.tensors and chunk.finished:
            return
        check_names(self.stage, chunk, {"codes"})
        spec = self.runner.spec
        codes = tensor(self.stage, chunk, "codes", INT_DTYPES, (spec.num_code_groups, None)).long()
        if chunk.meta.get("n") != codes.shape[1]:
            raise invalid(f"code2wav: chunk meta n={chunk.meta.get('n')} disagrees with {codes.shape[1]} frames")
        try:
            self.runner.validate_codes(codes)
        except ValueError as e:
            raise invalid(f"code2wav: tensor 'codes': {e}") from None
        for t in range(codes.shape[1]):
            state.session.add_frame(codes[:, t].clone())

    def ready(self, state: Code2WavState, input_finished: bool) -> bool:
        if state.full_payload and not input_finished:
            return False
        return state.session.due(input_finished) or input_finished

    def step(self, state: Code2WavState, input_finished: bool) -> Emit:
        emit = Emit()
        decoded, state.pending_audio = state.pending_audio, None
        if decoded is None and state.session.due(input_finished):
            decoded = state.session.decode_due()
        if decoded is not None:
            first, pcm = decoded
            meta = {"sample_rate": SAMPLE_RATE}
            emit.up.append(OutChunk({"audio": pcm}, offset=first, n=int(pcm.shape[0]), meta=meta))
        if input_finished and not state.session.pending:
            emit.up.append(OutChunk({}, offset=state.session.samples_out, finished=True))
            emit.done = True
        return emit

    def step_batch(self, items: list[StepItem]) -> list[Emit | BaseException]:
        """Every due request's frames go through one batched incremental decode."""
        due = [it.state for it in items if it.state.session.due(it.input_finished)]
        for st, decoded in zip(due, Code2WavSession.decode_many([st.session for st in due]), strict=True):
            st.pending_audio = decoded
        return [self.step(it.state, it.input_finished) for it in items]

    def close(self, state: Code2WavState) -> None:
        state.session.close()



def build_worker(cfg: DeployConfig, ckpt: Checkpoint) -> Code2WavWorker:
    stage = cfg.code2wav
    model = load_part(ckpt, "code2wav", stage.dtype, stage.device)
    return Code2WavWorker(Code2WavRunner(model, ckpt.spec), stage)
