"""Resuming a stream that was replayed: a caller whose downstream call failed reopens it on
another replica and sends the request again from its Start; the new replica regenerates its
outputs from position 0. `Resume` remembers, per producing stage, how far the caller already
has each output stream (offsets count positions: tokens, frames, samples), and sorts every
chunk of the new call into what the caller has (drop it), what is new (pass it on) and a chunk
that straddles the boundary (pass on only its new tail, sliced along the position axis).

Exact when the replayed stream is the same as the first one: greedy decoding, a seeded sampler,
and code2wav (no sampling) all are. Chunk boundaries may differ between the two calls; offsets
make the cut exact anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from omnistage.wire.tensor_blob import LENGTH_KEY, DecodedChunk


class Seen(Enum):
    NEW = "new"  # nothing of it delivered yet
    OLD = "old"  # all of it delivered already
    OVERLAP = "overlap"  # its head delivered, its tail not


@dataclass
class Resume:
    end: dict[str, int] = field(default_factory=dict)  # per stage: positions delivered so far
    finished: set[str] = field(default_factory=set)  # stages whose finished chunk was delivered

    def classify(self, stage: str, offset: int, length: int, finished: bool = False) -> Seen:
        if stage in self.finished:
            return Seen.OLD
        end = self.end.get(stage, 0)
        if offset >= end:
            return Seen.NEW
        if offset + length <= end:
            # A chunk whose positions the caller has, but which ends the stream where the first
            # call had not yet said so (boundaries differ between calls): its empty tail carries
            # the end. Dropped, the caller would wait for an end that had come.
            return Seen.OVERLAP if finished else Seen.OLD
        return Seen.OVERLAP

    def delivered(self, stage: str, offset: int, length: int, finished: bool) -> None:
        """The caller now has this chunk (call for every chunk passed on, in order)."""
        self.end[stage] = max(self.end.get(stage, 0), offset + length)
        if finished:
            self.finished.add(stage)

    def tail(self, stage: str, chunk: DecodedChunk) -> DecodedChunk:
        """The part of an OVERLAP chunk after what was delivered: every tensor whose last axis
        spans the chunk's positions is cut along it; the rest is kept as it is."""
        n = chunk.length
        start = self.end[stage]
        # (a finished chunk that ends before what was delivered, from a replay that was not the
        # same stream, ends it there, empty, rather than going back)
        cut = min(start - chunk.offset, n)
        tensors = {k: (t[..., cut:] if t.dim() and t.shape[-1] == n else t) for k, t in chunk.tensors.items()}
        meta = {**chunk.meta, LENGTH_KEY: n - cut}
        return DecodedChunk(tensors, meta, start, chunk.seq, chunk.finished)
