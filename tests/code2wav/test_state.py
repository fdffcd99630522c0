"""Per-request state is bounded while streaming and freed when the request ends."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from omnistage.models.qwen3_omni.code2wav_streaming import IncrementalCode2Wav
from tests.code2wav.helpers import make_model, random_codes


def test_state_is_bounded_by_the_window() -> None:
    model = make_model("B")  # sliding window 72, 4 layers
    dec = IncrementalCode2Wav(model)
    window = model.config.sliding_window
    codes = random_codes(model.config, 300, seed=50)
    state = dec.new_state()
    sizes = []
    for pos in range(0, 300, 25):
        dec.step([state], [codes[:, pos : pos + 25]])
        kv_frames = {k.shape[1] for k, _ in state.kv} | {v.shape[1] for _, v in state.kv}
        assert kv_frames == {min(pos + 25, window - 1)}
        sizes.append(state.nbytes())
    assert len(set(sizes[3:])) == 1, "state must not grow once the window is full"
    assert state.trans_drop == [0] * len(state.trans_drop)


def test_close_and_finish_free_state() -> None:
    model = make_model("A")
    dec = IncrementalCode2Wav(model)
    codes = random_codes(model.config, 12, seed=51)
    s1, s2 = dec.new_state(), dec.new_state()
    dec.step([s1, s2], [codes[:, :6], codes[:, :6]])
    assert s1.nbytes() > 0
    refs = [weakref.ref(t) for t in [*s1.conv_history, *s1.trans_tail, *(k for kv in s1.kv for k in kv)]]
    tails = dec.finish([s1])
    assert [t.numel() for t in tails] == [0]
    assert s1.closed and s1.nbytes() == 0
    gc.collect()
    assert all(r() is None for r in refs), "closed state's tensors are still referenced"
    with pytest.raises(RuntimeError):
        dec.step([s1], [codes[:, 6:]])
    dec.close([s2])
    assert s2.closed and s2.nbytes() == 0


def test_many_requests_leave_nothing_behind() -> None:
    model = make_model("A")
    dec = IncrementalCode2Wav(model)
    attrs_before = dict(vars(dec))
    codes = random_codes(model.config, 4, seed=52)
    refs: list[weakref.ref[torch.Tensor]] = []
    for _ in range(25):
        states = [dec.new_state() for _ in range(8)]
        dec.step(states, [codes[:, :2]] * 8)
        dec.step(states, [codes[:, 2:]] * 8)
        refs += [weakref.ref(t) for s in states for t in [*s.conv_history, *s.trans_tail]]
        dec.finish(states)
        del states
    gc.collect()
    assert all(r() is None for r in refs)
    assert dict(vars(dec)).keys() == attrs_before.keys()
    assert all(vars(dec)[k] is v for k, v in attrs_before.items()), "decoder must hold no per-request data"
