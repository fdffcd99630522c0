"""Property-based fuzzing of the decoder: random and mutated blobs/chunks (also as mutated
serialized bytes) either decode correctly or raise TensorBlobError (DecodeError at parse).
Never a crash, a hang or another exception."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnistage.v1 import tensor_pb2
from omnistage.v1.tensor_pb2 import Chunk, ShmRef, TensorBlob
from omnistage.wire import tensor_blob as tb
from omnistage.wire.shm import ShmPool, ShmReader
from omnistage.wire.tensor_blob import ChunkAssembler, TensorBlobError
from tests.wire.helpers import encode_messages
from tests.wire.mutation import BYTE_OPS, mutate_bytes

FUZZ = settings(
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)


@pytest.fixture(scope="module")
def segment() -> Iterator[tuple[str, ShmReader]]:
    """One real segment (1 MiB) the fuzzer may point into."""
    pool = ShmPool(enabled=True, threshold_bytes=1, segment_bytes=1 << 20)
    if not pool.enabled:
        pytest.skip("shared memory unavailable")
    slot = pool.allocate("fuzz", 4096)
    assert slot is not None
    slot.buffer[:] = np.random.default_rng(0).integers(0, 2, 4096, dtype=np.uint8).tobytes()
    try:
        yield slot.segment, ShmReader(enabled=True)
    finally:
        pool.close()


dims = st.one_of(
    st.integers(0, 6), st.integers(-3, 3), st.sampled_from([2**20, 2**31, 2**40, 2**62, -(2**62)])
)
shapes = st.lists(dims, max_size=6) | st.lists(st.integers(0, 1), min_size=30, max_size=40)
dtypes = st.one_of(st.integers(0, 10), st.integers(-5, 200))


@st.composite
def blobs(draw: st.DrawFn, segment_name: str) -> TensorBlob:
    blob = TensorBlob(shape=draw(shapes))
    blob.dtype = draw(dtypes)  # type: ignore[assignment]
    kind = draw(st.sampled_from(["raw", "shm", "none"]))
    if kind == "raw":
        blob.raw = draw(st.binary(max_size=300))
    elif kind == "shm":
        name = draw(st.sampled_from([segment_name, segment_name + "x", "omnistage-0-0-0-0-0", "x/../y", ""]))
        offset = draw(st.integers(-16, 1 << 20) | st.sampled_from([2**40, 2**62]))
        nbytes = draw(st.integers(-16, 8192) | st.sampled_from([1 << 20, 2**40, 2**62]))
        blob.shm.CopyFrom(ShmRef(segment=name, offset=offset, nbytes=nbytes))
    if draw(st.integers(0, 4)) == 0:
        blob.element_offset = draw(st.integers(-(2**62), 2**62))
    return blob


def _check_decoded(blob: TensorBlob, reader: ShmReader) -> None:
    """Decode; on success the result must be consistent with the blob, byte for byte."""
    try:
        t = tb.decode(blob, reader=reader)
        a = tb.decode_numpy(blob, reader=reader)
    except TensorBlobError:
        return
    assert list(t.shape) == list(blob.shape) == list(a.shape)
    kind = blob.WhichOneof("data")
    expected = blob.raw if kind == "raw" else bytes(reader.buffer(blob.shm)) if kind == "shm" else b""
    got_t = bytes(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""
    assert got_t == bytes(a.tobytes()) == expected
    again = tb.encode(t)
    assert again.raw == got_t and again.dtype == blob.dtype


@given(data=st.data())
@FUZZ
def test_random_blobs(segment: tuple[str, ShmReader], data: st.DataObject) -> None:
    name, reader = segment
    blob = data.draw(blobs(name))
    _check_decoded(blob, reader)
    try:
        blob2 = TensorBlob.FromString(blob.SerializeToString())
    except DecodeError:
        return
    _check_decoded(blob2, reader)


def _valid_chunks() -> list[bytes]:
    g = torch.Generator().manual_seed(0)
    out = [
        tb.encode_chunk(
            {
                "hidden": torch.randn(3, 5, generator=g).bfloat16(),
                "ids": torch.arange(3),
                "m": torch.ones(2).bool(),
            },
            offset=4,
            meta={"a": 1, "s": "x"},
        ).SerializeToString()
    ]
    out += [
        c.SerializeToString()
        for c in encode_messages({"x": torch.arange(3000, dtype=torch.int16)}, max_bytes=4096)
    ]
    return out


VALID = _valid_chunks()


@st.composite
def mutated(draw: st.DrawFn) -> list[bytes]:
    msgs = list(VALID[: draw(st.integers(1, len(VALID)))])
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(msgs) - 1))
        b = bytearray(msgs[i])
        op = draw(st.sampled_from([*BYTE_OPS, "swap"]))
        if op == "swap":
            j = draw(st.integers(0, len(msgs) - 1))
            msgs[i], msgs[j] = msgs[j], msgs[i]
            continue
        b = mutate_bytes(draw, b, op)
        msgs[i] = bytes(b)
    return msgs


@given(msgs=mutated())
@FUZZ
def test_mutated_serialized_chunks(msgs: list[bytes]) -> None:
    asm = ChunkAssembler(max_bytes=1 << 20)
    for raw in msgs:
        try:
            chunk = Chunk.FromString(raw)
        except DecodeError:
            continue
        try:
            out = asm.push(chunk)
        except TensorBlobError:
            continue
        if out is not None:
            assert set(out.tensors) <= set(chunk.tensors) | {"x", "hidden", "ids", "m"}
            for t in out.tensors.values():
                assert isinstance(t, torch.Tensor)
        for blob in chunk.tensors.values():  # direct blob decoding must be just as robust
            with contextlib.suppress(TensorBlobError):
                tb.decode(blob)


def test_valid_corpus_decodes() -> None:
    asm = ChunkAssembler()
    results = [asm.push(Chunk.FromString(m)) for m in VALID]
    assert results[0] is not None and results[-1] is not None
    assert torch.equal(results[-1].tensors["x"], torch.arange(3000, dtype=torch.int16))
    assert Chunk.FromString(VALID[0]).tensors["hidden"].dtype == tensor_pb2.BF16
