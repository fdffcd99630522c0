"""Checks of incoming chunk tensors: names, dtypes and shapes a stage expects, with errors that
name the field (INVALID_ARGUMENT)."""

from __future__ import annotations

import torch

from services.runtime.engine import invalid
from services.runtime.tensor_blob import DecodedChunk

INT_DTYPES = (torch.int64, torch.int32)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_names(stage: str, chunk: DecodedChunk, required: set[str], optional: set[str] = frozenset()) -> None:
    names = set(chunk.tensors)
    problems = []
    if required - names:
        problems.append(f"missing tensor(s) {sorted(required - names)}")
    if names - required - optional:
        problems.append(f"unexpected tensor(s) {sorted(names - required - optional)}")
    if problems:
        expected = sorted(required | optional)
        raise invalid(f"{stage}: chunk at offset {chunk.offset}: {', '.join(problems)}; expected {expected}")


def tensor(
    stage: str,
    chunk: DecodedChunk,
    name: str,
    dtypes: tuple[torch.dtype, ...],
    shape: tuple[int | None, ...],
) -> torch.Tensor:
    """The named tensor, checked against dtypes and a shape pattern (None = any size)."""
    t = chunk.tensors[name]
    if t.dtype not in dtypes:
        raise invalid(f"{stage}: tensor '{name}' has dtype {t.dtype}; expected one of {[str(d) for d in dtypes]}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape, strict=True)):
        pattern = ["*" if s is None else s for s in shape]
        raise invalid(f"{stage}: tensor '{name}' has shape {list(t.shape)}; expected {pattern}")
    return t

