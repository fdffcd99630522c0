"""tensor_blob: round trips, zero-copy decode, validation errors, meta."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from omnistage.v1 import tensor_pb2
from omnistage.v1.tensor_pb2 import ShmRef, TensorBlob
from omnistage.wire import tensor_blob as tb
from omnistage.wire.shm import ShmReader
from omnistage.wire.tensor_blob import TensorBlobError

TORCH_DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=g).to(dtype)


def _wire(blob: TensorBlob) -> TensorBlob:
    return TensorBlob.FromString(blob.SerializeToString())


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bytes(a.reshape(-1).view(torch.uint8).numpy()) == bytes(b.reshape(-1).view(torch.uint8).numpy())


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5), (2, 3, 4), (1, 0, 3)])
def test_torch_round_trip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = _sample(dtype, shape)
    y = tb.decode(_wire(tb.encode(x)))
    assert _bits_equal(x, y)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_numpy_round_trip(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16:
        pytest.skip("numpy has no bfloat16")
    a = _sample(dtype, (4, 6)).numpy()
    b = tb.decode_numpy(_wire(tb.encode(a)))
    assert b.dtype == a.dtype and np.array_equal(a, b)


def test_bf16_exact_including_nan_and_inf_bit_patterns() -> None:
    bits = torch.tensor([0x7FC1, 0xFFFF, 0x7F80, 0xFF80, 0x0001, 0x8000, 0x3F80], dtype=torch.int32)
    x = bits.to(torch.int16).view(torch.bfloat16)
    y = tb.decode(_wire(tb.encode(x)))
    assert y.dtype == torch.bfloat16 and _bits_equal(x, y)
    assert tb.decode_numpy(_wire(tb.encode(x))).dtype == np.uint16


def test_raw_layout_is_little_endian_row_major() -> None:
    x = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    blob = tb.encode(x)
    assert blob.dtype == tensor_pb2.I32 and list(blob.shape) == [2, 2]
    assert blob.raw == np.array([1, 2, 3, 4], dtype="<i4").tobytes()


def test_non_contiguous_and_big_endian_inputs() -> None:
    x = torch.arange(24, dtype=torch.float32).view(4, 6).t()[1:, ::2]
    assert torch.equal(tb.decode(tb.encode(x)), x)
    a = np.arange(12, dtype=">i8").reshape(3, 4)[:, ::-1]
    assert np.array_equal(tb.decode_numpy(tb.encode(a)), a)
    assert tb.decode(tb.encode(np.float64(2.5))).item() == 2.5


def test_requires_grad_tensor_encodes() -> None:
    x = torch.randn(3, requires_grad=True)
    assert torch.equal(tb.decode(tb.encode(x)), x.detach())


def test_decode_is_a_view_over_the_received_bytes() -> None:
    blob = _wire(tb.encode(torch.arange(1000, dtype=torch.float32)))
    a = tb.decode_numpy(blob)
    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, bytes) and not a.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the non-writable warning is handled inside the codec
        t = tb.decode(blob)
    assert t.dtype == torch.float32 and t[999].item() == 999.0


def test_one_byte_tensors_do_not_alias_shared_bytes_singletons() -> None:
    t = tb.decode(_wire(tb.encode(torch.tensor([5], dtype=torch.uint8))))
    t.add_(1)
    assert bytes([5]) == b"\x05"


@pytest.mark.parametrize(
    "blob",
    [
        TensorBlob(dtype=tensor_pb2.F32, shape=[3], raw=b"\0" * 11),
        TensorBlob(dtype=tensor_pb2.F32, shape=[3], raw=b"\0" * 16),
        TensorBlob(dtype=tensor_pb2.F32, shape=[2]),
        TensorBlob(dtype=tensor_pb2.DTYPE_UNSPECIFIED, shape=[1], raw=b"\0"),
        TensorBlob(dtype=77, shape=[1], raw=b"\0"),  # type: ignore[arg-type]
        TensorBlob(dtype=tensor_pb2.U8, shape=[-1], raw=b""),
        TensorBlob(dtype=tensor_pb2.U8, shape=[2**21, 2**21], raw=b""),
        TensorBlob(dtype=tensor_pb2.F64, shape=[2**38], raw=b""),
        TensorBlob(dtype=tensor_pb2.U8, shape=[1] * 40, raw=b"\0"),
        TensorBlob(dtype=tensor_pb2.BOOL, shape=[2], raw=b"\x01\x02"),
        TensorBlob(dtype=tensor_pb2.U8, shape=[4], raw=b"\0\0", element_offset=2),
        TensorBlob(dtype=tensor_pb2.U8, shape=[4], shm=ShmRef(segment="../etc/passwd", offset=0, nbytes=4)),
        TensorBlob(dtype=tensor_pb2.U8, shape=[4], shm=ShmRef(segment="omnistage-0-0-0-none-1", nbytes=4)),
        TensorBlob(dtype=tensor_pb2.U8, shape=[4], shm=ShmRef(segment="omnistage-x", nbytes=-4)),
        TensorBlob(dtype=tensor_pb2.F32, shape=[1], shm=ShmRef(segment="omnistage-x", offset=2, nbytes=4)),
    ],
    ids=lambda b: str(b).replace("\n", " ")[:60],
)
def test_malformed_blobs_raise_tensor_blob_error(blob: TensorBlob) -> None:
    with pytest.raises(TensorBlobError):
        tb.decode(blob)
    with pytest.raises(TensorBlobError):
        tb.decode_numpy(blob)
    with pytest.raises(ValueError):  # services may catch ValueError too
        tb.decode(blob, reader=ShmReader(enabled=True))


def test_unsupported_inputs() -> None:
    with pytest.raises(TensorBlobError):
        tb.encode(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(TensorBlobError):
        tb.encode(np.zeros(2, dtype=np.uint32))
    with pytest.raises(TensorBlobError):
        tb.encode([1, 2, 3])  # type: ignore[arg-type]


def test_meta_round_trip() -> None:
    chunk = tb.Chunk()
    values = {"speaker": "Ethan", "n": -3, "t": 0.25, "flag": True, "zero": False}
    tb.set_meta(chunk.meta, values)
    got = tb.get_meta(tb.Chunk.FromString(chunk.SerializeToString()).meta)
    assert got == values and isinstance(got["flag"], bool) and isinstance(got["n"], int)
    chunk.meta["empty"].Clear()
    with pytest.raises(TensorBlobError):
        tb.get_meta(chunk.meta)
    with pytest.raises(TensorBlobError):
        tb.set_meta(chunk.meta, {"bad": [1]})  # type: ignore[dict-item]


def test_encode_chunk_and_assemble() -> None:
    hidden, ids = torch.randn(4, 8).bfloat16(), torch.arange(4)
    chunk = tb.encode_chunk({"hidden": hidden, "ids": ids}, offset=12, seq=3, finished=True, meta={"k": 1})
    d = tb.ChunkAssembler().push(tb.Chunk.FromString(chunk.SerializeToString()))
    assert d is not None
    assert (d.offset, d.seq, d.finished, d.meta) == (12, 3, True, {"k": 1})
    assert _bits_equal(d.tensors["hidden"], hidden) and torch.equal(d.tensors["ids"], ids)
