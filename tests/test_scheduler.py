"""The continuous-batching scheduler (omnistage/engine/scheduler.py).

Expected values are worked out from the policy: decodes first (one token each), then pending
prefill of admitted requests, then FCFS admission; chunks take what the token budget leaves; a
request is admitted only if its reservation (prompt + max_new_tokens, capped at max_model_len)
fits next to what admitted requests reserve. Each step here plays the engine: everything
scheduled runs, then `update_from_output`.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from omnistage.engine import FinishReason, Request, RequestRejected, RequestStatus, Scheduler, SchedulerConfig

W, R, WFI = RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.WAITING_FOR_INPUT
REASONS = {"finish": FinishReason.STOP, "abort": FinishReason.ABORT, "fail": FinishReason.ERROR}


class Harness:
    """The scheduler with string ids, stepping as the engine does."""

    def __init__(self, max_num_seqs: int = 8, max_num_batched_tokens: int = 16, max_model_len: int = 1000,
                 cache_capacity_tokens: int | None = None, chunked_prefill: bool = True,
                 prefill_chunk: int | None = None) -> None:  # fmt: skip
        self.cfg = SchedulerConfig(
            max_num_seqs, max_num_batched_tokens, max_model_len, cache_capacity_tokens, chunked_prefill, prefill_chunk
        )
        self.s = Scheduler(self.cfg)
        self.reqs: dict[str, Request] = {}
        self.admitted: list[str] = []  # admitted by the last step

    def add(self, rid: str, prompt: int, max_new: int, ready: bool = True, cached: int = 0,
            early: bool = False) -> Request:  # fmt: skip
        req = Request(rid, None, arrival=len(self.reqs))
        self.s.add(req, prompt, max_new, cached, reserve_early=early)
        self.s.set_ready(req, ready)
        self.reqs[rid] = req
        return req

    def step(self) -> list[tuple[str, int, bool]]:
        before = {rid for rid, r in self.reqs.items() if r.admitted}
        out = self.s.schedule()
        self.admitted = [i.request.request_id for i in out if i.request.request_id not in before]
        self.s.update_from_output(out, [None] * len(out))
        return [(i.request.request_id, i.num_tokens, i.is_prefill) for i in out]

    def end(self, rid: str, how: str = "finish", hold: bool = False) -> Request:
        req = self.reqs[rid]
        self.s.finish(req, REASONS[how], hold=hold)
        return req

    def live(self) -> list[Request]:
        return [r for r in self.reqs.values() if not r.status.is_finished]

    def counts(self) -> dict[RequestStatus, int]:
        statuses = [r.status for r in self.live()]
        return {s: statuses.count(s) for s in (W, R, WFI)}


def run_to_exhaustion(h: Harness, rid: str, limit: int = 1000) -> None:
    for _ in range(limit):
        if h.reqs[rid].is_exhausted:
            return
        h.step()
    raise AssertionError(f"{rid} never exhausted")


# ---- config and states ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["max_num_seqs", "max_num_batched_tokens", "max_model_len", "cache_capacity_tokens"])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_config_rejects_non_positive_int(name: str, bad: object) -> None:
    args = {"max_num_seqs": 1, "max_num_batched_tokens": 1, "max_model_len": 1, "cache_capacity_tokens": 1}
    args[name] = bad
    with pytest.raises(ValueError, match=name):
        SchedulerConfig(**args)  # type: ignore[arg-type]


def test_config_accepts_unbounded_cache_and_checks_chunked_flag() -> None:
    assert SchedulerConfig(1, 1, 1, None).cache_capacity_tokens is None
    with pytest.raises(ValueError, match="chunked_prefill"):
        SchedulerConfig(1, 1, 1, None, chunked_prefill=1)  # type: ignore[arg-type]


def test_statuses_are_the_ones_the_design_names() -> None:
    names = ["WAITING", "RUNNING", "WAITING_FOR_INPUT", "FINISHED_STOPPED", "FINISHED_LENGTH", "FINISHED_ABORTED",
             "FAILED"]  # fmt: skip
    assert [s.name for s in RequestStatus] == names
    assert {s.name for s in RequestStatus if s.is_finished} == set(names[3:])
    assert [RequestStatus.for_reason(r).finish_reason for r in FinishReason] == list(FinishReason)


# ---- ordering --------------------------------------------------------------------------------


def test_decode_before_prefill_and_prefill_gets_the_rest_of_the_budget() -> None:
    h = Harness(max_num_batched_tokens=8)
    h.add("a", 4, 3)
    assert h.step() == [("a", 4, True)]
    h.add("b", 20, 1)
    # a decodes first (1 token); b's chunk takes the 8 - 1 tokens left
    assert h.step() == [("a", 1, False), ("b", 7, True)]
    h.add("c", 2, 1)
    # a decodes again; b continues its prefill (7 left of the budget) before c is admitted (0 left)
    assert h.step() == [("a", 1, False), ("b", 7, True)]
    # a: 3rd and last decode; b: remaining 20 - 14 = 6 tokens; c: 8 - 1 - 6 = 1 of its 2
    assert h.step() == [("a", 1, False), ("b", 6, True), ("c", 1, True)]
    assert h.reqs["a"].is_exhausted
    h.end("a")
    # b decodes; c finishes its prefill
    assert h.step() == [("b", 1, False), ("c", 1, True)]
    assert h.step() == [("c", 1, False)]  # b had max_new_tokens=1
    assert h.step() == []


def test_fcfs_admission() -> None:
    h = Harness(max_num_batched_tokens=8)
    for name in "abc":
        h.add(name, 5, 0)
    assert h.step() == [("a", 5, True), ("b", 3, True)]
    assert h.admitted == ["a", "b"]
    # b's remaining 2 come before c is admitted
    assert h.step() == [("b", 2, True), ("c", 5, True)]
    assert [h.reqs[x].arrival for x in "abc"] == [0, 1, 2]


def test_chunked_prefill_splits_a_long_prompt_within_the_budget() -> None:
    h = Harness(max_num_batched_tokens=10)
    h.add("long", 25, 2)
    steps = [h.step() for _ in range(5)]
    assert steps == [
        [("long", 10, True)],
        [("long", 10, True)],
        [("long", 5, True)],
        [("long", 1, False)],
        [("long", 1, False)],
    ]
    req = h.reqs["long"]
    assert req.is_exhausted and req.num_computed_tokens == 25 + 2 and req.num_output_tokens == 2


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits() -> None:
    h = Harness(max_num_batched_tokens=10, chunked_prefill=False)
    h.add("a", 2, 3)
    assert h.step() == [("a", 2, True)]
    h.add("b", 10, 1)
    h.add("c", 1, 1)  # would fit, but FCFS keeps it behind b
    for _ in range(3):  # a decodes: 10 - 1 = 9 < 10 left for b
        assert h.step() == [("a", 1, False)]
        assert h.reqs["b"].status is W and h.reqs["c"].status is W
    h.end("a")
    assert h.step() == [("b", 10, True)]  # whole, never split
    assert h.step() == [("b", 1, False), ("c", 1, True)]


def test_without_chunked_prefill_a_prompt_over_the_budget_is_rejected() -> None:
    h = Harness(max_num_batched_tokens=10, chunked_prefill=False)
    with pytest.raises(RequestRejected, match="max_num_batched_tokens"):
        h.add("big", 11, 1)
    assert h.s.stats()["total_rejected"] == 1


def test_without_chunked_prefill_only_the_uncached_prompt_must_fit_a_step() -> None:
    """A request that arrives with its prompt's cache (a decode role's) prefills nothing: its
    prompt may be larger than a step's budget; the part it would prefill may not."""
    h = Harness(max_num_batched_tokens=10, chunked_prefill=False)
    h.add("handed", 40, 3, cached=40)
    assert h.step() == [("handed", 1, False)]
    with pytest.raises(RequestRejected, match="prompt of 11 tokens to prefill exceeds max_num_batched_tokens=10"):
        h.add("partly", 40, 3, cached=29)


def test_max_num_seqs_per_step() -> None:
    h = Harness(max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(5):
        h.add(f"r{i}", 1, 1)
    assert [rid for rid, _, _ in h.step()] == ["r0", "r1"]
    # r0 and r1 decode; no slot left for r2
    assert h.step() == [("r0", 1, False), ("r1", 1, False)]
    h.end("r0")
    h.end("r1")
    assert [rid for rid, _, _ in h.step()] == ["r2", "r3"]


def test_max_num_seqs_when_more_admitted_requests_can_decode_than_fit() -> None:
    h = Harness(max_num_seqs=2, max_num_batched_tokens=100)
    h.add("a", 1, 3)
    h.add("b", 1, 3)
    h.step()  # a and b prefill, then wait for input
    h.s.set_ready(h.reqs["a"], False)
    h.s.set_ready(h.reqs["b"], False)
    h.add("c", 1, 3)
    h.add("d", 1, 3)
    h.step()  # c and d prefill
    h.s.set_ready(h.reqs["a"], True)
    h.s.set_ready(h.reqs["b"], True)
    # four admitted requests can decode; two slots, taken in admission order
    assert h.step() == [("a", 1, False), ("b", 1, False)]
    assert h.counts()[R] == 4


# ---- cache capacity --------------------------------------------------------------------------


@pytest.mark.parametrize("release", ["finish", "abort", "fail"])
def test_capacity_blocks_admission_and_is_released(release: str) -> None:
    h = Harness(max_num_batched_tokens=100, cache_capacity_tokens=100)
    h.add("a", 30, 30)  # reserves 60
    h.add("b", 30, 20)  # needs 50: 60 + 50 > 100
    h.add("c", 5, 5)  # needs 10 and would fit, but waits behind b
    h.step()
    assert h.admitted == ["a"]
    for _ in range(3):
        h.step()
        assert h.reqs["b"].status is W and h.reqs["c"].status is W
    st_ = h.s.stats()
    assert st_["reserved_tokens"] == 60 and st_["cache_usage"] == 0.6 and h.counts()[W] == 2
    done = h.end("a", release)
    want = {"finish": "FINISHED_STOPPED", "abort": "FINISHED_ABORTED", "fail": "FAILED"}[release]
    assert done.status.name == want
    assert done.reserved_tokens == 0 and h.s.stats()["reserved_tokens"] == 0
    h.step()
    assert h.admitted == ["b", "c"]
    assert h.s.stats()["reserved_tokens"] == 50 + 10
    total = {"finish": "finished", "abort": "aborted", "fail": "failed"}[release]
    assert h.s.stats()[f"total_{total}"] == 1


def test_a_held_reservation_blocks_admission_until_released() -> None:
    """A request ended with `hold` (its outputs still wait to leave: a prefill role's KV) keeps
    its reservation, by `update_from_output` as by `finish`, until `release`."""
    h = Harness(max_num_batched_tokens=100, cache_capacity_tokens=100)
    h.add("a", 50, 10)
    (item,) = h.s.schedule()
    h.s.update_from_output([item], [FinishReason.STOP], [True])
    h.add("b", 50, 10)
    h.step()
    assert h.reqs["a"].status is RequestStatus.FINISHED_STOPPED and h.reqs["a"].reserved_tokens == 0
    assert h.admitted == [] and h.s.stats()["held_tokens"] == 60 and h.s.stats()["reserved_tokens"] == 60
    h.s.release("b")  # not held: nothing changes
    h.s.release("a")
    h.s.release("a")
    assert h.s.stats()["reserved_tokens"] == 0
    h.step()
    assert h.admitted == ["b"]
    h.end("b", "abort", hold=True)  # held however it ended: the engine decides when to hold
    assert h.s.stats()["held_tokens"] == 60
    h.s.release("b")
    assert h.s.stats()["reserved_tokens"] == 0 and h.s.stats()["total_aborted"] == 1


def test_reservation_is_capped_at_max_model_len_and_so_are_decodes() -> None:
    h = Harness(max_model_len=50, cache_capacity_tokens=50, max_num_batched_tokens=100)
    req = h.add("a", 40, 100)
    assert req.decode_limit == 10
    run_to_exhaustion(h, "a")
    assert req.num_output_tokens == 10 and req.num_computed_tokens == 50 == req.reserved_tokens


def test_capacity_none_means_unbounded_and_zero_usage() -> None:
    h = Harness(max_num_batched_tokens=1000)
    for i in range(20):
        h.add(f"r{i}", 10, 10)
    h.step()
    st_ = h.s.stats()
    assert h.counts()[R] == 8 and st_["cache_usage"] == 0.0 and st_["cache_capacity_tokens"] == 0


def test_head_request_is_not_starved_by_smaller_later_ones() -> None:
    h = Harness(max_num_batched_tokens=100, cache_capacity_tokens=100)
    h.add("small-0", 10, 10)
    h.step()
    h.add("head", 50, 50)  # needs the whole cache
    for i in range(1, 6):  # small requests keep arriving; each would fit next to small-0
        h.add(f"small-{i}", 10, 10)
        h.step()
        assert h.admitted == [] and h.reqs["head"].status is W
    run_to_exhaustion(h, "small-0")
    h.end("small-0")
    h.step()
    assert h.admitted == ["head"]  # the cache is now full: the later small ones still wait
    assert h.counts()[W] == 5 and h.s.stats()["cache_usage"] == 1.0


# ---- waiting for input -----------------------------------------------------------------------


def test_waiting_for_input_is_skipped_keeps_its_reservation_and_resumes() -> None:
    h = Harness(max_num_batched_tokens=4, cache_capacity_tokens=100)
    a = h.add("a", 3, 2)
    assert h.step() == [("a", 3, True)]
    h.s.set_ready(a, False)
    assert a.status is WFI
    h.add("b", 9, 0)
    # a takes no budget while it waits: b gets all 4 tokens
    assert h.step() == [("b", 4, True)]
    assert h.counts()[WFI] == 1 and h.s.stats()["reserved_tokens"] == 5 + 9
    h.s.set_ready(a, True)
    assert a.status is R
    assert h.step() == [("a", 1, False), ("b", 3, True)]
    assert h.step() == [("a", 1, False), ("b", 2, True)]
    assert a.is_exhausted and h.reqs["b"].is_exhausted


def test_a_request_whose_worker_cannot_step_does_not_hold_up_the_queue() -> None:
    h = Harness(cache_capacity_tokens=100)
    idle = h.add("idle", 5, 4, ready=False)
    h.add("b", 3, 1)
    h.step()
    assert h.admitted == ["b"] and idle.status is WFI and idle.reserved_tokens == 0
    h.s.set_ready(idle, True)
    assert idle.status is W
    h.step()
    assert h.admitted == ["idle"] and idle.reserved_tokens == 5 + 4


# ---- rejection and misuse --------------------------------------------------------------------


def test_rejections() -> None:
    h = Harness(max_model_len=100, cache_capacity_tokens=80)
    with pytest.raises(RequestRejected, match="max_model_len=100"):
        h.add("too-long", 101, 0)
    with pytest.raises(RequestRejected, match="no room"):
        h.add("full", 100, 1)
    with pytest.raises(RequestRejected, match="cache_capacity_tokens=80") as e:
        h.add("cache", 50, 31)
    assert isinstance(e.value, ValueError) and "capped" not in str(e.value)  # (only when max_model_len caps it)
    with pytest.raises(RequestRejected, match=r"99 input \+ max_new_tokens=5, capped at max_model_len=100"):
        h.add("capped", 99, 5)
    assert h.s.stats()["total_rejected"] == 4 and h.s.stats()["total_added"] == 0
    # exactly at the limits is fine
    ok = h.add("ok", 50, 30)
    h.step()
    assert ok.reserved_tokens == 80


def test_a_rejection_names_the_request_by_its_callers_id() -> None:
    s = Scheduler(SchedulerConfig(4, 16, 100, None))
    with pytest.raises(RequestRejected, match=r"^request 'abc': input of 101 tokens") as e:
        s.add(Request("abc#3", None, caller_id="abc"), 101, 1)
    assert "#" not in str(e.value)


def test_bad_arguments() -> None:
    h = Harness(max_model_len=100)
    a = h.add("a", 1, 1)
    with pytest.raises(ValueError, match="already queued"):
        h.s.add(a, 1, 1)
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        h.s.add(Request("b", None), -1, 1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        h.s.add(Request("b", None), 1, -1)
    h.end("a", "abort")
    h.end("a", "finish")  # ending twice is a no-op
    assert a.status is RequestStatus.FINISHED_ABORTED and h.s.stats()["total_aborted"] == 1
    with pytest.raises(ValueError, match="already queued or finished"):
        h.s.add(a, 1, 1)


def test_stats_from_another_thread() -> None:
    h = Harness(max_num_seqs=4, max_num_batched_tokens=8, cache_capacity_tokens=64)
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                st_ = h.s.stats()
                assert 0.0 <= st_["cache_usage"] <= 1.0
        except BaseException as e:  # surfaced below
            errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(300):
            h.add(f"r{i}", i % 7, i % 3)
            for rid, _, _ in h.step():
                if h.reqs[rid].is_exhausted:
                    h.end(rid)
            if i % 5 == 0:
                for req in h.live()[:2]:
                    h.end(req.request_id, "abort")
    finally:
        stop.set()
        t.join()
    assert not errors


# ---- randomized state machine ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Snap:
    status: RequestStatus
    arrival: int
    pending: int
    can_decode: bool
    can_step: bool
    reservation: int


def snap(r: Request, mml: int) -> Snap:
    can_decode = r.ready and r.num_pending_prompt == 0 and r.num_output_tokens < r.decode_limit
    can_step = r.ready and (r.num_pending_prompt > 0 or can_decode)
    return Snap(r.status, r.arrival, r.num_pending_prompt, can_decode, can_step,
                min(mml, r.num_prompt_tokens + r.max_new_tokens))  # fmt: skip


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.h: Harness
        self.ended: dict[str, RequestStatus] = {}
        self.held: dict[str, int] = {}  # ended with their reservation kept, until released
        self.n = 0

    @initialize(
        seqs=st.integers(1, 4),
        budget=st.integers(1, 16),
        mml=st.integers(4, 40),
        cap=st.none() | st.integers(8, 80),
        chunked=st.booleans(),
        fixed=st.none() | st.integers(1, 16),
    )
    def setup(self, seqs: int, budget: int, mml: int, cap: int | None, chunked: bool, fixed: int | None) -> None:
        self.h = Harness(seqs, budget, mml, cap, chunked, min(fixed, budget) if fixed else None)

    def _next_piece(self, pending: int) -> int:
        """The prefill a request needs room for next: the rest without chunking, its fixed chunk
        with `prefill_chunk`, one token when a chunk takes what is left."""
        cfg = self.h.cfg
        if not cfg.chunked_prefill:
            return pending
        return min(pending, cfg.prefill_chunk) if cfg.prefill_chunk else min(pending, 1)

    # -- rules --

    @rule(prompt=st.integers(0, 12) | st.integers(0, 45), max_new=st.integers(0, 6), ready=st.booleans())
    def add(self, prompt: int, max_new: int, ready: bool) -> None:
        cfg = self.h.cfg
        rid = f"r{self.n}"
        self.n += 1
        need = min(cfg.max_model_len, prompt + max_new)
        should_reject = (
            prompt > cfg.max_model_len
            or (max_new > 0 and prompt == cfg.max_model_len)
            or (not cfg.chunked_prefill and prompt > cfg.max_num_batched_tokens)
            or (cfg.cache_capacity_tokens is not None and need > cfg.cache_capacity_tokens)
        )
        if should_reject:
            with pytest.raises(RequestRejected):
                self.h.add(rid, prompt, max_new, ready)
            assert rid not in self.h.reqs
            return
        req = self.h.add(rid, prompt, max_new, ready)
        assert req.status is (W if ready else WFI) and not req.admitted

    def _pick(self, data: st.DataObject) -> Request | None:
        cands = sorted(self.h.live(), key=lambda r: r.arrival)
        return data.draw(st.sampled_from(cands)) if cands else None

    @rule(data=st.data(), ready=st.booleans())
    def mark(self, data: st.DataObject, ready: bool) -> None:
        req = self._pick(data)
        if req is None:
            return
        self.h.s.set_ready(req, ready)
        if not ready:
            assert req.status is WFI
        else:
            assert req.status is (R if req.admitted else W)

    @rule(data=st.data(), how=st.sampled_from(["finish", "abort", "fail"]))
    def terminate(self, data: st.DataObject, how: str) -> None:
        req = self._pick(data)
        if req is not None:
            self._end(req, how)

    @rule(hold=st.booleans())
    def finish_exhausted(self, hold: bool = False) -> None:
        for req in [r for r in self.h.live() if r.is_exhausted]:
            self._end(req, "finish", hold)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        """Free a held reservation (or one never held, or twice: a no-op)."""
        rid = data.draw(st.sampled_from([*sorted(self.held), "r0", "unknown"]))
        self.h.s.release(rid)
        self.held.pop(rid, None)

    @rule()
    def step(self) -> None:
        self._step()

    @rule(prompt=st.integers(0, 8), max_new=st.integers(0, 4))
    def add_small(self, prompt: int, max_new: int) -> None:  # weights generation toward busy queues
        self.add(prompt, max_new, True)

    @rule()
    def step_again(self) -> None:
        self._step()

    def _end(self, req: Request, how: str, hold: bool = False) -> None:
        rid = req.request_id
        assert rid not in self.ended
        reservation = req.reserved_tokens
        self.h.end(rid, how, hold)
        assert req.status.is_finished and req.reserved_tokens == 0 and not req.admitted
        if hold and reservation:
            self.held[rid] = reservation
        self.ended[rid] = req.status
        self.h.end(rid, "abort")  # a second ending changes nothing
        assert req.status is self.ended[rid]

    def _step(self) -> list[tuple[str, int, bool]]:
        h, cfg = self.h, self.h.cfg
        pre = {r.request_id: snap(r, cfg.max_model_len) for r in h.live()}
        reserved_before = h.s.stats()["reserved_tokens"]
        got = h.step()
        ids = [rid for rid, _, _ in got]
        total = sum(n for _, n, _ in got)
        # budgets
        assert len(got) <= cfg.max_num_seqs
        assert total <= cfg.max_num_batched_tokens
        assert len(set(ids)) == len(ids)
        # each item is something the request could do
        for rid, n, is_prefill in got:
            p = pre[rid]
            assert p.can_step and n >= 1
            if is_prefill:
                assert n <= p.pending
                if not cfg.chunked_prefill or cfg.prefill_chunk:
                    assert n == self._next_piece(p.pending)
            else:
                assert n == 1 and p.pending == 0 and p.can_decode
        # order: admitted requests' decodes, their prefills, then new admissions in arrival order
        old = [it for it in got if pre[it[0]].status is not W]
        new = [it for it in got if pre[it[0]].status is W]
        assert got == old + new
        kinds = [is_prefill for _, _, is_prefill in old]
        assert kinds == sorted(kinds)
        assert h.admitted == [rid for rid, _, _ in new]
        arrivals = [pre[i].arrival for i in h.admitted]
        assert arrivals == sorted(arrivals)
        budget_left = cfg.max_num_batched_tokens - total
        slots_left = cfg.max_num_seqs - len(got)
        # decode before prefill: a skipped decode means no prefill ran and the step is full
        skipped = [rid for rid, p in pre.items() if p.status is R and p.can_decode]
        if any(rid not in ids for rid in skipped):
            assert not any(is_prefill for _, _, is_prefill in got) and (slots_left == 0 or budget_left == 0)
        # FCFS: a waiting request that could step and was passed over blocks everything behind it
        waiting = sorted((rid for rid, p in pre.items() if p.status is W and p.can_step), key=lambda r: pre[r].arrival)
        first_left = next((i for i, rid in enumerate(waiting) if rid not in h.admitted), len(waiting))
        assert waiting[:first_left] == h.admitted
        # work conservation: with room left, whatever did not run had a reason
        if slots_left and budget_left:
            for rid, p in pre.items():
                if p.status is R and p.can_step and rid not in ids:
                    assert self._next_piece(p.pending) > budget_left
            if first_left < len(waiting):
                p = pre[waiting[first_left]]
                cap = cfg.cache_capacity_tokens
                admitted_now = sum(pre[r].reservation for r in h.admitted)
                over_cap = cap is not None and reserved_before + admitted_now + p.reservation > cap
                too_big = self._next_piece(p.pending) > budget_left
                blocked_by_old = any(q.status is R and q.can_step and r not in ids for r, q in pre.items())
                assert over_cap or too_big or blocked_by_old
        return got

    # -- invariants --

    @invariant()
    def accounting(self) -> None:
        if not hasattr(self, "h"):
            return
        h, cfg = self.h, self.h.cfg
        stats = h.s.stats()
        live = h.live()
        reserved = sum(r.reserved_tokens for r in live if r.admitted) + sum(self.held.values())
        assert stats["reserved_tokens"] == reserved and stats["held_tokens"] == sum(self.held.values())
        if cfg.cache_capacity_tokens is not None:
            assert reserved <= cfg.cache_capacity_tokens
            assert stats["cache_usage"] == reserved / cfg.cache_capacity_tokens
        for r in live:
            reservation = min(cfg.max_model_len, r.num_prompt_tokens + r.max_new_tokens)
            assert r.num_computed_tokens <= reservation <= cfg.max_model_len
            assert 0 <= r.num_pending_prompt <= r.num_prompt_tokens
            assert r.num_output_tokens <= r.decode_limit <= r.max_new_tokens
            if not r.admitted:
                assert r.reserved_tokens == 0 and r.num_computed_tokens == 0 and r.status in (W, WFI)
            else:
                assert r.reserved_tokens == reservation and r.status in (R, WFI)
            assert (r.status is WFI) == (not r.ready)
        assert stats["total_added"] == len(live) + len(self.ended)

    def teardown(self) -> None:
        if not hasattr(self, "h"):
            return
        # every worker can step again, and held reservations are released as their outputs leave:
        # everything must then run to the end
        for rid in list(self.held):
            self.h.s.release(rid)
            del self.held[rid]
        for req in self.h.live():
            self.h.s.set_ready(req, True)
        work = sum(r.num_pending_prompt + r.decode_limit - r.num_output_tokens for r in self.h.live())
        for _ in range(work + len(self.h.live()) + 2):
            self.finish_exhausted()
            if not self.h.live():
                break
            assert self._step(), "no progress although every worker can step"
        assert not self.h.live(), "requests left after a bounded drain"
        stats = self.h.s.stats()
        assert stats["reserved_tokens"] == 0 and stats["cache_usage"] == 0
        assert stats["total_finished"] + stats["total_aborted"] + stats["total_failed"] == len(self.ended)


SchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerMachine = SchedulerMachine.TestCase


def test_drain_finishes_every_request_exactly() -> None:
    """Deterministic companion of the machine's drain: totals match the rules exactly."""
    h = Harness(max_num_seqs=3, max_num_batched_tokens=7, max_model_len=30, cache_capacity_tokens=40)
    specs = {f"r{i}": (3 + 5 * i % 17, i % 6) for i in range(12)}
    for rid, (p, m) in specs.items():
        h.add(rid, p, m)
    steps = 0
    while h.live():
        for req in h.live():
            if req.is_exhausted:
                p, m = specs[req.request_id]
                assert req.num_computed_tokens == p + m and req.num_output_tokens == m
                h.end(req.request_id)
        if h.live():
            assert h.step()
        steps += 1
        assert steps < 500
    st_ = h.s.stats()
    assert st_["total_finished"] == 12
    assert st_["total_prefill_tokens"] == sum(p for p, _ in specs.values())
    assert st_["total_decode_tokens"] == sum(m for _, m in specs.values())


def test_a_request_whose_cache_arrived_decodes_at_once_and_reserves_it() -> None:
    """A decode role's request: its prompt's cache came from the prefill role."""
    h = Harness(max_num_batched_tokens=4, cache_capacity_tokens=100)
    h.add("kv", 50, 10, cached=50)
    h.add("fresh", 6, 2)
    assert h.step() == [("kv", 1, False), ("fresh", 3, True)]
    assert h.s.stats()["reserved_tokens"] == 60 + 8
    with pytest.raises(ValueError, match=r"num_cached_tokens 7 outside 0\.\.6"):
        h.s.add(Request("x", None, arrival=9), 6, 2, 7)


def test_a_request_reserving_early_is_admitted_before_it_can_step_in_its_turn() -> None:
    """A decode role's request whose KV cache is still to come: admitted (its cache reserved) in
    arrival order while it waits for input, with no step; one that does not fit waits, and holds
    up those behind it; it steps once its input is in."""
    h = Harness(max_num_batched_tokens=4, cache_capacity_tokens=100)
    a = h.add("a", 50, 10, ready=False, cached=50, early=True)
    b = h.add("b", 50, 10, ready=False, cached=50, early=True)
    h.add("c", 6, 2, ready=False)  # an ordinary request waiting for input: passed over
    h.add("d", 4, 2)  # ready, but behind b, which does not fit yet
    assert h.step() == []  # d is not admitted: b, before it, does not fit next to a
    assert (a.admitted, b.admitted, h.reqs["d"].admitted, a.status) == (True, False, False, WFI)
    assert h.s.stats()["reserved_tokens"] == 60
    h.s.set_ready(a, True)
    assert h.step() == [("a", 1, False)]
    h.end("a")
    assert h.step() == [("d", 4, True)]  # b reserved (no step: its cache is still to come), then d
    assert b.admitted and b.status == WFI and h.s.stats()["reserved_tokens"] == 60 + 6


def _chunks(h: Harness, rid: str, steps: int = 40) -> list[int]:
    """The prefill chunks `rid` gets while the harness steps (everyone else too)."""
    got = []
    for _ in range(steps):
        got += [n for r, n, prefill in h.step() if r == rid and prefill]
        for req in [r for r in h.live() if r.is_exhausted]:
            h.end(req.request_id)
    return got


def test_fixed_prefill_chunks_split_a_prompt_the_same_alone_and_under_load() -> None:
    """With `prefill_chunk` a prompt is split where its length alone says (exact batching's
    "as if alone"); without it, where the budget other requests left runs out."""
    # worked out from the policy: x (5) and y (1) take 6 of the first step's 8, then both decode
    for fixed, alone_split, loaded_split in ((5, [5, 5, 2], [5, 5, 2]), (None, [8, 4], [2, 6, 4])):
        alone = Harness(max_num_seqs=4, max_num_batched_tokens=8, prefill_chunk=fixed)
        alone.add("p", 12, 1)
        assert _chunks(alone, "p") == alone_split
        loaded = Harness(max_num_seqs=4, max_num_batched_tokens=8, prefill_chunk=fixed)
        loaded.add("x", 5, 3)  # a shorter prompt first, decoding while p prefills
        loaded.add("y", 1, 4)
        loaded.add("p", 12, 1)
        assert _chunks(loaded, "p") == loaded_split, fixed
    with pytest.raises(ValueError, match="prefill_chunk"):
        SchedulerConfig(4, 8, 100, None, True, 9)
