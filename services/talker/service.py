"""Talker stage: thinker chunks in (prompt, then one token at a time); codec frames down to
code2wav and up (for clients that want codes)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnistage.loader import Checkpoint, load_part, talker_tts_embeds
from omnistage.v1 import stage_pb2
from services.runtime.config import DeployConfig
from services.runtime.engine import Emit, OutChunk, StageWorker, StepItem, invalid
from services.runtime.sampling import TALKER_DEFAULTS
from services.runtime.sampling_wire import from_proto
from services.runtime.tensor_blob import DecodedChunk
from services.runtime.validate import FLOAT_DTYPES, INT_DTYPES, check_names, tensor
from services.talker.runner import TalkerRunner
from services.talker.session import TalkerSession, step_sessions


@dataclass
class TalkerState:
    start: stage_pb2.Start
    session: TalkerSession
    full_payload: bool
    got_prompt: bool = False
    frames_sent: int = 0
    opened_downstream: bool = False
    tokens: list[int] = field(default_factory=list)


class TalkerWorker(StageWorker):
    stage = "talker"

    def __init__(self, runner: TalkerRunner, edge_mode: int) -> None:
        self.runner = runner
        self.spec = runner.spec
        self.edge_mode = edge_mode

    def open(self, start: stage_pb2.Start) -> TalkerState:
        sampling = from_proto(self.stage, start.sampling.get("talker"), TALKER_DEFAULTS)
        speaker = start.speaker or "ethan"
        try:
            session = TalkerSession(self.runner, sampling, speaker)
        except ValueError as e:
            raise invalid(f"talker: {e}") from None
        return TalkerState(start=start, session=session, full_payload=start.mode == stage_pb2.FULL_PAYLOAD)

    def feed(self, state: TalkerState, chunk: DecodedChunk) -> None:
        h = self.spec.thinker_hidden
        if not state.got_prompt:
            check_names(self.stage, chunk, {"prompt_ids", "prompt_embed"}, {"prompt_hidden"})
            ids = tensor(self.stage, chunk, "prompt_ids", INT_DTYPES, (None,)).long()
            n = int(ids.shape[0])
            embeds = tensor(self.stage, chunk, "prompt_embed", FLOAT_DTYPES, (n, h))
            hidden = None
            if "prompt_hidden" in chunk.tensors:
                hidden = tensor(self.stage, chunk, "prompt_hidden", FLOAT_DTYPES, (n, h)).clone()
            try:
                state.session.set_prompt(ids.clone(), embeds.clone(), hidden)
            except ValueError as e:
                raise invalid(f"talker: {e}") from None
            state.got_prompt = True
            return
        if not chunk.tensors and chunk.finished:
            state.session.thinker_done = True
            return
        check_names(self.stage, chunk, {"ids", "embed"})
        ids = tensor(self.stage, chunk, "ids", INT_DTYPES, (None,))
        embed = tensor(self.stage, chunk, "embed", FLOAT_DTYPES, (int(ids.shape[0]), h))
        last = bool(chunk.meta.get("last", False))
        for i in range(ids.shape[0]):
            state.tokens.append(int(ids[i]))
            state.session.add_token(embed[i].clone(), last and i == ids.shape[0] - 1)

    def ready(self, state: TalkerState, input_finished: bool) -> bool:
        if input_finished and not state.session.thinker_done:
            state.session.thinker_done = True
        if state.full_payload and not input_finished:
            return False
        return state.session.can_progress() or state.session.finished

    def max_steps(self, state: TalkerState) -> int:
        # A step runs the prompt, or completes a frame and/or feeds it back: at most two steps
        # per code-0, plus the prompt.
        return 2 * state.session.req.sampling.max_tokens + 1

    def step(self, state: TalkerState, input_finished: bool) -> Emit:
        result = self.step_batch([StepItem(state, input_finished, 1)])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def step_batch(self, items: list[StepItem]) -> list[Emit | BaseException]:
        """One batched code-predictor pass and one packed talker forward for every request."""
        live = [i for i, item in enumerate(items) if not item.state.session.finished]
        frames: list[torch.Tensor | None] = [None] * len(items)
        if live:
            new = step_sessions(self.runner, [items[i].state.session for i in live])
            for i, frame in zip(live, new, strict=True):
                frames[i] = frame
        return [self._emit(item.state, frame) for item, frame in zip(items, frames, strict=True)]

    def _emit(self, state: TalkerState, frame: torch.Tensor | None) -> Emit:
        emit = Emit()
        session = state.session
        if frame is not None:
            if not state.opened_downstream:
                start = stage_pb2.Start()
                start.CopyFrom(state.start)
                if state.start.mode != stage_pb2.FULL_PAYLOAD:
                    start.mode = self.edge_mode  # type: ignore[assignment]
                emit.open_downstream = start
                state.opened_downstream = True
            codes = frame.view(-1, 1)
            emit.down.append(OutChunk({"codes": codes}, offset=state.frames_sent, n=1))
            emit.up.append(OutChunk({"codes": codes}, offset=state.frames_sent, n=1))
            state.frames_sent += 1
        if session.finished:
            meta = {"stopped_on": session.stopped_on or ""}
            emit.up.append(OutChunk({}, offset=state.frames_sent, finished=True, meta=meta))
            if state.opened_downstream:
                emit.down.append(OutChunk({}, offset=state.frames_sent, finished=True))
                emit.close_downstream = True
            emit.done = True
        return emit

    def close(self, state: TalkerState) -> None:
        state.session.close()



def build_worker(cfg: DeployConfig, ckpt: Checkpoint) -> TalkerWorker:
    stage = cfg.talker
    model = load_part(ckpt, "talker", stage.dtype, stage.device)
    mode = stage_pb2.FULL_PAYLOAD if cfg.edges.talker_to_code2wav == "full_payload" else stage_pb2.ASYNC_CHUNK
    return TalkerWorker(TalkerRunner(model, ckpt.spec, talker_tts_embeds(ckpt, model)), mode)


__all__ = ["TalkerWorker", "build_worker"]
