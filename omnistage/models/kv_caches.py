"""Where packed steps keep requests' keys and values (models/batching.py runs the steps).

* `SlotCache`: one request's (or one equal-shaped batch's) cache in preallocated buffers that a
  step writes in place; exact mode's, and the code predictor's.
* `KVPool` / `PoolSlot`: fast mode's talkers: every request a row of one `[slots, heads,
  capacity, dim]` buffer per layer, so a decode step's rows are written and attended together
  (`PooledRows`).
* `TokenPool` / `PoolRange`: fast mode's thinker: every request a range of one token axis per
  layer, growing by doubling but never past its reservation, so the memory stays within the
  scheduler's budget (`PooledRanges`).
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

__all__ = ["KVPool", "PoolRange", "PoolSlot", "PooledRanges", "PooledRows", "SlotCache", "TokenPool", "layer_kv"]


def layer_kv(cache: Any, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-request cache's filled keys and values of one layer `[1, kv_heads, filled, dim]`
    (views): a `PoolRange`'s, or a `SlotCache`'s or `DynamicCache`'s layer."""
    if isinstance(cache, PoolRange):
        return cache.kv(layer_idx)
    layer = cache.layers[layer_idx]
    return layer.keys, layer.values


class _Slots:
    """One layer's keys and values `[B, heads, capacity, dim]` and how many positions are filled."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.filled = 0
        self.batch = 0

    @property
    def keys(self) -> torch.Tensor:
        assert self.k is not None
        return self.k[: self.batch, :, : self.filled]

    @property
    def values(self) -> torch.Tensor:
        assert self.v is not None
        return self.v[: self.batch, :, : self.filled]


class SlotCache:
    """A model's `past_key_values` held in preallocated slots: each layer's keys and values live
    in one `[B, heads, capacity, dim]` buffer, a step writes its rows in place after the filled
    ones, and attention reads a view of the filled positions. Nothing is concatenated per step
    (transformers' `DynamicCache` concatenates the whole cache every step); when a buffer is full
    its capacity doubles, the one copy, amortized. `reset()` empties it for reuse, keeping the
    buffers (the code predictor reuses one for every frame).

    Attention over a view of a buffer gives the same numbers as over the concatenated tensor
    (SDPA's result does not depend on the keys' strides; the parity tests run on it)."""

    is_compileable = False

    def __init__(self, num_layers: int, capacity: int = 64, limit: int | None = None) -> None:
        """`limit`: the most positions the cache will hold (a request's reservation): no buffer
        is made larger, so the memory a cache takes stays within what the scheduler reserved
        for it (doubling alone overshoots it by up to 2x)."""
        self.layers = [_Slots() for _ in range(num_layers)]
        self.capacity = capacity if limit is None else max(1, min(capacity, limit))
        self.limit = limit

    @staticmethod
    def fits(config: Any) -> bool:
        """Every layer attends to all of its past (no sliding-window layers, which DynamicCache trims)."""
        kinds = getattr(config, "layer_types", None) or ["full_attention"]
        return all(kind == "full_attention" for kind in kinds)

    @classmethod
    def for_model(cls, config: Any, limit: int | None = None) -> SlotCache | DynamicCache:
        """A SlotCache for a decoder of `config` (holding at most `limit` positions), or
        transformers' DynamicCache where it has sliding-window layers."""
        if cls.fits(config):
            return cls(int(config.num_hidden_layers), limit=limit)
        return DynamicCache(config=config)

    def reset(self) -> None:
        for slots in self.layers:
            slots.filled = 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, cache_kwargs: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.layers[layer_idx]
        b, heads, n, dim = key_states.shape
        end = slots.filled + n
        if slots.filled == 0:
            slots.batch = b
        elif b != slots.batch:
            raise RuntimeError(f"slot cache: a step of batch {b} on a cache filled with batch {slots.batch}")
        k = slots.k
        if k is None or k.shape[0] < b or k.shape[2] < end or k.shape[1] != heads or k.shape[3] != dim \
                or k.dtype != key_states.dtype or k.device != key_states.device:  # fmt: skip
            self._grow(slots, key_states, end)
        assert slots.k is not None and slots.v is not None
        slots.k[:b, :, slots.filled : end] = key_states
        slots.v[:b, :, slots.filled : end] = value_states
        slots.filled = end
        return slots.keys, slots.values

    def _grow(self, slots: _Slots, like: torch.Tensor, end: int) -> None:
        """New buffers holding at least `end` positions (doubling), with the filled ones copied."""
        _, heads, _, dim = like.shape
        old = slots.k
        capacity = max(self.capacity, old.shape[2] if old is not None else 0)
        while capacity < end:
            capacity *= 2
        if self.limit is not None and end <= self.limit:
            capacity = min(capacity, self.limit)
        batch = max(slots.batch, old.shape[0] if old is not None else 0)
        shape = (batch, heads, capacity, dim)
        k, v = like.new_empty(shape), like.new_empty(shape)
        if slots.filled:  # the same request(s) growing: keep what is there
            k[: slots.batch, :, : slots.filled] = slots.keys
            v[: slots.batch, :, : slots.filled] = slots.values
        slots.k, slots.v = k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].filled


class KVPool:
    """Every request's keys and values of one model in one buffer per layer,
    `[slots, kv_heads, capacity, dim]`: a request holds a slot (`acquire()`, a `PoolSlot`, its
    `past_key_values`), its positions fill that slot's row in place. Buffers start zeroed and
    grow by doubling, in slots or in capacity (copying what they hold, the one copy, amortized);
    a released slot is reused by the next request, and when the last one is released the buffers
    go (what a burst of long requests grew is not held while the stage is idle).

    What it is for: a decode step's one-row requests are written with one indexed store per layer
    and attended with one SDPA over the pool's rows up to the highest slot in use and positions up
    to the longest of them, each row masked to its own length (`PooledRows`), instead of one
    write and one SDPA per request. Nothing is gathered or concatenated: the keys SDPA reads are a
    view of the pool. Its cost: the pool holds as many positions per slot as its longest request
    (and the padding is attended, masked); fast mode only (exact mode's per-request SDPA is what
    `generate()` computes)."""

    def __init__(self, num_layers: int, slots: int = 4, capacity: int = 64) -> None:
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.num_layers = num_layers
        self.min_slots = max(1, slots)
        self.min_capacity = max(1, capacity)
        self.free: list[int] = []  # released slots, reused lowest first
        self.next_slot = 0  # slots ever handed out
        self.in_use: set[int] = set()

    @property
    def tokens(self) -> int:
        """Positions per layer its buffers hold (slots x capacity; 0 when idle)."""
        k = self.k[0]
        return 0 if k is None else k.shape[0] * k.shape[2]

    def acquire(self) -> PoolSlot:
        if self.free:
            index = heapq.heappop(self.free)
        else:
            index = self.next_slot
            self.next_slot += 1
        self.in_use.add(index)
        return PoolSlot(self, index)

    def release(self, slot: PoolSlot) -> None:
        if slot.index not in self.in_use:
            return
        self.in_use.discard(slot.index)
        heapq.heappush(self.free, slot.index)
        if not self.in_use:  # idle: let the buffers go (the next requests grow new ones, amortized)
            self.k = [None] * self.num_layers
            self.v = [None] * self.num_layers
            self.free.clear()
            self.next_slot = 0

    def buffers(self, layer_idx: int, slot: int, end: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s keys and values with room for `slot` and `end` positions (grown if
        need be) for new rows `like` `[., kv_heads, n, dim]`."""
        k = self.k[layer_idx]
        _, heads, _, dim = like.shape
        if k is None or k.shape[0] <= slot or k.shape[2] < end or k.shape[1] != heads or k.shape[3] != dim \
                or k.dtype != like.dtype or k.device != like.device:  # fmt: skip
            self._grow(layer_idx, slot, end, like)
        k, v = self.k[layer_idx], self.v[layer_idx]
        assert k is not None and v is not None
        return k, v

    def _grow(self, layer_idx: int, slot: int, end: int, like: torch.Tensor) -> None:
        old_k, old_v = self.k[layer_idx], self.v[layer_idx]
        _, heads, _, dim = like.shape
        same = old_k is not None and old_k.shape[1] == heads and old_k.shape[3] == dim and old_k.dtype == like.dtype \
            and old_k.device == like.device  # fmt: skip
        slots, capacity = self.min_slots, self.min_capacity
        if same:
            assert old_k is not None
            slots, capacity = max(slots, old_k.shape[0]), max(capacity, old_k.shape[2])
        while slots <= slot:
            slots *= 2
        while capacity < end:
            capacity *= 2
        k = like.new_zeros((slots, heads, capacity, dim))
        v = like.new_zeros((slots, heads, capacity, dim))
        if same:
            assert old_k is not None and old_v is not None
            k[: old_k.shape[0], :, : old_k.shape[2]] = old_k
            v[: old_v.shape[0], :, : old_v.shape[2]] = old_v
        self.k[layer_idx], self.v[layer_idx] = k, v


class PoolSlot:
    """One request's `past_key_values` in a `KVPool`: its row of every layer's buffer and how
    many positions of it are filled. Alone (a prefill chunk, exact mode's shape of a step) it is
    a cache like `SlotCache`: a step writes its rows after the filled ones and attention reads a
    view. `release()` gives the slot back (once; the pool reuses it)."""

    is_compileable = False

    def __init__(self, pool: KVPool, index: int) -> None:
        self.pool = pool
        self.index = index
        self.filled = [0] * pool.num_layers
        # per layer: the pool's buffer and this slot's `[1, heads, capacity, dim]` rows of it (views
        # made once per buffer: a lone request's step slices no more than a SlotCache's)
        self._rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None] * pool.num_layers

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, cache_kwargs: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if key_states.shape[0] != 1:
            raise RuntimeError(f"a pool slot holds one request, got a batch of {key_states.shape[0]}")
        start = self.filled[layer_idx]
        end = start + key_states.shape[2]
        k, v = self.pool.buffers(layer_idx, self.index, end, key_states)
        rows = self._rows[layer_idx]
        if rows is None or rows[0] is not k:
            row = slice(self.index, self.index + 1)
            rows = self._rows[layer_idx] = (k, k[row], v[row])
        _, k_row, v_row = rows
        k_row[:, :, start:end] = key_states
        v_row[:, :, start:end] = value_states
        self.filled[layer_idx] = end
        return k_row[:, :, :end], v_row[:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.filled[layer_idx]

    def release(self) -> None:
        self.pool.release(self)


def _pool_members(caches: Sequence[Any], lengths: Sequence[int], kind: type) -> list[int]:
    """The step's requests attended together: the one-row requests whose caches are `kind` on
    the pool most of them share (every layer filled alike), if two or more; else none."""
    groups: dict[int, list[int]] = {}
    for i, (cache, n) in enumerate(zip(caches, lengths, strict=True)):
        if n == 1 and isinstance(cache, kind) and len(set(cache.filled)) == 1:
            groups.setdefault(id(cache.pool), []).append(i)
    members = max(groups.values(), key=len, default=[])
    return members if len(members) >= 2 else []


@dataclass
class PooledRows:
    """The one-row requests of a packed step whose caches are slots of one `KVPool`: their new
    keys and values go in with one indexed store per layer, and their attention is one SDPA over
    the pool's rows `[:top]` and positions `[:longest]`, each row masked to its own filled
    positions (rows of slots not in the step attend to their first position only: finite
    numbers, dropped)."""

    pool: KVPool
    members: frozenset[int]  # indices into the step's requests
    rows: torch.Tensor  # [B] their rows in the packed sequence
    slots: torch.Tensor  # [B] their slots
    positions: torch.Tensor  # [B] where each one's new row goes
    caches: list[PoolSlot]
    top: int  # slots [0, top) are attended
    longest: int  # positions [0, longest) are attended
    _mask: torch.Tensor | None = None

    @classmethod
    def of(cls, caches: Sequence[Any], lengths: Sequence[int]) -> PooledRows | None:
        """The pooled rows of a step, if two or more one-row requests share a pool (one alone
        attends as a `PoolSlot` does, with a lone request's shapes)."""
        members = _pool_members(caches, lengths, PoolSlot)
        if not members:
            return None
        pooled: list[PoolSlot] = [caches[i] for i in members]
        starts = list(itertools.accumulate(lengths, initial=0))
        positions = [c.filled[0] for c in pooled]
        device = pooled[0].pool.k[0].device  # type: ignore[union-attr]  # every member has filled layer 0
        as_tensor = functools.partial(torch.tensor, dtype=torch.long, device=device)
        return cls(
            pool=pooled[0].pool, members=frozenset(members), rows=as_tensor([starts[i] for i in members]),
            slots=as_tensor([c.index for c in pooled]), positions=as_tensor(positions), caches=pooled,
            top=max(c.index for c in pooled) + 1, longest=max(positions) + 1,
        )  # fmt: skip

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> None:
        """The members' new rows of `[1, kv_heads, R, dim]` into their slots."""
        k, v = self.pool.buffers(layer_idx, self.top - 1, self.longest, key_states)
        k[self.slots, :, self.positions] = key_states[0].index_select(1, self.rows).transpose(0, 1)
        v[self.slots, :, self.positions] = value_states[0].index_select(1, self.rows).transpose(0, 1)
        for cache in self.caches:
            cache.filled[layer_idx] += 1

    def mask(self, device: torch.device) -> torch.Tensor:
        """`[top, 1, 1, longest]` bool: each member's row its filled positions, the other rows
        their first position (the same for every layer: made once)."""
        if self._mask is None:
            lengths = torch.ones(self.top, dtype=torch.long, device=device)
            lengths[self.slots] = self.positions + 1
            self._mask = (torch.arange(self.longest, device=device).view(1, -1) < lengths.view(-1, 1)).view(
                self.top, 1, 1, self.longest
            )
        return self._mask

    def attend(self, module: nn.Module, query: torch.Tensor, layer_idx: int, **kwargs: Any) -> torch.Tensor:
        """The members' attention outputs `[B, 1, heads, dim]` for packed queries `[1, heads, R, dim]`."""
        k, v = self.pool.k[layer_idx], self.pool.v[layer_idx]
        assert k is not None and v is not None
        q = query.new_zeros((self.top, query.shape[1], 1, query.shape[3]))
        q[self.slots, :, 0] = query[0].index_select(1, self.rows).transpose(0, 1)
        keys, values = k[: self.top, :, : self.longest], v[: self.top, :, : self.longest]
        out, _ = sdpa_attention_forward(module, q, keys, values, self.mask(query.device), **kwargs)
        return out.index_select(0, self.slots)


def _finite(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x` with NaN and infinities as 0 (finite values unchanged, bitwise), into `out` if given:
    what a `TokenPool` stores, because another request's attention spans it, masked, and a
    masked NaN key or value still makes SDPA's output NaN (measured on CPU)."""
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0, out=out)


class TokenPool:
    """Every request's keys and values of one model on one token axis per layer,
    `[1, kv_heads, size, dim]`: a request holds a range of it (`acquire(limit)`, a `PoolRange`,
    its `past_key_values`), placed first fit, never larger than its `limit` (its reservation).

    What it is for: the thinker's KV is bounded by the scheduler (`cache_capacity_tokens`, the sum
    of the requests' reservations). Ranges within their reservations keep the memory within that
    sum (`budget`: the buffers grow no further while the ranges fit in it, and they always do, by
    the scheduler's count), where `KVPool`'s rectangle holds every slot at its longest request's
    length. A decode step's one-row requests are written with one indexed store per layer and
    attended in groups of up to `GROUP`, each one SDPA over the span of the group's ranges with
    each query masked to its own filled positions (`PooledRanges`). A group's queries score
    every position of its span, masked: so a range starts at `min_range` positions (or its
    limit) and, when a step needs more, takes twice what it needs (up to its limit), in place
    when the run after it is free, else moved (copying what it holds; amortized). A span then
    holds at most about twice its members' filled positions, whatever their `max_tokens`
    (measured: reserving every range whole made a 48-layer decode step of 16 requests 69 ms at
    max_tokens 4000 instead of 26 at 20). A stored key or value is made finite first (`_finite`).

    When no free run fits a range, the ranges are packed from offset 0 into new buffers (grown by
    doubling, up to `budget` where the need allows): copying what they hold, amortized. When the
    last range is released the buffers go."""

    GROUP = 8  # decode rows per SDPA: bounds the masked work, which grows with group size x span

    def __init__(self, num_layers: int, budget: int | None = None, min_tokens: int = 256, min_range: int = 64) -> None:
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.num_layers = num_layers
        self.budget = budget
        self.min_tokens = max(1, min_tokens)
        self.min_range = max(1, min_range)
        self.size = 0  # tokens each buffer holds (a layer's is made at its first write)
        self.ranges: list[PoolRange] = []  # the live ones, by offset
        self.repacks = 0  # packings that copied what the buffers held

    @property
    def tokens(self) -> int:
        """Positions per layer its buffers hold (or will, at their first write; 0 when idle)."""
        return self.size

    def acquire(self, limit: int | None = None) -> PoolRange:
        """A range for a cache of at most `limit` positions (None: unknown; it grows as needed)."""
        rng = PoolRange(self, min(limit, self.min_range) if limit else self.min_range, limit)
        offset = self._free_run(rng.capacity)
        if offset is None:
            self._repack(extra=rng.capacity)
            offset = self._end()
        rng.offset = offset
        self._insert(rng)
        return rng

    def release(self, rng: PoolRange) -> None:
        if rng not in self.ranges:
            return
        self.ranges.remove(rng)
        if not self.ranges:  # idle: let the buffers go
            self.k = [None] * self.num_layers
            self.v = [None] * self.num_layers
            self.size = 0

    def buffers(self, layer_idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s keys and values (made at the pool's size on first use) for rows
        `like` `[1, kv_heads, n, dim]`."""
        k = self.k[layer_idx]
        if k is None:
            shape = (1, like.shape[1], self.size, like.shape[3])
            self.k[layer_idx], self.v[layer_idx] = like.new_zeros(shape), like.new_zeros(shape)
        elif k.shape[1] != like.shape[1] or k.shape[3] != like.shape[3] or k.dtype != like.dtype \
                or k.device != like.device:  # fmt: skip
            raise RuntimeError(f"token pool of {list(k.shape)} {k.dtype} on {k.device}: rows of "
                               f"{list(like.shape)} {like.dtype} on {like.device}")  # fmt: skip
        k, v = self.k[layer_idx], self.v[layer_idx]
        assert k is not None and v is not None
        return k, v

    def extend(self, rng: PoolRange, end: int) -> None:
        """Room for `end` positions in `rng` (twice that, up to its limit): in place if the run
        after it is free, else moved."""
        capacity = max(2 * end, self.min_range)
        if rng.limit is not None and end <= rng.limit:
            capacity = min(capacity, rng.limit)
        i = self.ranges.index(rng)
        following = self.ranges[i + 1].offset if i + 1 < len(self.ranges) else self.size
        if rng.offset + capacity <= following:
            rng.capacity = capacity
            return
        offset = self._free_run(capacity)
        if offset is None:
            rng.capacity = capacity
            self._repack(extra=0)
            return
        for k, v, filled in zip(self.k, self.v, rng.filled, strict=True):
            if k is not None and v is not None and filled:
                k[:, :, offset : offset + filled] = k[:, :, rng.offset : rng.offset + filled]
                v[:, :, offset : offset + filled] = v[:, :, rng.offset : rng.offset + filled]
        self.ranges.remove(rng)
        rng.offset, rng.capacity = offset, capacity
        self._insert(rng)

    def _insert(self, rng: PoolRange) -> None:
        at = next((i for i, r in enumerate(self.ranges) if r.offset > rng.offset), len(self.ranges))
        self.ranges.insert(at, rng)

    def _end(self) -> int:
        return self.ranges[-1].offset + self.ranges[-1].capacity if self.ranges else 0

    def _free_run(self, n: int) -> int | None:
        """The lowest offset with `n` free positions after it (first fit), or None."""
        at = 0
        for r in self.ranges:
            if r.offset - at >= n:
                return at
            at = r.offset + r.capacity
        return at if self.size - at >= n else None

    def _repack(self, extra: int) -> None:
        """The ranges packed from offset 0 in new buffers with `extra` free positions after them:
        the same size if that leaves half of it free (fragmentation), else doubled (to the
        budget, unless the ranges need more)."""
        need = sum(r.capacity for r in self.ranges) + extra
        size = self.size
        if need > size or (need > size // 2 and (self.budget is None or size < self.budget)):
            size = max(self.min_tokens, 2 * size, need)
            if self.budget is not None:
                size = max(min(size, self.budget), need)
        offsets = list(itertools.accumulate((r.capacity for r in self.ranges), initial=0))
        self.repacks += any(k is not None for k in self.k)  # (counted where it copies)
        for layer_idx, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            if k is None or v is None:
                continue
            shape = (1, k.shape[1], size, k.shape[3])
            new_k, new_v = k.new_zeros(shape), v.new_zeros(shape)
            for r, offset in zip(self.ranges, offsets, strict=False):
                n = r.filled[layer_idx]
                new_k[:, :, offset : offset + n] = k[:, :, r.offset : r.offset + n]
                new_v[:, :, offset : offset + n] = v[:, :, r.offset : r.offset + n]
            self.k[layer_idx], self.v[layer_idx] = new_k, new_v
        for r, offset in zip(self.ranges, offsets, strict=False):
            r.offset = offset
        self.size = size


class PoolRange:
    """One request's `past_key_values` in a `TokenPool`: positions [offset, offset + capacity)
    of every layer's buffer, and how many of them are filled. Alone (a prefill chunk, a decode
    row alone) it is a cache like `SlotCache`: a step writes its rows after the filled ones and
    attention reads a view. `release()` gives the range back (once)."""

    is_compileable = False

    def __init__(self, pool: TokenPool, capacity: int, limit: int | None) -> None:
        self.pool = pool
        self.offset = 0
        self.capacity = capacity
        self.limit = limit
        self.filled = [0] * pool.num_layers

    def reserve(self, end: int) -> None:
        """Room for `end` positions (a step calls it for its rows before any layer writes)."""
        if end > self.capacity:
            self.pool.extend(self, end)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, cache_kwargs: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if key_states.shape[0] != 1:
            raise RuntimeError(f"a pool range holds one request, got a batch of {key_states.shape[0]}")
        start = self.filled[layer_idx]
        end = start + key_states.shape[2]
        self.reserve(end)
        k, v = self.pool.buffers(layer_idx, key_states)
        at = self.offset
        _finite(key_states, out=k[:, :, at + start : at + end])
        _finite(value_states, out=v[:, :, at + start : at + end])
        self.filled[layer_idx] = end
        return k[:, :, at : at + end], v[:, :, at : at + end]

    def kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s filled keys and values `[1, kv_heads, filled, dim]` (views)."""
        k, v = self.pool.k[layer_idx], self.pool.v[layer_idx]
        assert k is not None and v is not None
        end = self.offset + self.filled[layer_idx]
        return k[:, :, self.offset : end], v[:, :, self.offset : end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.filled[layer_idx]

    def release(self) -> None:
        self.pool.release(self)


@dataclass
class PooledRanges:
    """The one-row requests of a packed step whose caches are ranges of one `TokenPool`: their
    new keys and values go in with one indexed store per layer; their attention is one SDPA per
    group of up to `TokenPool.GROUP` of them (by offset) over the group's span of the buffer, each
    query masked to its own filled positions. Grouped-query heads are packed into the query rows
    (no repeated keys)."""

    pool: TokenPool
    members: frozenset[int]  # indices into the step's requests
    rows: torch.Tensor  # [B] their rows in the packed sequence, in step order
    positions: torch.Tensor  # [B] where each one's new row goes in the buffers
    all_rows: bool  # the members are every row of the step, in order
    order: torch.Tensor | None  # [B] the members by offset (None: step order is offset order)
    inverse: torch.Tensor | None  # back to step order
    groups: list[tuple[int, int, int, int]]  # (first, end) members by offset, (lo, hi) their span
    starts: torch.Tensor  # [B] by offset: each member's range start
    ends: torch.Tensor  # [B] by offset: each member's filled end after the step
    caches: list[PoolRange]
    _masks: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def of(cls, caches: Sequence[Any], lengths: Sequence[int]) -> PooledRanges | None:
        """The pooled rows of a step, if two or more one-row requests share a pool."""
        members = _pool_members(caches, lengths, PoolRange)
        if not members:
            return None
        pooled: list[PoolRange] = [caches[i] for i in members]
        pool = pooled[0].pool
        starts = list(itertools.accumulate(lengths, initial=0))
        by_offset = sorted(range(len(pooled)), key=lambda j: pooled[j].offset)
        sorted_ = by_offset == list(range(len(pooled)))
        spans = []
        for first in range(0, len(by_offset), TokenPool.GROUP):
            chunk = [pooled[j] for j in by_offset[first : first + TokenPool.GROUP]]
            spans.append((first, first + len(chunk), chunk[0].offset, max(c.offset + c.filled[0] + 1 for c in chunk)))
        device = pool.k[0].device  # type: ignore[union-attr]  # every member has filled layer 0
        as_tensor = functools.partial(torch.tensor, dtype=torch.long, device=device)
        inverse = sorted(range(len(pooled)), key=lambda j: by_offset[j])
        return cls(
            pool=pool, members=frozenset(members), rows=as_tensor([starts[i] for i in members]),
            positions=as_tensor([c.offset + c.filled[0] for c in pooled]),
            all_rows=len(members) == len(lengths), order=None if sorted_ else as_tensor(by_offset),
            inverse=None if sorted_ else as_tensor(inverse), groups=spans,
            starts=as_tensor([pooled[j].offset for j in by_offset]),
            ends=as_tensor([pooled[j].offset + pooled[j].filled[0] + 1 for j in by_offset]), caches=pooled,
        )  # fmt: skip

    def _new_rows(self, states: torch.Tensor) -> torch.Tensor:
        """The members' rows `[heads, B, dim]` of packed `[1, heads, R, dim]`, in step order."""
        return states[0] if self.all_rows else states[0].index_select(1, self.rows)

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> None:
        k, v = self.pool.buffers(layer_idx, key_states)
        k[0, :, self.positions] = _finite(self._new_rows(key_states))
        v[0, :, self.positions] = _finite(self._new_rows(value_states))
        for cache in self.caches:
            cache.filled[layer_idx] += 1

    def _group_masks(self, repeat: int) -> list[torch.Tensor]:
        """Per group `[1, 1, repeat * g, span]` bool: each query row its member's filled positions
        (a query head's rows are its key head's `repeat` query heads, member after member)."""
        if repeat not in self._masks:
            masks = []
            for first, end, lo, hi in self.groups:
                at = torch.arange(lo, hi, device=self.starts.device).view(1, -1)
                mask = (at >= self.starts[first:end].view(-1, 1)) & (at < self.ends[first:end].view(-1, 1))
                masks.append(mask.repeat(repeat, 1).view(1, 1, repeat * (end - first), hi - lo))
            self._masks[repeat] = masks
        return self._masks[repeat]

    def attend(self, module: nn.Module, query: torch.Tensor, layer_idx: int, **kwargs: Any) -> torch.Tensor:
        """The members' attention outputs `[B, 1, heads, dim]`, in step order, for packed queries
        `[1, heads, R, dim]`."""
        k, v = self.pool.k[layer_idx], self.pool.v[layer_idx]
        assert k is not None and v is not None
        heads, dim = query.shape[1], query.shape[3]
        kv_heads = k.shape[1]
        repeat = heads // kv_heads
        q = self._new_rows(query)
        if self.order is not None:
            q = q.index_select(1, self.order)
        outs = []
        for (first, end, lo, hi), mask in zip(self.groups, self._group_masks(repeat), strict=True):
            g = end - first
            qg = q[:, first:end].reshape(1, kv_heads, repeat * g, dim)
            out = F.scaled_dot_product_attention(qg, k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=mask,
                                                 scale=kwargs.get("scaling"))  # fmt: skip
            outs.append(out.view(heads, g, dim))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if self.inverse is not None:
            out = out.index_select(1, self.inverse)
        return out.transpose(0, 1).unsqueeze(1)
