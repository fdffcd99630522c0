"""`omnistage bench batching` (benchmarks/batching.py) reads each request's logits in both
modes: exact computes the lm_head over every packed row, fast only over each request's last."""

from __future__ import annotations

from pathlib import Path

from benchmarks.batching import logit_drift
from omnistage.models import load_tokenizer, open_checkpoint


def test_the_drift_bench_reads_both_modes_logits(tiny_dir: Path) -> None:
    ckpt = open_checkpoint(tiny_dir)
    tok = load_tokenizer(ckpt)
    texts = ["hi", "Tell me about the sea.", "Name three colours.", "Where is the station?"]
    prompts = [ckpt.family.prompt_ids(tok, [{"role": "user", "content": t}]) for t in texts]
    out = logit_drift(ckpt, prompts, batch=2, max_tokens=3)
    assert out["requests"] == 4 and 0.0 <= out["identical_ids"] <= 1.0
    assert len(out["first_divergence"]) == round(4 * (1 - out["identical_ids"]))
    # the two modes are close (a GEMM's rows depend on how many it has): nowhere near a wrong row
    assert 0.0 <= out["max_abs_logit_delta"] < 1e-3, out
