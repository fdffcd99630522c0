"""Each stage alone, in-process, on the runners of one ``InProcessPipeline``.

Used twice by the harness:
  * the full-payload in-process baseline (thinker to the end, then the talker, then code2wav);
  * the bottleneck-stage baseline: each stage's runner timed alone over the same request mix
    (thinker tokens, talker frames from the recorded thinker outputs, code2wav decode of the
    recorded frames), converted to requests/s; the slowest stage bounds a pipeline of them.

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
from services.talker.session import TalkerSession
from services.thinker.runner import PromptOutput, TokenOutput

# Which stages have a runner that steps several requests together today.
BATCHED_RUNNERS = {"thinker": False, "talker": False, "code2wav": True}


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


def run_talker(pipe: Any, th: ThinkerResult, sampling: SamplingParams, speaker: str = "ethan") -> torch.Tensor:
    """All codec frames `[num_code_groups, frames]` for a finished thinker output, through the
    same ``TalkerSession`` the pipeline and the talker service use."""
    talk = TalkerSession(pipe.talker, sampling, speaker)
    frames: list[torch.Tensor] = []
    try:
        talk.set_prompt(th.prompt.ids, th.prompt.embeds, th.prompt.hidden)
        for t in th.tokens:
            talk.add_token(t.embed, t.is_last)
        while talk.can_progress():
            frame = talk.step()
            if frame is not None:
                frames.append(frame)
    finally:
        talk.close()
    if not frames:
        return torch.zeros((pipe.spec.num_code_groups, 0), dtype=torch.long)
    return torch.stack(frames, dim=1)


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


@dataclass
class StageTimes:
    """Seconds each stage spent on each request of the mix, run alone."""

    thinker_s: list[float] = field(default_factory=list)
    talker_s: list[float] = field(default_factory=list)
    code2wav_s_by_batch: dict[int, float] = field(default_factory=dict)  # batch size -> total seconds
    thinker_tokens: list[int] = field(default_factory=list)
    talker_frames: list[int] = field(default_factory=list)
    audio_samples: list[int] = field(default_factory=list)


def time_stages(
    pipe: Any,
    prompt_ids: Sequence[list[int]],
    thinker_sampling: SamplingParams,
    talker_sampling: SamplingParams,
    code2wav_batch_sizes: Sequence[int] = (1, 2, 4, 8),
    first_chunk: int = 4,
    chunk: int = 25,
    left_context: int = 25,
    progress: Callable[[int], None] | None = None,
) -> StageTimes:
    """Times every stage alone over the request mix. Thinker and talker run request by request
    (their runners take one request at a time); code2wav runs at each batch size given."""
    times = StageTimes()
    codes: list[torch.Tensor] = []
    for ids in prompt_ids:
        t0 = time.perf_counter()
        th = run_thinker(pipe, ids, thinker_sampling)
        t1 = time.perf_counter()
        c = run_talker(pipe, th, talker_sampling)
        t2 = time.perf_counter()
        times.thinker_s.append(t1 - t0)
        times.talker_s.append(t2 - t1)
        times.thinker_tokens.append(len(th.tokens))
        times.talker_frames.append(int(c.shape[1]))
        codes.append(c)
        if progress is not None:
            progress(1)
    n = len(codes)
    for b in sorted({max(1, min(b, n)) for b in code2wav_batch_sizes}) if n else []:
        t0 = time.perf_counter()
        pcm: list[torch.Tensor] = []
        for start in range(0, n, b):
            pcm += run_code2wav(pipe, codes[start : start + b], first_chunk, chunk, left_context)
        times.code2wav_s_by_batch[b] = time.perf_counter() - t0
        if not times.audio_samples:
            times.audio_samples = [int(p.shape[0]) for p in pcm]
    return times


def stage_summary(times: StageTimes) -> dict[str, Any]:
    """requests/s of each stage at its best batch size and which stage is the bottleneck."""
    n = len(times.thinker_s)
    stages: dict[str, Any] = {}
    if not n:
        return {"stages": stages, "bottleneck": None, "bottleneck_requests_per_s": None}

    def rate(total: float) -> float | None:
        return n / total if total > 0 else None

    stages["thinker"] = {
        "batch_sizes_tried": [1],
        "best_batch_size": 1,
        "total_s": sum(times.thinker_s),
        "requests_per_s": rate(sum(times.thinker_s)),
        "per_request_s": times.thinker_s,
        "tokens": times.thinker_tokens,
    }
    stages["talker"] = {
        "batch_sizes_tried": [1],
        "best_batch_size": 1,
        "total_s": sum(times.talker_s),
        "requests_per_s": rate(sum(times.talker_s)),
        "per_request_s": times.talker_s,
        "frames": times.talker_frames,
    }
    if times.code2wav_s_by_batch:
        best = min(times.code2wav_s_by_batch, key=lambda b: times.code2wav_s_by_batch[b])
        stages["code2wav"] = {
            "batch_sizes_tried": sorted(times.code2wav_s_by_batch),
            "best_batch_size": best,
            "total_s": times.code2wav_s_by_batch[best],
            "requests_per_s": rate(times.code2wav_s_by_batch[best]),
            "requests_per_s_by_batch": {str(b): rate(s) for b, s in sorted(times.code2wav_s_by_batch.items())},
            "audio_samples": times.audio_samples,
        }
    rated = {k: v["requests_per_s"] for k, v in stages.items() if v["requests_per_s"]}
    bottleneck = min(rated, key=lambda k: rated[k]) if rated else None
    return {
        "stages": stages,
        "bottleneck": bottleneck,
        "bottleneck_requests_per_s": rated.get(bottleneck) if bottleneck else None,
    }
