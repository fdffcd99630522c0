"""Pieces of a stage's call handling, in process: the input reader (an unexpected error while
taking a chunk in, e.g. out of memory placing a large input on the device, fails that request at
once with a clear status, instead of killing the reader and leaving the request to starve until
the input wait runs out) and the wait for a CUDA step's host copy (off the event loop)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omnistage.server.stage_server import StageService, _Call
from omnistage.v1 import stage_pb2
from omnistage.wire import Code, StageError
from omnistage.wire.shm import CallShmReader, ShmReader
from omnistage.wire.tensor_blob import encode_chunk
from omnistage.wire.wire_view import Received


class _Engine:
    """What the reader touches of an Engine: `feed` raises `error`; `abort` records."""

    def __init__(self, error: BaseException) -> None:
        self.worker = SimpleNamespace(name="talker", holds_input_until_admitted=False)
        self.error = error
        self.aborted: list[StageError | None] = []

    def feed(self, req: Any, chunk: Any) -> None:
        raise self.error

    def abort(self, req: Any, error: StageError | None = None) -> None:
        self.aborted.append(error)


@pytest.mark.parametrize(("error", "code"), [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB"), Code.RESOURCE_EXHAUSTED),
    (MemoryError(), Code.RESOURCE_EXHAUSTED),
    (RuntimeError("something broke"), Code.INTERNAL),
])  # fmt: skip
def test_an_unexpected_error_taking_a_chunk_fails_the_request(error: BaseException, code: Code) -> None:
    engine = _Engine(error)
    service = StageService(engine, model_name="m", arch="a", device="cpu", dtype="float32",  # type: ignore[arg-type]
                           downstream=None, downstream_name=None, edge_mode=0, max_message_bytes=1 << 20,
                           shm=False)  # fmt: skip
    chunk = encode_chunk({"ids": torch.tensor([1, 2])}, offset=0, length=2, finished=True)

    async def go() -> tuple[_Call, list[Any]]:
        async def messages() -> Any:
            yield Received(stage_pb2.StageRequest(chunk=chunk), {}, b"")

        call = _Call(asyncio.get_running_loop())
        req = SimpleNamespace(request_id="r#1", input_closed=False)
        await service._read_inputs(req, call, messages(), CallShmReader(ShmReader(enabled=False), None))  # type: ignore[arg-type]
        queued = []
        while not call.out_q.empty():
            queued.append(call.out_q.get_nowait())
        return call, queued

    call, queued = asyncio.run(go())
    assert call.failed
    errors = [q for q in queued if isinstance(q, StageError)]
    assert len(errors) == 1 and errors[0].code == code, queued
    assert errors[0].message.startswith("talker: message 2: "), errors[0].message
    assert engine.aborted == [errors[0]]  # the engine frees the request


def test_a_pending_host_copy_is_awaited_off_the_event_loop() -> None:
    """A step's CUDA outputs still being copied to the host: the stage waits for the copy in a
    worker thread, so its event loop keeps serving the other calls meanwhile."""
    import threading

    from omnistage.engine import OutChunk
    from omnistage.server.stage_server import host_ready

    class _Copy:  # a CUDA event stand-in: not done yet; synchronize blocks until released
        def __init__(self) -> None:
            self.release = threading.Event()
            self.waiting = threading.Event()
            self.waited_in: str | None = None

        def query(self) -> bool:
            return self.release.is_set()

        def synchronize(self) -> None:
            self.waited_in = threading.current_thread().name
            self.waiting.set()
            assert self.release.wait(5)

    async def go() -> tuple[_Copy, OutChunk, int]:
        copy = _Copy()
        out = OutChunk(tensors={}, offset=0, ready=copy)
        ticks = 0

        async def loop_alive() -> None:  # counts its turns while the copy is being waited for
            nonlocal ticks
            for _ in range(500):  # (at most 5 s)
                if copy.waiting.is_set():
                    ticks += 1
                    if ticks == 5:
                        copy.release.set()  # the copy completes while the loop runs
                        return
                await asyncio.sleep(0.01)

        await asyncio.gather(host_ready(out), loop_alive())
        return copy, out, ticks

    copy, out, ticks = asyncio.run(go())
    assert ticks == 5  # the loop ran while host_ready waited (on the loop, the wait would have stalled it)
    assert copy.waited_in is not None and copy.waited_in != threading.main_thread().name
    assert out.ready is None  # waited: encoding reads the host tensors now


def test_a_relayed_split_chunk_with_another_stages_chunk_between_its_parts() -> None:
    """The talker relays code2wav's parts as they come and its own chunks between them: each
    stage's split chunk is held whole on its own, and the other stage's chunk goes up (it was
    dropped, and counted as delivered)."""
    from omnistage.server.stage_server import parse_response
    from omnistage.wire.resume import Resume
    from omnistage.wire.tensor_blob import ChunkAssembler, encode_chunks

    service = SimpleNamespace(failover_attempts=1, max_message_bytes=1 << 20)
    audio = torch.arange(6000, dtype=torch.float32)
    pieces = encode_chunks({"audio": audio}, max_bytes=10_000, offset=0, length=6000)
    assert len(pieces) > 2
    raw = [stage_pb2.StageResponse(stage="code2wav", chunk=p.message()).SerializeToString() for p in pieces]
    frames = stage_pb2.StageResponse(stage="talker", chunk=encode_chunk(
        {"codes": torch.zeros(2, 4, dtype=torch.long)}, offset=0, length=4)).SerializeToString()  # fmt: skip
    parts: dict[str, Any] = {}
    resume = Resume()
    out: list[Any] = []
    for message in [raw[0], frames, *raw[1:]]:
        out += StageService._resume(service, message, parts, resume)  # type: ignore[arg-type]
    assert frames in out and resume.end["talker"] == 4 and resume.end["code2wav"] == 6000
    assembler = ChunkAssembler()
    got = [assembler.push(parse_response(m).message.chunk) for m in out if m != frames]
    assert got[-1] is not None and torch.equal(got[-1].tensors["audio"], audio)


class _HoldingEngine:
    """A decode role's engine as the reader sees it: its worker holds a request's input after the
    first chunk until the request is admitted; `feed` records offsets."""

    def __init__(self) -> None:
        self.worker = SimpleNamespace(name="thinker-decode", holds_input_until_admitted=True)
        self.fed: list[int] = []
        self.closed = False

    def feed(self, req: Any, chunk: Any) -> None:
        self.fed.append(chunk.offset)

    def close_input(self, req: Any) -> None:
        self.closed = True


def test_a_holding_worker_gets_no_more_input_until_the_request_is_admitted() -> None:
    """After the first chunk (which gives the request's cache size) the reader stops reading;
    the caller's further chunks wait in the transport until the engine says the cache is
    reserved (on_admitted, from the engine thread)."""
    import threading

    engine = _HoldingEngine()
    service = StageService(engine, model_name="m", arch="a", device="cpu", dtype="float32",  # type: ignore[arg-type]
                           downstream=None, downstream_name=None, edge_mode=0, max_message_bytes=1 << 20,
                           shm=False)  # fmt: skip
    chunks = [encode_chunk({"ids": torch.tensor([i])}, offset=i, length=1, finished=i == 2) for i in range(3)]

    async def go() -> list[tuple[str, list[int], int]]:
        pulled = 0

        async def messages() -> Any:
            nonlocal pulled
            for c in chunks:
                pulled += 1
                yield Received(stage_pb2.StageRequest(chunk=c), {}, b"")

        call = _Call(asyncio.get_running_loop())
        req = SimpleNamespace(request_id="r#1", input_closed=False)
        reader = asyncio.create_task(service._read_inputs(req, call, messages(),  # type: ignore[arg-type]
                                                          CallShmReader(ShmReader(enabled=False), None)))  # fmt: skip
        seen = []
        for _ in range(5):
            await asyncio.sleep(0.01)
        seen.append(("before", list(engine.fed), pulled))
        admit = threading.Thread(target=call.on_admitted, args=(req,))  # as the engine thread calls it
        admit.start()
        admit.join()
        req.input_closed = True  # what the engine notes when the finished chunk is fed
        await asyncio.wait_for(reader, 5)
        seen.append(("after", list(engine.fed), pulled))
        return seen

    seen = asyncio.run(go())
    # before: only chunk 0 fed, and no further message taken from the stream
    assert seen == [("before", [0], 1), ("after", [0, 1, 2], 3)]
    assert engine.closed


def test_the_engine_hears_a_request_has_left_once_the_stream_has_taken_its_last_message() -> None:
    """A prefill role's reservation lasts until its KV has left (Engine.sent): that is when the
    downstream stream comes back for the message after the request's last one (gRPC takes the
    next message only once it has written the one before), not when the engine hands it over."""
    from omnistage.engine import OutChunk
    from omnistage.server.stage_server import _DownBuffer

    left: list[str] = []
    engine = SimpleNamespace(worker=SimpleNamespace(name="thinker-prefill", holds_input_until_admitted=False),
                             sent=lambda req: left.append(req.request_id))  # fmt: skip
    service = StageService(engine, model_name="m", arch="a", device="cpu", dtype="float32",  # type: ignore[arg-type]
                           downstream="127.0.0.1:1", downstream_name="thinker-decode", edge_mode=0,
                           max_message_bytes=1 << 20, shm=False)  # fmt: skip

    async def go() -> list[tuple[str, list[str]]]:
        call = _Call(asyncio.get_running_loop())
        call.down = _DownBuffer(1 << 20)
        call.down_call = SimpleNamespace(done=lambda: False)
        req = SimpleNamespace(request_id="r#1")
        messages = service._down_messages(req, call, stage_pb2.Start(request_id="r"), 0)  # type: ignore[arg-type]
        seen = []
        await anext(messages)  # the Start
        call.down.put(OutChunk({"k": torch.zeros(4)}, offset=0, length=2))
        call.down.put(OutChunk({"k": torch.zeros(2)}, offset=2, length=1, finished=True))
        call.down.put(None)
        await anext(messages)
        seen.append(("first chunk taken", list(left)))
        await anext(messages)
        seen.append(("last chunk taken", list(left)))
        with pytest.raises(StopAsyncIteration):
            await anext(messages)
        seen.append(("stream came back for more", list(left)))
        return seen

    assert asyncio.run(go()) == [("first chunk taken", []), ("last chunk taken", []),
                                 ("stream came back for more", ["r#1"])]  # fmt: skip


@pytest.mark.parametrize("consumes_first", [True, False])
def test_shared_memory_is_released_at_the_first_answer_of_a_downstream_that_consumes_its_input_first(
        consumes_first: bool, tmp_path: Any) -> None:  # fmt: skip
    """The prefill role's KV in shared memory: the decode role answers only once it has copied
    all of a request's input in, so the prefill role releases the request's segments at that
    first answer (for the next requests' KV) rather than when the call ends, after the whole
    reply. Another stage's downstream may still read what it was sent: its segments stay."""
    from omnistage.wire.shm import ShmPool

    worker = SimpleNamespace(name="thinker-prefill", holds_input_until_admitted=False,
                             downstream_consumes_input_first=consumes_first)  # fmt: skip
    service = StageService(SimpleNamespace(worker=worker), model_name="m", arch="a", device="cpu",  # type: ignore[arg-type]
                           dtype="float32", downstream="127.0.0.1:1", downstream_name="thinker-decode", edge_mode=0,
                           max_message_bytes=1 << 20, shm=False)  # fmt: skip
    service.pool = pool = ShmPool(enabled=True, directory=tmp_path, threshold_bytes=1, sweep=False)
    assert pool.enabled and pool.allocate("r#1", 1024) is not None
    answers = [stage_pb2.StageResponse(stage="thinker", chunk=encode_chunk(
        {"ids": torch.tensor([5 + i])}, offset=1 + i, length=1, finished=i == 1)).SerializeToString()
        for i in range(2)]  # fmt: skip
    held: list[list[str]] = []

    class _DownCall:
        def __aiter__(self) -> Any:
            async def answers_in_turn() -> Any:
                for a in answers:
                    held.append(pool.held_requests())  # before this answer is read
                    yield a
                held.append(pool.held_requests())
            return answers_in_turn()

    async def go() -> None:
        call = _Call(asyncio.get_running_loop())
        call.down_call = _DownCall()
        await service._relay(SimpleNamespace(request_id="r#1"), call, SimpleNamespace())  # type: ignore[arg-type]

    asyncio.run(go())
    assert held == ([["r#1"], [], []] if consumes_first else [["r#1"]] * 3)
    pool.close()


def test_what_requests_keep_for_replay_is_bounded_per_process_and_handed_back_at_their_end() -> None:
    """`failover.replay_memory_bytes` bounds what all of a process's requests keep of what they
    sent (the per-request bound alone lets every request in flight keep 64 MiB): a request whose
    next output does not fit stops being replayable, saying why, and hands back what it kept;
    a request's end hands back the rest, so later requests are kept again."""
    from omnistage.engine import OutChunk
    from omnistage.server.stage_server import ReplayMemory, _DownBuffer

    def out(nbytes: int) -> OutChunk:
        return OutChunk({"x": torch.zeros(nbytes // 4)}, offset=0, length=1)

    async def go() -> None:
        memory = ReplayMemory(1000)
        first, second = _DownBuffer(800, memory), _DownBuffer(800, memory)
        first.put(out(400))
        second.put(out(400))
        first.put(out(160))
        assert (memory.held, memory.refusals) == (960, 0) and first.replayable and second.replayable
        second.put(out(80))  # 1040 > 1000: the process is full, though the request is under its own 800
        assert not second.replayable and "failover.replay_memory_bytes: 1000" in second.why
        assert (memory.held, memory.refusals) == (560, 1)  # what it kept is handed back
        second.put(out(4))  # no longer counted
        assert memory.held == 560
        first.put(out(400))  # 960 > the request's own 800
        assert not first.replayable and "failover.replay_budget_bytes (800)" in first.why
        assert (memory.held, memory.refusals) == (0, 1)
        third = _DownBuffer(800, memory)
        third.put(out(600))
        third.put(None)
        assert third.replayable and memory.held == 600
        assert [await third.get(i) is None for i in range(2)] == [False, True]  # kept to replay
        assert third.items[0] is not None and third.first == 0
        for buffer in (first, second, third):  # the calls end
            buffer.close()
        assert memory.held == 0
        third.put(out(40))  # too late to count
        # a reader waiting for more when the call ends (its downstream call failed) ends too:
        # gRPC's task sending the downstream messages was left parked until garbage collection
        fourth = _DownBuffer(800, memory)
        waiting = asyncio.create_task(fourth.get(0))
        await asyncio.sleep(0)
        assert not waiting.done()
        fourth.close()
        assert await asyncio.wait_for(waiting, 1.0) is None
        assert memory.held == 0 and memory.refusals == 1
        # failover off (failover.attempts: 0): nothing is kept once the call below has taken it
        off = _DownBuffer(800, memory, replayable=False)
        off.put(out(400))
        assert memory.held == 0 and not off.replayable and "failover.attempts: 0" in off.why
        assert await off.get(0) is not None
        off.taken(0)
        assert off.items == [] and off.first == 1

    asyncio.run(go())


def test_a_superseded_attempts_reader_drops_nothing_the_replay_still_sends() -> None:
    """A lost downstream call's message reader may still wait at the end of what was sent while
    the replay sends it all again from the start. When the request then stops being replayable
    (here: another request fills the process's replay memory) and a new output wakes both, the
    old reader returns without dropping anything: the replay sends every output in order."""
    from omnistage.engine import OutChunk
    from omnistage.server.stage_server import _DownBuffer

    engine = SimpleNamespace(worker=SimpleNamespace(name="thinker", holds_input_until_admitted=False),
                             sent=lambda req: None)  # fmt: skip
    service = StageService(engine, model_name="m", arch="a", device="cpu", dtype="float32",  # type: ignore[arg-type]
                           downstream="127.0.0.1:1", downstream_name="talker", edge_mode=0, max_message_bytes=1 << 20,
                           shm=False, replay_budget_bytes=800, replay_memory_bytes=1000)  # fmt: skip

    def out(i: int) -> OutChunk:
        return OutChunk({"k": torch.full((25,), float(i))}, offset=i, length=1)  # 100 bytes

    async def go() -> tuple[list[int], bool]:
        call = _Call(asyncio.get_running_loop())
        call.down = _DownBuffer(800, service.replay_memory)
        call.down_call = SimpleNamespace(done=lambda: False)
        req = SimpleNamespace(request_id="r#1")
        start = stage_pb2.Start(request_id="r")
        for i in range(4):
            call.down.put(out(i))
        lost = service._down_messages(req, call, start, 0)  # type: ignore[arg-type]
        for _ in range(5):  # the Start, then outputs 0-3
            await anext(lost)
        waiting = asyncio.ensure_future(anext(lost))  # waits for output 4
        await asyncio.sleep(0)
        call.attempt = 1  # the call was lost: the replay sends everything again
        replay = service._down_messages(req, call, start, 1)  # type: ignore[arg-type]
        await anext(replay)  # the Start
        sent = [(await anext(replay)).chunk.message().offset for _ in range(2)]
        assert service.replay_memory.take(1000 - service.replay_memory.held)  # another request fills it
        call.down.put(out(4))
        call.down.put(None)
        assert not call.down.replayable
        old_reader_ended = False
        try:
            await waiting
        except StopAsyncIteration:
            old_reader_ended = True
        sent += [(await anext(replay)).chunk.message().offset for _ in range(3)]
        with pytest.raises(StopAsyncIteration):
            await anext(replay)
        return sent, old_reader_ended

    assert asyncio.run(go()) == ([0, 1, 2, 3, 4], True)


@pytest.mark.parametrize("cancelled", [True, False])
def test_an_early_close_is_told_from_a_cancel_across_a_stalled_process(cancelled: bool) -> None:
    """A caller's cancel ends its messages as an early close does, and cancels the handler a
    moment later. When this process stalls meanwhile (not scheduled, or its loop held up) past
    the grace, the cancel, delivered just after, still lands first: the request is not failed
    INVALID_ARGUMENT (one cancel in a suite run was). A real early close is refused."""
    import threading
    import time

    class _Fed:
        worker = SimpleNamespace(name="code2wav", holds_input_until_admitted=False)

        def feed(self, req: Any, chunk: Any) -> None:
            pass

        def abort(self, req: Any, error: StageError | None = None) -> None:
            pass

    service = StageService(_Fed(), model_name="m", arch="a", device="cpu", dtype="float32",  # type: ignore[arg-type]
                           downstream=None, downstream_name=None, edge_mode=0, max_message_bytes=1 << 20,
                           shm=False)  # fmt: skip
    chunk = encode_chunk({"ids": torch.tensor([1])}, offset=0, length=1, finished=False)

    async def go() -> bool:
        async def messages() -> Any:  # one chunk, not the finished one, then the end
            yield Received(stage_pb2.StageRequest(chunk=chunk), {}, b"")

        loop = asyncio.get_running_loop()
        call = _Call(loop)
        req = SimpleNamespace(request_id="r#1", shown_id="'r'", input_closed=False)
        reader = asyncio.create_task(service._read_inputs(req, call, messages(),  # type: ignore[arg-type]
                                                          CallShmReader(ShmReader(enabled=False), None)))  # fmt: skip
        await asyncio.sleep(0.02)  # its messages have ended: it waits out the grace
        stalled = threading.Event()

        def cancel_after_the_stall() -> None:  # (as gRPC's poller delivers the cancel, once scheduled)
            stalled.wait()
            time.sleep(0.02)
            loop.call_soon_threadsafe(reader.cancel)

        if cancelled:
            threading.Thread(target=cancel_after_the_stall, daemon=True).start()
        time.sleep(0.4)  # the stall, past the whole grace
        stalled.set()
        await asyncio.wait_for(asyncio.shield(reader), 5)
        return call.failed

    assert asyncio.run(go()) is (not cancelled)


def test_a_cancel_message_ends_the_request_as_cancelled_and_drops_what_follows() -> None:
    """A caller that ends a request early says so with a Cancel (its gRPC cancel alone ends the
    messages as a half-close does): the request fails CANCELLED at once, not INVALID_ARGUMENT
    after the grace, and chunks behind the Cancel are not fed."""
    fed: list[Any] = []
    aborted: list[StageError | None] = []
    engine = SimpleNamespace(worker=SimpleNamespace(name="talker", holds_input_until_admitted=False),
                             feed=lambda req, chunk: fed.append(chunk),
                             abort=lambda req, error=None: aborted.append(error))  # fmt: skip
    service = StageService(engine, model_name="m", arch="a", device="cpu", dtype="float32",  # type: ignore[arg-type]
                           downstream=None, downstream_name=None, edge_mode=0, max_message_bytes=1 << 20,
                           shm=False)  # fmt: skip
    chunk = encode_chunk({"ids": torch.tensor([1])}, offset=0, length=1, finished=False)
    later = encode_chunk({"ids": torch.tensor([2])}, offset=1, length=1, finished=True)

    async def go() -> list[Any]:
        async def messages() -> Any:
            yield Received(stage_pb2.StageRequest(chunk=chunk), {}, b"")
            yield Received(stage_pb2.StageRequest(cancel=stage_pb2.Cancel(reason="thinker: its call ended")), {}, b"")
            yield Received(stage_pb2.StageRequest(chunk=later), {}, b"")

        call = _Call(asyncio.get_running_loop())
        req = SimpleNamespace(request_id="r#1", shown_id="'r'", input_closed=False)
        await asyncio.wait_for(service._read_inputs(req, call, messages(),  # type: ignore[arg-type]
                                                    CallShmReader(ShmReader(enabled=False), None)), 5)  # fmt: skip
        assert call.failed
        return [call.out_q.get_nowait() for _ in range(call.out_q.qsize())]

    queued = asyncio.run(go())
    assert len(fed) == 1  # the chunk before the Cancel only
    assert len(queued) == 1 and isinstance(queued[0], StageError), queued
    assert queued[0].code == Code.CANCELLED
    assert queued[0].message == "talker: request 'r' cancelled by its caller (thinker: its call ended)"
    assert aborted == [queued[0]]


def _thinker_with_talker_below() -> StageService:
    """A thinker's service, a talker below it, for its downstream writer and teardown alone."""
    return StageService(SimpleNamespace(worker=SimpleNamespace(name="thinker"), sent=lambda req: None),  # type: ignore[arg-type]
                        model_name="m", arch="a", device="cpu", dtype="float32", downstream="127.0.0.1:1",
                        downstream_name="talker", edge_mode=0, max_message_bytes=1 << 20, shm=False)  # fmt: skip


@pytest.mark.parametrize("case", ["waiting", "backlog", "end-queued", "end-taken"])
def test_a_call_that_ends_early_sends_a_cancel_below_ahead_of_its_backlog(case: str) -> None:
    """The downstream call's messages when the request's call ends early: what was taken, then
    a Cancel at once (to a reader waiting for more too), ahead of what is still queued (its end
    included: the stage below would read all of that first, and its shared memory, freed with
    the request). Once the end was
    taken (the call below half-closed), there is nothing to send: no Cancel, and the teardown
    cancels that call (its input complete, a cancel cannot pass for an early close there)."""
    from omnistage.engine import OutChunk
    from omnistage.server.stage_server import _DownBuffer

    service = _thinker_with_talker_below()

    def out(i: int) -> OutChunk:
        return OutChunk({"k": torch.zeros(2)}, offset=i, length=1)

    def kind(m: Any) -> str:
        msg = m if isinstance(m, stage_pb2.StageRequest) else None
        return msg.WhichOneof("kind") or "" if msg is not None else f"chunk {m.chunk.message().offset}"

    async def go() -> tuple[list[str], bool]:
        call = _Call(asyncio.get_running_loop())
        call.down = _DownBuffer(1 << 20)
        call.down_call = SimpleNamespace(done=lambda: False)
        messages = service._down_messages(SimpleNamespace(request_id="r#1"), call,  # type: ignore[arg-type]
                                          stage_pb2.Start(request_id="r"), 0)  # fmt: skip
        call.down.put(out(0))
        sent = [kind(await anext(messages)), kind(await anext(messages))]  # the Start, chunk 0
        if case == "waiting":  # the reader waits for more when the call ends
            parked = asyncio.ensure_future(anext(messages))
            await asyncio.sleep(0.01)
            call.down.close(cancel=True)
            sent.append(kind(await asyncio.wait_for(parked, 5)))
            sent += [kind(m) async for m in messages]
            return sent, call.down.end_taken
        call.down.put(out(1))  # queued, not taken
        if case != "backlog":
            call.down.put(None)
        if case == "end-taken":
            sent.append(kind(await anext(messages)))  # chunk 1
            with pytest.raises(StopAsyncIteration):  # the end: the half-close
                await anext(messages)
        call.down.close(cancel=True)  # (a taken end leaves nothing to send it after)
        sent += [kind(m) async for m in messages]
        return sent, call.down.end_taken

    sent, end_taken = asyncio.run(go())
    if case == "end-taken":
        assert (sent, end_taken) == (["start", "chunk 0", "chunk 1"], True)
    else:
        assert (sent, end_taken) == (["start", "chunk 0", "cancel"], False)


@pytest.mark.parametrize("below_ends_it", [True, False])
def test_the_call_below_is_cancelled_only_when_it_does_not_end_after_the_cancel(
    below_ends_it: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the Cancel the stage below ends the call itself (the relay reads it to its end);
    one that does not within CANCEL_BELOW_S (stopped, not reading) has its call cancelled. The
    request's shared memory is freed only then."""
    from omnistage.server import stage_server

    monkeypatch.setattr(stage_server, "CANCEL_BELOW_S", 0.05)
    service = _thinker_with_talker_below()

    class _DownCall:
        def __init__(self) -> None:
            self.ended = self.cancelled = False

        def done(self) -> bool:
            return self.ended

        def cancel(self) -> None:
            self.cancelled = self.ended = True

    async def go() -> tuple[bool, bool]:
        call = _Call(asyncio.get_running_loop())
        call.down_call = down = _DownCall()

        async def relay() -> None:  # reads the call below to its end, or forever
            if below_ends_it:
                await asyncio.sleep(0.01)
                down.ended = True
                return
            await asyncio.sleep(60)

        task = asyncio.create_task(relay())
        # the request's shared memory is freed once the call below has ended (it read what was sent)
        service.pool = SimpleNamespace(release_request=lambda rid: released.append((rid, down.ended)))  # type: ignore[assignment]
        await asyncio.wait_for(service._end_below(call, [task], SimpleNamespace(request_id="r#1")), 5)  # type: ignore[arg-type]
        await asyncio.sleep(0)
        return down.cancelled, task.done()

    released: list[tuple[str, bool]] = []
    cancelled, relay_done = asyncio.run(go())
    assert cancelled is not below_ends_it
    assert relay_done
    assert released == [("r#1", True)]


def test_a_replay_sends_the_cancel_although_the_lost_call_had_taken_the_end() -> None:
    """The lost call's writer took the end; the replay's new call sends everything again. A
    call that ends now must send that new call a Cancel (its input is not all sent again yet):
    a plain gRPC cancel there could pass for an early close."""
    from omnistage.engine import OutChunk
    from omnistage.server.stage_server import _DownBuffer

    service = _thinker_with_talker_below()

    async def go() -> list[str]:
        call = _Call(asyncio.get_running_loop())
        call.down = _DownBuffer(1 << 20)
        call.down_call = SimpleNamespace(done=lambda: False)
        for i in range(2):
            call.down.put(OutChunk({"k": torch.zeros(2)}, offset=i, length=1, finished=i == 1))
        call.down.put(None)
        req, start = SimpleNamespace(request_id="r#1"), stage_pb2.Start(request_id="r")
        lost = [m async for m in service._down_messages(req, call, start, 0)]  # type: ignore[arg-type]
        assert len(lost) == 3 and call.down.end_taken  # the Start, both chunks, then the end
        call.attempt = 1
        call.down.replay()  # as _open_downstream does for a replay
        again = service._down_messages(req, call, start, 1)  # type: ignore[arg-type]
        sent = [await anext(again), await anext(again)]  # the Start, chunk 0
        call.down.close(cancel=not call.down.end_taken)  # the teardown's choice (tell)
        sent += [m async for m in again]
        return [m.WhichOneof("kind") if isinstance(m, stage_pb2.StageRequest) else "chunk" for m in sent]

    assert asyncio.run(go()) == ["start", "chunk", "cancel"]
