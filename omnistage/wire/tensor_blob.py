"""tensor_blob: torch tensors / numpy arrays <-> ``omnistage.v1.TensorBlob`` and ``Chunk``.

Wire format: dtype enum, shape, and either ``raw`` (little-endian, row-major, no padding) or
``shm`` (a reference into a same-host shared-memory segment of the sender, see
``omnistage/wire/shm.py``). No pickle anywhere. One encoder (``encode_chunks``) and one
assembler (``ChunkAssembler``); ``encode`` and ``encode_chunk`` are thin views of the encoder.

Copies
------
* Decoding makes no copy: tensors are ``torch.frombuffer`` / ``numpy.frombuffer`` views over the
  received message bytes or over the mapped segment. protobuf-python (upb) would copy an inline
  payload when it parses the message and again whenever ``blob.raw`` is read, so received
  messages are parsed by ``omnistage/wire/wire_view.py``, which leaves the payloads in the
  received bytes and hands them over as memoryviews (the ``view`` / ``views`` arguments below).
  Without a view, ``decode`` reads ``blob.raw`` exactly once (protobuf's copy). The
  shared-memory path has no copy at all.
* Encoding copies once. An inline payload of ``LAZY_BYTES`` or more stays a view of the tensor
  until ``wire_view.serialize`` copies it into the outgoing message bytes (one ``bytes.join``).
  Smaller payloads are copied into the message: protobuf's copies of a few KiB cost less than
  the Python framing (the break-even measured here lies between 16 and 64 KiB). A
  non-contiguous tensor is gathered first (a second copy); a device tensor's device->host copy
  is the first. The shared-memory path copies once: one ``copy_`` into the slot (which is also
  the device->host copy for a CUDA tensor). ``LazyChunk.message()`` (and ``encode_chunk``)
  builds a plain protobuf message with the payloads copied in, for in-process use and tests.
* Tensors decoded from inline bytes share memory with a private ``bytes`` object: numpy marks
  them read-only; torch cannot, so treat them as read-only (``.clone()`` before in-place ops).
  Tensors decoded from shared memory are writable and stay valid until the sender releases the
  request (``ShmPool.release_request``); keep them longer only as a copy.
* bf16 travels as its 16-bit pattern and round-trips exactly; ``decode_numpy`` returns bf16 as
  ``uint16`` bit patterns because numpy has no bfloat16.

Large payloads: ``encode_chunks`` splits a logical chunk over several ``Chunk`` messages, each
under ``max_bytes`` serialized, and ``ChunkAssembler`` puts them back together.

Every malformed input raises ``TensorBlobError`` (a ``ValueError``; services map it to
INVALID_ARGUMENT): unknown dtype, negative or overflowing shape, byte length disagreeing with
dtype × shape, a missing segment or an out-of-range offset/nbytes, a broken split sequence, a
shared-memory reference where the receiver takes inline bytes only.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from omnistage.v1 import tensor_pb2
from omnistage.v1.tensor_pb2 import Chunk, Scalar, TensorBlob
from omnistage.wire.errors import TensorBlobError

if TYPE_CHECKING:
    from omnistage.v1.tensor_pb2 import ShmRef
    from omnistage.wire.shm import ShmPool


class SegmentReader(Protocol):
    """What decoding needs of a shared-memory reader (``shm.ShmReader``, ``shm.CallShmReader``)."""

    enabled: bool

    def buffer(self, ref: ShmRef) -> memoryview: ...

__all__ = [
    "LAZY_BYTES",
    "LENGTH_KEY",
    "MAX_NBYTES",
    "MAX_NDIM",
    "ArrayLike",
    "ChunkAssembler",
    "DecodedChunk",
    "LazyChunk",
    "ScalarValue",
    "decode",
    "decode_numpy",
    "encode",
    "encode_chunk",
    "encode_chunks",
    "get_meta",
    "set_meta",
]

ArrayLike = torch.Tensor | np.ndarray
ScalarValue = bool | int | float | str

MAX_NDIM = 32
MAX_NBYTES = 1 << 40  # one tensor, 1 TiB: anything larger is a corrupt or hostile shape
LENGTH_KEY = "n"  # meta: stream positions (tokens, frames, samples) a chunk advances its offset


def _spend_torch_frombuffer_warning() -> None:
    """torch warns once per process when it wraps a non-writable buffer such as ``bytes``; we do
    that on purpose (see the module docstring), so spend that one warning here, silenced, at
    import. A warnings filter alone would not do: callers (pytest, -W error) put theirs first."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.frombuffer(b"\0\0", dtype=torch.uint8)


_spend_torch_frombuffer_warning()


@dataclass(frozen=True)
class _DType:
    proto: int
    torch: torch.dtype
    wire: np.dtype  # little-endian numpy dtype of the bytes (bf16: its uint16 bit pattern)

    @property
    def itemsize(self) -> int:
        return self.wire.itemsize


_DTYPES = [
    _DType(tensor_pb2.BF16, torch.bfloat16, np.dtype("<u2")),
    _DType(tensor_pb2.F16, torch.float16, np.dtype("<f2")),
    _DType(tensor_pb2.F32, torch.float32, np.dtype("<f4")),
    _DType(tensor_pb2.F64, torch.float64, np.dtype("<f8")),
    _DType(tensor_pb2.I64, torch.int64, np.dtype("<i8")),
    _DType(tensor_pb2.I32, torch.int32, np.dtype("<i4")),
    _DType(tensor_pb2.I16, torch.int16, np.dtype("<i2")),
    _DType(tensor_pb2.I8, torch.int8, np.dtype("i1")),
    _DType(tensor_pb2.U8, torch.uint8, np.dtype("u1")),
    _DType(tensor_pb2.BOOL, torch.bool, np.dtype("?")),
]
_BY_PROTO = {d.proto: d for d in _DTYPES}
_BY_TORCH = {d.torch: d for d in _DTYPES}
_BY_NUMPY = {d.wire: d for d in _DTYPES if d.proto != tensor_pb2.BF16}


def _dtype_of_proto(value: int) -> _DType:
    try:
        return _BY_PROTO[value]
    except KeyError:
        raise TensorBlobError(f"unknown dtype {value}") from None


# --------------------------------------------------------------------------------------------
# encode
# --------------------------------------------------------------------------------------------


def _host_view(x: ArrayLike) -> tuple[_DType, np.ndarray | torch.Tensor]:
    """(dtype, a host array in wire layout or the torch tensor itself when it is on a device)."""
    if isinstance(x, torch.Tensor):
        dt = _BY_TORCH.get(x.dtype)
        if dt is None:
            raise TensorBlobError(f"unsupported torch dtype {x.dtype}")
        if x.layout != torch.strided:
            raise TensorBlobError(f"unsupported tensor layout {x.layout}")
        t = x.detach()
        if t.device.type != "cpu":
            return dt, t
        if t.dtype == torch.bfloat16:
            return dt, t.view(torch.int16).numpy().view(dt.wire)
        return dt, t.numpy()
    if isinstance(x, np.generic):
        x = np.asarray(x)
    if isinstance(x, np.ndarray):
        if x.dtype.name == "bfloat16":  # ml_dtypes, if installed
            return _BY_PROTO[tensor_pb2.BF16], x.view(np.uint16)
        key = x.dtype.newbyteorder("<") if x.dtype.byteorder in "<>=" else x.dtype
        dt = _BY_NUMPY.get(key)
        if dt is None:
            raise TensorBlobError(f"unsupported numpy dtype {x.dtype}")
        return dt, x
    raise TensorBlobError(f"cannot encode {type(x).__name__}; expected torch.Tensor or numpy.ndarray")


def _host_wire(dt: _DType, arr: np.ndarray | torch.Tensor) -> np.ndarray:
    """``arr`` as a host array of the wire dtype: copies only a device tensor (the device->host
    copy) or a big-endian array (never on the little-endian hosts we run on)."""
    if isinstance(arr, torch.Tensor):
        arr = _host_view(arr.cpu())[1]
        assert isinstance(arr, np.ndarray)
    return arr if arr.dtype == dt.wire else arr.astype(dt.wire)


def _flat_wire(dt: _DType, arr: np.ndarray | torch.Tensor) -> np.ndarray:
    """The elements in wire layout, flat: a view of a contiguous CPU tensor, no copy."""
    return np.ascontiguousarray(_host_wire(dt, arr)).reshape(-1)


def _fill_slot(buffer: memoryview, dt: _DType, arr: np.ndarray | torch.Tensor) -> None:
    if isinstance(arr, torch.Tensor):
        dst_t = torch.frombuffer(buffer, dtype=dt.torch).view(arr.shape)
        dst_t.copy_(arr)
        return
    dst = np.frombuffer(buffer, dtype=dt.wire).reshape(arr.shape)
    np.copyto(dst, arr, casting="equiv")


def encode(x: ArrayLike, *, pool: ShmPool | None = None, request_id: str | None = None) -> TensorBlob:
    """One tensor as a whole TensorBlob (``encode_chunk`` of one tensor, taken out of its chunk)."""
    return encode_chunk({"x": x}, pool=pool, request_id=request_id).tensors["x"]


# --------------------------------------------------------------------------------------------
# validate / decode
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Resolved:
    dtype: _DType
    shape: tuple[int, ...]
    numel: int
    element_offset: int
    count: int  # elements present in the data (== numel for a whole tensor)
    buffer: bytes | memoryview


def _check_shape(dims: list[int], itemsize: int) -> int:
    if len(dims) > MAX_NDIM:
        raise TensorBlobError(f"{len(dims)} dimensions (max {MAX_NDIM})")
    numel = span = 1  # span ignores zero dims: (0, 2**62) is empty but no library can shape it
    for d in dims:
        if d < 0:
            raise TensorBlobError(f"negative dimension in shape {dims}")
        numel *= d
        span *= max(d, 1)
        if span * itemsize > MAX_NBYTES:
            raise TensorBlobError(f"shape {dims} exceeds {MAX_NBYTES} bytes")
    return numel


def _resolve(
    blob: TensorBlob, reader: SegmentReader | None, *, allow_piece: bool, view: memoryview | None = None
) -> _Resolved:
    dt = _dtype_of_proto(blob.dtype)
    shape = tuple(blob.shape)
    numel = _check_shape(list(shape), dt.itemsize)
    eo = blob.element_offset
    if eo != 0 and not allow_piece:
        raise TensorBlobError("blob holds part of a split tensor (element_offset != 0); use ChunkAssembler")
    kind = blob.WhichOneof("data")
    buffer: bytes | memoryview
    if kind == "raw":
        # The received payload (wire_view), else protobuf's copy of it: read the field once.
        buffer = view if view is not None else blob.raw
        nbytes = len(buffer)
    elif kind == "shm":
        ref = blob.shm
        nbytes = ref.nbytes
        if nbytes < 0 or nbytes > MAX_NBYTES:
            raise TensorBlobError(f"shm nbytes {nbytes} out of range")
        if ref.offset % dt.itemsize:
            raise TensorBlobError(f"shm offset {ref.offset} not aligned to {dt.itemsize} bytes")
        if reader is None or not reader.enabled:
            raise TensorBlobError("a shared-memory reference where this receiver takes inline bytes only")
        buffer = reader.buffer(ref)
    else:
        buffer, nbytes = b"", 0
    if nbytes % dt.itemsize:
        raise TensorBlobError(f"{nbytes} bytes is not a whole number of {dt.itemsize}-byte elements")
    count = nbytes // dt.itemsize
    if allow_piece:
        if eo < 0 or eo + count > numel:
            raise TensorBlobError(f"piece [{eo}, {eo + count}) outside a tensor of {numel} elements")
    elif count != numel:
        raise TensorBlobError(f"{nbytes} data bytes but dtype × shape {list(shape)} needs {numel * dt.itemsize}")
    if dt.proto == tensor_pb2.BOOL and count and int(np.frombuffer(buffer, np.uint8, count).max()) > 1:
        raise TensorBlobError("BOOL bytes must be 0 or 1")
    return _Resolved(dt, shape, numel, eo, count, buffer)


def _numpy_view(r: _Resolved) -> np.ndarray:
    return np.frombuffer(r.buffer, dtype=r.dtype.wire, count=r.count)


def _torch_view(r: _Resolved) -> torch.Tensor:
    if r.count == 0:
        return torch.empty(0, dtype=r.dtype.torch)
    buf = r.buffer
    if isinstance(buf, bytes) and len(buf) <= 1:
        # CPython shares 0- and 1-byte bytes objects process-wide; never alias them.
        buf = bytearray(buf)
    return torch.frombuffer(buf, dtype=r.dtype.torch, count=r.count)


def decode(blob: TensorBlob, *, reader: SegmentReader | None = None, view: memoryview | None = None) -> torch.Tensor:
    """TensorBlob -> torch.Tensor, a view over the received bytes or the mapped segment.

    ``view``: the blob's inline payload in the received bytes (``wire_view.Received.views``),
    used instead of ``blob.raw``. A ``ShmRef`` needs ``reader`` (else TensorBlobError).
    """
    r = _resolve(blob, reader, allow_piece=False, view=view)
    return _torch_view(r).view(r.shape)


def decode_numpy(blob: TensorBlob, *, reader: SegmentReader | None = None,
                 view: memoryview | None = None) -> np.ndarray:  # fmt: skip
    """TensorBlob -> numpy array view (read-only for inline bytes). bf16 comes back as uint16."""
    r = _resolve(blob, reader, allow_piece=False, view=view)
    return _numpy_view(r).reshape(r.shape)


# --------------------------------------------------------------------------------------------
# meta
# --------------------------------------------------------------------------------------------


def set_meta(target: MutableMapping[str, Scalar], values: Mapping[str, ScalarValue]) -> None:
    """Write Python scalars into a ``map<string, Scalar>`` field (bool before int: bool is an int)."""
    for key, value in values.items():
        s = target[key]
        if isinstance(value, bool | np.bool_):
            s.bool_value = bool(value)
        elif isinstance(value, int | np.integer):
            s.int_value = int(value)
        elif isinstance(value, float | np.floating):
            s.double_value = float(value)
        elif isinstance(value, str):
            s.string_value = value
        else:
            raise TensorBlobError(f"meta {key!r}: unsupported type {type(value).__name__}")


def get_meta(source: Mapping[str, Scalar]) -> dict[str, ScalarValue]:
    """Read a ``map<string, Scalar>`` field into Python scalars."""
    out: dict[str, ScalarValue] = {}
    for key, s in source.items():
        kind = s.WhichOneof("value")
        if kind is None:
            raise TensorBlobError(f"meta {key!r} has no value")
        out[key] = getattr(s, kind)
    return out


# --------------------------------------------------------------------------------------------
# chunks
# --------------------------------------------------------------------------------------------


@dataclass
class DecodedChunk:
    """A logical chunk after decoding (and reassembly, when it was split)."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, ScalarValue] = field(default_factory=dict)
    offset: int = 0
    seq: int = 0
    finished: bool = False
    ready: Any = field(default=None, repr=False)  # copies to a device in flight (the engine's, after decoding)

    @property
    def length(self) -> int:
        """Stream positions (tokens, frames, samples) this chunk advances the offset by."""
        n = self.meta.get(LENGTH_KEY, 0)
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise TensorBlobError(f"chunk meta {LENGTH_KEY!r} must be a non-negative integer, got {n!r}")
        return n


_CHUNK_SLACK = 64  # part/parts/seq/finished/offset fields and map-entry framing
LAZY_BYTES = 32 << 10  # inline payloads at least this large stay in the tensor until serialization


@dataclass(frozen=True, slots=True)
class LazyChunk:
    """A Chunk message to send whose large inline payloads have not been copied yet.

    ``chunk`` holds everything but the lazy tensors. Each entry of ``lazy`` is (name, the
    tensor's TensorBlob without its data, its payload): the payload is a byte memoryview over
    the sender's tensor itself. ``wire_view.serialize`` writes the message bytes with each
    payload copied once, straight from the tensor; the tensors must not change until then.
    ``message()`` builds the plain Chunk (in-process use and tests).
    """

    chunk: Chunk
    lazy: tuple[tuple[str, TensorBlob, memoryview], ...] = ()

    def message(self) -> Chunk:
        if not self.lazy:
            return self.chunk
        out = Chunk()
        out.CopyFrom(self.chunk)
        for name, head, payload in self.lazy:
            blob = out.tensors[name]
            blob.CopyFrom(head)
            blob.raw = bytes(payload)
        return out


_Building = tuple[Chunk, list[tuple[str, TensorBlob, memoryview]]]  # a message being filled, its lazy tensors


def _payload(flat: np.ndarray) -> memoryview:
    return memoryview(flat.view(np.uint8))


def encode_chunk(tensors: Mapping[str, ArrayLike], **options: Any) -> Chunk:
    """``encode_chunks`` with no size limit, as one plain Chunk message (payloads copied in)."""
    (only,) = encode_chunks(tensors, **options)
    return only.message()


def encode_chunks(
    tensors: Mapping[str, ArrayLike],
    *,
    max_bytes: int | None = None,
    offset: int = 0,
    length: int | None = None,
    seq: int = 0,
    finished: bool = False,
    meta: Mapping[str, ScalarValue] | None = None,
    pool: ShmPool | None = None,
    request_id: str | None = None,
) -> list[LazyChunk]:
    """The encoder: a logical chunk as one or more Chunk messages, each at most ``max_bytes``
    serialized (None: one message, no limit).

    ``length``: the stream positions it advances (meta ``LENGTH_KEY``). When it does not fit in
    one message it becomes ``parts`` messages (``part`` 0..parts-1, consecutive ``seq`` from
    ``seq``, the same ``offset`` and ``meta``, ``finished`` only on the last). Tensors too
    large for the room left are spread over several messages as flat element ranges
    (``TensorBlob.element_offset``). With ``pool`` and ``request_id`` a tensor of at least
    ``pool.threshold_bytes`` goes into a shared-memory slot held by that request and takes a few
    bytes (inline when the pool is disabled or full). Inline payloads of ``LAZY_BYTES`` or more
    stay views of the tensors (see ``LazyChunk``); smaller ones are copied into the message,
    which costs less than the framing of a lazy payload. The caller's next seq is
    ``seq + len(result)``.
    """
    if max_bytes is not None and max_bytes < 4096:
        raise ValueError("max_bytes must be at least 4096")
    header = Chunk(offset=offset, seq=seq, finished=finished, part=1 << 30, parts=1 << 30)
    if meta or length is not None:
        set_meta(header.meta, {**(meta or {}), **({} if length is None else {LENGTH_KEY: length})})
    base = header.ByteSize() + _CHUNK_SLACK

    # Each tensor's header first; shm-bound tensors are written into their slot here.
    items: list[tuple[str, TensorBlob, _DType, np.ndarray | torch.Tensor | None]] = []
    total = base
    for name, x in tensors.items():
        dt, arr = _host_view(x)
        blob = TensorBlob(dtype=dt.proto, shape=[int(d) for d in arr.shape])  # type: ignore[arg-type]
        nbytes = math.prod(arr.shape) * dt.itemsize
        if pool is not None and request_id is not None and pool.wants(nbytes):
            slot = pool.allocate(request_id, nbytes)
            if slot is not None:
                _fill_slot(slot.buffer, dt, arr)
                blob.shm.CopyFrom(slot.ref())
                items.append((name, blob, dt, None))
                total += blob.ByteSize() + len(name.encode()) + 24
                continue
        items.append((name, blob, dt, arr))
        total += blob.ByteSize() + len(name.encode()) + 24 + nbytes

    def fresh(part: int) -> _Building:
        c = Chunk()
        c.CopyFrom(header)
        c.seq, c.part = seq + part, part
        return c, []

    def put(msg: _Building, name: str, blob: TensorBlob, dt: _DType, flat: np.ndarray | None) -> None:
        """Add ``blob`` with the elements ``flat`` (None: its data is already set)."""
        chunk, lazy = msg
        if flat is not None and flat.size * dt.itemsize >= LAZY_BYTES:
            lazy.append((name, blob, _payload(flat)))
            return
        entry = chunk.tensors[name]
        entry.CopyFrom(blob)
        if flat is not None:
            entry.raw = flat.tobytes()

    if max_bytes is None or total <= max_bytes:
        msg = fresh(0)
        msg[0].part = msg[0].parts = 0
        for name, blob, dt, arr in items:
            put(msg, name, blob, dt, None if arr is None else _flat_wire(dt, arr))
        return [LazyChunk(msg[0], tuple(msg[1]))]

    messages = [fresh(0)]
    room = max_bytes - base
    for name, blob, dt, arr in items:
        fixed = blob.ByteSize() + len(name.encode()) + 24 + 10  # + element_offset field
        if arr is None:
            if fixed > room:
                messages.append(fresh(len(messages)))
                room = max_bytes - base
            put(messages[-1], name, blob, dt, None)
            room -= fixed
            continue
        flat = _flat_wire(dt, arr)
        start, numel = 0, flat.size
        if max_bytes - base - fixed < dt.itemsize:
            raise ValueError(f"max_bytes {max_bytes} too small for tensor {name!r}")
        while True:
            fit = max(0, (room - fixed) // dt.itemsize)
            sliver = fit < numel - start and fit * dt.itemsize < (max_bytes - base) // 8
            chunk, lazy = messages[-1]
            holds = bool(chunk.tensors) or bool(lazy)
            holds_name = name in chunk.tensors or any(n == name for n, _, _ in lazy)
            if holds and (fit == 0 or sliver or holds_name):
                messages.append(fresh(len(messages)))  # open a new message rather than send a sliver
                room = max_bytes - base
                continue
            n = min(fit, numel - start)
            piece = TensorBlob()
            piece.CopyFrom(blob)
            piece.element_offset = start
            put(messages[-1], name, piece, dt, flat[start : start + n])
            room -= fixed + n * dt.itemsize
            start += n
            if start >= numel:
                break
    for chunk, _ in messages:
        chunk.parts = len(messages)
        chunk.finished = False
    messages[-1][0].finished = finished
    return [LazyChunk(chunk, tuple(lazy)) for chunk, lazy in messages]


def _decode_unsplit(chunk: Chunk, reader: SegmentReader | None, views: Mapping[str, memoryview]) -> DecodedChunk:
    """An unsplit Chunk (parts 0 or 1), decoded without copying tensor data."""
    tensors = {name: decode(blob, reader=reader, view=views.get(name)) for name, blob in chunk.tensors.items()}
    return DecodedChunk(tensors, get_meta(chunk.meta), chunk.offset, chunk.seq, chunk.finished)


# A split tensor's destination is allocated whole once what arrived is at least this share of it
# (or it is small): allocated at the first piece, a piece of a few bytes could claim the declared
# size, up to `max_bytes` (8 GiB) of address space per stream. What comes before is copied into a
# buffer the size of what came (kept as pieces, many tiny ones would hold far more than their bytes).
_ALLOCATE_AT_SHARE = 8
_ALLOCATE_SMALL = 1 << 20


@dataclass
class _Filling:
    """A split tensor being put together from its pieces, in order."""

    dtype: _DType
    shape: tuple[int, ...]
    numel: int
    filled: int = 0  # elements so far
    dest: np.ndarray | None = None  # the whole tensor's bytes, once allocated
    early: bytearray = field(default_factory=bytearray)  # what came before `dest`

    def add(self, piece: np.ndarray) -> None:
        """`piece`: the next elements' bytes (uint8)."""
        size = self.dtype.itemsize
        at = self.filled * size
        self.filled += piece.nbytes // size
        if self.dest is not None:
            self.dest[at : at + piece.nbytes] = piece
            return
        self.early += piece.data
        nbytes = self.numel * size
        if nbytes > max(_ALLOCATE_AT_SHARE * len(self.early), _ALLOCATE_SMALL):
            return
        self.dest = np.empty(nbytes, np.uint8)
        self.dest[: len(self.early)] = np.frombuffer(self.early, np.uint8)
        self.early = bytearray()


@dataclass
class _Pending:
    parts: int
    next_part: int
    first: Chunk
    done: dict[str, torch.Tensor] = field(default_factory=dict)
    held: int = 0  # bytes of the whole tensors in `done` (views keeping their messages alive)
    filling: dict[str, _Filling] = field(default_factory=dict)


class ChunkAssembler:
    """Turns a stream of Chunk messages back into logical chunks.

    ``push`` returns a ``DecodedChunk`` for every unsplit message (zero-copy) and for the last
    part of a split one (split tensors are copied once into a fresh buffer), else ``None``.
    ``max_bytes`` bounds the memory one split chunk may claim.
    """

    def __init__(self, *, reader: SegmentReader | None = None, max_bytes: int = 8 << 30) -> None:
        self._reader = reader
        self._max_bytes = max_bytes
        self._pending: _Pending | None = None

    @property
    def in_progress(self) -> bool:
        return self._pending is not None

    def push(self, chunk: Chunk, views: Mapping[str, memoryview] | None = None) -> DecodedChunk | None:
        """``views``: the chunk's inline payloads by tensor name (``wire_view.Received.views``)."""
        try:
            return self._push(chunk, views or {})
        except TensorBlobError:
            self._pending = None
            raise

    def _push(self, chunk: Chunk, views: Mapping[str, memoryview]) -> DecodedChunk | None:
        if chunk.parts < 0 or chunk.part < 0:
            raise TensorBlobError(f"part {chunk.part} of {chunk.parts}: negative")
        if chunk.parts <= 1:
            if chunk.part != 0 or self._pending is not None:
                raise TensorBlobError("unsplit chunk arrived inside a split sequence")
            return _decode_unsplit(chunk, self._reader, views)
        p = self._pending
        if p is None:
            if chunk.part != 0:
                raise TensorBlobError(f"split chunk starts at part {chunk.part}, not 0")
            p = self._pending = _Pending(parts=chunk.parts, next_part=0, first=chunk)
        # a split chunk's parts are consecutive messages: one seq each, from the first part's
        want_seq = p.first.seq + p.next_part
        if chunk.part != p.next_part or chunk.parts != p.parts or chunk.offset != p.first.offset \
                or chunk.seq != want_seq:  # fmt: skip
            raise TensorBlobError(
                f"split chunk out of order: got part {chunk.part}/{chunk.parts} at offset {chunk.offset} "
                f"(seq {chunk.seq}), expected {p.next_part}/{p.parts} at offset {p.first.offset} (seq {want_seq})"
            )
        if chunk.finished and chunk.part != p.parts - 1:
            raise TensorBlobError("finished set before the last part of a split chunk")
        for name, blob in chunk.tensors.items():
            self._add(p, name, blob, views.get(name))
        p.next_part += 1
        if p.next_part < p.parts:
            return None
        self._pending = None
        tensors = dict(p.done)
        for name, f in p.filling.items():
            if f.filled != f.numel or f.dest is None:
                raise TensorBlobError(f"split tensor {name!r} incomplete: {f.filled} of {f.numel} elements")
            tensors[name] = torch.frombuffer(f.dest, dtype=f.dtype.torch).view(f.shape)
        return DecodedChunk(tensors, get_meta(p.first.meta), p.first.offset, p.first.seq, chunk.finished)

    def _add(self, p: _Pending, name: str, blob: TensorBlob, view: memoryview | None) -> None:
        if name in p.done:
            raise TensorBlobError(f"tensor {name!r} repeated in a split chunk")
        r = _resolve(blob, self._reader, allow_piece=True, view=view)
        f = p.filling.get(name)
        if f is None:
            # everything the split chunk holds counts, the whole tensors it keeps as views too
            used = p.held + sum(f.numel * f.dtype.itemsize for f in p.filling.values())
            if used + r.numel * r.dtype.itemsize > self._max_bytes:
                raise TensorBlobError(f"split chunk exceeds {self._max_bytes} bytes")
            if r.element_offset == 0 and r.count == r.numel:  # whole tensor: no copy
                p.done[name] = _torch_view(r).view(r.shape)
                p.held += r.numel * r.dtype.itemsize
                return
            f = p.filling[name] = _Filling(r.dtype, r.shape, r.numel)
        if r.dtype.proto != f.dtype.proto or r.shape != f.shape:
            raise TensorBlobError(f"pieces of {name!r} disagree on dtype or shape")
        if r.element_offset != f.filled or r.count == 0:
            raise TensorBlobError(f"piece of {name!r} at element {r.element_offset}, expected {f.filled}")
        f.add(np.frombuffer(r.buffer, np.uint8, r.count * f.dtype.itemsize))
