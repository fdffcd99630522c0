"""The engine loop with a scripted worker: one Request object per request, the worker contract
(execute -> per-request outputs), and every way a request ends freeing what it held."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from omnistage.engine import (
    Engine,
    FinishReason,
    OutChunk,
    Request,
    RequestStatus,
    ScheduledItem,
    StageWorker,
    StepOutput,
)
from omnistage.wire import Code, DecodedChunk, StageError
from omnistage.wire.tensor_blob import LENGTH_KEY


class Counting(StageWorker):
    """Emits one chunk per step until `steps` are done; `fail_at` makes a step raise."""

    name = "counting"

    def __init__(self) -> None:
        self.closed: list[str] = []
        self.batches: list[int] = []

    def open(self, req: Request) -> None:
        if req.params.get("bad"):
            raise StageError(Code.INVALID_ARGUMENT, "counting: bad start")
        req.state = {"steps": req.params.get("steps", 2), "done": 0, "fed": 0}

    def feed(self, req: Request, chunk: DecodedChunk) -> None:
        req.state["fed"] += 1

    def demand(self, req: Request) -> tuple[int, int] | None:
        return 0, req.params.get("budget", 100)

    def ready(self, req: Request) -> bool:
        return req.input_finished or not req.params.get("needs_input", False)

    def execute(self, batch: Sequence[ScheduledItem]) -> list[StepOutput | Exception]:
        self.batches.append(len(batch))
        out: list[StepOutput | Exception] = []
        for item in batch:
            state = item.request.state
            if item.request.params.get("fail_at") == state["done"]:
                out.append(item.request.params.get("error", RuntimeError("boom")))
                continue
            state["done"] += 1
            step = StepOutput(up=[OutChunk({}, offset=state["done"] - 1, length=1)])
            if state["done"] == state["steps"]:
                step.finished, step.detail = FinishReason.STOP, "done"
            out.append(step)
        return out

    def close(self, req: Request) -> None:
        self.closed.append(req.request_id)


class Sink:
    def __init__(self) -> None:
        self.outputs: list[StepOutput] = []
        self.ended = threading.Event()
        self.req: Request | None = None

    def on_output(self, req: Request, out: StepOutput) -> None:
        self.outputs.append(out)

    def on_finished(self, req: Request) -> None:
        self.req = req
        self.ended.set()


def chunk(offset: int, n: int, finished: bool = False) -> DecodedChunk:
    return DecodedChunk({}, {LENGTH_KEY: n}, offset, 0, finished)


def run_until_idle(engine: Engine, limit: int = 100) -> None:
    for _ in range(limit):
        if engine.idle:
            return
        engine.run_once()
    raise AssertionError("engine did not go idle")


def test_requests_run_batched_to_their_end_and_are_freed() -> None:
    worker = Counting()
    engine = Engine(worker, background=False)
    sinks = [Sink() for _ in range(3)]
    for i, sink in enumerate(sinks):
        engine.open(f"r{i}", {"steps": 2 + i}, sink)
    run_until_idle(engine)
    assert max(worker.batches) == 3  # the three shared steps
    for i, sink in enumerate(sinks):
        assert [o.up[0].offset for o in sink.outputs] == list(range(2 + i))
        assert sink.req is not None and sink.req.status is RequestStatus.FINISHED_STOPPED
        assert sink.req.finish_detail == "done" and sink.req.state is None
    assert sorted(worker.closed) == ["r0", "r1", "r2"]
    assert engine.load()["open"] == 0 and engine.scheduler.stats()["reserved_tokens"] == 0


class SendsDown(Counting):
    """Says which requests will send chunks downstream (`down` in their params)."""

    def sends_down(self, req: Request) -> bool:
        return bool(req.params.get("down"))


class StartedSink(Sink):
    def __init__(self, worker: Counting) -> None:
        super().__init__()
        self.worker = worker
        self.started_after: list[int] = []  # the worker's steps before each on_started

    def on_started(self, req: Request) -> None:
        self.started_after.append(len(self.worker.batches))


def test_a_request_that_sends_down_is_announced_once_before_its_first_step() -> None:
    """The stage server opens the downstream call then, so its set-up overlaps the first step. A
    request that sends nothing down is not announced, and a sink without the hook is fine."""
    worker = SendsDown()
    engine = Engine(worker, background=False)
    down, local, plain = StartedSink(worker), StartedSink(worker), Sink()
    engine.open("first", {"steps": 3}, Sink())
    run_until_idle(engine)  # the worker has stepped before the others open
    engine.open("down", {"steps": 3, "down": True}, down)
    engine.open("local", {"steps": 3}, local)
    engine.open("plain", {"steps": 3, "down": True}, plain)
    run_until_idle(engine)
    assert down.started_after == [3]  # once, before the first step it is in (the 4th)
    assert local.started_after == []
    assert len(plain.outputs) == 3 and len(down.outputs) == 3


class HoldsInput(Counting):
    """A decode role's shape: the demand (a cache of `cache` tokens, all of it arriving as input)
    is known from the first chunk; it can step once its input is finished."""

    holds_input_until_admitted = True

    def demand(self, req: Request) -> tuple[int, int, int] | None:
        n = req.params["cache"]
        return (n, 2, n) if req.state["fed"] else None

    def ready(self, req: Request) -> bool:
        return req.input_finished


class AdmittedSink(Sink):
    def __init__(self) -> None:
        super().__init__()
        self.admitted = 0

    def on_admitted(self, req: Request) -> None:
        self.admitted += 1


def test_a_holding_workers_request_is_admitted_before_its_input_and_told_so() -> None:
    """With room for one cache, the first request is admitted at its first chunk (its sink told,
    so the server reads the rest); the second waits, untold, until the first ends, and meanwhile
    it is not starved of input (it waits for room, longer than the input wait)."""
    engine = Engine(HoldsInput(), 0.5, background=False, cache_capacity_tokens=15)
    sinks = [AdmittedSink(), AdmittedSink()]
    reqs = [engine.open(f"r{i}", {"cache": 10, "steps": 2}, sink) for i, sink in enumerate(sinks)]
    for req in reqs:
        engine.feed(req, chunk(0, 4))
    engine.run_once()
    time.sleep(0.7)
    engine.feed(reqs[0], chunk(4, 2))  # the first one's input goes on; the second waits past 0.5 s
    engine.run_once()
    assert [s.admitted for s in sinks] == [1, 0] and not sinks[1].ended.is_set()
    assert [r.status for r in reqs] == [RequestStatus.WAITING_FOR_INPUT] * 2
    engine.feed(reqs[0], chunk(6, 4, finished=True))  # the rest of the first one's cache
    for _ in range(4):
        engine.run_once()
    assert sinks[0].ended.is_set() and sinks[1].admitted == 1
    engine.feed(reqs[1], chunk(4, 6, finished=True))
    run_until_idle(engine)
    assert [len(s.outputs) for s in sinks] == [2, 2]


class HoldsUntilSent(Counting):
    """A prefill role's shape: a prompt of `prompt` tokens (its cache), one step, sent down."""

    holds_reservation_until_sent = True

    def demand(self, req: Request) -> tuple[int, int]:
        return req.params["prompt"], 1


class LaterSink(Sink):
    sends_later = True  # a transport: outputs leave the process after the engine hands them over


@pytest.mark.parametrize("sink_type", [LaterSink, Sink])
def test_a_reservation_lasts_until_the_transport_has_sent_the_request(sink_type: type[Sink]) -> None:
    """With room for one prompt, a request that ended keeps its reservation until `sent`, so the
    next one is admitted only then: what waits to be sent counts against the cache capacity. A
    sink that does not send later (in process) frees it as the request ends."""
    engine = Engine(HoldsUntilSent(), background=False, cache_capacity_tokens=15)
    sinks = [sink_type(), sink_type()]
    reqs = [engine.open(f"r{i}", {"prompt": 10, "steps": 1}, sink) for i, sink in enumerate(sinks)]
    for _ in range(3):
        engine.run_once()
    assert sinks[0].ended.is_set()
    held = sink_type is LaterSink
    stats = engine.scheduler.stats()
    assert (stats["held_tokens"], stats["reserved_tokens"]) == ((11, 11) if held else (0, 0))
    assert engine.load()["held_tokens"] == stats["held_tokens"]  # what the stage's metrics show
    assert sinks[1].ended.is_set() is not held  # in process: the second ran as the first ended
    assert reqs[1].status is (RequestStatus.WAITING if held else RequestStatus.FINISHED_STOPPED)
    engine.sent(reqs[0])
    run_until_idle(engine)
    assert sinks[1].ended.is_set()
    engine.sent(reqs[1])
    engine.sent(reqs[1])  # again (the call's end says so too): a no-op
    engine.run_once()
    assert engine.scheduler.stats()["reserved_tokens"] == 0


def test_a_request_its_transport_is_done_with_before_it_ends_holds_nothing() -> None:
    """The transport may be done with a request before the step that ends it (a worker that sends
    its last output a step before it finishes, or a call that ended): whichever comes first, no
    reservation is held past the end with nobody left to release it."""
    engine = Engine(HoldsUntilSent(), background=False, cache_capacity_tokens=15)
    first = engine.open("first", {"prompt": 10, "steps": 2}, LaterSink())
    engine.run_once()  # its first step
    engine.sent(first)  # the transport is done with it before its last step
    engine.run_once()  # its last step ends it
    assert first.status is RequestStatus.FINISHED_STOPPED
    assert engine.scheduler.stats()["reserved_tokens"] == 0
    second = engine.open("second", {"prompt": 10, "steps": 1}, LaterSink())
    run_until_idle(engine)
    assert second.status is RequestStatus.FINISHED_STOPPED  # admitted: nothing was left held


def test_a_cancelled_or_failed_request_keeps_no_reservation() -> None:
    """Only a request that ended well holds its reservation for its outputs: one cancelled (its
    call ended, and may have said sent before the engine saw the cancel) or failed does not."""
    engine = Engine(HoldsUntilSent(), background=False, cache_capacity_tokens=100)
    cancelled = engine.open("cancelled", {"prompt": 10, "steps": 2}, LaterSink())
    failed = engine.open("failed", {"prompt": 10, "steps": 2, "fail_at": 1}, LaterSink())
    engine.run_once()
    engine.abort(cancelled)
    engine.sent(cancelled)
    run_until_idle(engine)
    assert failed.status is RequestStatus.FAILED and cancelled.status is RequestStatus.FINISHED_ABORTED
    assert engine.scheduler.stats()["reserved_tokens"] == 0


def test_one_failing_request_does_not_take_the_others_down() -> None:
    worker = Counting()
    engine = Engine(worker, background=False)
    bad, good = Sink(), Sink()
    engine.open("bad", {"steps": 3, "fail_at": 1}, bad)
    engine.open("good", {"steps": 3}, good)
    run_until_idle(engine)
    assert bad.req is not None and bad.req.status is RequestStatus.FAILED
    assert bad.req.error is not None and bad.req.error.code is Code.INTERNAL and "boom" in bad.req.error.message
    assert good.req is not None and good.req.status is RequestStatus.FINISHED_STOPPED and len(good.outputs) == 3
    assert sorted(worker.closed) == ["bad", "good"]


def test_one_request_out_of_memory_fails_it_as_resource_exhausted() -> None:
    """Out of memory in one request's own work (a media encoder's, returned in its place) is
    RESOURCE_EXHAUSTED, as in a shared step (a client may retry it), not an internal error."""
    engine = Engine(Counting(), background=False)
    big, good = Sink(), Sink()
    engine.open("big", {"steps": 3, "fail_at": 0, "error": MemoryError("encoder")}, big)
    engine.open("good", {"steps": 3}, good)
    run_until_idle(engine)
    assert big.req is not None and big.req.error is not None
    assert big.req.error.code is Code.RESOURCE_EXHAUSTED and "out of memory in request big" in big.req.error.message
    assert good.req is not None and good.req.status is RequestStatus.FINISHED_STOPPED


class RaisesInStep(Counting):
    """Its shared step raises `error` once."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error: Exception | None = error

    def execute(self, batch: Sequence[ScheduledItem]) -> list[StepOutput | Exception]:
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return super().execute(batch)


@pytest.mark.parametrize(("error", "code"), [(MemoryError(), Code.RESOURCE_EXHAUSTED),
                                             (RuntimeError("boom"), Code.INTERNAL)])  # fmt: skip
def test_a_failed_shared_step_fails_its_requests_once_logged(error: Exception, code: Code,
                                                            caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """Every request in the step fails with one status (out of memory: RESOURCE_EXHAUSTED, which
    a client may retry), logged once for the step, not once per request; the engine goes on."""
    engine = Engine(RaisesInStep(error), background=False)
    sinks = [Sink() for _ in range(3)]
    for i, sink in enumerate(sinks):
        engine.open(f"r{i}", {"steps": 2}, sink)
    run_until_idle(engine)
    for sink in sinks:
        assert sink.req is not None and sink.req.error is not None and sink.req.error.code is code
    assert len([r for r in caplog.records if r.levelname == "ERROR"]) == 1
    assert "r0, r1, r2" in caplog.records[0].getMessage()
    later = Sink()
    engine.open("later", {"steps": 2}, later)
    run_until_idle(engine)
    assert later.req is not None and later.req.status is RequestStatus.FINISHED_STOPPED


class MiscountsOutputs(Counting):
    """A bug outside any one request's work: a step returns one output too few."""

    def execute(self, batch: Sequence[ScheduledItem]) -> list[StepOutput | Exception]:
        return super().execute(batch)[1:]


def test_an_engine_thread_that_fails_outside_a_request_says_so() -> None:
    """A failure of the loop itself (here a step's outputs miscounted: the strict zip raises)
    leaves no request able to step: `on_dead` hears it (a stage process exits on it, so its
    callers replay elsewhere) instead of the thread ending silently under a live service."""
    died: list[BaseException] = []
    heard = threading.Event()

    def on_dead(exc: BaseException) -> None:
        died.append(exc)
        heard.set()

    engine = Engine(MiscountsOutputs(), on_dead=on_dead)
    engine.open("r1", {"steps": 2}, Sink())
    engine.open("r2", {"steps": 2}, Sink())
    assert heard.wait(10)
    assert engine.dead is died[0] and isinstance(died[0], ValueError)  # zip(strict=True)'s
    assert engine._thread is not None
    engine._thread.join(5)
    assert not engine._thread.is_alive()


def test_open_errors_and_duplicate_ids() -> None:
    engine = Engine(Counting(), background=False)
    sink = Sink()
    engine.open("x", {"bad": True}, sink)
    run_until_idle(engine)
    assert sink.req is not None and sink.req.error is not None and sink.req.error.code is Code.INVALID_ARGUMENT
    engine.open("y", {"needs_input": True}, Sink())
    with pytest.raises(StageError, match="already open"):
        engine.open("y", {}, Sink())
    with pytest.raises(StageError, match="request_id is empty"):
        engine.open("", {}, Sink())


def test_input_order_is_checked_before_the_worker_sees_it() -> None:
    engine = Engine(Counting(), background=False)
    req = engine.open("r", {"needs_input": True}, Sink())
    engine.feed(req, chunk(0, 2))
    with pytest.raises(StageError, match="out of order; expected 2"):
        engine.feed(req, chunk(5, 1))
    engine.feed(req, chunk(2, 1, finished=True))
    with pytest.raises(StageError, match="after the finished chunk"):
        engine.feed(req, chunk(3, 1))
    run_until_idle(engine)
    assert req.status is RequestStatus.FINISHED_STOPPED


def test_input_after_a_request_has_ended_is_checked_and_held_nowhere() -> None:
    """A request that ended while its caller still sends (a talker at its frame limit while the
    thinker goes on) drops what comes: order still checked, no device copy, nothing queued."""
    engine = Engine(Counting(), background=False)
    starts: list[int] = []
    real_start = engine.device_inputs.start
    engine.device_inputs.start = lambda c: (starts.append(c.offset), real_start(c))[1]  # type: ignore[method-assign]
    req = engine.open("r", {"steps": 1}, Sink())
    engine.feed(req, chunk(0, 2))
    assert starts == [0] and len(req.inbox) == 1
    run_until_idle(engine)
    assert req.status is RequestStatus.FINISHED_STOPPED and not req.inbox  # what it did not read is let go
    for offset in range(2, 40, 2):
        engine.feed(req, chunk(offset, 2))
    assert starts == [0] and not req.inbox
    with pytest.raises(StageError, match="out of order; expected 40"):
        engine.feed(req, chunk(3, 1))
    engine.close_input(req)
    assert not req.inbox


def test_abort_frees_the_request_and_says_so() -> None:
    worker = Counting()
    engine = Engine(worker, background=False)
    sink = Sink()
    req = engine.open("r", {"needs_input": True}, sink)
    engine.run_once()
    assert req.status is RequestStatus.WAITING_FOR_INPUT and engine.load()["waiting_for_input"] == 1
    engine.abort(req)
    engine.run_once()
    assert req.status is RequestStatus.FINISHED_ABORTED and req.finish_reason is FinishReason.ABORT
    assert worker.closed == ["r"] and sink.ended.is_set() and engine.idle


def test_input_wait_timeout_and_deadline_fail_with_their_status() -> None:
    engine = Engine(Counting(), input_wait_timeout_s=0.05, background=False)
    starved, late = Sink(), Sink()
    engine.open("starved#7", {"needs_input": True}, starved, caller_id="starved")
    engine.open("late#8", {"needs_input": True}, late, deadline=time.monotonic() - 1, caller_id="late")
    time.sleep(0.1)
    run_until_idle(engine)
    assert starved.req is not None and starved.req.error is not None
    assert starved.req.error.code is Code.DEADLINE_EXCEEDED and "input_wait_timeout_s" in starved.req.error.message
    assert late.req is not None and late.req.error is not None
    assert late.req.error.code is Code.DEADLINE_EXCEEDED and "deadline" in late.req.error.message
    # each names the request by the id its caller knows, not the stage's own (which adds to it)
    assert "request starved starved" in starved.req.error.message and "#" not in starved.req.error.message
    assert "request late passed" in late.req.error.message and "#" not in late.req.error.message


def test_a_deadline_passed_waiting_for_room_says_so() -> None:
    """A request that could step but was never admitted (the requests before it held the cache)
    fails at its deadline naming the wait and its settings, not as if its own steps were slow."""
    engine = Engine(Counting(), cache_capacity_tokens=100, background=False)
    first, second = Sink(), Sink()
    engine.open("first", {"steps": 50, "budget": 80}, first)
    engine.run_once()  # admitted: it holds 80 of the 100 tokens
    engine.open("second", {"budget": 80}, second, deadline=time.monotonic() + 60)
    engine.run_once()  # queued: no room
    assert second.req is None and engine.load()["waiting"] == 1
    next(r for r in engine._requests.values() if r.request_id == "second").deadline = time.monotonic() - 1
    run_until_idle(engine)
    assert second.req is not None and second.req.error is not None and second.req.error.code is Code.DEADLINE_EXCEEDED
    assert "waiting to be admitted" in second.req.error.message and "cache_capacity_tokens" in second.req.error.message
    assert first.req is not None and first.req.status is RequestStatus.FINISHED_STOPPED


def test_a_request_that_uses_its_budget_unfinished_fails() -> None:
    engine = Engine(Counting(), background=False)
    sink = Sink()
    engine.open("r", {"steps": 5, "budget": 2}, sink)
    run_until_idle(engine)
    assert sink.req is not None and sink.req.error is not None
    assert sink.req.error.code is Code.INTERNAL and "budget" in sink.req.error.message
    assert len(sink.outputs) == 2


def test_the_engine_thread_serves_and_stops() -> None:
    engine = Engine(Counting())
    sinks = [Sink() for _ in range(4)]
    for i, sink in enumerate(sinks):
        engine.open(f"r{i}", {"steps": 3}, sink)
    assert all(s.ended.wait(10) for s in sinks)
    assert all(len(s.outputs) == 3 for s in sinks)
    engine.stop()
    assert engine.idle


def test_request_status_follows_admission_and_readiness() -> None:
    engine = Engine(Counting(), background=False)
    req = engine.open("r", {"needs_input": True, "steps": 1}, Sink())
    engine.run_once()
    assert (req.status, req.admitted, req.ready) == (RequestStatus.WAITING_FOR_INPUT, False, False)
    engine.close_input(req)
    engine.run_once()  # ready now: queued, admitted and stepped in one iteration
    assert req.status is RequestStatus.FINISHED_STOPPED


class SlowReader(Sink):
    """A caller that takes at most `room` outputs until it reads again (backpressure)."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room

    def congested(self) -> bool:
        return len(self.outputs) >= self.room


def test_a_caller_that_stops_reading_pauses_its_request_then_fails_it() -> None:
    # (2 s: the 40 steps before the stall must not pass it on a loaded machine)
    engine = Engine(Counting(), output_stall_timeout_s=2.0, background=False)
    slow, fast = SlowReader(room=3), Sink()
    engine.open("slow", {"steps": 50}, slow)
    engine.open("fast", {"steps": 20}, fast)
    for _ in range(30):
        engine.run_once()
    assert len(slow.outputs) == 3, "a congested request must not step"
    assert fast.req is not None and fast.req.error is None and len(fast.outputs) == 20  # others go on
    slow.room = 5  # it reads a little: the request resumes, up to its room
    for _ in range(10):
        engine.run_once()
    assert len(slow.outputs) == 5 and not slow.ended.is_set()
    time.sleep(2.1)  # then reads nothing for longer than output_stall_timeout_s
    run_until_idle(engine)
    assert slow.req is not None and slow.req.error is not None
    assert slow.req.error.code is Code.DEADLINE_EXCEEDED and "output_stall_timeout_s" in slow.req.error.message


def test_a_cache_too_small_for_the_default_reply_is_said_at_start(caplog: pytest.LogCaptureFixture) -> None:
    """cache_capacity_tokens under a one-token prompt plus the default reply length refuses every
    request that does not set max_tokens: the thinker says so once, at start (it started silently);
    and when it holds fewer such requests than max_num_seqs. Not a prefill role, which reserves
    no reply."""
    import logging
    from types import SimpleNamespace

    from omnistage.models import SamplingParams
    from services.thinker.worker import ThinkerWorker

    spec = SimpleNamespace(max_positions=2048, talker_needs_hidden=False)
    worker = ThinkerWorker(SimpleNamespace(device="cpu", spec=spec), SamplingParams(max_tokens=1024))
    with caplog.at_level(logging.WARNING):
        for capacity in (None, 65536, 1025):
            worker.warn_if_defaults_do_not_fit(capacity)
        assert not caplog.records
        worker.warn_if_defaults_do_not_fit(600)
    assert len(caplog.records) == 1 and "cache_capacity_tokens=600" in caplog.text and "at least 1025" in caplog.text
    short = ThinkerWorker(SimpleNamespace(device="cpu", spec=spec), SamplingParams(max_tokens=1024), max_model_len=500)
    caplog.clear()
    short.warn_if_defaults_do_not_fit(500)  # the model length caps the reply: a 500-token cache holds any request
    assert not caplog.records
    # a cache that holds fewer default-length requests than max_num_seqs: said too, with what would hold them
    with caplog.at_level(logging.WARNING):
        worker.warn_if_defaults_do_not_fit(16 * 1025, 16)
        assert not caplog.records
        worker.warn_if_defaults_do_not_fit(16 * 1025 - 1, 16)
    assert len(caplog.records) == 1 and "holds at most 15 requests" in caplog.text, caplog.text
    assert "max_num_seqs=16" in caplog.text and "raise it to 16400" in caplog.text
    # a prefill role reserves its prompts and their first tokens only: a small cache refuses no reply there
    from services.thinker.prefill import PrefillWorker

    prefill = PrefillWorker.__new__(PrefillWorker)  # (its model checks need a real thinker: this one's settings)
    prefill.__dict__.update(worker.__dict__)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        prefill.warn_if_defaults_do_not_fit(600, 16)
    assert not caplog.records
    # a decode role reserves the reply past the prefill's first token: one token less
    from services.thinker.decode import DecodeWorker

    decode = DecodeWorker.__new__(DecodeWorker)
    decode.__dict__.update(worker.__dict__)
    with caplog.at_level(logging.WARNING):
        decode.warn_if_defaults_do_not_fit(16 * 1024, 16)
        assert not caplog.records
        decode.warn_if_defaults_do_not_fit(1023, 16)
    assert "at least 1024" in caplog.text, caplog.text


def test_each_ending_is_told_to_the_observer_once_with_its_outcome() -> None:
    """A stage counts how its requests ended (ok, cancelled, or the status they failed with): its
    own failures were seen only as the gateway's status of the whole request."""
    from collections import Counter

    class Observer:
        def __init__(self) -> None:
            self.outcomes: Counter[str] = Counter()

        def on_step(self, batch_size: int, seconds: float, cpu_seconds: float, produced: int) -> None:
            pass

        def on_finished(self, outcome: str) -> None:
            self.outcomes[outcome] += 1

    observer = Observer()
    engine = Engine(Counting(), background=False, observer=observer)
    engine.open("ok", {"steps": 2}, Sink())
    engine.open("boom", {"fail_at": 0}, Sink())
    engine.open("bad", {"bad": True}, Sink())
    cancelled = engine.open("cancelled", {"needs_input": True}, Sink())
    engine.run_once()
    engine.abort(cancelled)
    engine.abort(cancelled)  # (a second abort of an ended request is a no-op)
    run_until_idle(engine)
    assert observer.outcomes == {"ok": 1, "INTERNAL": 1, "INVALID_ARGUMENT": 1, "CANCELLED": 1}, observer.outcomes
