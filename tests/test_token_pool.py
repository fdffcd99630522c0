"""Fast mode's token pool (models/kv_caches.py `TokenPool`): the thinker's requests' keys and
values on one token axis per layer, each request a range of exactly its reservation (so the
memory stays within the scheduler's budget), a decode step's one-row requests written with one
indexed store and attended in groups, one masked SDPA per group, instead of one per request."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from omnistage.models.batching import PackedCache, _Layout, exact_attention
from omnistage.models.kv_caches import PooledRanges, PoolRange, SlotCache, TokenPool, layer_kv
from omnistage.models.sampling import SamplingParams
from tests.conftest import TEST_DEVICE, DispatchCount, ops_per_further_request, staged_pipeline

DEV = TEST_DEVICE  # on CUDA too (benchmarks/gpu/run.sh tests)


def _kv(heads: int, n: int, dim: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, heads, n, dim, device=DEV), torch.randn(1, heads, n, dim, device=DEV)


def test_a_range_holds_what_dynamic_cache_holds_as_ranges_move_and_the_pool_grows() -> None:
    """Each request's range holds exactly what its own DynamicCache would while ranges are placed
    first fit into holes, a range without a limit outgrows its capacity (in place when the run
    after it is free, else packed into grown buffers, or moved to a free run), and the ranges are
    packed into grown buffers; the buffers go when the pool is idle."""
    torch.manual_seed(0)
    pool = TokenPool(num_layers=2, min_tokens=16, min_range=4)
    ranges: dict[str, PoolRange] = {}
    own: dict[str, DynamicCache] = {}

    def feed(name: str, n: int) -> None:
        for layer in range(2):
            k, v = _kv(2, n)
            got, want = ranges[name].update(k, v, layer), own[name].update(k, v, layer)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    def check() -> None:
        for name, rng in ranges.items():
            for layer in range(2):
                k, v = layer_kv(rng, layer)
                assert torch.equal(k, own[name].layers[layer].keys) and torch.equal(v, own[name].layers[layer].values)
        spans = sorted((r.offset, r.offset + r.capacity) for r in ranges.values())
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)) and spans[-1][1] <= pool.size

    ranges["a"], own["a"] = pool.acquire(None), DynamicCache()
    feed("a", 6)  # past its 4 positions, the run after it free: twice 6, in place
    assert (ranges["a"].offset, ranges["a"].capacity) == (0, 12)
    ranges.pop("a").release()
    own.pop("a")
    assert pool.k == [None, None]  # idle: the buffers went
    for name, limit, n in (("a", 6, 4), ("b", None, 3), ("c", 5, 5)):
        ranges[name], own[name] = pool.acquire(limit), DynamicCache()
        feed(name, n)
    # each starts at min_range (4) or less: "c" grew to its limit of 5 in place
    assert pool.size == 16 and [(r.offset, r.capacity) for r in ranges.values()] == [(0, 4), (4, 4), (8, 5)]
    feed("b", 3)  # past its 4 positions, "c" after it and no free run of 12: packed into 32
    assert (ranges["b"].capacity, pool.size, pool.repacks) == (12, 32, 1)
    check()
    ranges.pop("a").release()
    own.pop("a")
    ranges["d"], own["d"] = pool.acquire(3), DynamicCache()  # first fit: "a"'s hole at 0
    assert ranges["d"].offset == 0
    feed("d", 3)
    ranges["e"], own["e"] = pool.acquire(14), DynamicCache()  # 4 positions, at the end
    assert (ranges["e"].offset, ranges["e"].capacity, pool.repacks) == (21, 4, 1)
    feed("e", 9)  # to its limit of 14: no run of 14 free, packed and grown to 64
    assert pool.repacks == 2 and pool.size == 64 and pool.k[0] is not None and pool.k[0].shape[2] == 64
    feed("b", 7)  # 13 of 12: 26, moved to the free run after "e"
    assert ranges["b"].capacity == 26 and ranges["b"].offset > ranges["e"].offset and pool.repacks == 2
    check()
    for rng in ranges.values():
        rng.release()
    ranges["b"].release()  # twice: harmless
    assert pool.k == [None, None] and pool.size == 0 and not pool.ranges


def test_the_pool_stays_within_its_budget() -> None:
    """With a budget (the scheduler's cache_capacity_tokens), the buffers grow no further than it
    while the ranges' limits sum to no more than it (what the scheduler's admission guarantees),
    whatever the order of arrivals, growth and departures; no range holds more than its limit,
    and each holds what its own cache holds after every move and packing."""
    rng = random.Random(5)
    budget = 200
    pool = TokenPool(num_layers=1, budget=budget, min_tokens=16, min_range=4)
    live: list[tuple[PoolRange, DynamicCache]] = []
    for _ in range(400):
        roll = rng.random()
        if live and (roll < 0.25 or sum(r.limit or 0 for r, _ in live) > budget - 10):
            live.pop(rng.randrange(len(live)))[0].release()
        elif live and roll < 0.6:  # one of them decodes or prefills some more, within its limit
            r, own = live[rng.randrange(len(live))]
            n = min(rng.randint(1, 6), (r.limit or 0) - r.get_seq_length())
            if n > 0:
                kv = _kv(1, n)
                r.update(*kv, 0)
                own.update(*kv, 0)
        else:
            limit = rng.randint(1, 40)
            if sum(r.limit or 0 for r, _ in live) + limit > budget:
                continue
            r, own = pool.acquire(limit), DynamicCache()
            kv = _kv(1, rng.randint(1, limit))
            r.update(*kv, 0)
            own.update(*kv, 0)
            live.append((r, own))
        assert pool.size <= budget and all(r.capacity <= (r.limit or 0) for r, _ in live)
    assert pool.repacks > 0 and live  # the walk did pack the pool
    for r, own in live:
        k, v = layer_kv(r, 0)
        assert torch.equal(k, own.layers[0].keys) and torch.equal(v, own.layers[0].values)


class _Batching:
    fast = True

    def __init__(self) -> None:
        self.layout: Any = None


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (2, 2)])
def test_pooled_ranges_attention_is_each_requests_own_attention(heads: int, kv_heads: int) -> None:
    """A step of a prefill chunk and eleven decode rows (two groups), in an order other than the
    ranges', with a range not in the step holding NaN keys and values inside a group's span: every
    request's output is what SDPA over its own cache gives (to the last bits: other kernels), and
    finite; the NaN request's rows were stored as zeros."""
    torch.manual_seed(1)
    dim, layers = 8, 2
    pool = TokenPool(num_layers=layers, min_tokens=32)
    history = [5, 9, 2, 4, 7, 1, 3, 6, 8, 2, 5, 3]
    ranges = [pool.acquire(n + 4) for n in history]
    own = [SlotCache(layers) for _ in history]
    poisoned = 4
    for rng, mine, n in zip(ranges, own, history, strict=True):
        for layer in range(layers):
            k, v = _kv(kv_heads, n, dim)
            if rng is ranges[poisoned]:
                k[..., 0, :], v[..., 1, :] = float("nan"), float("inf")
            rng.update(k, v, layer)
            mine.update(k, v, layer)
    ranges[1].release()  # a hole, then a newcomer with a prefill chunk of 3 rows
    newcomer = pool.acquire(3)
    step = [i for i in range(len(history)) if i not in (1, poisoned)]
    random.Random(2).shuffle(step)
    caches: list[Any] = [ranges[i] for i in step] + [newcomer]
    mine_all: list[SlotCache] = [own[i] for i in step] + [SlotCache(layers)]
    lengths = [1] * len(step) + [3]
    packed = PackedCache(caches, lengths)
    assert isinstance(packed.pooled, PooledRanges) and len(packed.pooled.members) == len(step) == 10
    assert len(packed.pooled.groups) == 2 and packed.pooled.order is not None
    rows = sum(lengths)
    for layer in range(layers):
        batching = _Batching()
        module = SimpleNamespace(layer_idx=layer, num_key_value_groups=heads // kv_heads, is_causal=True,
                                 _exact_batching=batching)  # fmt: skip
        batching.layout = _Layout(lengths, batch_axis=False, cache=packed)
        q = torch.randn(1, heads, rows, dim, device=DEV)
        k, v = _kv(kv_heads, rows, dim)
        packed.update(k, v, layer)
        out, _ = exact_attention(module, q, k, v, None)
        assert bool(torch.isfinite(out).all())
        start = 0
        for i, n in enumerate(lengths):
            keys, values = mine_all[i].update(k[:, :, start : start + n], v[:, :, start : start + n], layer)
            stored = layer_kv(caches[i], layer)
            assert torch.equal(stored[0], keys) and torch.equal(stored[1], values)
            want = F.scaled_dot_product_attention(q[:, :, start : start + n], keys, values, is_causal=n > 1,
                                                  enable_gqa=heads != kv_heads).transpose(1, 2)  # fmt: skip
            torch.testing.assert_close(out[:, start : start + n], want, rtol=1e-5, atol=1e-6)
            start += n
        held = layer_kv(ranges[poisoned], layer)
        assert bool(torch.isfinite(held[0]).all()) and float(held[0][..., 0, :].abs().sum()) == 0.0
    assert [c.get_seq_length() for c in caches] == [history[i] + 1 for i in step] + [3]


def test_which_steps_pool_ranges() -> None:
    pool, other = TokenPool(1), TokenPool(1)
    a, b, c = pool.acquire(8), pool.acquire(8), other.acquire(8)
    for r in (a, b, c):
        r.update(*_kv(1, 2, 4), 0)
    assert PooledRanges.of([a], [1]) is None  # alone: a lone request's shapes
    assert PooledRanges.of([a, c], [1, 1]) is None  # two pools, one row each
    assert PooledRanges.of([a, b], [1, 2]) is None  # one of them a chunk
    assert PooledRanges.of([a, b, c], [1, 1, 1]).members == {0, 1}  # type: ignore[union-attr]


def _think(pipe: Any, group: list[int], texts: list[str], max_tokens: int = 12) -> dict[int, list[int]]:
    """Greedy thinker steps for requests `group` together (prefill, then decode): their token ids."""
    th = pipe.thinker
    states = {i: th.new_state(SamplingParams(max_tokens=max_tokens)) for i in group}
    for i in group:
        th.set_prompt(states[i], pipe.prompt_ids(texts[i]))
    pos = dict.fromkeys(group, 0)
    out: dict[int, list[int]] = {i: [] for i in group}
    while live := [i for i in group if not states[i].finished]:
        items = [(states[i], pos[i], 1 if pos[i] >= len(states[i].prompt_ids) else len(states[i].prompt_ids))
                 for i in live]  # fmt: skip
        for i, (_, _, n), result in zip(live, items, th.step(items), strict=True):
            pos[i] += n
            if result.token is not None:
                out[i].append(result.token.token_id)
    for state in states.values():
        th.release(state)
    return out


@pytest.fixture(scope="module")
def fast_thinkers(tiny_dir: Path, tiny_variant_dir: Path, q25_dir: Path) -> dict[str, Any]:
    from omnistage.config import parse_config

    cfg = parse_config({"thinker": {"batching": "fast"}})
    return {name: staged_pipeline(d, cfg) for name, d in
            (("published", tiny_dir), ("variant", tiny_variant_dir), ("qwen2_5_omni", q25_dir))}  # fmt: skip


TEXTS = ["hi", "Tell me about the sea.", "Name three colours.", "Count to five.", "Why is the sky blue?",
         "Write a haiku.", "What is 2+2?", "Say hello.", "Describe a cat.", "List some fruit."]  # fmt: skip


@pytest.mark.parametrize("name", ["published", "variant", "qwen2_5_omni"])
def test_the_fast_thinker_attends_its_decode_rows_through_the_token_pool(
    name: str, fast_thinkers: dict[str, Any], checkpoints: Any, q25_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fast mode's thinker keeps its requests' caches in one token pool within its budget and
    attends a step's decode rows in groups; ten requests together get the tokens each gets alone,
    and a lone request gets exact mode's tokens (generate()'s); every range is given back."""
    fast = fast_thinkers[name]
    exact = staged_pipeline(q25_dir) if name == "qwen2_5_omni" else checkpoints(name)[0]
    fast.thinker.set_kv_budget(1000)
    pooled: list[int] = []
    sizes: list[int] = []
    real = PooledRanges.attend

    def spy(self: PooledRanges, *args: Any, **kwargs: Any) -> torch.Tensor:
        pooled.append(len(self.members))
        sizes.append(fast.thinker.batching.pooled_tokens())  # what the stage's metrics report
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PooledRanges, "attend", spy)
    group = list(range(len(TEXTS)))
    together = _think(fast, group, TEXTS)
    assert pooled and max(pooled) == len(TEXTS) and 0 < max(sizes) <= 1000
    pooled.clear()
    alone = {i: _think(fast, [i], TEXTS)[i] for i in group}
    assert not pooled  # one request: its own range's shapes
    reference = {i: _think(exact, [i], TEXTS)[i] for i in group}
    assert together == alone == reference
    assert all(len(t) > 1 for t in together.values())
    pool = fast.thinker.batching.token_pool
    assert pool is not None and not pool.ranges and pool.k[0] is None  # every range given back: idle
    assert fast.thinker.batching.pooled_tokens() == 0


def test_a_fast_thinker_steps_ops_hardly_grow_with_its_batch(fast_thinkers: dict[str, Any]) -> None:
    """The decode step attends its requests' rows together and makes their embeddings and
    positions at once: the ops it dispatches (about one kernel launch each on a GPU) grow by a
    few per request (2.5 on this checkpoint), not by the 31 that one attention and cache write
    per request per layer, and its own embedding and position, cost."""
    pipe = fast_thinkers["published"]
    th = pipe.thinker
    ids = pipe.prompt_ids("Tell me about the sea.")

    def decode_step_ops(batch: int) -> int:
        states = [th.new_state(SamplingParams(max_tokens=8, stop_ids=(-1,))) for _ in range(batch)]
        for state in states:
            th.set_prompt(state, ids)
        th.step([(s, 0, len(ids)) for s in states])
        th.step([(s, len(ids), 1) for s in states])
        with DispatchCount() as count:
            th.step([(s, len(ids) + 1, 1) for s in states])
        for state in states:
            th.release(state)
        return count.ops

    per_request = ops_per_further_request(decode_step_ops)  # batches 2 and 16
    assert per_request <= 6, per_request
