"""The talker's per-frame code-predictor loop, eager against its CUDA graphs, in one process on
one loaded talker (the same weights, the same inputs, side by side): milliseconds per frame
batch at each batch size, median and p99 of `--iters` timed calls after a warm-up, and the
ratio; for greedy batches, and for sampled ones (every row sampling the code predictor's
defaults, its own seed: the talker's default over HTTP). Also whether the graph's codes equal
the eager loop's.

Usage: python -m benchmarks.gpu.code_predictor_graphs [--model DIR] [--dtype bfloat16]
       [--batching fast] [--batches 1,4,16] [--iters 50] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.stats import percentile
from omnistage.cli.serve import default_model_dir
from omnistage.models.checkpoint import open_checkpoint
from omnistage.models.qwen3_omni.code_predictor import ResidualChoice, greedy
from omnistage.models.sampling import CODE_PREDICTOR_SAMPLED, TokenChooser


def _times(call: Any, iters: int, budget_s: float) -> list[float]:
    out = []
    deadline = time.perf_counter() + budget_s
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - start) * 1e3)
        if time.perf_counter() > deadline:
            break
    return out


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batching", default="fast", choices=["exact", "fast"])
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--budget-s", type=float, default=20.0, help="time bound per batch size and path")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    ckpt = open_checkpoint(args.model or default_model_dir())
    started = time.perf_counter()
    talker = ckpt.family.talker(ckpt, args.dtype, "cuda", args.batching, cuda_graphs=max(batches))
    loop = talker.code_predictor
    groups = ckpt.spec.num_code_groups

    def sampled(batch: int) -> ResidualChoice:  # the same seeds every call: the same draws
        choosers = [TokenChooser(CODE_PREDICTOR_SAMPLED.with_overrides(seed=i), device="cuda") for i in range(batch)]
        return ResidualChoice(choosers, groups, "cuda")

    rows = []
    for batch in batches:
        g = torch.Generator().manual_seed(batch)
        first = torch.randn(batch, 2, ckpt.spec.talker_hidden, generator=g).to("cuda", talker.model.dtype)
        paths = {  # (graph, eager); a sampled call's choice (its uniforms drawn) is part of what it costs
            "": (lambda first=first: loop.run(first), lambda first=first: loop._run(first, greedy, loop.cache)),
            "sampled_": (lambda first=first, b=batch: loop.run(first, sampled(b)),
                         lambda first=first, b=batch: loop._run(first, sampled(b), loop.cache)),
        }  # fmt: skip
        row: dict[str, Any] = {"batch": batch}
        for prefix, (graph_call, eager_call) in paths.items():
            for _ in range(3):
                graph_call()
                eager_call()
            graphed = _times(graph_call, args.iters, args.budget_s)
            eager = _times(eager_call, args.iters, args.budget_s)
            eager_p50, graph_p50 = percentile(eager, 50) or 0.0, percentile(graphed, 50) or 0.0  # each ran once
            row.update({f"{prefix}eager_ms_p50": eager_p50, f"{prefix}eager_ms_p99": percentile(eager, 99),
                        f"{prefix}graph_ms_p50": graph_p50, f"{prefix}graph_ms_p99": percentile(graphed, 99),
                        f"{prefix}speedup_p50": eager_p50 / graph_p50 if graph_p50 else None,
                        f"{prefix}codes_equal": torch.equal(graph_call(), eager_call()),
                        f"{prefix}calls": [len(eager), len(graphed)]})  # fmt: skip
        rows.append(row)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    result = {"model": str(ckpt.path), "dtype": args.dtype, "batching": args.batching,
              "groups": ckpt.spec.num_code_groups, "device": torch.cuda.get_device_name(),
              "load_and_capture_s": time.perf_counter() - started, "rows": rows}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
