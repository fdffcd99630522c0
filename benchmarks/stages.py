"""Each stage alone, in process, on the workers of one ``InProcessPipeline``: the
bottleneck-stage baseline of ``omnistage bench``.

A stage runs behind a fresh engine (no thread) around the pipeline's own worker, with every
input already there: the thinker gets the prompts, the talker the thinker's recorded chunks,
code2wav the talker's recorded frames. The request mix runs in consecutive batches of each
batch size (``max_num_seqs`` = the batch size), as the stage's service batches them; its best
rate in requests/s counts, and the slowest stage bounds a pipeline of them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from omnistage.engine import Engine, OutChunk, Request, StepOutput
from omnistage.models.sampling import SamplingParams
from omnistage.topology import STAGES
from omnistage.v1 import stage_pb2
from services import edges
from services.pipeline import received


@dataclass
class Recorded:
    """What one request produced on one stage."""

    up: list[OutChunk] = field(default_factory=list)
    down: list[OutChunk] = field(default_factory=list)
    detail: str = ""

    def tensors(self, name: str) -> list[torch.Tensor]:
        return [c.tensors[name] for c in self.up if name in c.tensors]


class _Recorder:
    def __init__(self, rec: Recorded) -> None:
        self.rec = rec

    def on_output(self, req: Request, out: StepOutput) -> None:
        out.wait()
        self.rec.up += out.up
        self.rec.down += out.down

    def on_finished(self, req: Request) -> None:
        if req.error is not None:
            raise req.error
        self.rec.detail = req.finish_detail


def run_stage(
    pipe: Any, name: str, inputs: Sequence[tuple[stage_pb2.Start, list[OutChunk]]], per_step: int | None = None
) -> list[Recorded]:
    """Run requests `(start, input chunks)` together on stage `name` alone, to their ends.
    `per_step`: input chunks each request receives per engine iteration (None: all at once), to
    let a stage that decodes what has arrived (code2wav) stream as it does in service."""
    stage = pipe.cfg.stage(name)
    # the stage's own limits and prompt split (exact batching: fixed chunks), with room for the whole batch
    limits = {**stage.engine_limits(), "max_num_seqs": max(1, len(inputs)), "cache_capacity_tokens": None}
    engine = Engine(pipe.workers[name], 0, **limits, background=False)
    records = [Recorded() for _ in inputs]
    queues = []
    for (start, chunks), rec in zip(inputs, records, strict=True):
        queues.append((engine.open(start.request_id, start, _Recorder(rec)), list(chunks)))
    while not engine.idle:
        fed = False
        for req, chunks in queues:
            if chunks:
                take = len(chunks) if per_step is None else per_step
                for c in chunks[:take]:
                    engine.feed(req, received(c))
                del chunks[:take]
                if not chunks:
                    engine.close_input(req)
                fed = True
        if not engine.run_once() and not fed:
            raise RuntimeError(f"{name} alone made no progress")
    return records


def make_start(thinker: SamplingParams, talker: SamplingParams, want_audio: bool = True) -> stage_pb2.Start:
    start = stage_pb2.Start(request_id=uuid.uuid4().hex, want_audio=want_audio)
    start.sampling["thinker"].CopyFrom(edges.sampling_proto(thinker))
    start.sampling["talker"].CopyFrom(edges.sampling_proto(talker))
    return start


@dataclass
class StageTimes:
    """Seconds each stage took over the whole request mix, alone, by batch size."""

    s_by_batch: dict[str, dict[int, float]] = field(default_factory=lambda: {k: {} for k in STAGES})
    # fast batching: per stage and batch size, how its outputs compare with each request alone
    agreement: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
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
    key: Callable[[Any], list[Any]] | None,
    progress: Callable[[int], None] | None,
    exact: bool = True,
) -> list[Any]:
    """Run ``inputs`` through one stage in batches of each size, timed; return the outputs of
    the first size. With ``key`` (each output's tokens or frames), exact batching must give the
    first size's outputs at every size; fast batching's agreement with them is recorded."""
    first: list[Any] | None = None
    for b in sizes:
        t0 = time.perf_counter()
        out = [o for batch in _batches(len(inputs), b) for o in run_batch([inputs[i] for i in batch])]
        times.s_by_batch[name][b] = time.perf_counter() - t0
        if progress is not None:
            progress(1)
        if first is None:
            first = out
            continue
        if key is None:
            continue
        agreement = compare(list(map(key, first)), list(map(key, out)))
        if exact and agreement["identical"] < 1:
            raise RuntimeError(f"{name} at batch size {b} gave other outputs than at batch size {sizes[0]}")
        if not exact:
            times.agreement.setdefault(name, {})[b] = agreement
    return first or []


def compare(alone: list[list[Any]], batched: list[list[Any]]) -> dict[str, Any]:
    """Requests whose outputs (token ids, or frames) equal their lone run, and where the others
    first differ (the position of the first differing token or frame)."""
    diverged = [next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
                for x, y in zip(alone, batched, strict=True) if x != y]  # fmt: skip
    return {"requests": len(alone), "identical": (len(alone) - len(diverged)) / max(1, len(alone)),
            "first_divergence": sorted(diverged)}  # fmt: skip


def time_stages(
    pipe: Any,
    prompt_ids: Sequence[list[int]],
    thinker_sampling: SamplingParams,
    talker_sampling: SamplingParams,
    batch_sizes: Sequence[int] = (1, 2, 4, 8),
    progress: Callable[[int], None] | None = None,
) -> StageTimes:
    """Times every stage alone over the request mix at each batch size: the mix in consecutive
    batches of that many requests, each batch run to its end together. The talker replays the
    thinker outputs and code2wav the frames of the first batch size; every batch size must give
    the same tokens and codes (exact batching). ``progress`` is called once per (stage, batch
    size) timed."""
    times = StageTimes()
    sizes = batch_sizes_for(len(prompt_ids), batch_sizes)
    starts = [make_start(thinker_sampling, talker_sampling) for _ in prompt_ids]
    async_mode = edges.edge_mode("async_chunk")

    def tokens(rec: Recorded) -> list[int]:
        return [int(i) for t in rec.tensors(edges.IDS) for i in t.tolist()]

    def frames(rec: Recorded) -> list[list[int]]:
        return [f for t in rec.tensors(edges.CODES) for f in t.t().tolist()]

    exact = {name: pipe.cfg.stage(name).batching == "exact" for name in ("thinker", "talker")}
    thinker_out = _time_stage(
        times, "thinker", sizes, [(s, [edges.prompt_chunk(p)]) for s, p in zip(starts, prompt_ids, strict=True)],
        lambda batch: run_stage(pipe, "thinker", batch), tokens, progress, exact["thinker"],
    )  # fmt: skip
    talker_in = [(edges.downstream_start(s, async_mode), r.down) for s, r in zip(starts, thinker_out, strict=True)]
    talker_out = _time_stage(
        times, "talker", sizes, talker_in,
        lambda batch: run_stage(pipe, "talker", batch), frames, progress, exact["talker"],
    )  # fmt: skip
    c2w_in = [(s, r.down) for (s, _), r in zip(talker_in, talker_out, strict=True) if r.down]
    # As in service: the talker sends a causal decoder its frames a decode's worth per message,
    # another decoder each frame alone (services/talker/worker.py); one decode's worth per iteration.
    pace = 1 if pipe.spec.code2wav_causal else pipe.cfg.stage("code2wav").chunk_frames
    c2w_out = _time_stage(
        times, "code2wav", sizes, c2w_in, lambda batch: run_stage(pipe, "code2wav", batch, pace), None, progress
    )
    times.thinker_tokens = [len(tokens(r)) for r in thinker_out]
    times.talker_frames = [sum(int(t.shape[1]) for t in r.tensors(edges.CODES)) for r in talker_out]
    times.audio_samples = [sum(int(t.shape[0]) for t in r.tensors(edges.AUDIO)) for r in c2w_out]
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
        if name in times.agreement:  # fast batching: outputs against each request alone, per batch size
            stages[name]["agreement_by_batch"] = {str(b): a for b, a in sorted(times.agreement[name].items())}
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
