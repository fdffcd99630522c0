"""G.711 (gateway/g711.py): FFmpeg's codecs against Python's own audioop (the reference
implementation, in the standard library until 3.13), and the 24 kHz -> 8 kHz stream."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

from gateway.g711 import G711_RATE, G711Encoder, g711_to_pcm16

FORMATS = ["audio/pcma", "audio/pcmu"]


def _reference(fmt: str) -> tuple[Any, Any]:
    """audioop's (encode, decode) for `fmt`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = pytest.importorskip("audioop", reason="audioop, the reference, left the standard library in 3.13")
    return {"audio/pcmu": (audioop.lin2ulaw, audioop.ulaw2lin), "audio/pcma": (audioop.lin2alaw, audioop.alaw2lin)}[fmt]


def test_decoding_gives_g711_s_values() -> None:
    """A few codes' values from ITU-T G.711's tables (mu-law 0x00 and 0x80 the extremes, 0xFF
    zero; A-law's even bits inverted: 0xD5 and 0x55 the smallest steps), without audioop."""
    mu = np.frombuffer(g711_to_pcm16(bytes([0x00, 0x80, 0xFF, 0x7F]), "audio/pcmu"), "<i2").tolist()
    a = np.frombuffer(g711_to_pcm16(bytes([0xD5, 0x55, 0x2A, 0xAA]), "audio/pcma"), "<i2").tolist()
    assert mu == [-32124, 32124, 0, 0] and a == [8, -8, -32256, 32256]


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_sample_is_encoded_as_a_level_beside_it(fmt: str) -> None:
    """Encoding picks one of the two G.711 levels around each sample (the levels: the decoder's,
    pinned above), without audioop."""
    x = (np.random.default_rng(5).standard_normal(20_000) * 8000).clip(-32768, 32767).astype("<i2")
    encoder = G711Encoder(fmt, G711_RATE)
    codes = encoder.push(x.tobytes()) + encoder.finish()
    got = np.frombuffer(g711_to_pcm16(codes, fmt), "<i2").astype(np.int64)
    levels = np.unique(np.frombuffer(g711_to_pcm16(bytes(range(256)), fmt), "<i2").astype(np.int64))
    at = np.searchsorted(levels, x.astype(np.int64))  # levels[at - 1] < x <= levels[at]
    below, above = levels[np.clip(at - 1, 0, levels.size - 1)], levels[np.clip(at, 0, levels.size - 1)]
    assert got.size == x.size and np.all((got == below) | (got == above))


@pytest.mark.parametrize("fmt", FORMATS)
def test_decoding_is_the_reference_tables(fmt: str) -> None:
    every_code = bytes(range(256))
    assert g711_to_pcm16(every_code, fmt) == _reference(fmt)[1](every_code, 2)
    assert g711_to_pcm16(every_code[::-1] * 3, fmt) == _reference(fmt)[1](every_code[::-1] * 3, 2)
    assert g711_to_pcm16(b"", fmt) == b""


@pytest.mark.parametrize("fmt", FORMATS)
def test_encoding_at_8_khz_is_as_close_as_the_reference(fmt: str) -> None:
    encode, decode = _reference(fmt)
    x = (np.random.default_rng(3).standard_normal(8000) * 6000).clip(-32768, 32767).astype("<i2")
    enc = G711Encoder(fmt, G711_RATE)
    got = enc.push(x.tobytes()) + enc.finish()
    assert len(got) == x.size  # one byte a sample, nothing lost or added at the same rate
    mine = np.frombuffer(g711_to_pcm16(got, fmt), "<i2").astype(np.int64)
    ref = np.frombuffer(decode(encode(x.tobytes(), 2), 2), "<i2").astype(np.int64)
    assert np.abs(mine - x).max() <= np.abs(ref - x).max()
    assert np.mean(np.abs(mine - x)) <= np.mean(np.abs(ref - x)) * 1.01


def test_the_model_s_audio_streams_down_to_8_khz_in_any_pieces() -> None:
    rate = 24_000
    t = np.arange(2 * rate) / rate
    x = (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2")
    whole = G711Encoder("audio/pcmu", rate)
    at_once = whole.push(x.tobytes()) + whole.finish()
    pieces = G711Encoder("audio/pcmu", rate)
    streamed = b"".join(pieces.push(x[i:i + 997].tobytes()) for i in range(0, x.size, 997)) + pieces.finish()
    assert streamed == at_once and len(at_once) == x.size * G711_RATE // rate
    heard = np.frombuffer(g711_to_pcm16(at_once, "audio/pcmu"), "<i2").astype(np.float64)
    want = 0.3 * np.sin(2 * np.pi * 440 * np.arange(heard.size) / G711_RATE) * 32767
    inner = slice(100, -100)  # (the resampler's filter at the ends)
    assert np.corrcoef(heard[inner], want[inner])[0, 1] > 0.999  # the same tone, in time
    assert np.abs(heard[inner] - want[inner]).max() < 0.02 * 32767
