"""Each stage alone, in-process, on the runners of one ``InProcessPipeline``.

Used twice by the harness:
  * the full-payload in-process baseline (thinker to the end, then the talker, then code2wav);
  * the bottleneck-stage baseline: each stage's runner timed alone over the same request mix
    (thinker tokens, talker frames from the recorded thinker outputs, code2wav decode of the
    recorded frames) at several batch sizes, the way its service batches (the thinker's and
    talker's packed steps, code2wav's batched decode); its best rate in requests/s; the
    slowest stage bounds a pipeline of them.

The talker replay drives the same ``TalkerSession`` as ``omnistage.pipeline.run_request``, with
every thinker token already there, so it produces the same codes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from services.runtime.sampling import SamplingParams
from services.talker.session import TalkerSession, step_sessions
from services.thinker.runner import PromptOutput, TokenOutput


@dataclass
class ThinkerResult:
    prompt: PromptOutput
    tokens: list[TokenOutput]

    @property
    def token_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]


def run_thinker(
    pipe: Any,
    prompt_ids: list[int],
    sampling: SamplingParams,
    on_token: Callable[[TokenOutput], None] | None = None,
) -> ThinkerResult:
    """Prefill and decode one request to its end on the thinker runner alone."""
    runner = pipe.thinker
    req = runner.new_request(prompt_ids, sampling)
    prompt, tok = runner.prefill(req)
    tokens = [tok]
    if on_token is not None:
        on_token(tok)
    while not tok.is_last:
        tok = runner.decode(req)
        tokens.append(tok)
        if on_token is not None:
            on_token(tok)
    runner.release(req)
    return ThinkerResult(prompt, tokens)


def run_thinker_many(pipe: Any, prompts: Sequence[list[int]], sampling: SamplingParams) -> list[ThinkerResult]:
    """Several requests to their ends together, one packed step for all of them at a time (each
    prompt whole in its first step), as the thinker service batches them."""
    runner = pipe.thinker
    reqs = [runner.new_request(p, sampling) for p in prompts]
    prompt_outs: list[PromptOutput | None] = [None] * len(reqs)
    tokens: list[list[TokenOutput]] = [[] for _ in reqs]
    live = list(range(len(reqs)))
    try:
        while live:
            items = [(reqs[i], 1 if reqs[i].prefill_done else len(prompts[i])) for i in live]
            for i, out in zip(live, runner.step_many(items), strict=True):
                if out.prompt is not None:
                    prompt_outs[i] = out.prompt
                if out.token is not None:
                    tokens[i].append(out.token)
            live = [i for i in live if not (tokens[i] and tokens[i][-1].is_last)]
    finally:
        for r in reqs:
            runner.release(r)
    results = []
    for p, t in zip(prompt_outs, tokens, strict=True):
        assert p is not None
        results.append(ThinkerResult(p, t))
    return results


def _talker_session(pipe: Any, th: ThinkerResult, sampling: SamplingParams, speaker: str) -> TalkerSession:
    """A session with every thinker output already there."""
    talk = TalkerSession(pipe.talker, sampling, speaker)
    talk.set_prompt(th.prompt.ids, th.prompt.embeds, th.prompt.hidden)
    for t in th.tokens:
        talk.add_token(t.embed, t.is_last)
    return talk


def _stack_frames(pipe: Any, frames: list[torch.Tensor]) -> torch.Tensor:
    if not frames:
        return torch.zeros((pipe.spec.num_code_groups, 0), dtype=torch.long)
    return torch.stack(frames, dim=1)


def run_talker_many(
    pipe: Any, ths: Sequence[ThinkerResult], sampling: SamplingParams, speaker: str = "ethan"
) -> list[torch.Tensor]:
    """``run_talker`` for several finished thinker outputs together, one batched step
    (``step_sessions``) at a time, as the talker service batches them."""
    sessions = [_talker_session(pipe, th, sampling, speaker) for th in ths]
    frames: list[list[torch.Tensor]] = [[] for _ in sessions]
    try:
        while True:
            live = [i for i, s in enumerate(sessions) if s.can_progress()]
            if not live:
                break
            for i, frame in zip(live, step_sessions(pipe.talker, [sessions[i] for i in live]), strict=True):
                if frame is not None:
                    frames[i].append(frame)
    finally:
        for s in sessions:
            s.close()
    return [_stack_frames(pipe, f) for f in frames]


def run_talker(pipe: Any, th: ThinkerResult, sampling: SamplingParams, speaker: str = "ethan") -> torch.Tensor:
    """All codec frames `[num_code_groups, frames]` for a finished thinker output, through the
    same ``TalkerSession`` the pipeline and the talker service use."""
    talk = _talker_session(pipe, th, sampling, speaker)
    frames: list[torch.Tensor] = []
    try:
        while talk.can_progress():
            frame = talk.step()
            if frame is not None:
                frames.append(frame)
    finally:
        talk.close()
    return _stack_frames(pipe, frames)


def chunk_schedule(frames: int, first_chunk: int, chunk: int) -> list[tuple[int, int]]:
    """Frame spans code2wav is fed, as the pipeline feeds it: a small first chunk, then `chunk`."""
    spans: list[tuple[int, int]] = []
    pos = 0
    while pos < frames:
        n = first_chunk if not spans else chunk
        spans.append((pos, min(pos + n, frames)))
        pos += n
    return spans


def run_code2wav(
    pipe: Any, codes: Sequence[torch.Tensor], first_chunk: int = 4, chunk: int = 25, left_context: int = 25
) -> list[torch.Tensor]:
    """Streamed decode of several requests together (one batched step per chunk round);
    returns each request's PCM."""
    runner = pipe.code2wav
    streams = [runner.open_stream("exact", left_context) for _ in codes]
    plans = [chunk_schedule(int(c.shape[1]), first_chunk, chunk) for c in codes]
    outs: list[list[torch.Tensor]] = [[] for _ in codes]
    step = 0
    while True:
        active = [i for i, p in enumerate(plans) if step < len(p)]
        if not active:
            break
        pcm = runner.push(
            [streams[i] for i in active],
            [codes[i][:, plans[i][step][0] : plans[i][step][1]] for i in active],
        )
        for i, p in zip(active, pcm, strict=True):
            outs[i].append(p)
        step += 1
    for s in streams:
        runner.close(s)
    return [torch.cat(o) if o else torch.zeros(0) for o in outs]


STAGES = ("thinker", "talker", "code2wav")


@dataclass
class StageTimes:
    """Seconds each stage took over the whole request mix, alone, by batch size."""

    s_by_batch: dict[str, dict[int, float]] = field(default_factory=lambda: {k: {} for k in STAGES})
    thinker_tokens: list[int] = field(default_factory=list)
    talker_frames: list[int] = field(default_factory=list)
    audio_samples: list[int] = field(default_factory=list)


def batch_sizes_for(n: int, batch_sizes: Sequence[int]) -> list[int]:
    """The distinct batch sizes that differ for a mix of n requests."""
    return sorted({max(1, min(b, n)) for b in batch_sizes}) if n else []


def _batches(n: int, b: int) -> list[range]:
    return [range(start, min(start + b, n)) for start in range(0, n, b)]


def _time_stage(
    times: StageTimes,
    name: str,
    sizes: Sequence[int],
    inputs: Sequence[Any],
    run_batch: Callable[[list[Any]], list[Any]],
    same: Callable[[list[Any], list[Any]], bool] | None,
    progress: Callable[[int], None] | None,
) -> list[Any]:
    """Run ``inputs`` through one stage in batches of each size, timed; return the outputs of
    the first size, which every other size must match (``same``) when given."""
    first: list[Any] | None = None
    for b in sizes:
        t0 = time.perf_counter()
        out = [o for batch in _batches(len(inputs), b) for o in run_batch([inputs[i] for i in batch])]
        times.s_by_batch[name][b] = time.perf_counter() - t0
        if progress is not None:
            progress(1)
        if first is None:
            first = out
        elif same is not None and not same(out, first):
            raise RuntimeError(f"{name} at batch size {b} gave other outputs than at batch size {sizes[0]}")
    return first or []


def time_stages(
    pipe: Any,
    prompt_ids: Sequence[list[int]],
    thinker_sampling: SamplingParams,
    talker_sampling: SamplingParams,
    batch_sizes: Sequence[int] = (1, 2, 4, 8),
    first_chunk: int = 4,
    chunk: int = 25,
    left_context: int = 25,
    progress: Callable[[int], None] | None = None,
) -> StageTimes:
    """Times every stage alone over the request mix at each batch size: the mix in consecutive
    batches of that many requests, each batch run to its end together. The talker replays the
    thinker outputs and code2wav the codes of the first batch size; every batch size must give
    the same tokens and codes (packed steps are batch-invariant). ``progress`` is called once
    per (stage, batch size) timed."""
    times = StageTimes()
    sizes = batch_sizes_for(len(prompt_ids), batch_sizes)
    thinker_out = _time_stage(
        times, "thinker", sizes, prompt_ids,
        lambda batch: run_thinker_many(pipe, batch, thinker_sampling),
        lambda a, b: [r.token_ids for r in a] == [r.token_ids for r in b], progress,
    )  # fmt: skip
    codes = _time_stage(
        times, "talker", sizes, thinker_out,
        lambda batch: run_talker_many(pipe, batch, talker_sampling),
        lambda a, b: all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), progress,
    )  # fmt: skip
    pcm = _time_stage(
        times, "code2wav", sizes, codes,
        lambda batch: run_code2wav(pipe, batch, first_chunk, chunk, left_context), None, progress,
    )  # fmt: skip
    times.thinker_tokens = [len(r.tokens) for r in thinker_out]
    times.talker_frames = [int(c.shape[1]) for c in codes]
    times.audio_samples = [int(p.shape[0]) for p in pcm]
    return times


def stage_summary(times: StageTimes, requests: int) -> dict[str, Any]:
    """requests/s of each stage at its best batch size and which stage is the bottleneck."""
    stages: dict[str, Any] = {}
    for name, by_batch in times.s_by_batch.items():
        if not by_batch or not requests:
            continue
        best = min(by_batch, key=lambda b: by_batch[b])
        stages[name] = {
            "batch_sizes_tried": sorted(by_batch),
            "best_batch_size": best,
            "total_s": by_batch[best],
            "requests_per_s": requests / by_batch[best] if by_batch[best] > 0 else None,
            "requests_per_s_by_batch": {str(b): requests / s if s > 0 else None for b, s in sorted(by_batch.items())},
        }
    if "thinker" in stages:
        stages["thinker"]["tokens"] = times.thinker_tokens
    if "talker" in stages:
        stages["talker"]["frames"] = times.talker_frames
    if "code2wav" in stages:
        stages["code2wav"]["audio_samples"] = times.audio_samples
    rated = {k: v["requests_per_s"] for k, v in stages.items() if v["requests_per_s"]}
    bottleneck = min(rated, key=lambda k: rated[k]) if rated else None
    return {
        "stages": stages,
        "bottleneck": bottleneck,
        "bottleneck_requests_per_s": rated.get(bottleneck) if bottleneck else None,
    }
