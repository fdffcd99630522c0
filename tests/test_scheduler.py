"""The continuous-batching scheduler (services/runtime/scheduler.py).

Expected values are worked out from the policy: decodes first (one token each), then pending
prefill of admitted requests, then FCFS admission; chunks take what the token budget leaves; a
request is admitted only if its reservation (input bound + max_new_tokens, capped at
max_model_len) fits next to what admitted requests reserve.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from services.runtime.scheduler import (
    DONE_STATES,
    RequestRejected,
    RequestState,
    ScheduledItem,
    Scheduler,
    SchedulerConfig,
    SchedulerRequest,
)

W, R, WFI = RequestState.WAITING, RequestState.RUNNING, RequestState.WAITING_FOR_INPUT


def make(
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 16,
    max_model_len: int = 1000,
    cache_capacity_tokens: int | None = None,
    chunked_prefill: bool = True,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, cache_capacity_tokens, chunked_prefill)
    )


def items(s: Scheduler) -> list[tuple[str, int, bool]]:
    return [tuple(i) for i in s.schedule()]  # type: ignore[misc]


def run_to_exhaustion(s: Scheduler, request_id: str, limit: int = 1000) -> None:
    req = s.get(request_id)
    assert req is not None
    for _ in range(limit):
        if req.is_exhausted:
            return
        s.schedule()
    raise AssertionError(f"{request_id} never exhausted")


# ---- config ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["max_num_seqs", "max_num_batched_tokens", "max_model_len", "cache_capacity_tokens"])
@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "4"])
def test_config_rejects_non_positive_int(name: str, bad: object) -> None:
    kw: dict[str, object] = dict(max_num_seqs=1, max_num_batched_tokens=1, max_model_len=1, cache_capacity_tokens=1)
    kw[name] = bad
    with pytest.raises(ValueError, match=name):
        SchedulerConfig(**kw)  # type: ignore[arg-type]


def test_config_accepts_unbounded_cache_and_checks_chunked_flag() -> None:
    assert SchedulerConfig(1, 1, 1, None).chunked_prefill is True
    with pytest.raises(ValueError, match="chunked_prefill"):
        SchedulerConfig(1, 1, 1, None, chunked_prefill="no")  # type: ignore[arg-type]


def test_states_are_the_six_the_design_names() -> None:
    names = ["WAITING", "RUNNING", "WAITING_FOR_INPUT", "FINISHED", "ABORTED", "FAILED"]
    assert [s.name for s in RequestState] == names
    assert {s.name for s in DONE_STATES} == {"FINISHED", "ABORTED", "FAILED"}


# ---- ordering --------------------------------------------------------------------------------


def test_decode_before_prefill_and_prefill_gets_the_rest_of_the_budget() -> None:
    s = make(max_num_batched_tokens=8)
    s.add("a", 4, 3)
    assert items(s) == [("a", 4, True)]
    s.add("b", 20, 1)
    # a decodes first (1 token); b's chunk takes the 8 - 1 tokens left
    assert items(s) == [("a", 1, False), ("b", 7, True)]
    s.add("c", 2, 1)
    # a decodes again; b continues its prefill (7 left of the budget) before c is admitted (0 left)
    assert items(s) == [("a", 1, False), ("b", 7, True)]
    # a: 3rd and last decode; b: remaining 20 - 14 = 6 tokens; c: 8 - 1 - 6 = 1 of its 2
    assert items(s) == [("a", 1, False), ("b", 6, True), ("c", 1, True)]
    assert s.get("a").is_exhausted  # type: ignore[union-attr]
    s.finish("a")
    # b decodes; c finishes its prefill
    assert items(s) == [("b", 1, False), ("c", 1, True)]
    assert items(s) == [("c", 1, False)]  # b had max_new_tokens=1
    assert s.schedule().scheduled == []


def test_fcfs_admission() -> None:
    s = make(max_num_batched_tokens=8)
    for name in "abc":
        s.add(name, 5, 0)
    out = s.schedule()
    assert out.admitted == ["a", "b"]
    assert list(out) == [ScheduledItem("a", 5, True), ScheduledItem("b", 3, True)]
    # b's remaining 2 come before c is admitted
    assert items(s) == [("b", 2, True), ("c", 5, True)]
    assert [s.get(x).arrival for x in "abc"] == [0, 1, 2]  # type: ignore[union-attr]


def test_chunked_prefill_splits_a_long_prompt_within_the_budget() -> None:
    budget = 10
    s = make(max_num_batched_tokens=budget)
    s.add("long", 25, 2)
    steps = [items(s) for _ in range(5)]
    assert steps == [
        [("long", 10, True)],
        [("long", 10, True)],
        [("long", 5, True)],
        [("long", 1, False)],
        [("long", 1, False)],
    ]
    req = s.get("long")
    assert req is not None and req.is_exhausted and req.num_computed_tokens == 25 + 2 and req.num_generated == 2


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits() -> None:
    s = make(max_num_batched_tokens=10, chunked_prefill=False)
    s.add("a", 2, 3)
    assert items(s) == [("a", 2, True)]
    s.add("b", 10, 1)
    s.add("c", 1, 1)  # would fit, but FCFS keeps it behind b
    for _ in range(3):  # a decodes: 10 - 1 = 9 < 10 left for b
        assert items(s) == [("a", 1, False)]
        assert s.get("b").state is W and s.get("c").state is W  # type: ignore[union-attr]
    s.finish("a")
    assert items(s) == [("b", 10, True)]  # whole, never split
    assert items(s) == [("b", 1, False), ("c", 1, True)]


def test_without_chunked_prefill_a_prompt_over_the_budget_is_rejected() -> None:
    s = make(max_num_batched_tokens=10, chunked_prefill=False)
    with pytest.raises(RequestRejected, match="max_num_batched_tokens") as e:
        s.add("big", 11, 1)
    assert not e.value.resource_exhausted
    assert "big" not in s and s.stats()["total_rejected"] == 1


def test_max_num_seqs_per_step() -> None:
    s = make(max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(5):
        s.add(f"r{i}", 1, 1)
    assert [i.request_id for i in s.schedule()] == ["r0", "r1"]
    # r0 and r1 decode; no slot left for r2
    assert items(s) == [("r0", 1, False), ("r1", 1, False)]
    s.finish("r0")
    s.finish("r1")
    assert [i.request_id for i in s.schedule()] == ["r2", "r3"]


def test_max_num_seqs_when_more_admitted_requests_can_decode_than_fit() -> None:
    s = make(max_num_seqs=2, max_num_batched_tokens=100)
    s.add("a", 1, 3, input_complete=False, max_input_tokens=5)
    s.add("b", 1, 3, input_complete=False, max_input_tokens=5)
    s.schedule()  # a and b prefill, then wait for input
    s.add("c", 1, 3)
    s.add("d", 1, 3)
    s.schedule()  # c and d prefill
    s.extend_input("a", 0, complete=True)
    s.extend_input("b", 0, complete=True)
    # four admitted requests can decode; two slots, taken in admission order
    assert items(s) == [("a", 1, False), ("b", 1, False)]
    assert s.stats()["running"] == 4


# ---- cache capacity --------------------------------------------------------------------------


@pytest.mark.parametrize("release", ["finish", "abort", "fail"])
def test_capacity_blocks_admission_and_is_released(release: str) -> None:
    s = make(max_num_batched_tokens=100, cache_capacity_tokens=100)
    s.add("a", 30, 30)  # reserves 60
    s.add("b", 30, 20)  # needs 50: 60 + 50 > 100
    s.add("c", 5, 5)  # needs 10 and would fit, but waits behind b
    assert s.schedule().admitted == ["a"]
    for _ in range(3):
        s.schedule()
        assert s.get("b").state is W and s.get("c").state is W  # type: ignore[union-attr]
    st_ = s.stats()
    assert st_["reserved_tokens"] == 60 and st_["cache_usage"] == 0.6 and st_["waiting"] == 2
    done = getattr(s, release)("a")
    assert done.state.name == {"finish": "FINISHED", "abort": "ABORTED", "fail": "FAILED"}[release]
    assert done.reserved_tokens == 0 and s.stats()["reserved_tokens"] == 0
    assert s.schedule().admitted == ["b", "c"]
    assert s.stats()["reserved_tokens"] == 50 + 10
    assert s.stats()[f"total_{done.state.name.lower()}"] == 1


def test_reservation_is_capped_at_max_model_len_and_so_are_decodes() -> None:
    s = make(max_model_len=50, cache_capacity_tokens=50, max_num_batched_tokens=100)
    req = s.add("a", 40, 100)
    assert req.max_tokens == 50 and req.decode_limit == 10
    run_to_exhaustion(s, "a")
    assert req.num_generated == 10 and req.num_computed_tokens == 50 == req.reserved_tokens


def test_capacity_none_means_unbounded_and_zero_usage() -> None:
    s = make(max_num_batched_tokens=1000)
    for i in range(20):
        s.add(f"r{i}", 10, 10)
    s.schedule()
    st_ = s.stats()
    assert st_["running"] == 8 and st_["cache_usage"] == 0.0 and st_["cache_capacity_tokens"] == 0


def test_head_request_is_not_starved_by_smaller_later_ones() -> None:
    s = make(max_num_batched_tokens=100, cache_capacity_tokens=100)
    s.add("small-0", 10, 10)
    s.schedule()
    s.add("head", 50, 50)  # needs the whole cache
    for i in range(1, 6):  # small requests keep arriving; each would fit next to small-0
        s.add(f"small-{i}", 10, 10)
        out = s.schedule()
        assert out.admitted == [] and s.get("head").state is W  # type: ignore[union-attr]
    run_to_exhaustion(s, "small-0")
    s.finish("small-0")
    out = s.schedule()
    assert out.admitted == ["head"]  # the cache is now full: the later small ones still wait
    assert s.stats()["waiting"] == 5 and s.stats()["cache_usage"] == 1.0


# ---- input streaming -------------------------------------------------------------------------


def test_waiting_for_input_is_skipped_keeps_its_reservation_and_resumes() -> None:
    s = make(max_num_batched_tokens=4, cache_capacity_tokens=100)
    a = s.add("a", 3, 2, input_complete=False, max_input_tokens=10)
    assert a.max_tokens == 10 + 2
    assert items(s) == [("a", 3, True)]
    assert a.state is WFI and not a.is_runnable
    s.add("b", 9, 0)
    # a takes no budget while it waits: b gets all 4 tokens
    assert items(s) == [("b", 4, True)]
    assert s.stats()["waiting_for_input"] == 1 and s.stats()["reserved_tokens"] == 12 + 9
    s.extend_input("a", 2, complete=False)
    assert a.state is R
    assert items(s) == [("a", 2, True), ("b", 2, True)]  # admission order: a before b
    assert a.state is WFI
    s.extend_input("a", 0, complete=True)  # input ends at 5: the reservation shrinks to 5 + 2
    assert a.state is R and a.max_tokens == 7 and s.stats()["reserved_tokens"] == 7 + 9
    assert items(s) == [("a", 1, False), ("b", 3, True)]
    assert items(s) == [("a", 1, False)]
    assert a.is_exhausted and s.get("b").is_exhausted  # type: ignore[union-attr]


def test_mark_waiting_for_input_and_mark_runnable() -> None:
    s = make()
    a = s.add("a", 2, 5)
    s.schedule()
    s.mark_waiting_for_input("a")
    assert a.state is WFI
    assert s.schedule().scheduled == []
    assert not s.has_runnable()
    s.mark_runnable("a")
    assert a.state is R and items(s) == [("a", 1, False)]
    # extend_input also wakes an explicitly blocked request
    b = s.add("b", 1, 0, input_complete=False, max_input_tokens=4)
    s.schedule()
    s.mark_waiting_for_input("b")
    s.extend_input("b", 1, complete=False)
    assert b.state is R and ("b", 1, True) in items(s)


def test_waiting_request_without_input_does_not_hold_up_the_queue() -> None:
    s = make(cache_capacity_tokens=100)
    empty = s.add("empty", 0, 4, input_complete=False, max_input_tokens=20)
    s.add("b", 3, 1)
    out = s.schedule()
    assert out.admitted == ["b"] and empty.state is W and empty.reserved_tokens == 0
    s.extend_input("empty", 5, complete=True)
    assert s.schedule().admitted == ["empty"]
    assert empty.reserved_tokens == 5 + 4


def test_stream_decode_decodes_while_input_streams() -> None:
    s = make()
    t = s.add("talker", 2, 10, input_complete=False, max_input_tokens=5, stream_decode=True)
    u = s.add("plain", 2, 10, input_complete=False, max_input_tokens=5)
    assert items(s) == [("talker", 2, True), ("plain", 2, True)]
    assert items(s) == [("talker", 1, False)]  # plain waits for its input
    assert t.state is R and u.state is WFI
    s.extend_input("talker", 1, complete=False)
    assert items(s) == [("talker", 1, True)]  # new input is prefilled before the next decode
    assert t.num_pending_input == 0 and t.num_computed_tokens == 2 + 1 + 1


def test_unbounded_streaming_input_cannot_decode_before_it_completes() -> None:
    s = make(max_model_len=20)
    t = s.add("t", 2, 5, input_complete=False, stream_decode=True)
    assert t.max_tokens == 20 and t.decode_limit == 0  # the input may still fill max_model_len
    assert items(s) == [("t", 2, True)]
    assert t.state is WFI
    s.extend_input("t", 0, complete=True)
    assert t.max_tokens == 2 + 5 and t.decode_limit == 5


# ---- rejection and misuse --------------------------------------------------------------------


def test_rejections() -> None:
    s = make(max_model_len=100, cache_capacity_tokens=80)
    with pytest.raises(RequestRejected, match="max_model_len=100") as e:
        s.add("too-long", 101, 0)
    assert not e.value.resource_exhausted
    with pytest.raises(RequestRejected, match="no room"):
        s.add("full", 100, 1)
    with pytest.raises(RequestRejected, match="max_input_tokens=101"):
        s.add("bound", 1, 1, input_complete=False, max_input_tokens=101)
    with pytest.raises(RequestRejected, match="cache_capacity_tokens=80") as e:
        s.add("cache", 50, 31)
    assert e.value.resource_exhausted
    assert isinstance(e.value, ValueError)
    with pytest.raises(RequestRejected, match="cache_capacity_tokens=80"):
        s.add("stream", 1, 1, input_complete=False)  # reserves max_model_len = 100 > 80
    assert s.stats()["total_rejected"] == 5 and len(s) == 0
    # exactly at the limits is fine
    assert s.add("ok", 50, 30).max_tokens == 80


def test_bad_arguments() -> None:
    s = make(max_model_len=100)
    s.add("a", 1, 1, input_complete=False, max_input_tokens=3)
    with pytest.raises(ValueError, match="already scheduled"):
        s.add("a", 1, 1)
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        s.add("b", -1, 1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        s.add("b", 1, -1)
    with pytest.raises(ValueError, match="below"):
        s.add("b", 5, 1, input_complete=False, max_input_tokens=4)
    with pytest.raises(ValueError, match="past its bound"):
        s.extend_input("a", 3, complete=False)
    assert s.get("a").num_prompt_tokens == 1  # type: ignore[union-attr]
    s.extend_input("a", 2, complete=True)
    with pytest.raises(ValueError, match="after it was complete"):
        s.extend_input("a", 0, complete=True)
    s.abort("a")
    for op in (s.finish, s.abort, s.fail, s.mark_runnable, s.mark_waiting_for_input):
        with pytest.raises(KeyError):
            op("a")
    with pytest.raises(KeyError):
        s.extend_input("nope", 1, complete=True)


def test_stats_from_another_thread() -> None:
    s = make(max_num_seqs=4, max_num_batched_tokens=8, cache_capacity_tokens=64)
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                st_ = s.stats()
                assert 0.0 <= st_["cache_usage"] <= 1.0
        except BaseException as e:  # surfaced below
            errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(300):
            s.add(f"r{i}", i % 7, i % 3)
            for item in s.schedule():
                req = s.get(item.request_id)
                if req is not None and req.is_exhausted:
                    s.finish(item.request_id)
            if i % 5 == 0:
                for rid in [f"r{j}" for j in range(i) if f"r{j}" in s][:2]:
                    s.abort(rid)
    finally:
        stop.set()
        t.join()
    assert not errors


# ---- randomized state machine ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Snap:
    state: RequestState
    arrival: int
    pending: int
    can_decode: bool
    runnable: bool
    max_tokens: int


def snap(r: SchedulerRequest) -> Snap:
    return Snap(r.state, r.arrival, r.num_pending_input, r.can_decode, r.is_runnable, r.max_tokens)


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.s: Scheduler
        self.cfg: SchedulerConfig
        self.live: dict[str, SchedulerRequest] = {}
        self.ended: dict[str, RequestState] = {}
        self.n = 0

    @initialize(
        seqs=st.integers(1, 4),
        budget=st.integers(1, 16),
        mml=st.integers(4, 40),
        cap=st.none() | st.integers(8, 80),
        chunked=st.booleans(),
    )
    def setup(self, seqs: int, budget: int, mml: int, cap: int | None, chunked: bool) -> None:
        self.cfg = SchedulerConfig(seqs, budget, mml, cap, chunked)
        self.s = Scheduler(self.cfg)

    # -- rules --

    @rule(
        prompt=st.integers(0, 12) | st.integers(0, 45),
        max_new=st.integers(0, 6),
        complete=st.sampled_from([True, True, True, False]),
        bound_extra=st.none() | st.integers(0, 20),
        stream=st.booleans(),
    )
    def add(self, prompt: int, max_new: int, complete: bool, bound_extra: int | None, stream: bool) -> None:
        cfg = self.cfg
        rid = f"r{self.n}"
        self.n += 1
        max_input = None if bound_extra is None else prompt + bound_extra
        bound = prompt if complete else (cfg.max_model_len if max_input is None else max_input)
        explicit = complete or max_input is not None
        need = min(cfg.max_model_len, bound + max_new)
        should_reject = (
            prompt > cfg.max_model_len
            or bound > cfg.max_model_len
            or (explicit and max_new > 0 and bound == cfg.max_model_len)
            or (not cfg.chunked_prefill and prompt > cfg.max_num_batched_tokens)
            or (cfg.cache_capacity_tokens is not None and need > cfg.cache_capacity_tokens)
        )
        if should_reject:
            with pytest.raises(RequestRejected):
                self.s.add(rid, prompt, max_new, complete, max_input_tokens=max_input, stream_decode=stream)
            assert rid not in self.s
            return
        req = self.s.add(rid, prompt, max_new, complete, max_input_tokens=max_input, stream_decode=stream)
        assert req.state is W and req.max_tokens == need
        self.live[rid] = req

    def _pick(self, data: st.DataObject, pred: object = None) -> SchedulerRequest | None:
        cands = sorted((r for r in self.live.values() if pred is None or pred(r)), key=lambda r: r.arrival)  # type: ignore[operator]
        return data.draw(st.sampled_from(cands)) if cands else None

    @rule(data=st.data(), n=st.integers(0, 12), complete=st.booleans())
    def extend(self, data: st.DataObject, n: int, complete: bool) -> None:
        req = self._pick(data, lambda r: not r.input_complete)
        if req is None:
            return
        before = (req.num_prompt_tokens, req.reserved_tokens)
        if req.num_prompt_tokens + n > req.max_input_tokens:
            with pytest.raises(ValueError, match="past its bound"):
                self.s.extend_input(req.request_id, n, complete)
            assert (req.num_prompt_tokens, req.reserved_tokens) == before
            return
        self.s.extend_input(req.request_id, n, complete)
        assert req.num_prompt_tokens == before[0] + n and not req.blocked
        if complete and req.state is not W:
            assert req.reserved_tokens == min(self.cfg.max_model_len, req.num_prompt_tokens + req.max_new_tokens)

    @rule(data=st.data(), block=st.booleans())
    def mark(self, data: st.DataObject, block: bool) -> None:
        req = self._pick(data)
        if req is None:
            return
        if block:
            self.s.mark_waiting_for_input(req.request_id)
            assert not req.is_runnable and req.state in (W, WFI)
        else:
            self.s.mark_runnable(req.request_id)
            assert not req.blocked

    @rule(data=st.data(), how=st.sampled_from(["finish", "abort", "fail"]))
    def terminate(self, data: st.DataObject, how: str) -> None:
        req = self._pick(data)
        if req is not None:
            self._end(req, how)

    @rule()
    def finish_exhausted(self) -> None:
        for req in [r for r in self.live.values() if r.is_exhausted]:
            self._end(req, "finish")

    @rule()
    def step(self) -> None:
        self._step()

    @rule(prompt=st.integers(0, 8), max_new=st.integers(0, 4))
    def add_small(self, prompt: int, max_new: int) -> None:  # weights generation toward busy queues
        self.add(prompt, max_new, True, None, False)

    @rule()
    def step_again(self) -> None:
        self._step()

    def _end(self, req: SchedulerRequest, how: str) -> None:
        rid = req.request_id
        assert rid not in self.ended
        getattr(self.s, how)(rid)
        assert req.state in DONE_STATES and req.reserved_tokens == 0 and rid not in self.s
        self.ended[rid] = req.state
        del self.live[rid]
        with pytest.raises(KeyError):  # a second terminal transition is refused
            self.s.abort(rid)

    def _step(self) -> list[ScheduledItem]:
        cfg, s = self.cfg, self.s
        pre = {rid: snap(r) for rid, r in self.live.items()}
        out = s.schedule()
        got = list(out)
        ids = [i.request_id for i in got]
        total = sum(i.num_tokens for i in got)
        # budgets
        assert len(got) <= cfg.max_num_seqs
        assert total <= cfg.max_num_batched_tokens and total == out.num_batched_tokens
        assert len(set(ids)) == len(ids)
        # each item is something the request could do
        for it in got:
            p = pre[it.request_id]
            assert p.runnable and it.num_tokens >= 1
            if it.is_prefill:
                assert it.num_tokens <= p.pending
                if not cfg.chunked_prefill:
                    assert it.num_tokens == min(p.pending, cfg.max_num_batched_tokens)
            else:
                assert it.num_tokens == 1 and p.pending == 0 and p.can_decode
        # order: admitted requests' decodes, their prefills, then new admissions in arrival order
        old = [it for it in got if pre[it.request_id].state is not W]
        new = [it for it in got if pre[it.request_id].state is W]
        assert got == old + new
        kinds = [it.is_prefill for it in old]
        assert kinds == sorted(kinds)
        assert out.admitted == [it.request_id for it in new]
        arrivals = [pre[i].arrival for i in out.admitted]
        assert arrivals == sorted(arrivals)
        budget_left = cfg.max_num_batched_tokens - total
        slots_left = cfg.max_num_seqs - len(got)
        # decode before prefill: a skipped decode means no prefill ran and the step is full
        skipped_decodes = [rid for rid, p in pre.items() if p.state is not W and p.runnable and p.pending == 0]
        if any(rid not in ids for rid in skipped_decodes):
            assert not any(it.is_prefill for it in got) and (slots_left == 0 or budget_left == 0)
        # FCFS: a runnable waiting request passed over blocks everything behind it
        waiting = sorted((rid for rid, p in pre.items() if p.state is W and p.runnable), key=lambda r: pre[r].arrival)
        first_left = next((i for i, rid in enumerate(waiting) if rid not in out.admitted), len(waiting))
        assert waiting[:first_left] == out.admitted
        # work conservation: with room left, whatever did not run had a reason
        if slots_left and budget_left:
            for rid, p in pre.items():
                if p.state is not W and p.runnable and rid not in ids:
                    assert not cfg.chunked_prefill and p.pending > 0
                    assert min(p.pending, cfg.max_num_batched_tokens) > budget_left
            if first_left < len(waiting):
                p = pre[waiting[first_left]]
                cap = cfg.cache_capacity_tokens
                over_cap = cap is not None and s.stats()["reserved_tokens"] + p.max_tokens > cap
                too_big = not cfg.chunked_prefill and min(p.pending, cfg.max_num_batched_tokens) > budget_left
                blocked_by_old = any(
                    q.state is not W and q.runnable and r not in ids for r, q in pre.items()
                )  # without chunking an admitted request's prefill that did not fit goes first
                assert over_cap or too_big or blocked_by_old
        return got

    # -- invariants --

    @invariant()
    def accounting(self) -> None:
        if not hasattr(self, "s"):
            return
        s, cfg = self.s, self.cfg
        stats = s.stats()
        admitted = [r for r in self.live.values() if r.state in (R, WFI)]
        reserved = sum(r.reserved_tokens for r in admitted)
        assert stats["reserved_tokens"] == reserved
        if cfg.cache_capacity_tokens is not None:
            assert reserved <= cfg.cache_capacity_tokens
            assert stats["cache_usage"] == reserved / cfg.cache_capacity_tokens
        for r in self.live.values():
            assert r.num_computed_tokens <= r.max_tokens <= cfg.max_model_len
            assert 0 <= r.num_pending_input <= r.num_prompt_tokens <= r.max_input_tokens
            assert r.num_generated <= r.max_new_tokens
            if r.state is W:
                assert r.reserved_tokens == 0 and r.num_computed_tokens == 0
            else:
                assert r.reserved_tokens == r.max_tokens
            if r.state is WFI:
                assert not r.is_runnable
        assert stats["running"] == sum(r.state is R for r in self.live.values())
        assert stats["waiting_for_input"] == sum(r.state is WFI for r in self.live.values())
        assert stats["waiting"] == sum(r.state is W for r in self.live.values())
        assert len(s) == len(self.live)
        assert stats["total_added"] == len(self.live) + len(self.ended)

    def teardown(self) -> None:
        if not hasattr(self, "s"):
            return
        # complete every input and lift every block: everything admitted must then run to the end
        for req in list(self.live.values()):
            if not req.input_complete:
                self.s.extend_input(req.request_id, 0, complete=True)
            self.s.mark_runnable(req.request_id)
        work = sum(r.num_pending_input + r.decode_limit - r.num_generated for r in self.live.values())
        for _ in range(work + len(self.live) + 2):
            self.finish_exhausted()
            if not self.live:
                break
            assert self._step(), "no progress although every input is complete"
        assert not self.live, "requests left after a bounded drain"
        for rid, state in self.ended.items():
            assert state in DONE_STATES and rid not in self.s
        stats = self.s.stats()
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
    s = make(max_num_seqs=3, max_num_batched_tokens=7, max_model_len=30, cache_capacity_tokens=40)
    specs = {f"r{i}": (3 + 5 * i % 17, i % 6) for i in range(12)}
    for rid, (p, m) in specs.items():
        s.add(rid, p, m)
    steps = 0
    while len(s):
        for rid in list(specs):
            r = s.get(rid)
            if r is not None and r.is_exhausted:
                assert r.num_computed_tokens == specs[rid][0] + specs[rid][1] and r.num_generated == specs[rid][1]
                s.finish(rid)
        if len(s):
            assert s.schedule().scheduled
        steps += 1
        assert steps < 500
    st_ = s.stats()
    assert st_["total_finished"] == 12
    assert st_["total_prefill_tokens"] == sum(p for p, _ in specs.values())
    assert st_["total_decode_tokens"] == sum(m for _, m in specs.values())
