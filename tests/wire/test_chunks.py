"""encode_chunks / ChunkAssembler: no message over the limit, exact reassembly, broken sequences."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch

from omnistage.wire import tensor_blob as tb
from omnistage.wire.shm import ShmPool, ShmReader
from omnistage.wire.tensor_blob import Chunk, ChunkAssembler, TensorBlobError
from tests.wire.helpers import encode_messages


def _payload() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "hidden": torch.randn(300, 257, generator=g).bfloat16(),
        "embed": torch.randn(300, 64, generator=g),
        "ids": torch.arange(300),
        "wide": torch.randn(1, 9000, generator=g).double(),  # one row bigger than a message
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "mask": torch.rand(50, generator=g) > 0.5,
    }


def _assemble(chunks: list[Chunk], reader: ShmReader | None = None) -> list[tb.DecodedChunk]:
    asm = ChunkAssembler(reader=reader)
    out = []
    for c in chunks:
        d = asm.push(Chunk.FromString(c.SerializeToString()))
        if d is not None:
            out.append(d)
    assert not asm.in_progress
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    def raw(t: torch.Tensor) -> bytes:
        return bytes(t.reshape(-1).view(torch.uint8).numpy())

    return a.dtype == b.dtype and a.shape == b.shape and raw(a) == raw(b)


@pytest.mark.parametrize("max_bytes", [4096, 10_000, 65_536, 1 << 20, 64 << 20])
def test_split_messages_stay_under_limit_and_reassemble(max_bytes: int) -> None:
    tensors = _payload()
    chunks = encode_messages(tensors, max_bytes=max_bytes, offset=40, seq=5, finished=True, meta={"m": "x"})
    assert all(c.ByteSize() <= max_bytes for c in chunks)
    assert [c.seq for c in chunks] == list(range(5, 5 + len(chunks)))
    assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
    if len(chunks) > 1:
        assert [c.part for c in chunks] == list(range(len(chunks)))
        assert {c.parts for c in chunks} == {len(chunks)}
    else:
        assert chunks[0].parts == 0
    (d,) = _assemble(chunks)
    assert (d.offset, d.seq, d.finished, d.meta) == (40, 5, True, {"m": "x"})
    assert set(d.tensors) == set(tensors)
    for name, x in tensors.items():
        assert _same(x, d.tensors[name]), name


def test_stream_of_split_and_unsplit_chunks() -> None:
    chunks: list[Chunk] = []
    seq = 0
    for i, n in enumerate([5, 2000, 1, 3000]):
        part = encode_messages(
            {"codes": torch.full((n, 16), i, dtype=torch.int64)},
            max_bytes=50_000,
            offset=i * 10,
            seq=seq,
            finished=i == 3,
        )
        seq += len(part)
        chunks += part
    out = _assemble(chunks)
    assert [d.offset for d in out] == [0, 10, 20, 30] and [d.finished for d in out] == [False] * 3 + [True]
    assert [d.tensors["codes"].shape[0] for d in out] == [5, 2000, 1, 3000]
    assert all(bool((d.tensors["codes"] == i).all()) for i, d in enumerate(out))


def test_shm_tensors_are_not_split(pool: ShmPool, reader: ShmReader) -> None:
    tensors = {"hidden": torch.randn(2000, 100), "ids": torch.arange(10)}
    chunks = encode_messages(tensors, max_bytes=8192, pool=pool, request_id="r")
    assert len(chunks) == 1 and chunks[0].tensors["hidden"].WhichOneof("data") == "shm"
    (d,) = _assemble(chunks, reader)
    assert torch.equal(d.tensors["hidden"], tensors["hidden"]) and torch.equal(
        d.tensors["ids"], tensors["ids"]
    )
    pool.release_request("r")


def _split() -> list[Chunk]:
    chunks = encode_messages({"x": torch.arange(5000, dtype=torch.int32)}, max_bytes=4096)
    assert len(chunks) >= 4
    return chunks


def test_assembler_rejects_broken_sequences() -> None:
    chunks = _split()
    cases: list[list[Chunk]] = [
        chunks[1:],  # starts mid-way
        [chunks[0], chunks[2]],  # gap
        [chunks[0], chunks[0]],  # repeat
        [chunks[0], tb.encode_chunk({"y": torch.ones(1)})],  # unsplit inside a split
    ]
    bad_offset = Chunk()
    bad_offset.CopyFrom(chunks[1])
    bad_offset.offset = 99
    cases.append([chunks[0], bad_offset])
    other_seq = Chunk()  # a part of another message stream (its seq does not follow on)
    other_seq.CopyFrom(chunks[1])
    other_seq.seq += 7
    cases.append([chunks[0], other_seq])
    missing_piece = Chunk()
    missing_piece.CopyFrom(chunks[-1])
    del missing_piece.tensors["x"]
    cases.append([*chunks[:-1], missing_piece])
    for part, parts in ((0, -1), (-1, 0)):  # (-1 parts was taken as unsplit)
        negative = Chunk()
        negative.CopyFrom(chunks[0])
        negative.part, negative.parts = part, parts
        cases.append([negative])
    early_finish = Chunk()
    early_finish.CopyFrom(chunks[0])
    early_finish.finished = True
    cases.append([early_finish])
    for case in cases:
        asm = ChunkAssembler()
        with pytest.raises(TensorBlobError):
            for c in case:
                asm.push(c)
        assert not asm.in_progress  # an error resets the assembler


def test_assembler_memory_bound() -> None:
    asm = ChunkAssembler(max_bytes=1000)
    with pytest.raises(TensorBlobError):
        for c in _split():
            asm.push(c)


def test_too_small_limit_is_refused() -> None:
    with pytest.raises(ValueError):
        encode_messages({"x": torch.ones(10)}, max_bytes=100)


def test_a_split_chunk_counts_its_whole_tensors_against_the_bound() -> None:
    """Parts that each bring a whole new tensor are held as views of their messages: they count
    toward `max_bytes` as pieces copied into place do (64 parts of 1 MiB each were all taken
    under a 4 MiB bound)."""
    asm = ChunkAssembler(max_bytes=4 << 20)
    taken = 0
    with pytest.raises(TensorBlobError, match=r"split chunk exceeds 4194304 bytes"):
        for i in range(64):
            part = tb.encode_chunk({f"t{i}": torch.zeros(1 << 18)}, offset=0, length=0)  # 1 MiB each
            part.parts, part.part, part.seq = 64, i, i
            assert asm.push(part) is None
            taken += 1
    assert taken == 4 and not asm.in_progress


def _vm_size_kb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmSize from /proc/self/status (Linux)")
def test_a_split_tensor_takes_memory_as_its_pieces_come() -> None:
    """A first piece of 16 bytes that declares a 4 GiB tensor claims 16 bytes, not the declared
    size: the destination was allocated whole at the first piece, so a few messages per stream
    held 8 GiB of address space each (a MemoryError under overcommit limits)."""
    declared = 1 << 32
    first = Chunk(parts=2, part=0)
    first.tensors["x"].CopyFrom(tb.TensorBlob(dtype=tb.tensor_pb2.U8, shape=[declared], raw=b"\0" * 16))
    before = _vm_size_kb()
    asm = ChunkAssembler()
    assert asm.push(first) is None and asm.in_progress
    assert _vm_size_kb() - before < 256 << 10  # (4 GiB is 4 << 20 kB)
    # pieces that come are placed in order and the tensor is whole at the last part: a small one
    # (allocated at once), and one of 12 MB in uneven pieces, the first ones held until an eighth came
    for n, cuts in ((1000, (0, 400, 1000)), (3_000_000, (0, 7, 20_000, 100_000, 300_000, 301_111, 2_000_000,
                                                        2_999_999, 3_000_000))):  # fmt: skip
        asm = ChunkAssembler()
        x = torch.arange(n, dtype=torch.int32)
        pieces = list(itertools.pairwise(cuts))
        for i, (lo, hi) in enumerate(pieces):
            part = Chunk(parts=len(pieces), part=i, seq=i)
            part.tensors["x"].CopyFrom(tb.TensorBlob(dtype=tb.tensor_pb2.I32, shape=[n],
                                                     raw=x[lo:hi].numpy().tobytes(), element_offset=lo))  # fmt: skip
            done = asm.push(part)
        assert done is not None and torch.equal(done.tensors["x"], x), n
