"""What each stage process holds (`omnistage bench load`): the peak resident memory of loading one
part of a checkpoint, against loading the whole model, each in a fresh process.

Every figure is a fresh `python` that imports torch and transformers first (its RSS then is the
baseline), then loads; the peak RSS (`VmHWM`) minus that baseline is what the load cost. Of what
the loaded process holds, `anon` is its own memory and `file` the checkpoint's pages it maps
(weights stored in the dtype loaded are used in place from the mapped files: page cache, which
the kernel may drop and other processes mapping the same files share).
With no `--model` it writes a synthetic checkpoint of the family, large enough that weights
dominate (published layout, sharded, experts stored one by one).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import machine_info, write_json

CHILD = r"""
import json, sys
import torch, transformers
from transformers.utils import logging
logging.set_verbosity_error()

def status_mb(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key + ":")) / 1024

def rss_mb():
    return status_mb("VmRSS")

base = rss_mb()
base_anon, base_file = status_mb("RssAnon"), status_mb("RssFile")
path, what = sys.argv[1], sys.argv[2]
if what == "whole":
    from omnistage.models import open_checkpoint
    ckpt = open_checkpoint(path)
    cls = getattr(transformers, ckpt.config.architectures[0])
    model = cls.from_pretrained(path, dtype=torch.float32)
else:
    from omnistage.models import load_part, open_checkpoint
    model = load_part(open_checkpoint(path), what)
params = sum(p.numel() for p in model.parameters())
peak = status_mb("VmHWM")  # this process's own high-water mark (ru_maxrss would carry the parent's over exec)
anon, file = status_mb("RssAnon") - base_anon, status_mb("RssFile") - base_file
print(json.dumps({"baseline_mb": base, "peak_mb": peak, "after_mb": rss_mb(), "parameters": params,
                  "anon_after_mb": anon, "file_after_mb": file}))
"""

# A checkpoint of the family whose weights dominate a process's memory (about 0.3 GB in fp32).
LARGE_SHAPE: dict[str, Any] = {"hidden": 1024, "talker_hidden": 512}
LARGE_OVERRIDES: dict[str, Any] = {
    "thinker_config": {"text_config": {"num_hidden_layers": 4, "num_experts": 16, "moe_intermediate_size": 256,
                                       "intermediate_size": 2048}},
    "talker_config": {"text_config": {"num_experts": 16, "moe_intermediate_size": 256, "intermediate_size": 1024,
                                      "shared_expert_intermediate_size": 512}},
}  # fmt: skip


def measure(path: Path, what: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), what], capture_output=True, text=True, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["load_mb"] = res["peak_mb"] - res["baseline_mb"]
    return res


def run(model_dir: Path | None = None) -> dict[str, Any]:
    from omnistage.models import open_checkpoint

    tmp = None
    if model_dir is None:
        from omnistage.models.qwen3_omni.tiny import TinyShape, write_tiny_checkpoint

        tmp = tempfile.TemporaryDirectory(prefix="omnistage-load-")
        model_dir = Path(tmp.name)
        write_tiny_checkpoint(model_dir, shape=TinyShape(**LARGE_SHAPE), overrides=LARGE_OVERRIDES,
                              shard_bytes=64 << 20)  # fmt: skip
    try:
        ckpt = open_checkpoint(model_dir)
        weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        parts = list(ckpt.family.part_configs)
        figures = {what: measure(model_dir, what) for what in [*parts, "whole"]}
    finally:
        if tmp is not None:
            tmp.cleanup()
    whole = figures["whole"]["load_mb"]
    return {
        "model": str(model_dir) if tmp is None else "synthetic (benchmarks/load_rss.py LARGE_*)",
        "weights_mb": weights / 2**20,
        "figures": figures,
        "part_over_whole": {p: figures[p]["load_mb"] / whole for p in parts},
        "machine": machine_info(),
    }


def main(model_dir: Path | None = None, json_out: Path | None = None) -> dict[str, Any]:
    res = run(model_dir)
    print(f"checkpoint: {res['model']}, {res['weights_mb']:.0f} MB of weights")
    print(f"{'loaded':<10} {'parameters':>12} {'baseline MB':>12} {'peak MB':>9} {'load MB':>9} {'/ whole':>8} "
          f"{'anon MB':>8} {'file MB':>8}")  # fmt: skip
    for what, f in res["figures"].items():
        ratio = res["part_over_whole"].get(what, 1.0)
        print(f"{what:<10} {f['parameters']:>12,} {f['baseline_mb']:>12.0f} {f['peak_mb']:>9.0f} "
              f"{f['load_mb']:>9.0f} {ratio:>8.2f} {f['anon_after_mb']:>8.0f} {f['file_after_mb']:>8.0f}")  # fmt: skip
    write_json(json_out, res)
    return res
