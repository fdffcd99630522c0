"""`omnistage bench batching`: how far fast batching is from exact on the bench's request mix.

The thinker steps the mix in batches (every request of a batch in each packed step, as the
engine runs them), once in exact mode (each request bitwise as alone: what `generate()` gives)
and once in fast mode (one GEMM per layer over all rows). Per request: whether its greedy ids
are identical, where they first differ, and the largest |Δ| of its logits over the steps whose
inputs were still the same in both runs (up to and including its first differing token).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from benchmarks.common import machine_info, write_json

__all__ = ["logit_drift", "main"]


def _run(thinker: Any, prompts: list[list[int]], params: Any) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Every prompt's greedy ids and the logits row that chose each, stepping all together."""
    captured: list[torch.Tensor] = []
    hook = thinker.model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()))
    try:
        states = [thinker.new_state(params) for _ in prompts]
        for s, ids in zip(states, prompts, strict=True):
            thinker.set_prompt(s, ids)
        ids_out: list[list[int]] = [[] for _ in prompts]
        logits: list[list[torch.Tensor]] = [[] for _ in prompts]
        items = [(i, 0, len(p)) for i, p in enumerate(prompts)]
        while items:
            captured.clear()
            results = thinker.step([(states[i], pos, n) for i, pos, n in items])
            out = captured[0]  # exact: [1, rows, vocab]; fast: [requests, vocab], each one's last row only
            end = 0
            following = []
            for k, ((i, pos, n), r) in enumerate(zip(items, results, strict=True)):
                end += n
                logits[i].append((out[k] if out.dim() == 2 else out[0, end - 1]).float())
                ids_out[i].append(r.token.token_id)
                if not r.token.is_last:
                    following.append((i, pos + n, 1))
            items = following
        for s in states:
            thinker.release(s)
        return ids_out, logits
    finally:
        hook.remove()


def logit_drift(ckpt: Any, prompts: list[list[int]], batch: int, max_tokens: int) -> dict[str, Any]:
    exact = ckpt.family.thinker(ckpt, "float32", "cpu", "exact")
    fast = ckpt.family.thinker(ckpt, "float32", "cpu", "fast")
    params = ckpt.family.thinker_defaults(ckpt).with_overrides(max_tokens=max_tokens, do_sample=False)
    identical, first, max_delta = 0, [], 0.0
    for b in range(0, len(prompts), batch):
        group = prompts[b : b + batch]
        (ids_e, log_e), (ids_f, log_f) = _run(exact, group, params), _run(fast, group, params)
        for a, f, la, lf in zip(ids_e, ids_f, log_e, log_f, strict=True):
            k = next((j for j, (x, y) in enumerate(zip(a, f, strict=False)) if x != y), None)
            if a == f:
                identical += 1
            else:
                first.append(k if k is not None else min(len(a), len(f)))
            last = len(la) if k is None else k + 1  # the steps whose inputs were the same
            for x, y in zip(la[:last], lf[:last], strict=False):
                max_delta = max(max_delta, float((x - y).abs().max()))
    return {"requests": len(prompts), "batch": batch, "identical_ids": identical / max(1, len(prompts)),
            "first_divergence": sorted(first), "max_abs_logit_delta": max_delta}  # fmt: skip


def main(model: Path | None, requests: int, batch: int, max_tokens: int, json_out: Path | None) -> dict[str, Any]:
    from benchmarks.prompts import BUILTIN_PROMPTS, request_sequence
    from omnistage.cli.serve import resolve_model
    from omnistage.config import DeployConfig
    from omnistage.models import load_tokenizer, open_checkpoint

    ckpt = open_checkpoint(resolve_model(DeployConfig(), str(model) if model else None))
    tok = load_tokenizer(ckpt)
    texts = [BUILTIN_PROMPTS[i] for i in request_sequence(len(BUILTIN_PROMPTS), requests, seed=0)]
    prompts = [ckpt.family.prompt_ids(tok, [{"role": "user", "content": t}]) for t in texts]
    result = {"schema": "omnistage.bench.batching/1", "machine": machine_info(),
              "thinker": logit_drift(ckpt, prompts, batch, max_tokens)}  # fmt: skip
    t = result["thinker"]
    print(f"[batching] thinker, {t['requests']} requests in batches of {batch}, {max_tokens} tokens: "
          f"{100 * t['identical_ids']:.0f} % identical greedy ids (others first differ at {t['first_divergence']}), "
          f"max |Δ logits| {t['max_abs_logit_delta']:.3g}", flush=True)  # fmt: skip
    if json_out is not None:
        write_json(json_out, result)
    return result
