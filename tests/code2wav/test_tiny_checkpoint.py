"""Exact streaming on the tiny checkpoint's own code2wav (loaded like the service loads it),
and the windowed option against the windowed reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.models.checkpoint import open_checkpoint
from omnistage.models.qwen3_omni.code2wav import Code2Wav
from omnistage.models.qwen3_omni.code2wav_streaming import full_decode, windowed_decode_stream


@pytest.fixture(scope="module")
def runner(tiny_dir: Path) -> Code2Wav:
    ckpt = open_checkpoint(tiny_dir)
    return ckpt.family.code2wav(ckpt, "float32", "cpu")


def _codes(runner: Code2Wav, frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, runner.spec.codebook_size, (runner.spec.num_code_groups, frames), generator=g)


def _stream(runner: Code2Wav, codes: torch.Tensor, chunk: int, mode: str = "exact") -> torch.Tensor:
    stream = runner.open_stream(mode)  # type: ignore[arg-type]
    parts = []
    for s in range(0, codes.shape[1], chunk):
        stream.pending = list(codes[:, s : s + chunk].unbind(1))
        first, pcm = runner.decode_pending([stream])[0]
        assert first == sum(p.shape[0] for p in parts)
        parts.append(pcm)
    runner.close(stream)
    return torch.cat(parts)


@pytest.mark.parametrize(("frames", "chunk", "seed"), [(400, 25, 0), (400, 37, 1), (130, 1, 2), (97, 4, 3),
                                                   (650, 300, 5), (301, 301, 6), (620, 700, 7)])  # fmt: skip
def test_exact_stream_equals_generates_decode(runner: Code2Wav, frames: int, chunk: int, seed: int) -> None:
    """generate() decodes in segments of 300 frames, each with the 25 before it as context
    (`chunked_decode`); past 300 frames that is not a full decode. The stream equals it, however
    its pieces fall (across a segment's end, or several segments in one piece)."""
    codes = _codes(runner, frames, seed)
    reference = runner.model.chunked_decode(codes.unsqueeze(0), 300, 25).reshape(-1).float()
    streamed = _stream(runner, codes, chunk)
    segments = -(-frames // 300)
    assert streamed.shape == reference.shape == (frames * runner.samples_per_frame - 555 * segments,)
    assert float((streamed - reference).abs().max()) <= 1e-5
    assert float(reference.abs().max()) > 0.05  # not a comparison of two silences
    if frames > 300:  # ...and there it is not the full decode
        full = full_decode(runner.model, codes).reshape(-1).float()
        assert full.shape[0] > reference.shape[0]


def test_windowed_option_is_the_windowed_reference(runner: Code2Wav) -> None:
    codes = _codes(runner, 80, 4)
    reference = torch.cat(windowed_decode_stream(runner.model, codes, 25, 25))
    assert torch.allclose(_stream(runner, codes, 25, "windowed"), reference.float(), atol=1e-6, rtol=0)
    # ...and it is not the full decode: each window drops the samples its last frame still
    # owes, which the exact mode keeps.
    full = full_decode(runner.model, codes).float()
    assert reference.shape[0] < full.shape[0]


def test_streams_at_different_points_of_their_segments_share_a_step(runner: Code2Wav) -> None:
    """One decode_pending call for three streams: one inside its first segment, one crossing into
    its second, one spanning two boundaries at once; each equals generate()'s decode of its frames."""
    total = [150, 340, 700]
    codes = [_codes(runner, n, 10 + i) for i, n in enumerate(total)]
    streams = [runner.open_stream("exact") for _ in codes]
    cuts = [(0, 100, 150), (0, 290, 340), (0, 10, 700)]  # each stream's frames in two calls
    parts: list[list[torch.Tensor]] = [[] for _ in codes]
    for step in range(2):
        for s, c, cut in zip(streams, codes, cuts, strict=True):
            s.pending = list(c[:, cut[step] : cut[step + 1]].unbind(1))
        for i, (first, pcm) in enumerate(runner.decode_pending(streams)):
            assert first == sum(p.shape[0] for p in parts[i])
            parts[i].append(pcm)
    for s, c, got in zip(streams, codes, parts, strict=True):
        runner.close(s)
        reference = runner.model.chunked_decode(c.unsqueeze(0), 300, 25).reshape(-1).float()
        assert torch.cat(got).shape == reference.shape
        assert float((torch.cat(got) - reference).abs().max()) <= 1e-5


def test_a_backlog_decoded_a_bounded_number_of_frames_a_call_is_the_same_audio(runner: Code2Wav) -> None:
    """`max_frames`: each call decodes at most that many pending frames (the rest stay pending);
    the pieces, across segment ends, are generate()'s decode of all of them."""
    codes = _codes(runner, 420, 11)
    reference = runner.model.chunked_decode(codes.unsqueeze(0), 300, 25).reshape(-1).float()
    stream = runner.open_stream("exact")
    stream.pending = list(codes.unbind(1))
    parts, frames = [], []
    while stream.pending:
        before = stream.frames_in
        first, pcm = runner.decode_pending([stream], 130)[0]
        assert first == sum(p.shape[0] for p in parts)
        parts.append(pcm)
        frames.append(stream.frames_in - before)
    runner.close(stream)
    assert frames == [130, 130, 130, 30]
    assert torch.cat(parts).shape == reference.shape and float((torch.cat(parts) - reference).abs().max()) <= 1e-5
