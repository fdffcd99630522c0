"""Batched stepping: each request gets what it gets alone, whatever else is in the step."""

from __future__ import annotations

import pytest
import torch

from omnistage.models.qwen3_omni import code2wav_streaming
from omnistage.models.qwen3_omni.code2wav_streaming import (
    _CPU_POINTWISE_ROWS,
    GroupBy,
    IncrementalCode2Wav,
    _pointwise_conv,
    exact_decode_stream,
    full_decode,
)
from tests.code2wav.helpers import make_model, random_codes

# Three requests of different lengths, different chunk schedules and start steps, so steps mix
# different frame counts, cached-KV lengths, RoPE offsets and first-chunk trims.
LENGTHS = (150, 97, 41)
SCHEDULES = ((25,), (10, 25), (3, 7))  # chunk sizes; the last one repeats
JOIN_STEP = (0, 1, 3)


def _chunks(schedule: tuple[int, ...], frames: int) -> list[tuple[int, int]]:
    out, pos, i = [], 0, 0
    while pos < frames:
        n = schedule[min(i, len(schedule) - 1)]
        out.append((pos, min(pos + n, frames)))
        pos += n
        i += 1
    return out


def _run_alone(dec: IncrementalCode2Wav, codes: torch.Tensor, schedule: tuple[int, ...]) -> torch.Tensor:
    state = dec.new_state()
    pieces = [dec.step([state], [codes[:, a:b]])[0] for a, b in _chunks(schedule, codes.shape[1])]
    pieces += dec.finish([state])
    return torch.cat(pieces)


def _run_together(dec: IncrementalCode2Wav, codes: list[torch.Tensor]) -> list[torch.Tensor]:
    plans = [_chunks(s, c.shape[1]) for s, c in zip(SCHEDULES, codes, strict=True)]
    states = [dec.new_state() for _ in codes]
    outs: list[list[torch.Tensor]] = [[] for _ in codes]
    step = 0
    while any(plans):
        active = [i for i in range(len(codes)) if step >= JOIN_STEP[i] and plans[i]]
        spans = [plans[i].pop(0) for i in active]
        res = dec.step([states[i] for i in active], [codes[i][:, a:b] for i, (a, b) in zip(active, spans, strict=True)])
        for i, r in zip(active, res, strict=True):
            outs[i].append(r)
        step += 1
    for i, tail in enumerate(dec.finish(states)):
        outs[i].append(tail)
    return [torch.cat(o) for o in outs]


@pytest.mark.parametrize("group_by", ["frames", "none", "shape"])
def test_batched_equals_alone(group_by: GroupBy) -> None:
    model = make_model("A")
    dec = IncrementalCode2Wav(model, group_by=group_by)
    codes = [random_codes(model.config, n, seed=20 + i) for i, n in enumerate(LENGTHS)]
    together = _run_together(dec, codes)
    for i, c in enumerate(codes):
        alone = _run_alone(dec, c, SCHEDULES[i])
        full = full_decode(model, c)
        assert together[i].shape == alone.shape == full.shape
        d_alone = (together[i] - alone).abs().max().item()
        d_full = (together[i] - full).abs().max().item()
        print(
            f"\n[group_by={group_by} req {i} T={c.shape[1]}] batched vs alone max|d| = {d_alone:.3g} "
            f"(bitwise: {torch.equal(together[i], alone)}), vs full decode {d_full:.3g}"
        )
        assert d_alone <= 1e-5
        assert d_full <= 1e-5


def test_batched_equals_alone_float64_padded() -> None:
    """With everything padded into one forward, float64 agrees to rounding: no cross-talk."""
    model = make_model("A", seed=3, dtype=torch.float64)
    dec = IncrementalCode2Wav(model, group_by="none")
    codes = [random_codes(model.config, n // 2, seed=30 + i) for i, n in enumerate(LENGTHS)]
    together = _run_together(dec, codes)
    for i, c in enumerate(codes):
        alone = torch.cat(exact_decode_stream(dec, c, 5))
        assert (together[i] - alone).abs().max().item() <= 1e-12
        assert (together[i] - full_decode(model, c)).abs().max().item() <= 1e-12


@torch.no_grad()
def test_a_wide_batch_of_pointwise_convs_computes_each_row_as_alone() -> None:
    """Past the rows one CPU call gets (single-threaded ATen hands a 1-wide kernel to oneDNN from
    a batch of 16 on), each row is still bit for bit what a request gets alone. (On this
    sandbox's Xeon one call over 16 rows is not; that depends on the CPU, so it is not asserted.)"""
    assert torch.get_num_threads() == 1  # as in a stage (StageConfig.threads); see conftest.py
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(4, 4, 1)
    for rows in (_CPU_POINTWISE_ROWS + 1, 2 * _CPU_POINTWISE_ROWS + 3):
        x = torch.randn(rows, 4, 3000)
        alone = torch.cat([conv(x[i : i + 1]) for i in range(rows)])
        assert torch.equal(_pointwise_conv(conv, x), alone)


def test_a_cpu_convolution_call_gets_the_rows_that_fit_its_byte_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past `_CPU_CONV_CALL_BYTES` of input and output a step's convolutions run in calls of fewer
    rows (one where a row alone is over it), the small ones still batched; each request's stream
    stays what it gets alone."""
    budget = 64 << 10  # small, so this model's shapes split: its widest rows are ~0.5 MB in float64
    monkeypatch.setattr(code2wav_streaming, "_CPU_CONV_CALL_BYTES", budget)
    calls: list[tuple[int, int]] = []  # (rows, bytes of a row's input and output) per call

    def record(x: torch.Tensor, y: torch.Tensor) -> None:
        calls.append((x.shape[0], (x[0].numel() + y[0].numel()) * x.element_size()))

    def conv1d_hook(mod: torch.nn.Module, args: tuple[torch.Tensor, ...], y: torch.Tensor) -> None:
        record(args[0], y)

    transposed = torch.nn.functional.conv_transpose1d

    def conv_transpose1d(x: torch.Tensor, *args: object, **kw: object) -> torch.Tensor:
        y = transposed(x, *args, **kw)  # type: ignore[arg-type]
        record(x, y)
        return y

    model = make_model("A", seed=3, dtype=torch.float64)
    dec = IncrementalCode2Wav(model)
    codes = [random_codes(model.config, 30, seed=50 + i) for i in range(4)]
    alone = [_run_alone(dec, c, (5, 25)) for c in codes]
    hooks = [m.register_forward_hook(conv1d_hook) for m in model.modules() if isinstance(m, torch.nn.Conv1d)]
    monkeypatch.setattr(torch.nn.functional, "conv_transpose1d", conv_transpose1d)
    try:
        states = [dec.new_state() for _ in codes]
        pieces = [dec.step(states, [c[:, a:b] for c in codes]) for a, b in ((0, 5), (5, 30))]
    finally:
        for h in hooks:
            h.remove()
    assert {rows for rows, _ in calls} == {1, 2, 4}, calls  # split where needed, batched where not
    assert all(rows == 1 or rows * row <= budget for rows, row in calls), calls
    assert any(rows == 1 and row > budget for rows, row in calls)  # rows over the budget alone still run
    for i, ref in enumerate(alone):
        together = torch.cat([p[i] for p in pieces])
        assert together.shape == ref.shape
        assert (together - ref).abs().max().item() <= 1e-12


def test_zero_frame_requests_in_a_step() -> None:
    model = make_model("B")
    dec = IncrementalCode2Wav(model, group_by="none")
    codes = random_codes(model.config, 30, seed=40)
    a, b = dec.new_state(), dec.new_state()
    ya, yb = dec.step([a, b], [codes[:, :10], codes[:, :0]])
    assert yb.numel() == 0 and b.frames_seen == 0
    ya2, yb2 = dec.step([a, b], [codes[:, 10:30], codes[:, :30]])
    full = full_decode(model, codes)
    assert (torch.cat([ya, ya2]) - full).abs().max().item() <= 1e-5
    assert (torch.cat([yb, yb2]) - full).abs().max().item() <= 1e-5


def test_step_validates_inputs() -> None:
    model = make_model("B")
    dec = IncrementalCode2Wav(model)
    s = dec.new_state()
    codes = random_codes(model.config, 4, seed=1)
    with pytest.raises(ValueError):
        dec.step([s], [codes[:3]])
    with pytest.raises(ValueError):
        dec.step([s, s], [codes, codes])
    with pytest.raises(ValueError):
        dec.step([s], [])
