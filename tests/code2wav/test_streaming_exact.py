"""Exact streaming: the concatenated stream equals one full forward on all frames."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeSnakeBeta

from omnistage.models.qwen3_omni.code2wav_streaming import (
    IncrementalCode2Wav,
    _snake_beta,
    exact_decode_stream,
    full_decode,
    place_windowed_chunks,
    windowed_decode_stream,
)
from tests.code2wav.helpers import make_model, random_codes

TOL = 1e-5

# (config, frames, codes seed, chunk sizes).  Chunk 1 is run on shorter sequences (one step per
# frame costs ~15 ms of per-op overhead on CPU) but longer than config B's window (72).
CASES = [
    ("A", 400, 1, (4, 25, 37)),
    ("A", 137, 2, (1, 25, 37)),
    ("A", 61, 3, (1, 4)),
    ("B", 400, 4, (1, 4, 25, 37)),
    ("B", 203, 5, (4, 25, 37)),
    ("B", 9, 6, (1, 4, 25)),
]


@functools.cache
def _reference(name: str, frames: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    model = make_model(name)
    codes = random_codes(model.config, frames, seed)
    return codes, full_decode(model, codes)


@functools.cache
def _decoder(name: str) -> IncrementalCode2Wav:
    return IncrementalCode2Wav(make_model(name))


@pytest.mark.parametrize(
    ("name", "frames", "seed", "chunk"),
    [(n, f, s, c) for n, f, s, chunks in CASES for c in chunks],
)
def test_stream_equals_full_decode(name: str, frames: int, seed: int, chunk: int) -> None:
    codes, ref = _reference(name, frames, seed)
    dec = _decoder(name)
    assert ref.shape[0] == dec.samples_for_frames(frames)
    assert ref.std() > 0.05, "weights too small: output is trivial"
    pieces = exact_decode_stream(dec, codes, chunk)
    out = torch.cat(pieces)
    assert out.shape == ref.shape
    diff = (out - ref).abs().max().item()
    print(f"\n[{name} T={frames} chunk={chunk}] exact stream max|d| = {diff:.3g}")
    assert diff <= TOL


def test_real_upsampling_lengths() -> None:
    dec = _decoder("A")
    cfg = dec.config
    upsample = 1
    for f in (*cfg.upsampling_ratios, *cfg.upsample_rates):
        upsample *= f
    assert upsample == dec.total_upsample == 1920
    # The real model trims sum(rate) after each decoder block's transposed conv ...
    held = 0
    for r in cfg.upsample_rates:
        held = held * r + r
    assert dec.holdback_samples == held == 555
    for frames in (1, 2, 25, 400):
        assert dec.samples_for_frames(frames) == frames * 1920 - 555


@pytest.mark.parametrize("name", ["A", "B"])
def test_samples_per_step_and_finish(name: str) -> None:
    """First step emits n*U - H samples, later steps n*U, finish nothing, zero frames nothing."""
    dec = _decoder(name)
    codes, ref = _reference(name, 61 if name == "A" else 203, 3 if name == "A" else 5)
    u, h = dec.total_upsample, dec.holdback_samples
    state = dec.new_state()
    sizes = [3, 0, 1, 20, 37]
    pos = 0
    got = []
    for i, n in enumerate(sizes):
        (piece,) = dec.step([state], [codes[:, pos : pos + n]])
        expect = 0 if n == 0 else n * u - (h if pos == 0 else 0)
        assert piece.shape == (expect,), (i, n)
        pos += n
        got.append(piece)
        assert state.frames_seen == pos
        assert state.samples_emitted == dec.samples_for_frames(pos)
    tail = dec.finish([state])
    assert [t.numel() for t in tail] == [0]
    assert state.closed
    out = torch.cat(got)
    prefix = full_decode(dec.model, codes[:, :pos])
    assert (out - prefix).abs().max().item() <= TOL
    # A full decode of a prefix is a prefix of the full decode.
    assert (prefix - ref[: prefix.shape[0]]).abs().max().item() <= TOL


def test_float64_is_exact_to_rounding() -> None:
    """In float64 the stream matches to ~1e-12: the method is exact, not approximate."""
    model = make_model("A", seed=7, dtype=torch.float64)
    codes = random_codes(model.config, 50, seed=8)
    ref = full_decode(model, codes)
    dec = IncrementalCode2Wav(model)
    for chunk in (1, 7):
        out = torch.cat(exact_decode_stream(dec, codes, chunk))
        diff = (out - ref).abs().max().item()
        print(f"\n[A float64 T=50 chunk={chunk}] exact stream max|d| = {diff:.3g}")
        assert diff <= 1e-10


@pytest.mark.parametrize("name", ["A", "B"])
def test_windowed_reference_is_approximate(name: str) -> None:
    """Report (not assert) how far the windowed 25/25 scheme is from the full decode."""
    codes, ref = _reference(name, 400, 1 if name == "A" else 4)
    model = make_model(name)
    dec = _decoder(name)
    chunks = windowed_decode_stream(model, codes, chunk_frames=25, left_context_frames=25)
    stream = torch.cat(chunks)
    n = min(stream.shape[0], ref.shape[0])
    concat_diff = (stream[:n] - ref[:n]).abs().max().item()
    aligned = 0.0
    for start, c in place_windowed_chunks(chunks, 25, dec.total_upsample):
        aligned = max(aligned, (c - ref[start : start + c.shape[0]]).abs().max().item())
    exact = torch.cat(exact_decode_stream(dec, codes, 25))
    exact_diff = (exact - ref).abs().max().item()
    print(
        f"\n[{name} T=400 chunk=25] windowed 25/25: stream max|d| = {concat_diff:.3g} "
        f"(missing {ref.shape[0] - stream.shape[0]} samples), aligned per-chunk max|d| = {aligned:.3g}; "
        f"exact max|d| = {exact_diff:.3g}"
    )
    assert stream.shape[0] == ref.shape[0] - (len(chunks) - 1) * dec.holdback_samples


@torch.no_grad()
def test_snake_beta_in_place_is_the_modules_forward_bitwise() -> None:
    """The decoder's SnakeBeta (the module's ops into one new tensor) equals the module's forward
    bit for bit, on contiguous and strided inputs, and leaves its input alone."""
    torch.manual_seed(0)
    for channels, length in ((4, 1000), (64, 257)):
        act = Qwen3OmniMoeSnakeBeta(channels)
        act.alpha.normal_(0, 0.5)
        act.beta.normal_(0, 0.5)
        for x in (torch.randn(3, channels, length) * 3, (torch.randn(3, length, channels) * 3).transpose(1, 2)):
            before = x.clone()
            assert torch.equal(_snake_beta(act, x), act(x))
            assert torch.equal(x, before)
