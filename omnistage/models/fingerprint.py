"""A short identity of a loaded model's weights, so two processes can tell whether they run the
same checkpoint (the thinker's prefill and decode roles, before one continues the other's KV
cache). Cheap at any size: the config plus, per tensor, its name, shape and up to 64 evenly
spaced values rounded to bfloat16 (so the same checkpoint loaded in float32 and in bfloat16
gives the same identity; the dtype is compared on its own)."""

from __future__ import annotations

import hashlib
import json

import torch
from torch import nn

__all__ = ["weights_fingerprint"]

SAMPLES = 64


_RUNTIME_KEYS = {"dtype", "torch_dtype", "_attn_implementation", "_attn_implementation_autoset"}


def _without_dtypes(data: object) -> object:
    """The config without what the load chose (dtype, attention kernel), at every depth."""
    if isinstance(data, dict):
        return {k: _without_dtypes(v) for k, v in data.items() if k not in _RUNTIME_KEYS}
    if isinstance(data, list):
        return [_without_dtypes(v) for v in data]
    return data


@torch.no_grad()
def weights_fingerprint(model: nn.Module) -> str:
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None:
        h.update(json.dumps(_without_dtypes(config.to_dict()), sort_keys=True, default=str).encode())
    for name, t in sorted(model.state_dict().items()):
        flat = t.reshape(-1)
        step = max(1, flat.numel() // SAMPLES)
        sample = flat[::step][:SAMPLES].to(torch.bfloat16).float().cpu()
        h.update(f"{name}{tuple(t.shape)}".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]
