"""Fast mode's KV pool (models/kv_caches.py `KVPool`): every request's keys and values of one model
in one buffer per layer, a decode step's one-row requests written with one indexed store and
attended with one masked SDPA over the pool instead of one per request."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from omnistage.models.batching import PackedCache, exact_attention
from omnistage.models.kv_caches import KVPool, PooledRows, PoolSlot, SlotCache
from omnistage.models.sampling import SamplingParams
from tests.conftest import TEST_DEVICE, DispatchCount, ops_per_further_request, staged_pipeline

DEV = TEST_DEVICE  # the pool's tests run on CUDA too (benchmarks/gpu/run.sh tests)


def test_a_pool_slot_holds_what_dynamic_cache_holds_as_the_pool_grows() -> None:
    """Each request's slot holds exactly what its own DynamicCache would, while the pool grows in
    capacity and in slots (copying what the others hold) and slots are released and reused."""
    torch.manual_seed(0)
    pool = KVPool(num_layers=2, slots=1, capacity=2)
    slots = [pool.acquire() for _ in range(2)]
    dyns = [DynamicCache(), DynamicCache()]
    assert [s.index for s in slots] == [0, 1]

    def feed(i: int, n: int) -> None:
        for layer in range(2):
            k, v = torch.randn(1, 2, n, 8, device=DEV), torch.randn(1, 2, n, 8, device=DEV)
            got, want = slots[i].update(k, v, layer), dyns[i].update(k, v, layer)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    for i, n in ((0, 3), (1, 1), (0, 1), (1, 5), (0, 1)):
        feed(i, n)
    assert pool.k[0] is not None and pool.k[0].shape[:3] == (2, 2, 8)  # 1 -> 2 slots, 2 -> 4 -> 8 positions
    slots.append(pool.acquire())  # a third request: the pool doubles its slots, keeping the others'
    dyns.append(DynamicCache())
    feed(2, 2)
    assert pool.k[0].shape[0] == 4 and pool.tokens == 4 * 8  # what the stage's metrics report
    for i in range(3):
        for layer in range(2):
            keys, _ = dyns[i].update(torch.empty(1, 2, 0, 8, device=DEV), torch.empty(1, 2, 0, 8, device=DEV), layer)
            held = slots[i].get_seq_length(layer)
            assert torch.equal(pool.k[layer][slots[i].index, :, :held], keys[0])
    slots[0].release()
    slots[0].release()  # twice: harmless, the slot is not handed out twice
    again = pool.acquire()
    assert again.index == 0 and again.get_seq_length() == 0 and pool.acquire().index == 3
    for slot in (*slots, again):
        slot.release()
    assert pool.in_use == {3} and pool.k[0] is not None
    pool.release(PoolSlot(pool, 3))
    assert pool.k == [None, None] and pool.tokens == 0 and pool.acquire().index == 0  # idle: the buffers went


class _Batching:
    fast = True

    def __init__(self) -> None:
        self.layout: Any = None


def _attention_module(layer: int, heads: int, kv_heads: int) -> Any:
    batching = _Batching()
    module = SimpleNamespace(layer_idx=layer, num_key_value_groups=heads // kv_heads, is_causal=True,
                             _exact_batching=batching)  # fmt: skip
    return module, batching


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (2, 2)])
def test_pooled_attention_is_each_requests_own_attention(heads: int, kv_heads: int) -> None:
    """A step of one prefill chunk and three decode rows on pool slots: the decode rows go through
    one masked SDPA over the pool, and every request's output is what SDPA over its own cache
    gives (to the last bits: the kernel differs), its keys where its own cache has them."""
    from omnistage.models.batching import _Layout

    torch.manual_seed(1)
    dim, layers = 8, 2
    pool = KVPool(num_layers=layers)
    own: list[SlotCache] = []
    slots: list[PoolSlot] = []
    for n in (5, 9, 2, 4):  # the history each request has before the step
        slot, mine = pool.acquire(), SlotCache(layers)
        for layer in range(layers):
            k, v = torch.randn(1, kv_heads, n, dim, device=DEV), torch.randn(1, kv_heads, n, dim, device=DEV)
            slot.update(k, v, layer)
            mine.update(k, v, layer)
        slots.append(slot)
        own.append(mine)
    slots[1].release()  # a hole: slot 1 is not in the step, the pool's rows past it are
    del own[1]
    newcomer = pool.acquire()  # reuses slot 1, with a prefill chunk of 3 rows
    assert newcomer.index == 1
    caches: list[Any] = [slots[0], newcomer, slots[2], slots[3]]
    lengths = [1, 3, 1, 1]
    own.insert(1, SlotCache(layers))
    packed = PackedCache(caches, lengths)
    assert packed.pooled is not None and packed.pooled.members == {0, 2, 3}
    rows = sum(lengths)
    for layer in range(layers):
        module, batching = _attention_module(layer, heads, kv_heads)
        batching.layout = _Layout(lengths, batch_axis=False, cache=packed)
        q = torch.randn(1, heads, rows, dim, device=DEV)
        k, v = torch.randn(1, kv_heads, rows, dim, device=DEV), torch.randn(1, kv_heads, rows, dim, device=DEV)
        packed.update(k, v, layer)
        out, _ = exact_attention(module, q, k, v, None)
        start = 0
        for i, n in enumerate(lengths):
            keys, values = own[i].update(k[:, :, start : start + n], v[:, :, start : start + n], layer)
            assert torch.equal(pool.k[layer][caches[i].index, :, : keys.shape[2]], keys[0])
            qi = q[:, :, start : start + n]
            assert n == 1 or keys.shape[2] == n  # the chunk is its request's first: causal over itself
            want = F.scaled_dot_product_attention(qi, keys, values, is_causal=n > 1,
                                                  enable_gqa=heads != kv_heads).transpose(1, 2)  # fmt: skip
            torch.testing.assert_close(out[:, start : start + n], want, rtol=1e-5, atol=1e-6)
            start += n
    assert [c.get_seq_length() for c in caches] == [6, 3, 3, 5]


def test_a_lone_decode_row_or_one_of_another_cache_is_not_pooled() -> None:
    pool, other = KVPool(1), KVPool(1)
    a, b, c = pool.acquire(), pool.acquire(), other.acquire()
    for s in (a, b, c):
        s.update(torch.ones(1, 1, 2, 4, device=DEV), torch.ones(1, 1, 2, 4, device=DEV), 0)
    assert PooledRows.of([a], [1]) is None  # alone: a lone request's shapes
    assert PooledRows.of([a, c], [1, 1]) is None  # two pools, one row each
    assert PooledRows.of([a, b], [1, 2]) is None  # one of them a chunk
    assert PooledRows.of([a, b, c], [1, 1, 1]).members == {0, 1}  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with a deeper talker (4 layers; `omnistage make-tiny --set`)."""
    from omnistage.models.qwen3_omni.tiny import write_tiny_checkpoint

    out = tmp_path_factory.mktemp("tiny-deep-talker")
    write_tiny_checkpoint(out, settings={"talker_config.text_config.num_hidden_layers": 4})
    return out


@pytest.fixture(scope="module")
def fast_talkers(tiny_dir: Path, tiny_variant_dir: Path, deep_dir: Path) -> dict[str, Any]:
    from omnistage.config import parse_config

    cfg = parse_config({"talker": {"batching": "fast"}})
    dirs = {"published": tiny_dir, "variant": tiny_variant_dir, "deep": deep_dir}
    return {name: staged_pipeline(d, cfg) for name, d in dirs.items()}


def _talk(pipe: Any, group: list[int], inputs: list[Any]) -> dict[int, list[Any]]:
    """Greedy talker steps for requests `group` together: per step, each one's frame and
    last-layer hidden state."""
    talker, spec = pipe.talker, pipe.spec
    states = {i: talker.new_state(SamplingParams(max_tokens=8), spec.default_speaker) for i in group}
    for i in group:
        ids, embeds, tokens = inputs[i]
        states[i].set_prompt(ids.to(talker.device), embeds.to(talker.device), None, spec)
        for k, t in enumerate(tokens):
            states[i].add_token(t.to(talker.device), k == len(tokens) - 1)
    trace: dict[int, list[Any]] = {i: [] for i in group}
    for _ in range(10):
        live = [i for i in group if states[i].can_step(True)]
        if not live:
            break
        for i, frame in zip(live, talker.step([(states[i], True) for i in live]), strict=True):
            past = states[i].past_hidden
            trace[i].append((None if frame is None else frame.tolist(), None if past is None else past.clone()))
    for state in states.values():
        talker.release(state)
    return trace


@pytest.mark.parametrize("name", ["published", "variant", "deep"])
def test_the_fast_talker_attends_its_decode_rows_through_the_pool(
    name: str, fast_talkers: dict[str, Any], checkpoints: Any, deep_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fast mode's talker keeps its requests' caches in one pool and attends a step's decode rows
    together; a lone request computes what exact mode computes, bitwise, and requests together
    what each computes alone, to the last bits (frames equal on these checkpoints)."""
    fast = fast_talkers[name]
    exact = staged_pipeline(deep_dir) if name == "deep" else checkpoints(name)[0]
    assert len(exact.talker.model.model.layers) == (4 if name == "deep" else 2)
    spec = fast.spec
    prompts = [fast.prompt_ids(p) for p in ("hi", "Tell me about the sea.", "Name three colours.")]
    torch.manual_seed(3)
    inputs = [(torch.tensor(p), torch.randn(len(p), spec.thinker_hidden),
               [torch.randn(spec.thinker_hidden) for _ in range(5)]) for p in prompts]  # fmt: skip
    pooled_steps = []
    real = PooledRows.attend

    def spy(self: PooledRows, *args: Any, **kwargs: Any) -> torch.Tensor:
        pooled_steps.append(len(self.members))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PooledRows, "attend", spy)
    together = _talk(fast, [0, 1, 2], inputs)
    # every request that is still speaking after its prompt (on the tiny one, "hi" may stop at once)
    speaking = sum(len(together[i]) > 2 for i in range(3))
    assert speaking >= 2 and pooled_steps and max(pooled_steps) == speaking
    pooled_steps.clear()
    for i in range(3):
        alone = _talk(fast, [i], inputs)[i]
        reference = _talk(exact, [i], inputs)[i]
        assert not pooled_steps  # one request: its own cache's shapes
        assert [f for f, _ in alone] == [f for f, _ in reference] == [f for f, _ in together[i]]
        for (_, a), (_, r), (_, t) in zip(alone, reference, together[i], strict=True):
            assert (a is None) == (r is None) == (t is None)
            if a is not None:
                if DEV == "cpu":  # the same kernels; on CUDA exact mode's lone-row products may differ
                    assert torch.equal(a, r)
                else:
                    torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(t, a, rtol=1e-4, atol=1e-5)
    pool = fast.talker.batching.kv_pool
    assert pool is not None and not pool.in_use and fast.talker.batching.pooled_tokens() == 0  # every slot back


def test_qwen2_5_omnis_fast_talker_pools_its_decode_rows_too(q25_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other family's talker (one codebook) on the same pool: its stage alone, on the
    thinker's recorded outputs, gives each request the frames it gives alone, with the decode
    rows of the requests together attended as one."""
    from benchmarks.stages import make_start, run_stage
    from omnistage.config import parse_config
    from services import edges
    pipe = staged_pipeline(q25_dir, parse_config({"talker": {"batching": "fast"}}))
    prompts = [pipe.prompt_ids(p) for p in ("Tell me about the sea.", "Name three colours.", "Count to five.")]
    thinker = pipe.thinker_defaults().with_overrides(max_tokens=6)
    talker = SamplingParams(max_tokens=12)
    starts = [make_start(thinker, talker) for _ in prompts]
    recorded = run_stage(pipe, "thinker", [(s, [edges.prompt_chunk(p)]) for s, p in zip(starts, prompts, strict=True)])
    mode = edges.edge_mode("async_chunk")

    def talk(group: list[int]) -> list[list[int]]:
        inputs = [(edges.downstream_start(make_start(thinker, talker), mode), recorded[i].down) for i in group]
        return [[int(c) for t in r.tensors(edges.CODES) for c in t.view(-1).tolist()]
                for r in run_stage(pipe, "talker", inputs)]  # fmt: skip

    members: list[int] = []
    real = PooledRows.attend

    def spy(self: PooledRows, *args: Any, **kwargs: Any) -> torch.Tensor:
        members.append(len(self.members))
        return real(self, *args, **kwargs)

    alone = [talk([i])[0] for i in range(3)]
    monkeypatch.setattr(PooledRows, "attend", spy)
    together = talk([0, 1, 2])
    assert sum(len(f) > 1 for f in alone) >= 2 and members and max(members) >= 2
    assert together == alone
    assert not pipe.talker.batching.kv_pool.in_use


def test_a_fast_talker_steps_ops_hardly_grow_with_its_batch(fast_talkers: dict[str, Any]) -> None:
    """The decode step runs its requests' rows together (the pool's attention, one projection of
    the trailing text, one GEMM per linear): the ops it dispatches (about one kernel launch each on
    a GPU) grow by a few per request, not by dozens as one attention and one projection per
    request did (38 per request on this checkpoint)."""
    pipe = fast_talkers["published"]
    talker, spec = pipe.talker, pipe.spec
    ids = torch.tensor(pipe.prompt_ids("Tell me about the sea."), device=talker.device)

    def decode_step_ops(batch: int) -> int:
        torch.manual_seed(3)
        states = [talker.new_state(SamplingParams(max_tokens=6, stop_ids=(-1,)), spec.default_speaker)
                  for _ in range(batch)]  # fmt: skip
        for state in states:
            state.set_prompt(ids, torch.randn(len(ids), spec.thinker_hidden, device=talker.device), None, spec)
            for k in range(6):
                state.add_token(torch.randn(spec.thinker_hidden, device=talker.device), k == 5)
        talker.step([(s, True) for s in states])  # the prompts
        talker.step([(s, True) for s in states])
        with DispatchCount() as count:
            frames = talker.step([(s, True) for s in states])
        assert all(f is not None for f in frames)
        for state in states:
            talker.release(state)
        return count.ops

    per_request = ops_per_further_request(decode_step_ops)  # batches 2 and 16: both on the pool
    assert per_request <= 10, per_request
