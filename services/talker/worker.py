"""Talker stage: thinker chunks in (the prompt, then one token at a time); codec frames down to
code2wav and up (for callers that want codes).

Frames go out on code2wav's schedule when its decoder is causal (`Code2WavConfig.chunk_target`:
`first_chunk_frames`, then as many as were sent, up to `chunk_frames`; the rest with the end; a
request's first frame made while no other request is open here goes out as
`first_chunk_frames_idle`, marked for code2wav to decode at once).
The code2wav stage decodes on that schedule anyway, so its first audio comes no later, and a
reply's frames take a few messages through three processes instead of one each (measured: +40 %
requests/s at c=16 on 2 cores). A decoder that looks ahead (its audio for a frame waits for later
frames) gets every frame as it is made."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from omnistage.config import Code2WavConfig, DeployConfig, TalkerConfig
from omnistage.engine import FinishReason, Request, ScheduledItem, StageWorker, StepOutput
from omnistage.models import Checkpoint, SamplingParams
from omnistage.v1 import stage_pb2
from omnistage.wire import Code, DecodedChunk, StageError, invalid
from services import edges

# what made the talker stop -> the engine's finish reason
_REASONS = {"stop_id": FinishReason.STOP, "no_text": FinishReason.STOP, "max_tokens": FinishReason.LENGTH}
# the thinker's rows, which the talker only reads on its device (copied as they arrive)
_ON_DEVICE = frozenset({edges.PROMPT_EMBED, edges.PROMPT_HIDDEN, edges.EMBED, edges.HIDDEN})

# The largest batch captured as a CUDA graph (larger ones run eagerly): each capture costs start-up
# time and graph memory, and an exact-mode capture grows with its batch.
MAX_GRAPH_BATCH = 256


class TalkerWorker(StageWorker):
    name = "talker"

    def __init__(self, talker: Any, defaults: SamplingParams, code2wav: Code2WavConfig | None = None) -> None:
        self.talker = talker  # the family's talker (e.g. omnistage/models/qwen3_omni/talker.py)
        self.device = talker.device
        self.spec = talker.spec
        self.defaults = defaults
        # the code2wav schedule frames are sent on (None: each frame as it is made)
        self.schedule = code2wav if self.spec.code2wav_causal else None
        self.held: dict[str, list[torch.Tensor]] = {}

    def wants_on_device(self, name: str) -> bool:
        return name in _ON_DEVICE

    def sends_down(self, req: Request) -> bool:
        return True  # its frames to code2wav, and always the end (even of a reply with no frames)

    def made(self, out: StepOutput) -> int:
        return sum(c.length for c in out.down)  # every frame goes down; up only when the caller wants codes

    def open(self, req: Request) -> None:
        start: stage_pb2.Start = req.params
        sampling = edges.sampling(self.name, start, self.defaults, int(self.spec.max_positions),
                                  "the model's positions", vocab=self.spec.talker_vocab,
                                  required_stop_ids=self.spec.talker_stop_ids())  # fmt: skip
        try:
            req.state = self.talker.new_state(sampling, start.speaker or self.spec.default_speaker)
        except ValueError as e:
            raise invalid(f"talker: {e}") from None
        self.held[req.request_id] = []  # frames made, not yet sent (the schedule above)

    def feed(self, req: Request, chunk: DecodedChunk) -> None:
        state = req.state
        hidden_size = self.spec.thinker_hidden
        if state.prompt is None:
            prompt = edges.read_thinker_prompt(self.name, chunk, hidden_size)
            try:
                self.talker.set_prompt(state, prompt.ids, self._cast(prompt.embeds), self._cast(prompt.hidden),
                                       prompt.rope)  # fmt: skip
            except ValueError as e:
                raise invalid(f"talker: {e}") from None
            return
        if edges.is_end(chunk):  # the last token it had was not marked last: it cannot be taken back
            raise invalid("talker: an empty finished chunk after the tokens; the chunk holding the thinker's "
                          "last token must be the finished one")  # fmt: skip
        tokens = edges.read_tokens(self.name, chunk, hidden_size, with_hidden=bool(self.spec.talker_needs_hidden))
        for i, (embed, hidden) in enumerate(tokens):
            state.add_token(self._cast(embed), chunk.finished and i == len(tokens) - 1, self._cast(hidden))

    def _cast(self, rows: torch.Tensor | None) -> torch.Tensor | None:
        """The thinker's rows (finite: edges checked) in the talker's dtype: a thinker in bfloat16
        may feed a float32 talker, and mixed dtypes failed the step the request shared."""
        return None if rows is None else rows.to(self.dtype)

    @functools.cached_property
    def dtype(self) -> torch.dtype:
        """The talker's weights' dtype, what it computes in."""
        return next(self.talker.model.parameters()).dtype

    def max_steps(self, req: Request) -> int:
        # A step runs the prompt, or completes a frame and/or feeds it back: at most two steps
        # per code-0, plus the prompt.
        return 2 * req.state.sampling.max_tokens + 1

    def ready(self, req: Request) -> bool:
        start: stage_pb2.Start = req.params
        if start.mode == stage_pb2.FULL_PAYLOAD and not req.input_finished:
            return False
        return req.state.finished or req.state.can_step(req.input_finished)

    def execute(self, batch: Sequence[ScheduledItem]) -> list[StepOutput | Exception]:
        """One packed talker forward and one batched code-predictor pass for every request."""
        live = [it.request for it in batch if not it.request.state.finished]
        frames = dict(zip(live, self.talker.step([(r.state, r.input_finished) for r in live]), strict=True))
        # no other request open here, stepping or waiting for its thinker: the pipeline has room
        # (Code2WavConfig.chunk_target); a burst that has reached the talker is not idle
        idle = len(self.held) == 1
        return [self._output(it.request, frames.get(it.request), idle) for it in batch]

    def _output(self, req: Request, frame: Any, idle: bool) -> StepOutput | Exception:
        state = req.state
        if state.error is not None:  # the model's output failed this request (not its input): it alone fails
            return StageError(Code.INTERNAL, f"talker: {state.error}")
        out = StepOutput()
        held = self.held[req.request_id]
        if frame is not None:
            held.append(frame)
        sent = state.frames - len(held)
        due = self.schedule is None or len(held) >= self.schedule.chunk_target(sent, idle) or state.finished
        if held and due:
            # cut short of code2wav's own count (an idle pipeline's first chunk): code2wav is told
            short = self.schedule is not None and not state.finished and len(held) < self.schedule.chunk_target(sent)
            chunk = edges.frames_chunk(sent, torch.stack(held, dim=1), decode_now=short)
            held.clear()
            out.down.append(chunk)
            if not req.params.omit_codes:
                out.up.append(chunk)
        if state.finished:
            out.up.append(edges.end_chunk(state.frames, state.stopped_on))
            out.down.append(edges.end_chunk(state.frames))
            out.finished = _REASONS[state.stopped_on]
            out.detail = state.stopped_on
        return out

    def close(self, req: Request) -> None:
        self.held.pop(req.request_id, None)
        self.talker.release(req.state)

    def kv_pool_tokens(self) -> int:
        return int(self.talker.batching.pooled_tokens())


def build_worker(cfg: DeployConfig, ckpt: Checkpoint) -> TalkerWorker:
    stage = cfg.stage("talker")
    assert isinstance(stage, TalkerConfig)
    graphs = min(stage.max_num_seqs, MAX_GRAPH_BATCH) if stage.cuda_graphs else 0
    talker = ckpt.family.talker(ckpt, stage.dtype, stage.device, stage.batching, graphs)
    code2wav = cfg.stage("code2wav")
    assert isinstance(code2wav, Code2WavConfig)
    return TalkerWorker(talker, ckpt.family.talker_defaults(), code2wav)
