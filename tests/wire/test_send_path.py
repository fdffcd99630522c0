"""The send path: ``encode_lazy_chunks`` + ``wire_view.serialize`` copy each large inline payload
once, straight from the tensor into the outgoing bytes, and write messages protobuf (and
wire_view) read exactly as the plain protobuf encoding of the same chunk."""

from __future__ import annotations

import tracemalloc
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from omnistage.v1 import stage_pb2
from omnistage.v1.tensor_pb2 import Chunk
from omnistage.wire import tensor_blob as tb
from omnistage.wire import wire_view as wv
from omnistage.wire.shm import ShmPool, ShmReader
from omnistage.wire.tensor_blob import ChunkAssembler
from tests.wire.helpers import encode_messages
from tests.wire.test_tensor_blob import TORCH_DTYPES, _bits_equal, _sample
from tests.wire.test_wire_view import PROPS, logical_chunks

HEADS: dict[str, Any] = {
    "request": lambda: stage_pb2.StageRequest(),
    "response": lambda: stage_pb2.StageResponse(stage="talker"),
}


def _plain(kind: str, chunk: Chunk) -> bytes:
    head = HEADS[kind]()
    head.chunk.CopyFrom(chunk)
    return head.SerializeToString()


def _parse(kind: str, data: bytes) -> Any:
    return (wv.parse_request if kind == "request" else wv.parse_response)(data)


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).ctypes.data)


# --------------------------------------------------------------------------------------------
# no copy before serialization, one copy in it
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_lazy_payload_is_the_tensor_memory(dtype: torch.dtype) -> None:
    x = _sample(dtype, (64, 1024))
    (lazy,) = tb.encode_chunks({"hidden": x, "ids": torch.arange(3)}, max_bytes=8 << 20)
    ((name, head, payload),) = lazy.lazy  # ids is small: inside the message
    assert name == "hidden" and head.WhichOneof("data") is None and list(head.shape) == [64, 1024]
    assert _address(payload) == x.data_ptr() and payload.nbytes == x.numel() * x.element_size()
    assert set(lazy.chunk.tensors) == {"ids"}


def test_split_pieces_are_slices_of_the_tensor() -> None:
    x = torch.randn(300_000)
    lazies = tb.encode_chunks({"hidden": x}, max_bytes=256 << 10)
    assert len(lazies) > 1
    covered = 0
    for lazy in lazies:
        ((_, head, payload),) = lazy.lazy
        assert _address(payload) == x.data_ptr() + head.element_offset * 4
        covered += payload.nbytes
    assert covered == x.numel() * 4


def test_small_tensors_stay_in_the_message() -> None:
    small = torch.randn(tb.LAZY_BYTES // 4 - 1)
    (lazy,) = tb.encode_chunks({"embed": small}, max_bytes=8 << 20)
    assert lazy.lazy == () and lazy.chunk.tensors["embed"].WhichOneof("data") == "raw"


def _serialize_traced(message: wv.Outgoing) -> tuple[bytes, int]:
    """(serialize(message), the peak of bytes allocated through Python's and numpy's allocators
    meanwhile, above what was allocated before)."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        data = wv.serialize(message)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return data, peak


def test_serialize_copies_each_payload_once() -> None:
    x = torch.randn(2 << 20)  # 8 MiB
    nbytes = x.numel() * 4
    (lazy,) = tb.encode_chunks({"hidden": x}, max_bytes=16 << 20)
    # Nothing was copied when encoding: the message carries what the tensor holds when it is
    # serialized (which is why senders must not change it before).
    x.add_(1.0)
    data, peak = _serialize_traced(wv.Outgoing(stage_pb2.StageRequest(), lazy))
    (plain,) = encode_messages({"hidden": x}, max_bytes=16 << 20)
    assert data == stage_pb2.StageRequest(chunk=plain).SerializeToString()  # one tensor: even the same bytes
    # The result is the one copy, and no second payload-sized buffer ever lived beside it.
    assert nbytes <= peak <= nbytes + (64 << 10)


def test_non_contiguous_tensor_is_gathered_once_before_serializing() -> None:
    x = torch.randn(512, 256).t()
    (lazy,) = tb.encode_chunks({"hidden": x}, max_bytes=8 << 20)
    data = wv.serialize(wv.Outgoing(stage_pb2.StageRequest(), lazy))
    r = wv.parse_request(data)
    d = ChunkAssembler().push(r.message.chunk, r.views)
    assert d is not None and torch.equal(d.tensors["hidden"], x)


# --------------------------------------------------------------------------------------------
# the bytes read as the plain protobuf encoding
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(HEADS))
def test_serialized_message_equals_plain_protobuf(kind: str) -> None:
    tensors = {
        "embed": torch.randn(40, 300).bfloat16(),
        "ids": torch.arange(5),
        "mask": torch.rand(50_000) > 0.5,
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }
    with mock.patch.object(tb, "LAZY_BYTES", 0):  # every tensor lazy, even the 0-d one
        (lazy,) = tb.encode_chunks(tensors, max_bytes=8 << 20, offset=7, seq=3, meta={"n": 5, "last": True})
    assert {n for n, _, _ in lazy.lazy} == set(tensors)
    data = wv.serialize(wv.Outgoing(HEADS[kind](), lazy))
    plain = _plain(kind, lazy.message())
    assert len(data) == len(plain)
    cls = type(HEADS[kind]())
    assert cls.FromString(data) == cls.FromString(plain)
    r = _parse(kind, data)
    assert set(r.views) == set(tensors) and all(v.obj is data for v in r.views.values())
    d = ChunkAssembler().push(r.message.chunk, r.views)
    assert d is not None and (d.offset, d.seq, d.meta) == (7, 3, {"n": 5, "last": True})
    for name, x in tensors.items():
        assert _bits_equal(d.tensors[name], x)


def test_outgoing_head_keeps_its_fields_and_must_not_hold_a_chunk() -> None:
    """A head's own fields come first; the lazy chunk is appended as field 2, so a head that
    already holds a chunk would be merged with it: refused."""
    (lazy,) = tb.encode_chunks({"x": torch.randn(20_000)}, max_bytes=1 << 20)
    data = wv.serialize(wv.Outgoing(stage_pb2.StageResponse(stage="code2wav"), lazy))
    m = stage_pb2.StageResponse.FromString(data)
    assert m.stage == "code2wav" and set(m.chunk.tensors) == {"x"}
    with pytest.raises(ValueError, match="must not hold a chunk"):
        wv.serialize(wv.Outgoing(stage_pb2.StageResponse(stage="code2wav", chunk=Chunk(seq=1)), lazy))


@given(
    case=logical_chunks(),
    kind=st.sampled_from(list(HEADS)),
    use_shm=st.booleans(),
    lazy_bytes=st.sampled_from([0, 1, 64, 1 << 62]),
)
@PROPS
def test_random_chunks_serialize_as_plain_protobuf(
    shm_pool: tuple[ShmPool, ShmReader],
    case: tuple[dict[str, torch.Tensor], dict[str, Any]],
    kind: str,
    use_shm: bool,
    lazy_bytes: int,
) -> None:
    pool, reader = shm_pool
    tensors, options = case
    try:
        with mock.patch.object(tb, "LAZY_BYTES", lazy_bytes):
            lazies = tb.encode_chunks(tensors, pool=pool if use_shm else None, request_id="send", **options)
        cls = type(HEADS[kind]())
        asm, decoded = ChunkAssembler(reader=reader), []
        for lazy in lazies:
            data = wv.serialize(wv.Outgoing(HEADS[kind](), lazy))
            plain = _plain(kind, lazy.message())
            assert len(data) == len(plain) and len(data) <= options["max_bytes"]
            assert cls.FromString(data) == cls.FromString(plain)
            r = _parse(kind, data)
            d = asm.push(r.message.chunk, r.views)
            if d is not None:
                decoded.append(d)
        (d,) = decoded
        assert set(d.tensors) == set(tensors)
        for name, x in tensors.items():
            assert _bits_equal(d.tensors[name], x)
        assert (d.offset, d.seq, d.finished) == (options["offset"], options["seq"], options["finished"])
    finally:
        pool.release_request("send")
