"""Wire benchmark: ``omnistage bench wire [--json FILE]``.

Every figure is the median of several repetitions and comes with its baseline from the same run
(every figure against a baseline from the same run):

* codec: the send path (``encode_lazy_chunks`` + ``wire_view.serialize`` of a StageRequest) +
  the receive path (``wire_view.parse_request`` + decode) vs ``pickle.dumps/loads`` of the
  tensor vs ``torch.save/torch.load`` through BytesIO; encode alone vs plain protobuf
  (``encode`` into the message + ``SerializeToString``);
* decode alone, each from the serialized StageRequest bytes as gRPC hands them to the
  deserializer: inline through ``wire_view`` (the stages' path: no copy), inline through plain
  protobuf ``FromString`` + decode (protobuf-python copies the payload at parse and again when
  ``raw`` is read; the baseline), over shared memory (parse + map + wrap, no copy), and the
  frombuffer wrap itself over already-received bytes;
* shared memory: write into a pool slot + decode through a second mapping (a ShmReader) vs a
  plain ``numpy.copyto`` into a preallocated buffer, as bandwidth;
* gRPC on 127.0.0.1 (random free port): Stage.Stream throughput of 4 MiB chunks inline vs via
  shared memory (with the probe handshake), bounded in count and time; the sink is registered
  with ``wire_view.add_stage_servicer`` like a real stage.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

from benchmarks.common import machine_info, timed_median, write_json
from omnistage.server.grpc_common import add_stage_servicer, stage_stream
from omnistage.v1 import stage_pb2, stage_pb2_grpc
from omnistage.v1.tensor_pb2 import TensorBlob
from omnistage.wire import tensor_blob as tb
from omnistage.wire import wire_view as wv
from omnistage.wire.shm import ShmPool, ShmReader, peer_accepts_shm

SIZES = {"64kb": 64 << 10, "1mb": 1 << 20, "16mb": 16 << 20, "64mb": 64 << 20}
GRPC_CHUNK_BYTES = 4 << 20
GRPC_MAX_MSG = 8 << 20
GRPC_CHUNKS = 24
GRPC_BUDGET_S = 4.0
_ONE_MESSAGE = 1 << 30  # codec figures: every size in one message (nothing here goes over gRPC)


def _reps(nbytes: int) -> int:
    return 25 if nbytes <= 1 << 20 else 7 if nbytes <= 16 << 20 else 5


# -- codec --------------------------------------------------------------------------------------


def _request_bytes(x: torch.Tensor, pool: ShmPool | None = None, request_id: str | None = None) -> bytes:
    """One StageRequest carrying ``x`` as tensor "x", serialized the way stages send: a lazy chunk
    through ``wire_view.serialize`` (the payload copied once, from the tensor into the bytes)."""
    (chunk,) = tb.encode_chunks({"x": x}, max_bytes=_ONE_MESSAGE, pool=pool, request_id=request_id)
    return wv.serialize(wv.Outgoing(stage_pb2.StageRequest(), chunk))


def _request_bytes_protobuf(x: torch.Tensor) -> bytes:
    """The same message through plain protobuf (the encode baseline): the same chunk encoder, then
    the payload copied into a ``bytes``, by protobuf into the message, and into the serialized bytes."""
    return stage_pb2.StageRequest(chunk=tb.encode_chunk({"x": x})).SerializeToString()


def _receive(wire: bytes, reader: ShmReader | None = None) -> torch.Tensor:
    """What a stage does with a received message: wire_view parse, then decode over the views."""
    r = wv.parse_request(wire)
    return tb.decode(r.message.chunk.tensors["x"], reader=reader, view=r.views.get("x"))


def _codec(x: torch.Tensor, reps: int) -> dict[str, float]:
    def blob_rt() -> torch.Tensor:
        return _receive(_request_bytes(x))

    def pickle_rt() -> torch.Tensor:
        return pickle.loads(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL))

    def torch_rt() -> torch.Tensor:
        buf = io.BytesIO()
        torch.save(x, buf)
        buf.seek(0)
        return torch.load(buf)

    assert torch.equal(blob_rt(), x) and torch.equal(pickle_rt(), x) and torch.equal(torch_rt(), x)
    assert _request_bytes(x) == _request_bytes_protobuf(x)  # the same message, byte for byte
    return {
        "encode_s": timed_median(lambda: _request_bytes(x), reps)[0],
        "encode_protobuf_s": timed_median(lambda: _request_bytes_protobuf(x), reps)[0],
        "tensor_blob_s": timed_median(blob_rt, reps)[0],
        "pickle_s": timed_median(pickle_rt, reps)[0],
        "torch_save_s": timed_median(torch_rt, reps)[0],
    }


def _decode_alone(x: torch.Tensor, pool: ShmPool, reader: ShmReader, reps: int) -> dict[str, float]:
    inline = _request_bytes(x)
    received = x.numpy().tobytes()

    def inline_zero_copy() -> torch.Tensor:
        return _receive(inline)

    def inline_protobuf() -> torch.Tensor:
        return tb.decode(stage_pb2.StageRequest.FromString(inline).chunk.tensors["x"])

    # The measured paths must give the tensor, and the wire_view one must alias the received bytes.
    t = inline_zero_copy()
    base = np.frombuffer(inline, np.uint8).ctypes.data
    assert torch.equal(t, x) and base <= t.data_ptr() < base + len(inline)
    assert torch.equal(inline_protobuf(), x)
    n = 201  # the size-independent paths take microseconds: many repetitions steady the median
    out = {
        "decode_inline_s": timed_median(inline_zero_copy, n)[0],
        "decode_inline_protobuf_s": timed_median(inline_protobuf, max(reps, 25))[0],
        "frombuffer_wrap_s": timed_median(lambda: torch.frombuffer(received, dtype=torch.float32), n)[0],
    }
    if pool.enabled:
        via_shm = _request_bytes(x, pool, "decode")
        assert stage_pb2.StageRequest.FromString(via_shm).chunk.tensors["x"].WhichOneof("data") == "shm"
        assert torch.equal(_receive(via_shm, reader), x)
        out["decode_shm_s"] = timed_median(lambda: _receive(via_shm, reader), n)[0]
        pool.release_request("decode")
    return out


def _paired_ratio(big: Callable[[], Any], small: Callable[[], Any], reps: int = 401) -> float:
    """median(big) / median(small), the two timed alternately: on a shared machine load drifts
    over seconds, and timing the sizes apart from each other turns that drift into the ratio."""
    times: tuple[list[float], list[float]] = ([], [])
    big(), small()
    for _ in range(reps):
        for fn, acc in ((big, times[0]), (small, times[1])):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return statistics.median(times[0]) / statistics.median(times[1])


def _decode_ratios(pool: ShmPool, reader: ShmReader) -> dict[str, float | None]:
    """64 MiB over 64 KiB decode from the serialized StageRequest, measured as pairs."""
    big, small = (torch.randn(SIZES[k] // 4, generator=torch.Generator().manual_seed(0)) for k in ("64mb", "64kb"))
    inline = _request_bytes(big), _request_bytes(small)
    out: dict[str, float | None] = {
        "decode_64mb_over_decode_64kb": _paired_ratio(lambda: _receive(inline[0]), lambda: _receive(inline[1])),
        "decode_shm_64mb_over_decode_shm_64kb": None,
    }
    if pool.enabled:
        shm = _request_bytes(big, pool, "pairs"), _request_bytes(small, pool, "pairs")
        out["decode_shm_64mb_over_decode_shm_64kb"] = _paired_ratio(
            lambda: _receive(shm[0], reader), lambda: _receive(shm[1], reader)
        )
        pool.release_request("pairs")
    return out


def _shm_vs_memcpy(x: torch.Tensor, pool: ShmPool, reader: ShmReader, reps: int) -> dict[str, float]:
    src = x.numpy()
    nbytes = src.nbytes
    dst = np.empty_like(src)

    def memcpy() -> None:
        np.copyto(dst, src)

    def shm_transfer() -> None:
        slot = pool.allocate("bw", nbytes)
        assert slot is not None
        np.copyto(np.frombuffer(slot.buffer, dtype=src.dtype).reshape(src.shape), src)
        blob = TensorBlob(dtype=tb.tensor_pb2.F32, shape=list(src.shape))
        blob.shm.CopyFrom(slot.ref())
        y = tb.decode_numpy(TensorBlob.FromString(blob.SerializeToString()), reader=reader)
        assert y.shape == src.shape
        pool.release_request("bw")

    t_mem = timed_median(memcpy, reps)[0]
    t_shm = timed_median(shm_transfer, reps)[0]
    return {"memcpy_gbps": nbytes / t_mem / 1e9, "shm_gbps": nbytes / t_shm / 1e9}


# -- gRPC loopback ------------------------------------------------------------------------------


class SinkStage(stage_pb2_grpc.StageServicer):
    """Decodes every chunk (zero-copy, requests parsed by wire_view) and answers once at the end
    with the byte count. `receiver()`, when given, makes each call's handler of its whole
    chunks (what the receiving stage does with them)."""

    def __init__(self, reader: ShmReader, receiver: Callable[[], Callable[[tb.DecodedChunk], None]] | None = None
                 ) -> None:  # fmt: skip
        self.reader = reader
        self.receiver = receiver

    def Stream(self, request_iterator: Iterator[stage_pb2.StageRequest], context: grpc.ServicerContext):
        context.send_initial_metadata(self.reader.accept(context.invocation_metadata()))
        handle = self.receiver() if self.receiver is not None else None
        asm = tb.ChunkAssembler(reader=self.reader)
        total = 0
        for received in request_iterator:
            req = received.message
            if req.WhichOneof("kind") != "chunk":
                continue
            d = asm.push(req.chunk, received.views)
            if d is not None:
                total += sum(t.numel() * t.element_size() for t in d.tensors.values())
                if handle is not None:
                    handle(d)
        done = tb.encode_chunk({}, finished=True, meta={"bytes": total})
        yield stage_pb2.StageResponse(stage="sink", chunk=done)


@contextlib.contextmanager
def loopback_stage(servicer: SinkStage, max_message_bytes: int) -> Iterator[str]:
    """A sync gRPC server for `servicer` on a free port of 127.0.0.1, registered like a real
    stage (`add_stage_servicer`); yields its address."""
    opts = [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes)]  # fmt: skip
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=opts)
    add_stage_servicer(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def stream_to(address: str, chunks: Callable[[ShmPool | None, str], Iterator[tb.LazyChunk]], pool: ShmPool | None,
              max_message_bytes: int, timeout: float = 60) -> tuple[float, bool, int]:  # fmt: skip
    """One call to a SinkStage: a Start, then what `chunks(pool or None, request_id)` encodes
    (the pool only when the peer accepted shared memory). Returns (seconds, shm used, bytes the
    sink decoded)."""
    rid = f"bench-{time.monotonic_ns()}"
    holder: dict[str, Any] = {}
    call_ready = threading.Event()  # gRPC may pull requests before Stream() has returned the call
    used = {"shm": False}

    def requests() -> Iterator[Any]:
        yield stage_pb2.StageRequest(start=stage_pb2.Start(request_id=rid))
        call_ready.wait(10)
        use = None
        if pool is not None and peer_accepts_shm(holder["call"].initial_metadata()):
            use, used["shm"] = pool, True
        for c in chunks(use, rid):
            yield wv.Outgoing(stage_pb2.StageRequest(), c)

    opts = [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes)]  # fmt: skip
    with grpc.insecure_channel(address, options=opts) as channel:
        md = pool.invocation_metadata() if pool is not None else []
        t0 = time.perf_counter()
        call = stage_stream(channel)(requests(), metadata=md, timeout=timeout)
        holder["call"] = call
        call_ready.set()
        (resp,) = list(call)
        elapsed = time.perf_counter() - t0
    if pool is not None:
        pool.release_request(rid)
    return elapsed, used["shm"], int(tb.get_meta(resp.message.chunk.meta)["bytes"])


def _grpc_throughput(address: str, pool: ShmPool | None) -> tuple[float, bool, int]:
    """(MB/s, shm used, bytes) for one request streaming up to GRPC_CHUNKS chunks."""
    payload = torch.randn(GRPC_CHUNK_BYTES // 4)
    sent = {"bytes": 0}
    deadline = time.monotonic() + GRPC_BUDGET_S

    def chunks(use: ShmPool | None, rid: str) -> Iterator[tb.LazyChunk]:
        for i in range(GRPC_CHUNKS):
            last = i == GRPC_CHUNKS - 1 or time.monotonic() > deadline
            yield from tb.encode_chunks(
                {"hidden": payload}, max_bytes=GRPC_MAX_MSG, seq=i, offset=i, finished=last, pool=use, request_id=rid
            )
            sent["bytes"] += payload.numel() * 4
            if last:
                return

    elapsed, shm, got = stream_to(address, chunks, pool, GRPC_MAX_MSG)
    assert got == sent["bytes"], (got, sent["bytes"])
    return got / elapsed / 1e6, shm, got


def _grpc(pool: ShmPool, reps: int = 3) -> dict[str, Any]:
    reader = ShmReader(enabled=True)
    try:
        with loopback_stage(SinkStage(reader), GRPC_MAX_MSG) as address:
            _grpc_throughput(address, None)  # warm up the channel path
            inline = [_grpc_throughput(address, None) for _ in range(reps)]
            via_shm = [_grpc_throughput(address, pool) for _ in range(reps)]
    finally:
        reader.close()
    return {
        "chunk_bytes": GRPC_CHUNK_BYTES,
        "bytes_per_request": statistics.median(r[2] for r in inline),
        "inline_mb_s": statistics.median(r[0] for r in inline),
        "shm_mb_s": statistics.median(r[0] for r in via_shm),
        "shm_used": all(r[1] for r in via_shm),
    }


# -- main ---------------------------------------------------------------------------------------


def run() -> dict[str, Any]:
    t_start = time.perf_counter()
    pool = ShmPool(enabled=True, threshold_bytes=1, segment_bytes=64 << 20, max_total_bytes=1 << 30)
    reader = ShmReader(enabled=True)
    sizes: dict[str, dict[str, float]] = {}
    try:
        for label, nbytes in SIZES.items():
            x = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(0))
            reps = _reps(nbytes)
            row: dict[str, float] = {"bytes": nbytes}
            row |= _codec(x, reps)
            row |= _decode_alone(x, pool, reader, reps)
            row |= _shm_vs_memcpy(x, pool, reader, reps) if pool.enabled else {}
            sizes[label] = row
        pairs = _decode_ratios(pool, reader)
        grpc_figs = _grpc(pool) if pool.enabled else {}
    finally:
        pool.close()
        reader.close()
    s16, s64, s64k = sizes["16mb"], sizes["64mb"], sizes["64kb"]
    ratios: dict[str, float | None] = {
        "pickle_over_tensor_blob_16mb": s16["pickle_s"] / s16["tensor_blob_s"],
        "encode_protobuf_over_encode_16mb": s16["encode_protobuf_s"] / s16["encode_s"],
        "torch_save_over_tensor_blob_16mb": s16["torch_save_s"] / s16["tensor_blob_s"],
        "decode_64mb_over_decode_64kb": pairs["decode_64mb_over_decode_64kb"],
        "decode_protobuf_64mb_over_decode_protobuf_64kb": s64["decode_inline_protobuf_s"]
        / s64k["decode_inline_protobuf_s"],
        "decode_shm_64mb_over_decode_shm_64kb": pairs["decode_shm_64mb_over_decode_shm_64kb"],
        "frombuffer_64mb_over_frombuffer_64kb": s64["frombuffer_wrap_s"] / s64k["frombuffer_wrap_s"],
        "shm_over_memcpy_bandwidth": (s64["shm_gbps"] / s64["memcpy_gbps"]) if pool.enabled else None,
        "grpc_shm_over_inline_throughput": (grpc_figs["shm_mb_s"] / grpc_figs["inline_mb_s"]) if grpc_figs else None,
    }
    return {
        "benchmark": "wire",
        "command": "omnistage bench wire --json FILE",
        "machine": machine_info(),
        "statistic": "median",
        "sizes": sizes,
        "grpc": grpc_figs,
        "ratios": ratios,
        "notes": {
            "encode_protobuf_over_encode_16mb": "serialized StageRequest of one 16 MiB tensor: encode_chunks + "
            "plain protobuf (copy to bytes, copy on assignment, copy on serialization) over the stages' send path "
            "(encode_lazy_chunks + wire_view.serialize: one copy, from the tensor into the bytes)",
            "decode_64mb_over_decode_64kb": "inline payload from the serialized StageRequest bytes: "
            "wire_view.parse_request + tensor_blob.decode over the received bytes (no copy); the two sizes "
            "timed alternately, 401 pairs, ratio of medians (the per-size rows are timed separately)",
            "decode_protobuf_64mb_over_decode_protobuf_64kb": "the same bytes through plain protobuf FromString + "
            "decode: protobuf-python (upb) copies the payload at parse and again when raw is read",
            "decode_shm_64mb_over_decode_shm_64kb": "shared-memory blob from the serialized StageRequest bytes "
            "(parse + map + wrap, no copy), timed in pairs like the inline one",
            "shm_over_memcpy_bandwidth": "64 MiB: slot write + decode via a second mapping vs numpy.copyto",
        },
        "wall_s": time.perf_counter() - t_start,
    }


def _fmt_table(res: dict[str, Any]) -> str:
    cols = [
        ("encode_s", "encode ms", 1e3),
        ("encode_protobuf_s", "enc protobuf ms", 1e3),
        ("tensor_blob_s", "blob e+d ms", 1e3),
        ("pickle_s", "pickle ms", 1e3),
        ("torch_save_s", "torch.save ms", 1e3),
        ("decode_inline_s", "dec inline us", 1e6),
        ("decode_inline_protobuf_s", "dec protobuf us", 1e6),
        ("decode_shm_s", "dec shm us", 1e6),
        ("frombuffer_wrap_s", "wrap us", 1e6),
        ("memcpy_gbps", "memcpy GB/s", 1),
        ("shm_gbps", "shm GB/s", 1),
    ]
    lines = ["size   " + " ".join(f"{c[1]:>14}" for c in cols)]
    for label, row in res["sizes"].items():
        cells = [f"{row[k] * m:14.3f}" if k in row else f"{'-':>14}" for k, _, m in cols]
        lines.append(f"{label:<6} " + " ".join(cells))
    g = res["grpc"]
    if g:
        lines.append(
            f"gRPC 127.0.0.1, {g['chunk_bytes'] >> 20} MiB chunks: inline {g['inline_mb_s']:.0f} MB/s, "
            f"shm {g['shm_mb_s']:.0f} MB/s (shm used: {g['shm_used']})"
        )
    lines.append("ratios:")
    for k, v in res["ratios"].items():
        lines.append(f"  {k:<45} {'n/a' if v is None else f'{v:.2f}'}")
    lines.append(f"wall {res['wall_s']:.1f} s on {res['machine']['cpu_count']} CPUs, {res['machine']['platform']}")
    return "\n".join(lines)


def main(json_out: Path | None = None) -> dict[str, Any]:
    res = run()
    print(_fmt_table(res))
    write_json(json_out, res)
    return res


if __name__ == "__main__":
    import sys

    main(Path(sys.argv[1]) if len(sys.argv) > 1 else None)
