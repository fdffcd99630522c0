"""Real gRPC on 127.0.0.1: chunks inline (split under the message limit) and via shared memory
with the metadata handshake, the inline fallback, and TensorBlobError -> INVALID_ARGUMENT."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest
import torch

from omnistage.v1 import stage_pb2, stage_pb2_grpc, tensor_pb2
from omnistage.wire import tensor_blob as tb
from omnistage.wire.shm import ShmPool, ShmReader, list_segments, peer_accepts_shm
from omnistage.wire.tensor_blob import ChunkAssembler, TensorBlobError
from tests.wire.helpers import encode_messages

MAX_MSG = 1 << 20
TIMEOUT_S = 30


class EchoStage(stage_pb2_grpc.StageServicer):
    """Answers every logical chunk with each tensor's dtype, shape, transport and checksum."""

    def __init__(self, reader: ShmReader) -> None:
        self.reader = reader

    def Stream(self, request_iterator: Iterator[stage_pb2.StageRequest], context: grpc.ServicerContext):
        context.send_initial_metadata(self.reader.accept(context.invocation_metadata()))
        asm = ChunkAssembler(reader=self.reader)
        try:
            first = next(request_iterator)
            if first.WhichOneof("kind") != "start":
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first message must be Start")
            for req in request_iterator:
                transports = {n: b.WhichOneof("data") or "" for n, b in req.chunk.tensors.items()}
                d = asm.push(req.chunk)
                if d is None:
                    continue
                meta: dict[str, tb.ScalarValue] = {}
                for name, t in d.tensors.items():
                    meta[f"{name}.sum"] = float(t.double().sum())
                    meta[f"{name}.shape"] = ",".join(map(str, t.shape))
                    meta[f"{name}.dtype"] = str(t.dtype)
                    meta[f"{name}.via"] = transports.get(name, "raw")
                out = tb.encode_chunk({}, offset=d.offset, seq=d.seq, finished=d.finished, meta=meta)
                yield stage_pb2.StageResponse(stage="echo", chunk=out)
        except TensorBlobError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))


@dataclass
class Server:
    address: str
    server: grpc.Server


def _serve(reader: ShmReader) -> Server:
    opts = [("grpc.max_receive_message_length", MAX_MSG), ("grpc.max_send_message_length", MAX_MSG)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=opts)
    stage_pb2_grpc.add_StageServicer_to_server(EchoStage(reader), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return Server(f"127.0.0.1:{port}", server)


@pytest.fixture
def echo() -> Iterator[Server]:
    s = _serve(ShmReader(enabled=True))
    yield s
    s.server.stop(grace=None)


@pytest.fixture
def echo_no_shm() -> Iterator[Server]:
    s = _serve(ShmReader(enabled=False))
    yield s
    s.server.stop(grace=None)


def _run(address: str, payloads: list[dict[str, torch.Tensor]], pool: ShmPool | None) -> tuple[list, bool]:
    """Stream the payloads as one request; return (responses, shm used)."""
    rid = "req-1"
    holder: dict[str, grpc.Call] = {}
    call_ready = threading.Event()  # gRPC may pull requests before Stream() has returned the call
    used = {"shm": False}

    def requests() -> Iterator[stage_pb2.StageRequest]:
        yield stage_pb2.StageRequest(start=stage_pb2.Start(request_id=rid))
        use_pool = None
        assert call_ready.wait(TIMEOUT_S)
        if pool is not None and peer_accepts_shm(holder["call"].initial_metadata()):
            use_pool, used["shm"] = pool, True
        seq = 0
        for i, p in enumerate(payloads):
            chunks = encode_messages(
                p, max_bytes=MAX_MSG, offset=i, seq=seq, finished=i == len(payloads) - 1,
                pool=use_pool, request_id=rid,
            )  # fmt: skip
            seq += len(chunks)
            for c in chunks:
                yield stage_pb2.StageRequest(chunk=c)

    opts = [("grpc.max_receive_message_length", MAX_MSG), ("grpc.max_send_message_length", MAX_MSG)]
    with grpc.insecure_channel(address, options=opts) as channel:
        stub = stage_pb2_grpc.StageStub(channel)
        md = pool.invocation_metadata() if pool is not None else []
        call = stub.Stream(requests(), metadata=md, timeout=TIMEOUT_S)
        holder["call"] = call
        call_ready.set()
        try:
            responses = list(call)
        finally:
            if pool is not None:
                pool.release_request(rid)
    return responses, used["shm"]


def _payloads() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        {"hidden": torch.randn(4, 2048, generator=g).bfloat16(), "ids": torch.arange(4)},
        {"hidden": torch.randn(1500, 1024, generator=g), "ids": torch.arange(1500)},  # 6 MB: split or shm
        {"codes": torch.randint(0, 2048, (25, 16), generator=g)},
    ]


def _check(responses: list, payloads: list[dict[str, torch.Tensor]], via: str) -> None:
    assert len(responses) == len(payloads)
    assert [r.chunk.finished for r in responses] == [False] * (len(payloads) - 1) + [True]
    for r, p in zip(responses, payloads, strict=True):
        meta = tb.get_meta(r.chunk.meta)
        for name, t in p.items():
            assert meta[f"{name}.sum"] == pytest.approx(float(t.double().sum()), rel=1e-9, abs=1e-6)
            assert meta[f"{name}.shape"] == ",".join(map(str, t.shape))
            assert meta[f"{name}.dtype"] == str(t.dtype)
        if via == "shm":
            assert meta["hidden.via" if "hidden" in p else "codes.via"] in {"shm", "raw"}
    if via == "shm":
        assert tb.get_meta(responses[1].chunk.meta)["hidden.via"] == "shm"
    else:
        assert all(v != "shm" for r in responses for k, v in tb.get_meta(r.chunk.meta).items() if k.endswith(".via"))


def test_inline_chunks_are_split_under_the_message_limit(echo: Server) -> None:
    payloads = _payloads()
    responses, used = _run(echo.address, payloads, pool=None)
    assert not used
    _check(responses, payloads, "raw")


def test_shared_memory_path_with_handshake(echo: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNISTAGE_SHM", raising=False)
    before = set(list_segments())
    with ShmPool(threshold_bytes=64 << 10, max_free_segments=0) as pool:
        payloads = _payloads()
        responses, used = _run(echo.address, payloads, pool)
        assert used
        _check(responses, payloads, "shm")
        assert pool.num_segments == 0  # released with the request
    assert set(list_segments()) - before == set()


def test_receiver_that_declines_gets_inline_bytes(echo_no_shm: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNISTAGE_SHM", raising=False)
    with ShmPool(threshold_bytes=64 << 10) as pool:
        payloads = _payloads()
        responses, used = _run(echo_no_shm.address, payloads, pool)
        assert not used and pool.num_segments == 0
        _check(responses, payloads, "raw")


def _stream_error(address: str, chunk: tb.Chunk) -> grpc.RpcError:
    """The error a Stream call of Start + ``chunk`` ends with."""
    reqs = [stage_pb2.StageRequest(start=stage_pb2.Start(request_id="r")), stage_pb2.StageRequest(chunk=chunk)]
    with grpc.insecure_channel(address) as channel:
        call = stage_pb2_grpc.StageStub(channel).Stream(iter(reqs), timeout=TIMEOUT_S)
        with pytest.raises(grpc.RpcError) as err:
            list(call)
    return err.value


def test_bad_blob_maps_to_invalid_argument(echo: Server) -> None:
    bad = tb.Chunk()
    bad.tensors["x"].CopyFrom(tensor_pb2.TensorBlob(dtype=tensor_pb2.F32, shape=[3], raw=b"\0" * 5))
    err = _stream_error(echo.address, bad)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "bytes" in (err.details() or "")


def test_unsplit_oversized_message_is_refused_by_grpc(echo: Server) -> None:
    big = tb.encode_chunk({"x": torch.zeros(MAX_MSG // 4 + 1000)})
    assert _stream_error(echo.address, big).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
