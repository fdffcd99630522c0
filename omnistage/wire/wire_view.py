"""wire_view: Stage messages to and from wire bytes with no copy of their tensor payloads on
receipt and one on sending (docs/architecture.md, "The wire").

Sending: ``serialize`` writes an ``Outgoing`` message (its chunk a ``tensor_blob.LazyChunk``)
as protobuf's small parts plus the payloads joined straight from the tensors into the one
outgoing ``bytes`` (gRPC's serializers must return ``bytes``; protobuf-python would first copy
a payload into the message, then again into the serialized bytes).

Receiving: protobuf-python (upb) copies a ``bytes`` field into its arena when it parses a
message and again into a fresh ``bytes`` object every time the field is read, so decoding an
inline ``TensorBlob`` through a normal ``FromString`` costs two copies of the payload. Here the received bytes are
walked with the protobuf wire format (tags, varints, length prefixes) down the one path that
carries tensor payloads::

    StageRequest.chunk / StageResponse.chunk
      -> Chunk.tensors map entry -> value -> TensorBlob.raw

(field numbers read from the generated descriptors).

Each ``raw`` payload is replaced by a 4-byte placeholder (its index) and the resulting small
*skeleton* is parsed by protobuf itself, so every protobuf rule (merging of repeated
sub-messages, oneof overrides, duplicate map keys, unknown fields, validation) is protobuf's
own. Afterwards each surviving placeholder is turned back into a ``memoryview`` slice of the
received bytes and the field is emptied; ``tensor_blob`` decodes those views with
``torch.frombuffer`` / ``numpy.frombuffer``: no copy of the payload at all.

Anything the walk does not handle (groups, truncated or overlong framing, a garbage tag, a
padded length prefix on the walked path, a map entry with fields besides key and value, which
protobuf keeps whole as an unknown field) falls back to the plain ``FromString``: it either
parses the message (the payloads then come from the message, one copy each, as before) or
raises ``DecodeError`` exactly as before. Messages under ``SMALL_BYTES`` take that plain path
too: the walk is Python, some 10-30 µs a message whatever its size, which costs more than
protobuf's two copies of a few KiB (the break-even measured here lies between 32 and 256 KiB).

The bytes on the wire are unchanged: a peer using the generated stubs interoperates. This
module knows protobuf, not gRPC: the server layer plugs ``parse_request`` / ``serialize`` into
its handlers.

Lifetimes: a view keeps the whole received message alive, and tensors decoded from it are
read-only in effect (``bytes`` is immutable; numpy marks them read-only, torch cannot).
A ``Received.message`` has its inline payloads emptied: re-serializing it loses them, so relay
``Received.wire`` instead (``serialize`` does).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Generic, TypeVar

from google.protobuf.message import Message

from omnistage.v1 import stage_pb2
from omnistage.v1.tensor_pb2 import Chunk, TensorBlob
from omnistage.wire.errors import TensorBlobError
from omnistage.wire.tensor_blob import LazyChunk

__all__ = [
    "SMALL_BYTES",
    "Outgoing",
    "Received",
    "Undecodable",
    "failure_of",
    "failure_response",
    "or_undecodable",
    "parse_chunk",
    "parse_request",
    "parse_response",
    "serialize",
]

M = TypeVar("M", bound=Message)
T = TypeVar("T")

SMALL_BYTES = 32 << 10  # messages shorter than this are parsed by protobuf alone (see module doc)

@dataclass(frozen=True, slots=True)
class Received(Generic[M]):
    """A message parsed from wire bytes, with its chunk's inline payloads left in those bytes.

    ``views`` maps a tensor name of the message's chunk to its ``raw`` payload, a memoryview
    slice of ``wire``; such a blob has ``raw`` set to ``b""`` in ``message`` (still the oneof
    case). Pass ``views`` along with the chunk to ``ChunkAssembler.push`` / ``decode_chunk``.
    """

    message: M
    views: Mapping[str, memoryview]
    wire: bytes


@dataclass(frozen=True, slots=True)
class Undecodable:
    """A received message that does not parse: what a server's deserializer hands its handler
    instead of raising (gRPC would end the call UNKNOWN, or leave it hanging mid-stream).
    ``reason`` names the failure, never the bytes."""

    size: int
    reason: str


# --------------------------------------------------------------------------------------------
# wire-format walk
# --------------------------------------------------------------------------------------------


class _Unsupported(Exception):
    """The walk cannot handle these bytes; parse them with plain protobuf instead."""


def _number(message: type[Message], name: str) -> int:
    """A field's number, from the generated descriptors (never written down here)."""
    return int(message.DESCRIPTOR.fields_by_name[name].number)


# Protobuf fixes map entries at key = 1, value = 2.
_MAP_KEY, _MAP_VALUE = 1, 2
_ENTRY_KEY_TAG, _ENTRY_VALUE_TAG = _MAP_KEY << 3 | 2, _MAP_VALUE << 3 | 2
_RAW = _number(TensorBlob, "raw")
_TENSORS = _number(Chunk, "tensors")

_PAYLOAD = "payload"
# field number -> what to do with a length-delimited field of that number
_BLOB_PLAN: dict[int, Any] = {_RAW: _PAYLOAD}
_ENTRY_PLAN: dict[int, Any] = {_MAP_VALUE: _BLOB_PLAN}
_CHUNK_PLAN: dict[int, Any] = {_TENSORS: _ENTRY_PLAN}
_REQUEST_PLAN: dict[int, Any] = {_number(stage_pb2.StageRequest, "chunk"): _CHUNK_PLAN}
_RESPONSE_PLAN: dict[int, Any] = {_number(stage_pb2.StageResponse, "chunk"): _CHUNK_PLAN}
_PLACEHOLDER = 4  # bytes: the payload's index, little-endian
_PLACEHOLDER_LEN = bytes([_PLACEHOLDER])  # its length prefix


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 64:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
    raise _Unsupported  # truncated, or longer than 10 bytes


_ONE_BYTE = [bytes((i,)) for i in range(0x80)]


def _encode_varint(value: int) -> bytes:
    if value < 0x80:
        return _ONE_BYTE[value]
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _walk(
    buf: bytes,
    view: memoryview,
    pos: int,
    end: int,
    plan: dict[int, Any],
    out: list[Any],
    payloads: list[memoryview],
) -> int:
    """Append the skeleton of the message in buf[pos:end] to ``out`` (memoryview slices of
    ``buf`` and a few new bytes); return the skeleton's length."""
    run = pos  # start of the bytes still to be copied verbatim
    size = 0
    entry = plan is _ENTRY_PLAN
    while pos < end:
        tag = buf[pos]  # one-byte tags and lengths are the common case: no call
        pos += 1
        if tag >= 0x80:
            tag, pos = _varint(buf, pos - 1, end)
            if tag > 0xFFFFFFFF:
                raise _Unsupported
        if tag < 8:  # field number 0
            raise _Unsupported
        if entry and tag != _ENTRY_KEY_TAG and tag != _ENTRY_VALUE_TAG:
            # protobuf keeps a map entry holding anything but key and value as an unknown field
            # of the chunk, bytes and all; let protobuf do that.
            raise _Unsupported
        wire_type = tag & 7
        if wire_type == 2:
            tag_end = pos
            if pos < end and buf[pos] < 0x80:
                n = buf[pos]
                pos += 1
            else:
                n, pos = _varint(buf, pos, end)
            body = pos
            pos += n
            action = plan.get(tag >> 3)
            if action is not None and pos <= end:
                if body - tag_end > 1 and body - tag_end != len(_encode_varint(n)):
                    raise _Unsupported  # a padded length: protobuf may judge it differently, let it
                out.append(view[run:tag_end])  # verbatim, up to and including this field's tag
                size += tag_end - run
                if action is _PAYLOAD:
                    piece = _PLACEHOLDER_LEN + len(payloads).to_bytes(_PLACEHOLDER, "little")
                    payloads.append(view[body:pos])
                    out.append(piece)
                    size += 1 + _PLACEHOLDER
                else:
                    sub: list[Any] = []
                    sub_size = _walk(buf, view, body, pos, action, sub, payloads)
                    prefix = _ONE_BYTE[sub_size] if sub_size < 0x80 else _encode_varint(sub_size)
                    out.append(prefix)
                    out.extend(sub)
                    size += len(prefix) + sub_size
                run = pos
        elif wire_type == 0:
            if pos < end and buf[pos] < 0x80:
                pos += 1
            else:
                _, pos = _varint(buf, pos, end)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        else:  # groups (3, 4) and invalid wire types
            raise _Unsupported
        if pos > end:
            raise _Unsupported
    out.append(view[run:end])
    return size + (end - run)


# --------------------------------------------------------------------------------------------
# parse
# --------------------------------------------------------------------------------------------

_NO_VIEWS: Mapping[str, memoryview] = MappingProxyType({})


def _parse(cls: type[M], data: bytes, plan: dict[int, Any], chunk_of: Callable[[M], Chunk | None]) -> Received[M]:
    if len(data) < SMALL_BYTES:
        return Received(cls.FromString(data), _NO_VIEWS, data)
    out: list[Any] = []
    payloads: list[memoryview] = []
    try:
        _walk(data, memoryview(data), 0, len(data), plan, out, payloads)
    except _Unsupported:
        payloads = []
    if not payloads:  # nothing to leave out (or bytes the walk cannot handle): plain protobuf
        return Received(cls.FromString(data), _NO_VIEWS, data)
    message = cls.FromString(b"".join(out))  # the skeleton: everything but the payloads
    chunk = chunk_of(message)
    if chunk is None:
        return Received(message, _NO_VIEWS, data)
    views: dict[str, memoryview] = {}
    for name, blob in chunk.tensors.items():
        if blob.WhichOneof("data") == "raw":
            placeholder = blob.raw  # every raw left in the skeleton is one of ours
            index = int.from_bytes(placeholder, "little")
            if len(placeholder) != _PLACEHOLDER or index >= len(payloads):
                raise TensorBlobError(f"tensor {name!r}: payload placeholder lost in the parse")
            views[name] = payloads[index]
            blob.raw = b""
    return Received(message, views, data)


def parse_chunk(data: bytes) -> Received[Chunk]:
    """Chunk bytes -> the Chunk with its inline payloads as views into ``data``."""
    return _parse(Chunk, data, _CHUNK_PLAN, lambda m: m)


def parse_request(data: bytes) -> Received[stage_pb2.StageRequest]:
    """StageRequest bytes -> ``Received`` (the gRPC request deserializer of Stage.Stream)."""
    return _parse(
        stage_pb2.StageRequest, data, _REQUEST_PLAN, lambda m: m.chunk if m.WhichOneof("kind") == "chunk" else None
    )


def or_undecodable(parse: Callable[[bytes], T]) -> Callable[[bytes], T | Undecodable]:
    """`parse` returning ``Undecodable`` instead of raising (a server's request deserializer)."""

    def parse_or_error(data: bytes) -> T | Undecodable:
        try:
            return parse(data)
        except Exception as e:  # DecodeError, TensorBlobError, anything protobuf raises on garbage
            return Undecodable(len(data), type(e).__name__)

    return parse_or_error


def parse_response(data: bytes) -> Received[stage_pb2.StageResponse]:
    """StageResponse bytes -> ``Received`` (the gRPC response deserializer of Stage.Stream)."""
    return _parse(stage_pb2.StageResponse, data, _RESPONSE_PLAN, lambda m: m.chunk if m.HasField("chunk") else None)


_STAGE_TAG = _number(stage_pb2.StageResponse, "stage") << 3 | 2
_FAILURE_TAG = _number(stage_pb2.StageResponse, "failure") << 3 | 2


def failure_of(data: bytes) -> stage_pb2.Failure | None:
    """The Failure a StageResponse's bytes hold, else None, without walking a chunk: protobuf and
    `serialize` write a response's `stage` first, then its chunk or its failure (a relaying stage
    checks every response it passes up unparsed)."""
    pos = 0
    if data[:1] == bytes((_STAGE_TAG,)):
        try:
            n, pos = _varint(data, 1, len(data))
        except _Unsupported:  # (garbage: the parse that follows says so)
            return None
        pos += n
    if data[pos : pos + 1] != bytes((_FAILURE_TAG,)):
        return None
    return stage_pb2.StageResponse.FromString(data).failure


def failure_response(stage: str, code: str, message: str) -> stage_pb2.StageResponse:
    return stage_pb2.StageResponse(stage=stage, failure=stage_pb2.Failure(code=code, message=message))


# --------------------------------------------------------------------------------------------
# serialize
# --------------------------------------------------------------------------------------------

def _tag(number: int) -> bytes:
    """The tag of a length-delimited field (wire type 2)."""
    return _encode_varint(number << 3 | 2)


_ENTRY_TAG = _tag(_TENSORS)
_KEY_TAG = _tag(_MAP_KEY)
_VALUE_TAG = _tag(_MAP_VALUE)
_RAW_TAG = _tag(_RAW)
_CHUNK_TAGS = {
    stage_pb2.StageRequest: _tag(_number(stage_pb2.StageRequest, "chunk")),
    stage_pb2.StageResponse: _tag(_number(stage_pb2.StageResponse, "chunk")),
}


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A StageRequest / StageResponse to send: ``head`` with no chunk set (a StageResponse's
    ``stage``; an empty StageRequest) and the chunk as a ``LazyChunk``."""

    head: stage_pb2.StageRequest | stage_pb2.StageResponse
    chunk: LazyChunk


def _chunk_pieces(chunk: LazyChunk) -> tuple[list[bytes | memoryview], int]:
    """The Chunk's wire bytes as pieces (the lazy payloads as they are) and their total length.

    protobuf writes everything but the lazy tensors; each lazy tensor follows as one more
    ``tensors`` map entry whose TensorBlob is its header's bytes then the ``raw`` field.
    Parsers accept fields in any order, so this is the message protobuf would write, up to the
    order of map entries and of a blob's fields.
    """
    rest = chunk.chunk.SerializeToString()
    pieces: list[bytes | memoryview] = [rest]
    size = len(rest)
    for name, head, payload in chunk.lazy:
        key = name.encode()
        n = payload.nbytes
        blob_head = head.SerializeToString() + _RAW_TAG + _encode_varint(n)
        entry_head = (
            _KEY_TAG + _encode_varint(len(key)) + key + _VALUE_TAG + _encode_varint(len(blob_head) + n) + blob_head
        )
        entry_len = len(entry_head) + n
        framing = _ENTRY_TAG + _encode_varint(entry_len) + entry_head
        pieces += (framing, payload)
        size += len(framing) + n
    return pieces, size


def serialize(message: Message | Received[Any] | Outgoing | bytes) -> bytes:
    """The bytes to send for a Stage.Stream message (the gRPC serializer of both directions).

    ``Outgoing``: the one copy of each lazy payload, straight from the tensor into the result.
    ``Received`` or ``bytes`` (a response relayed from downstream): the bytes it arrived in.
    Otherwise protobuf's ``SerializeToString``.
    """
    if isinstance(message, Outgoing):
        if message.head.HasField("chunk"):  # protobuf would merge the two chunks
            raise ValueError("Outgoing.head must not hold a chunk")
        head = message.head.SerializeToString()
        pieces, size = _chunk_pieces(message.chunk)
        return b"".join([head, _CHUNK_TAGS[type(message.head)], _encode_varint(size), *pieces])
    if isinstance(message, Received):
        return message.wire
    if isinstance(message, bytes):  # relayed unparsed
        return message
    return message.SerializeToString()
