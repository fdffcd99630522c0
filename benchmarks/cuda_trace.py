"""Where a stage's copies run on CUDA (`omnistage bench trace`): the in-process pipeline on a GPU
under torch's profiler, then, from the trace, every host<->device copy by kind and stream, and
how much of the side stream's copy time a kernel on another stream ran through (the copies
overlap compute). Writes the Chrome trace (open it in Perfetto) and the summary."""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import machine_info, write_json

PROMPTS = [
    "Tell me a short story about a robot who learns to sing.",
    "Can you explain how streaming works?",
]


def copies_and_overlap(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per copy kind (the profiler's name, e.g. 'Memcpy DtoH (Device -> Pinned)') and stream: count,
    microseconds, and the microseconds during which a kernel ran on another stream."""
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy")]
    kernels = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["args"].get("stream"))
                     for e in spans if e["cat"] == "kernel")  # fmt: skip
    by: dict[tuple[str, Any], dict[str, float]] = defaultdict(lambda: {"count": 0, "us": 0.0, "overlapped_us": 0.0})
    for e in spans:
        if e["cat"] != "gpu_memcpy":
            continue
        t0, t1, stream = float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["args"].get("stream")
        row = by[(e["name"], stream)]
        row["count"] += 1
        row["us"] += t1 - t0
        covered = 0.0
        last = t0
        for k0, k1, ks in kernels:  # kernels sorted by start; the union of their cover on [t0, t1]
            if k0 >= t1:
                break
            if ks == stream or k1 <= last:
                continue
            covered += min(k1, t1) - max(k0, last)
            last = min(k1, t1)
        row["overlapped_us"] += covered
    compute = {s for _, _, s in kernels}
    return {
        "kernel_streams": sorted(compute, key=str),
        "copies": [
            {"kind": name, "stream": stream, **row,
             "overlapped_fraction": row["overlapped_us"] / row["us"] if row["us"] else 0.0}
            for (name, stream), row in sorted(by.items(), key=lambda kv: str(kv[0]))
        ],
    }


def measure(model_dir: Path | None, out_dir: Path, batching: str = "exact", requests: int = 2,
            dtype: str = "float32") -> dict[str, Any]:  # fmt: skip
    from omnistage.cli.serve import default_model_dir
    from omnistage.config import DeployConfig, apply_overrides, config_path
    from omnistage.models.sampling import SamplingParams
    from omnistage.topology import PROCESSES
    from services.pipeline import InProcessPipeline, PipelineRequest

    if not torch.cuda.is_available():
        raise SystemExit("bench trace needs a CUDA device")
    overrides: dict[str, Any] = {f"{config_path(n)}.device": "cuda" for n in PROCESSES}
    overrides |= {f"{config_path(n)}.dtype": dtype for n in PROCESSES}
    overrides |= {f"{config_path(n)}.batching": batching for n in ("thinker", "talker")}
    pipe = InProcessPipeline(model_dir or default_model_dir(), apply_overrides(DeployConfig(), overrides))

    def run(prompt: str) -> None:
        ids = pipe.prompt_ids(prompt)
        req = PipelineRequest(ids, pipe.thinker_defaults().with_overrides(max_tokens=24), SamplingParams(max_tokens=48))
        for _ in pipe.run(req):
            pass

    run(PROMPTS[0])  # warm-up: kernels chosen, allocator and host cache filled
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(requests):
            run(PROMPTS[i % len(PROMPTS)])
        torch.cuda.synchronize()
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / f"trace-{batching}.json"
    prof.export_chrome_trace(str(raw))
    events = json.loads(raw.read_text())["traceEvents"]
    with gzip.open(out_dir / f"trace-{batching}.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    raw.unlink()
    summary = {"machine": machine_info(), "device": torch.cuda.get_device_name(), "batching": batching,
               "dtype": dtype, "requests": requests, **copies_and_overlap(events)}  # fmt: skip
    write_json(out_dir / f"trace-{batching}.summary.json", summary)
    return summary
