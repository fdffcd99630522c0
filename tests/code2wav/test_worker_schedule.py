"""The code2wav stage's decode schedule: its first chunk as soon as `first_chunk_frames` frames are
final, then chunks as long as the audio already out (up to `chunk_frames`), the rest at the end;
frames that arrive one at a time or all at once are decoded once each, in order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from omnistage.config import Code2WavConfig
from omnistage.engine import Request, ScheduledItem
from omnistage.v1 import stage_pb2
from omnistage.wire import Code, DecodedChunk, StageError
from omnistage.wire.tensor_blob import LENGTH_KEY
from services import edges
from services.code2wav.worker import Code2WavWorker

GROUPS = 3


@dataclass
class _Stream:
    pending: list[torch.Tensor] = field(default_factory=list)
    frames_in: int = 0
    input_done: bool = False
    decoded: list[list[int]] = field(default_factory=list)  # the frames (their values) of each decode

    @property
    def samples_out(self) -> int:
        return self.frames_in


class _FakeCode2Wav:
    """A causal decoder whose 'audio' for frame k is one sample of value k."""

    @dataclass
    class spec:  # stands in for the family spec
        num_code_groups: int = GROUPS

    def open_stream(self, mode: str, left_context_frames: int, speaker: Any = None, seed: Any = None) -> _Stream:
        return _Stream()

    def validate_codes(self, codes: torch.Tensor) -> None:
        pass

    def ready_frames(self, stream: _Stream) -> int:
        return len(stream.pending)

    def decode_pending(self, streams: list[_Stream], max_frames: int | None = None) -> list[tuple[int, torch.Tensor]]:
        out = []
        for s in streams:
            frames = [int(f[0]) for f in s.pending[:max_frames]]
            s.decoded.append(frames)
            out.append((s.frames_in, torch.tensor(frames, dtype=torch.float32)))
            s.frames_in += len(frames)
            s.pending = s.pending[len(frames) :]
        return out

    def close(self, stream: _Stream) -> None:
        pass


def _frames(offset: int, n: int, **meta: Any) -> DecodedChunk:
    codes = torch.arange(offset, offset + n).repeat(GROUPS, 1)
    return DecodedChunk({edges.CODES: codes}, {LENGTH_KEY: n, **meta}, offset=offset)


def _decode(total: int, cfg: Code2WavConfig, per_message: int, first_decode_now: int = 0) -> list[list[int]]:
    """Frames `per_message` a message (the first `first_decode_now` of them in one chunk marked
    decode_now, as a talker's idle first chunk); what each decode took."""
    worker = Code2WavWorker(_FakeCode2Wav(), cfg, sample_rate=24000)
    req = Request("r", stage_pb2.Start(request_id="r"))
    worker.open(req)
    sent = 0
    if first_decode_now:
        worker.feed(req, _frames(0, first_decode_now, decode_now=True))
        sent = first_decode_now
        if worker.ready(req):
            worker.execute([ScheduledItem(req, 1, False)])
    while not (req.input_finished and not req.state.pending):
        n = min(per_message, total - sent)
        if n:
            worker.feed(req, _frames(sent, n))
            sent += n
        req.input_finished = sent == total
        if worker.ready(req):
            worker.execute([ScheduledItem(req, 1, False)])
    return req.state.decoded


@pytest.mark.parametrize(
    ("first", "total", "sizes"),
    [
        (2, 40, [2, 2, 4, 5, 5, 5, 5, 5, 5, 2]),  # doubling from the first chunk, up to chunk_frames (5)
        (1, 9, [1, 1, 2, 4, 1]),
        (3, 2, [2]),  # the input ends before the first chunk is full: what there is
        (7, 12, [7, 5]),  # a first chunk longer than chunk_frames
    ],
)
def test_frames_arriving_one_by_one_are_decoded_on_the_schedule(first: int, total: int, sizes: list[int]) -> None:
    decoded = _decode(total, Code2WavConfig(base_port=7301, first_chunk_frames=first, chunk_frames=5), per_message=1)
    assert [len(d) for d in decoded] == sizes
    assert [f for d in decoded for f in d] == list(range(total))


def test_a_chunk_marked_decode_now_is_decoded_at_once_then_the_schedule_goes_on() -> None:
    """The talker's idle first chunk (1 frame, under first_chunk_frames 2) is not held for a second
    frame; after it, frames arriving one by one are decoded as many as were decoded before (from 1:
    no chunk longer than the audio already out)."""
    cfg = Code2WavConfig(base_port=7301, first_chunk_frames=2, chunk_frames=5)
    decoded = _decode(12, cfg, per_message=1, first_decode_now=1)
    assert [len(d) for d in decoded] == [1, 1, 2, 4, 4]
    assert [f for d in decoded for f in d] == list(range(12))
    unmarked = _decode(12, cfg, per_message=1)  # without the mark the first decode waits for 2
    assert [len(d) for d in unmarked] == [2, 2, 4, 4]


def test_a_decode_now_that_is_not_a_bool_is_refused() -> None:
    worker = Code2WavWorker(_FakeCode2Wav(), Code2WavConfig(base_port=7301), sample_rate=24000)
    req = Request("r", stage_pb2.Start(request_id="r"))
    worker.open(req)
    with pytest.raises(StageError) as e:
        worker.feed(req, _frames(0, 1, decode_now=1))
    assert e.value.code is Code.INVALID_ARGUMENT and "'decode_now' must be a bool" in e.value.message
    assert not req.state.pending and not worker.decode_now


def test_frames_that_arrive_together_are_decoded_together() -> None:
    decoded = _decode(12, Code2WavConfig(base_port=7301, first_chunk_frames=2, chunk_frames=5), per_message=6)
    assert [len(d) for d in decoded] == [6, 6]
    assert [f for d in decoded for f in d] == list(range(12))


def test_a_backlog_goes_through_in_steps_of_at_most_max_frames_per_step() -> None:
    """Frames that piled up (the decoder behind its talker) are decoded a bounded number a step,
    in order, the end only after the last of them."""
    cfg = Code2WavConfig(base_port=7301, first_chunk_frames=2, chunk_frames=5, max_frames_per_step=4)
    decoded = _decode(23, cfg, per_message=23)
    assert [len(d) for d in decoded] == [4, 4, 4, 4, 4, 3]
    assert [f for d in decoded for f in d] == list(range(23))


def test_the_default_schedule_is_the_documented_one() -> None:
    cfg, done, sizes = Code2WavConfig(base_port=7301), 0, []
    while len(sizes) < 7:
        sizes.append(cfg.chunk_target(done))
        done += sizes[-1]
    assert sizes == [2, 2, 4, 8, 16, 25, 25]  # docs/architecture.md, "code2wav streaming"
    done, idle = 0, []
    while len(idle) < 7:
        idle.append(cfg.chunk_target(done, idle=True))
        done += idle[-1]
    assert idle == [1, 1, 2, 4, 8, 16, 25]  # an idle pipeline's (the talker's first frame made alone)
