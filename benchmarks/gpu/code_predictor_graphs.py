"""The talker's per-frame code-predictor loop, eager against its CUDA graphs, in one process on
one loaded talker (the same weights, the same inputs, side by side): milliseconds per frame
batch at each batch size, median and p99 of `--iters` timed calls after a warm-up, and the
ratio. Also whether the graph's codes equal the eager loop's at the graph's bucket size.

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
from omnistage.models.qwen3_omni.code_predictor import greedy


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
    rows = []
    for batch in batches:
        g = torch.Generator().manual_seed(batch)
        first = torch.randn(batch, 2, ckpt.spec.talker_hidden, generator=g).to("cuda", talker.model.dtype)
        for _ in range(3):
            loop.run(first)
            loop._run(first, greedy, loop.cache)
        graphed = _times(lambda first=first: loop.run(first), args.iters, args.budget_s)
        eager = _times(lambda first=first: loop._run(first, greedy, loop.cache), args.iters, args.budget_s)
        same = torch.equal(loop.run(first), loop._run(first, greedy, loop.cache))
        eager_p50, graph_p50 = percentile(eager, 50) or 0.0, percentile(graphed, 50) or 0.0  # each ran at least once
        row = {"batch": batch, "eager_ms_p50": eager_p50, "eager_ms_p99": percentile(eager, 99),
               "graph_ms_p50": graph_p50, "graph_ms_p99": percentile(graphed, 99),
               "speedup_p50": eager_p50 / graph_p50 if graph_p50 else None, "codes_equal": same,
               "calls": [len(eager), len(graphed)]}  # fmt: skip
        rows.append(row)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    result = {"model": str(ckpt.path), "dtype": args.dtype, "batching": args.batching,
              "groups": ckpt.spec.num_code_groups, "device": torch.cuda.get_device_name(),
              "load_and_capture_s": time.perf_counter() - started, "rows": rows}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
