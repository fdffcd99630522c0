"""Thinker stage: prompt ids in; text token ids up; per-token embeddings down to the talker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc
import torch

from omnistage.loader import Checkpoint, load_part, thinker_sampling_defaults
from omnistage.v1 import stage_pb2
from services.runtime.config import DeployConfig
from services.runtime.engine import Emit, OutChunk, StageError, StageWorker, StepItem, invalid
from services.runtime.sampling import SamplingParams
from services.runtime.sampling_wire import from_proto
from services.runtime.tensor_blob import DecodedChunk
from services.runtime.validate import INT_DTYPES, check_names, tensor
from services.thinker.runner import PromptOutput, ThinkerRequest, ThinkerRunner, TokenOutput


@dataclass
class ThinkerState:
    start: stage_pb2.Start
    sampling: SamplingParams
    prompt_ids: list[int] | None = None
    req: ThinkerRequest | None = None


class ThinkerWorker(StageWorker):
    stage = "thinker"

    def __init__(self, runner: ThinkerRunner, defaults: SamplingParams, edge_mode: int) -> None:
        self.runner = runner
        self.defaults = defaults
        self.edge_mode = edge_mode

    def open(self, start: stage_pb2.Start) -> ThinkerState:
        sampling = from_proto(self.stage, start.sampling.get("thinker"), self.defaults)
        return ThinkerState(start=start, sampling=sampling)

    def feed(self, state: ThinkerState, chunk: DecodedChunk) -> None:
        if state.prompt_ids is not None:
            raise invalid("thinker: the prompt was already received")
        check_names(self.stage, chunk, {"ids"})
        ids = tensor(self.stage, chunk, "ids", INT_DTYPES, (None,))
        prompt = [int(i) for i in ids.tolist()]
        try:
            self.runner.validate_prompt(prompt)
        except ValueError as e:
            raise invalid(f"thinker: {e}") from None
        if len(prompt) != chunk.meta.get("n", len(prompt)):
            raise invalid(f"thinker: chunk meta n={chunk.meta.get('n')} disagrees with {len(prompt)} prompt ids")
        state.prompt_ids = prompt

    def ready(self, state: ThinkerState, input_finished: bool) -> bool:
        return input_finished and state.prompt_ids is not None and (state.req is None or not state.req.finished)

    def _token_chunks(self, state: ThinkerState, tok: TokenOutput) -> tuple[OutChunk, OutChunk]:
        meta = {"last": tok.is_last}
        if tok.stopped_on:
            meta["stopped_on"] = tok.stopped_on
        ids = torch.tensor([tok.token_id])
        up = OutChunk({"ids": ids}, offset=tok.index, n=1, finished=tok.is_last, meta=meta)
        down = OutChunk(
            {"ids": ids, "embed": tok.embed.unsqueeze(0)},
            offset=tok.index,
            n=1,
            finished=tok.is_last,
            meta={"last": tok.is_last},
        )
        return up, down

    def demand(self, state: ThinkerState) -> tuple[int, int] | None:
        if state.prompt_ids is None:
            return None
        return len(state.prompt_ids), state.sampling.max_tokens

    def max_model_len(self) -> int:
        return self.runner.spec.max_positions

    def step(self, state: ThinkerState, input_finished: bool) -> Emit:
        result = self.step_batch([StepItem(state, input_finished, 1 << 30)])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def step_batch(self, items: list[StepItem]) -> list[Emit | BaseException]:
        """One packed forward: prefill chunks of the `num_tokens` the scheduler gave, and decodes."""
        out: list[Emit | BaseException] = [Emit() for _ in items]
        work: list[tuple[int, ThinkerRequest, int]] = []
        for i, item in enumerate(items):
            state: ThinkerState = item.state
            if state.req is None:
                if state.prompt_ids is None:
                    out[i] = StageError(grpc.StatusCode.INVALID_ARGUMENT, "thinker: input finished without a prompt")
                    continue
                state.req = self.runner.new_request(state.prompt_ids, state.sampling)
            work.append((i, state.req, item.num_tokens))
        if work:
            results = self.runner.step_many([(req, n) for _, req, n in work])
            for (i, _, _), result in zip(work, results, strict=True):
                out[i] = self._emit(items[i].state, result.prompt, result.token)
        return out

    def _emit(self, state: ThinkerState, prompt: PromptOutput | None, tok: TokenOutput | None) -> Emit:
        want_audio = state.start.want_audio
        emit = Emit()
        if prompt is not None and want_audio:
            start = stage_pb2.Start()
            start.CopyFrom(state.start)
            if state.start.mode != stage_pb2.FULL_PAYLOAD:
                start.mode = self.edge_mode  # type: ignore[assignment]
            emit.open_downstream = start
            tensors: dict[str, Any] = {"prompt_ids": prompt.ids, "prompt_embed": prompt.embeds}
            mm = self.runner.spec.multimodal_ids
            if any(int(i) in mm for i in prompt.ids.tolist()):
                tensors["prompt_hidden"] = prompt.hidden
            emit.down.append(OutChunk(tensors, offset=0, n=0))
        if tok is None:  # a prefill chunk that is not the last
            return emit
        up, down = self._token_chunks(state, tok)
        emit.up.append(up)
        if want_audio:
            emit.down.append(down)
        if tok.is_last:
            emit.done = True
            emit.close_downstream = want_audio
        return emit

    def close(self, state: ThinkerState) -> None:
        if state.req is not None:
            self.runner.release(state.req)

    def capacity(self) -> dict[str, int]:
        return {"max_model_len": self.runner.spec.max_positions}


def build_worker(cfg: DeployConfig, ckpt: Checkpoint) -> ThinkerWorker:
    stage = cfg.thinker
    model = load_part(ckpt, "thinker", stage.dtype, stage.device)
    mode = stage_pb2.FULL_PAYLOAD if cfg.edges.thinker_to_talker == "full_payload" else stage_pb2.ASYNC_CHUNK
    return ThinkerWorker(ThinkerRunner(model, ckpt.spec), thinker_sampling_defaults(ckpt), mode)
