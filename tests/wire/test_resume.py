"""Resume: what of a replayed stream the caller already has, by offsets."""

from __future__ import annotations

import torch

from omnistage.wire import DecodedChunk
from omnistage.wire.resume import Resume, Seen
from omnistage.wire.tensor_blob import LENGTH_KEY


def chunk(offset: int, n: int, finished: bool = False, groups: int = 3) -> DecodedChunk:
    codes = torch.arange(offset, offset + n).repeat(groups, 1)  # [G, n], value = position
    return DecodedChunk({"codes": codes, "scale": torch.tensor([7.0])}, {LENGTH_KEY: n, "sample_rate": 24000},
                        offset, 0, finished)  # fmt: skip


def test_a_replayed_stream_delivers_each_position_once_whatever_its_chunk_boundaries() -> None:
    r = Resume()
    for c in (chunk(0, 4), chunk(4, 3)):  # the first call: positions 0..6
        assert r.classify("talker", c.offset, c.length) is Seen.NEW
        r.delivered("talker", c.offset, c.length, c.finished)
    # the replay regenerates from 0 in other pieces: [0, 5) [5, 9) [9, 9] finished
    assert r.classify("talker", 0, 5) is Seen.OLD
    straddling = chunk(5, 4)
    assert r.classify("talker", 5, 4) is Seen.OVERLAP
    tail = r.tail("talker", straddling)
    assert (tail.offset, tail.length) == (7, 2)
    assert tail.tensors["codes"].tolist() == [[7, 8]] * 3  # cut along the position axis only
    assert tail.tensors["scale"].tolist() == [7.0] and tail.meta["sample_rate"] == 24000
    r.delivered("talker", tail.offset, tail.length, tail.finished)
    assert r.classify("talker", 9, 0) is Seen.NEW  # the empty finished chunk at the end
    r.delivered("talker", 9, 0, True)
    assert r.classify("talker", 9, 0) is Seen.OLD  # nothing after the finished chunk, twice
    assert r.classify("code2wav", 0, 100) is Seen.NEW  # each stage's stream on its own


def test_the_end_comes_through_on_a_chunk_whose_positions_the_caller_has() -> None:
    """The first call delivered positions 0..5 and was lost before its (empty) finished chunk;
    the replay sends 0..5 with the end on the same chunk: its empty tail, finished, goes on."""
    r = Resume()
    r.delivered("code2wav", 0, 6, False)
    last = chunk(0, 6, finished=True)
    assert r.classify("code2wav", 0, 6, finished=True) is Seen.OVERLAP
    tail = r.tail("code2wav", last)
    assert (tail.offset, tail.length, tail.finished) == (6, 0, True)
    assert tail.tensors["codes"].shape == (3, 0)
    r.delivered("code2wav", tail.offset, tail.length, tail.finished)
    assert r.classify("code2wav", 0, 6, finished=True) is Seen.OLD  # delivered once
    assert r.classify("talker", 0, 4) is Seen.NEW and r.classify("code2wav", 0, 3) is Seen.OLD
    # a replay that ends short of what was delivered (not the same stream) ends it where it is
    r.delivered("talker", 0, 4, False)
    short = r.tail("talker", chunk(0, 3, finished=True))
    assert (short.offset, short.length, short.finished) == (4, 0, True) and short.tensors["codes"].shape == (3, 0)
