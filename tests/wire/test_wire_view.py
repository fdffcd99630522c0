"""wire_view: received Stage messages decode without copying their inline payloads, parse exactly
as protobuf does (random, split, shared-memory and mutated messages), and work as the gRPC
(de)serializers of Stage.Stream."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any
from unittest import mock

import grpc
import numpy as np
import pytest
import torch
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnistage.server.grpc_common import add_stage_servicer, stage_stream
from omnistage.v1 import stage_pb2, stage_pb2_grpc
from omnistage.v1.tensor_pb2 import Chunk, ShmRef
from omnistage.wire import tensor_blob as tb
from omnistage.wire import wire_view as wv
from omnistage.wire.shm import ShmPool, ShmReader
from omnistage.wire.tensor_blob import ChunkAssembler, TensorBlobError
from tests.wire.helpers import encode_messages
from tests.wire.mutation import BYTE_OPS, mutate_bytes
from tests.wire.test_tensor_blob import TORCH_DTYPES, _bits_equal, _sample

PROPS = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)

KINDS: dict[str, tuple[type[Message], Callable[[bytes], wv.Received[Any]]]] = {
    "request": (stage_pb2.StageRequest, wv.parse_request),
    "response": (stage_pb2.StageResponse, wv.parse_response),
    "chunk": (Chunk, wv.parse_chunk),
}


def _inside(ptr: int, data: bytes) -> bool:
    base = np.frombuffer(data, np.uint8).ctypes.data
    return base <= ptr < base + len(data)


def _wrap(kind: str, chunk: Chunk) -> bytes:
    if kind == "request":
        return stage_pb2.StageRequest(chunk=chunk).SerializeToString()
    if kind == "response":
        return stage_pb2.StageResponse(stage="thinker", chunk=chunk).SerializeToString()
    return chunk.SerializeToString()


def _chunk_of(message: Message) -> Chunk | None:
    if isinstance(message, Chunk):
        return message
    if isinstance(message, stage_pb2.StageRequest):
        return message.chunk if message.WhichOneof("kind") == "chunk" else None
    assert isinstance(message, stage_pb2.StageResponse)
    return message.chunk if message.HasField("chunk") else None


def _restore(r: wv.Received[Any]) -> Message:
    """The received message with its payloads put back: what plain protobuf parses."""
    m = type(r.message)()
    m.CopyFrom(r.message)
    chunk = _chunk_of(m)
    if r.views:
        assert chunk is not None
        for name, view in r.views.items():
            assert chunk.tensors[name].WhichOneof("data") == "raw" and chunk.tensors[name].raw == b""
            chunk.tensors[name].raw = bytes(view)
    return m


def _walk_always() -> Any:
    """Send every message through the wire walk, not only those of SMALL_BYTES and more."""
    return mock.patch.object(wv, "SMALL_BYTES", 0)


def _parse_like_protobuf(kind: str, data: bytes) -> tuple[wv.Received[Any], Message] | None:
    """wire_view's parse must equal protobuf's (or fail exactly when protobuf fails)."""
    cls, parse = KINDS[kind]
    try:
        expected = cls.FromString(data)
    except DecodeError:
        with pytest.raises(DecodeError):
            parse(data)
        return None
    r = parse(data)
    assert r.wire is data
    got = _restore(r)
    assert got == expected
    assert got.SerializeToString(deterministic=True) == expected.SerializeToString(deterministic=True)
    for view in r.views.values():
        assert view.obj is data  # a slice of the received bytes, not a copy
    return r, expected


# --------------------------------------------------------------------------------------------
# zero copy
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_decoded_tensor_lies_in_the_received_bytes(kind: str, dtype: torch.dtype) -> None:
    x = _sample(dtype, (96, 200), seed=1)  # >= 19200 bytes; with "ids", over SMALL_BYTES for every dtype
    ids = torch.arange(5000, dtype=torch.int64)
    data = _wrap(kind, tb.encode_chunk({"x": x, "ids": ids}, offset=3, meta={"n": 7}))
    assert len(data) >= wv.SMALL_BYTES
    r = KINDS[kind][1](data)
    assert set(r.views) == {"x", "ids"}
    chunk = _chunk_of(r.message)
    assert chunk is not None
    d = ChunkAssembler().push(chunk, r.views)
    assert d is not None and d.offset == 3 and d.meta == {"n": 7}
    assert _bits_equal(d.tensors["x"], x) and torch.equal(d.tensors["ids"], ids)
    assert _inside(d.tensors["x"].data_ptr(), data) and _inside(d.tensors["ids"].data_ptr(), data)
    a = tb.decode_numpy(chunk.tensors["x"], view=r.views["x"])
    assert _inside(a.ctypes.data, data) and not a.flags.writeable
    assert bytes(a.tobytes()) == bytes(x.reshape(-1).view(torch.uint8).numpy())
    # The check discriminates: plain protobuf hands the payload over as a copy.
    plain = tb.decode(_chunk_of(KINDS[kind][0].FromString(data)).tensors["x"])  # type: ignore[union-attr]
    assert _bits_equal(plain, x) and not _inside(plain.data_ptr(), data)


def test_tensor_keeps_the_received_bytes_alive() -> None:
    x = torch.randn(40_000)
    data = _wrap("request", tb.encode_chunk({"hidden": x}))
    baseline = sys.getrefcount(data)
    r = wv.parse_request(data)
    t = tb.decode(r.message.chunk.tensors["hidden"], view=r.views["hidden"])
    del r
    assert sys.getrefcount(data) > baseline  # held through the tensor's view
    assert torch.equal(t, x) and _inside(t.data_ptr(), data)
    del t
    assert sys.getrefcount(data) == baseline


def test_small_messages_take_plain_protobuf() -> None:
    chunk = tb.encode_chunk({"ids": torch.arange(10), "embed": torch.randn(2, 8).bfloat16()}, finished=True)
    data = _wrap("request", chunk)
    assert len(data) < wv.SMALL_BYTES
    r = wv.parse_request(data)
    assert r.views == {} and r.message == stage_pb2.StageRequest.FromString(data)
    d = ChunkAssembler().push(r.message.chunk, r.views)
    assert d is not None and torch.equal(d.tensors["ids"], torch.arange(10)) and d.finished


def test_relay_sends_the_received_bytes() -> None:
    data = _wrap("response", tb.encode_chunk({"audio": torch.randn(20_000)}, seq=4))
    r = wv.parse_response(data)
    assert r.views and wv.serialize(r) is data
    own = stage_pb2.StageResponse(stage="talker", chunk=tb.encode_chunk({"codes": torch.zeros(2, 3)}))
    assert wv.serialize(own) == own.SerializeToString()


# --------------------------------------------------------------------------------------------
# same parse as protobuf
# --------------------------------------------------------------------------------------------


NAMES = ["embed", "hidden", "ids", "codes", "audio"]


@st.composite
def logical_chunks(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {}
    for name in draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=4)):
        shape = tuple(draw(st.lists(st.integers(0, 24), max_size=3)))
        tensors[name] = _sample(draw(st.sampled_from(TORCH_DTYPES)), shape, seed=draw(st.integers(0, 99)))
    options = {
        "max_bytes": draw(st.sampled_from([4096, 6000, 1 << 20])),
        "offset": draw(st.integers(0, 1 << 40)),
        "seq": draw(st.integers(0, 1000)),
        "finished": draw(st.booleans()),
        "meta": draw(st.dictionaries(st.sampled_from(["n", "last", "x"]), st.integers(-5, 5) | st.text(max_size=4))),
    }
    return tensors, options


def _decode_all(kind: str, msgs: list[bytes], reader: ShmReader) -> list[tb.DecodedChunk]:
    asm, out = ChunkAssembler(reader=reader), []
    for data in msgs:
        r = KINDS[kind][1](data)
        chunk = _chunk_of(r.message)
        assert chunk is not None
        d = asm.push(chunk, r.views)
        if d is not None:
            out.append(d)
    return out


@given(case=logical_chunks(), kind=st.sampled_from(list(KINDS)), use_shm=st.booleans())
@PROPS
def test_random_messages_parse_and_decode_as_with_protobuf(
    shm_pool: tuple[ShmPool, ShmReader], case: tuple[dict[str, torch.Tensor], dict[str, Any]], kind: str, use_shm: bool
) -> None:
    pool, reader = shm_pool
    tensors, options = case
    chunks = encode_messages(tensors, pool=pool if use_shm else None, request_id="prop", **options)
    msgs = [_wrap(kind, c) for c in chunks]
    try:
        with _walk_always():
            for data in msgs:
                parsed = _parse_like_protobuf(kind, data)
                assert parsed is not None
                r, expected = parsed
                raw_names = {n for n, b in _chunk_of(expected).tensors.items() if b.WhichOneof("data") == "raw"}  # type: ignore[union-attr]
                assert set(r.views) == raw_names  # the walk ran: every inline payload is a view
            (d,) = _decode_all(kind, msgs, reader)
        assert set(d.tensors) == set(tensors)
        for name, x in tensors.items():
            assert _bits_equal(d.tensors[name], x)
        assert (d.offset, d.seq, d.finished) == (options["offset"], options["seq"], options["finished"])
    finally:
        pool.release_request("prop")


def _field(number: int, wire_type: int, payload: bytes = b"") -> bytes:
    return wv._encode_varint(number << 3 | wire_type) + payload


def _len(number: int, body: bytes) -> bytes:
    return _field(number, 2, wv._encode_varint(len(body)) + body)


def _padded_varint(value: int, width: int) -> bytes:
    out = bytearray(wv._encode_varint(value))
    out[-1] |= 0x80
    out += b"\x80" * (width - len(out) - 1) + b"\x00"
    return bytes(out)


BIG = bytes(range(256)) * 200  # 51200 bytes
SHM_REF = ShmRef(segment="omnistage-nobody", nbytes=4).SerializeToString()


def _blob(raw: bytes = BIG, dtype: int = 9, extra: bytes = b"") -> bytes:
    return _field(1, 0, bytes([dtype])) + _len(2, wv._encode_varint(len(raw))) + _len(3, raw) + extra


def _entry(name: str, blob: bytes) -> bytes:
    return _len(1, _len(1, name.encode()) + _len(2, blob))


EDGE_CASES: dict[str, tuple[str, bytes]] = {
    "two chunks merge": ("request", _len(2, _entry("a", _blob())) + _len(2, _entry("b", _blob(BIG[:100])))),
    "duplicate map key, last wins": ("chunk", _entry("a", _blob(BIG[:300])) + _entry("a", _blob())),
    "value twice in one entry merges": ("chunk", _len(1, _len(1, b"a") + _len(2, _blob()) + _len(2, b"\x08\x03"))),
    "unknown field in a map entry": ("chunk", _len(1, _len(1, b"a") + _len(2, _blob()) + b"\x20\x02")),
    "key with a wrong wire type": ("chunk", _len(1, b"\x08\x01" + _len(2, _blob()))),
    "raw twice in a blob": ("chunk", _entry("a", _blob() + _len(3, BIG[:64]))),
    "shm after raw wins": ("chunk", _entry("a", _blob() + _len(4, SHM_REF))),
    "raw after shm wins": ("chunk", _entry("a", _len(4, SHM_REF) + _blob())),
    "start after chunk wins": ("request", _len(2, _entry("a", _blob())) + _len(1, b"\x0a\x01r")),
    "chunk after start wins": ("request", _len(1, b"") + _len(2, _entry("a", _blob()))),
    "unknown fields kept": (
        "response",
        _len(9, BIG) + _len(2, _entry("a", _blob(extra=_len(15, b"zz")))) + _field(7, 5, b"abcd"),
    ),
    "stage and chunk": ("response", _len(1, b"talker") + _len(2, _entry("a", _blob()) + b"\x18\x07")),
    "wrong wire type for chunk": ("request", _field(2, 0, b"\x05") + _len(9, BIG)),
    "wrong wire type for raw": ("chunk", _entry("a", _field(3, 5, b"abcd") + _len(3, BIG))),
    "group in a blob": ("chunk", _entry("a", _blob() + _field(20, 3) + _field(1, 0, b"\x01") + _field(20, 4))),
    "padded payload length": ("chunk", _len(1, _len(2, _field(3, 2, _padded_varint(len(BIG), 5) + BIG)))),
    "padded entry length": ("chunk", _field(1, 2, _padded_varint(len(_len(2, _blob())), 4) + _len(2, _blob()))),
    "field number zero": ("chunk", _field(0, 0, b"\x01") + _entry("a", _blob())),
    "truncated payload": ("request", _len(2, _entry("a", _blob()))[:-10]),
    "length past the end": ("chunk", _entry("a", _blob()) + b"\x0a\xff\xff\x03"),
    "end group alone": ("response", _len(2, _entry("a", _blob())) + _field(3, 4)),
    "overlong varint": ("chunk", _entry("a", _blob()) + _field(4, 0, b"\xff" * 10 + b"\x01")),
    "invalid utf-8 key": ("chunk", _len(1, _len(1, b"\xff") + _len(2, _blob()))),
    "empty": ("request", b""),
}


def _same_decode(r: wv.Received[Any], expected: Message) -> None:
    """Decoding through the views gives what decoding protobuf's parse gives, error for error."""
    reader = ShmReader(enabled=False)
    got_chunk, want_chunk = _chunk_of(r.message), _chunk_of(expected)
    if want_chunk is None:
        assert got_chunk is None or not r.views
        return
    assert got_chunk is not None
    for name, blob in want_chunk.tensors.items():
        try:
            want = tb.decode(blob, reader=reader)
        except TensorBlobError:
            with pytest.raises(TensorBlobError):
                tb.decode(got_chunk.tensors[name], reader=reader, view=r.views.get(name))
            continue
        got = tb.decode(got_chunk.tensors[name], reader=reader, view=r.views.get(name))
        assert _bits_equal(got, want)


@pytest.mark.parametrize("case", EDGE_CASES)
def test_protobuf_edge_cases(case: str) -> None:
    kind, data = EDGE_CASES[case]
    for small in (0, wv.SMALL_BYTES, 1 << 30):
        with mock.patch.object(wv, "SMALL_BYTES", small):
            parsed = _parse_like_protobuf(kind, data)
        if parsed is not None:
            _same_decode(*parsed)


def test_edge_cases_exercise_both_outcomes() -> None:
    """The table above holds messages that take the zero-copy path and ones protobuf rejects."""
    outcomes = set()
    for kind, data in EDGE_CASES.values():
        try:
            outcomes.add("views" if KINDS[kind][1](data).views else "plain")
        except DecodeError:
            outcomes.add("error")
    assert outcomes == {"views", "plain", "error"}


def _corpus() -> list[tuple[str, bytes]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for kind in KINDS:
        tensors = {
            "hidden": torch.randn(3, 5, generator=g).bfloat16(),
            "ids": torch.arange(7),
            "m": torch.ones(2).bool(),
        }
        out.append((kind, _wrap(kind, tb.encode_chunk(tensors, offset=4, meta={"a": 1, "s": "x"}))))
        split = encode_messages({"x": torch.arange(3000, dtype=torch.int16)}, max_bytes=4096, seq=2, finished=True)
        out += [(kind, _wrap(kind, c)) for c in split]
    out.append(
        ("request", stage_pb2.StageRequest(start=stage_pb2.Start(request_id="r", want_audio=True)).SerializeToString())
    )
    return out


CORPUS = _corpus()


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, bytes]:
    kind, data = draw(st.sampled_from(CORPUS))
    b = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from([*BYTE_OPS, "append"]))
        if op == "append":  # protobuf merges concatenated messages
            b += draw(st.sampled_from([d for k, d in CORPUS if k == kind]))
        else:
            b = mutate_bytes(draw, b, op)
    return kind, bytes(b)


@given(case=mutated())
@settings(PROPS, max_examples=1500)
def test_mutated_bytes_parse_as_protobuf_or_fail_as_protobuf(case: tuple[str, bytes]) -> None:
    kind, data = case
    with _walk_always():
        parsed = _parse_like_protobuf(kind, data)
    if parsed is None:
        return
    _same_decode(*parsed)
    r, _ = parsed
    chunk = _chunk_of(r.message)
    if chunk is not None:  # an assembler fed these only ever answers with TensorBlobError
        with contextlib.suppress(TensorBlobError):
            ChunkAssembler(max_bytes=1 << 20).push(chunk, r.views)


# --------------------------------------------------------------------------------------------
# gRPC
# --------------------------------------------------------------------------------------------


class RelayStage(stage_pb2_grpc.StageServicer):
    """Checks every received chunk decodes over the received bytes, then answers with the same
    tensors the two ways a stage answers: as its own chunk (an Outgoing, payloads copied once
    from the tensors) on odd seq, as a relayed downstream response (a Received, sent as its
    bytes) on even seq."""

    def __init__(self) -> None:
        self.aliased: list[bool] = []

    def Stream(self, request_iterator: Iterator[wv.Received[stage_pb2.StageRequest]], context: grpc.ServicerContext):
        asm = ChunkAssembler()
        for received in request_iterator:
            if received.message.WhichOneof("kind") != "chunk":
                continue
            d = asm.push(received.message.chunk, received.views)
            if d is None:
                continue
            self.aliased += [_inside(t.data_ptr(), received.wire) for t in d.tensors.values() if t.numel()]
            if d.seq % 2:
                (lazy,) = tb.encode_chunks(d.tensors, max_bytes=8 << 20, seq=d.seq)
                assert lazy.lazy  # the payloads really go the lazy way
                yield wv.Outgoing(stage_pb2.StageResponse(stage="relay"), lazy)
            else:
                answer = stage_pb2.StageResponse(stage="relay", chunk=tb.encode_chunk(d.tensors, seq=d.seq))
                yield wv.parse_response(answer.SerializeToString())

    def Info(self, request: stage_pb2.InfoRequest, context: grpc.ServicerContext) -> stage_pb2.InfoResponse:
        return stage_pb2.InfoResponse(role="relay")


def test_grpc_stage_stream_zero_copy_and_interop() -> None:
    service = RelayStage()
    opts = [("grpc.max_receive_message_length", 8 << 20), ("grpc.max_send_message_length", 8 << 20)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=opts)
    add_stage_servicer(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    tensors = {"hidden": torch.randn(4, 9000).bfloat16(), "ids": torch.arange(20_000)}

    def requests(lazy: bool = False) -> Iterator[stage_pb2.StageRequest | wv.Outgoing]:
        """Start, then 3 chunks: plain protobuf, or (``lazy``) Outgoing from seq 1 on."""
        yield stage_pb2.StageRequest(start=stage_pb2.Start(request_id="g"))
        for seq in range(3):
            if lazy and seq:
                (chunk,) = tb.encode_chunks(tensors, max_bytes=8 << 20, seq=seq)
                yield wv.Outgoing(stage_pb2.StageRequest(), chunk)
            else:
                yield stage_pb2.StageRequest(chunk=tb.encode_chunk(tensors, seq=seq))

    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=opts) as channel:
            assert stage_pb2_grpc.StageStub(channel).Info(stage_pb2.InfoRequest(), timeout=10).role == "relay"
            received = list(stage_stream(channel)(requests(lazy=True), timeout=30))
            plain = list(stage_pb2_grpc.StageStub(channel).Stream(requests(), timeout=30))
            relayed = list(stage_stream(channel, relay=True)(requests(), timeout=30))
    finally:
        server.stop(grace=None)
    assert service.aliased and all(service.aliased)  # the server decoded over the received bytes
    assert len(received) == len(plain) == len(relayed) == 3
    # a relaying stage gets the raw bytes: exactly what the generated stubs parse
    assert all(isinstance(b, bytes) for b in relayed)
    assert [stage_pb2.StageResponse.FromString(b) for b in relayed] == plain
    for r, p in zip(received, plain, strict=True):
        assert _restore(r) == p  # generated stubs read the same messages
        assert set(r.views) == {"hidden", "ids"}
        d = ChunkAssembler().push(r.message.chunk, r.views)
        assert d is not None
        for name, x in tensors.items():
            assert _bits_equal(d.tensors[name], x) and _inside(d.tensors[name].data_ptr(), r.wire)
