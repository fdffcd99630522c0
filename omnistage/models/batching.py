"""Packed batching: one forward for many requests, in one of two modes.

* `exact` (below): each request's numbers bitwise as if alone; the parity tests run in it.
* `fast`: each linear layer is one GEMM over every request's rows (the thinker's lm_head only
  over the row each request's token is chosen from), MoE routers and experts run
  over all rows at once (transformers' `grouped_mm`), and the code predictor's attention is one
  SDPA over its batch axis. Results are close to a lone request's, not bitwise (a GEMM's rows
  depend on how many rows it has). A request's KV cache is pooled (`new_cache`;
  models/kv_caches.py): a slot of the model's `KVPool` (the talkers'), or a range of its
  `TokenPool` (the thinker's, whose caches the scheduler bounds): a decode step's one-row
  requests are written with one indexed store per layer and attended with one SDPA over the
  pool (`PooledRows`), or one per group of ranges (`PooledRanges`), each row masked to its own
  positions; a prefill chunk, or a decode row alone, attends over its own slot or range as exact
  mode does (the variable-length case). Its linears stay plain `nn.Linear`,
  and transformers' standard RMSNorm runs as one `F.rms_norm` call (on CPU the same ops, so a
  lone request's numbers are exact mode's; measured: the talker alone 6-11 % more requests/s).

Exact mode:

The thinker and the talker run every scheduled request in a single forward: the requests'
rows (a prefill chunk, or one decode token) are packed along the sequence axis of a batch of
one, each request keeps its own cache (`SlotCache`, below), and the code predictor, where all
requests have the same shape, uses the batch axis. Plain batching would change the results in
the last bits, and greedy tokens with them: on CPU a GEMM's rows depend on how many rows it
has (measured: no row of `F.linear` over M > 1 rows equals the same row computed alone), and
so does SDPA over a batch.

`PackedBatching(model, mode="exact")` is an explicit mode of one loaded model. It

* replaces every `nn.Linear` with an `ExactLinear` holding the same parameters: during a packed
  step a request of one row is computed with a batched matrix-vector product, whose rows equal
  `F.linear` of that row alone for any batch size (a start-up self-test probes this for every
  weight shape and logs the result; shapes that fail it are computed row by row), and a request
  of several rows with its own `F.linear` over exactly its rows;
* wraps the modules that call `F.linear` themselves (MoE routers), and those whose elementwise
  math is not row-independent (the talker's MoE block: a sigmoid over an [N, 1] tensor), so
  that each request's rows go through them alone;
* routes attention and the MoE experts (through transformers' attention and experts
  interfaces) to implementations that run SDPA per request over its own cache, and the
  `grouped_mm` experts per request, adding expert outputs in `generate()`'s order.

Everything else in the model works row by row (norms, RoPE, activations, top-k routing), which
does not depend on the number of rows while a row's width is a multiple of the CPU's vector
width (true of every width these models have; a narrower one is what the MoE block above has).
Outside `step(...)` the model computes exactly as loaded (SDPA attention, `grouped_mm` experts).
`tests/test_batching.py` checks the kernel facts this rests on and that a request's outputs are
bitwise the same alone and in any batch.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from omnistage.models.kv_caches import KVPool, PooledRanges, PooledRows, PoolRange, PoolSlot, SlotCache, TokenPool

__all__ = [
    "MODES",
    "ExactLinear",
    "PackedBatching",
    "PackedCache",
    "fuse_rms_norms",
    "grouped_linear",
]

MODES = ("exact", "fast")

log = logging.getLogger(__name__)

IMPLEMENTATION = "omnistage_exact"


@dataclass
class _Layout:
    lengths: list[int]  # rows per request, in row order
    batch_axis: bool  # requests along the batch axis (equal lengths) instead of the sequence axis
    cache: PackedCache | None = None
    rows: int = field(init=False)

    def __post_init__(self) -> None:
        self.rows = sum(self.lengths)


def _runs(lengths: Sequence[int]) -> Iterator[tuple[int, int, bool]]:
    """(start, end, single-row run) over the rows: maximal runs of one-row requests, and each
    several-row request on its own."""
    start = 0
    i = 0
    while i < len(lengths):
        if lengths[i] == 1:
            j = i
            while j < len(lengths) and lengths[j] == 1:
                j += 1
            yield start, start + (j - i), True
            start += j - i
            i = j
        else:
            yield start, start + lengths[i], False
            start += lengths[i]
            i += 1


def _random_at(
    shape: tuple[int, ...], misalign: int, dtype: torch.dtype, device: str, gen: torch.Generator
) -> torch.Tensor:
    """A random tensor whose address is `misalign` bytes past a 64-byte boundary: kernels also
    choose their path by alignment (the same weights at another address give other last bits),
    and checkpoint weights are often not 64-byte aligned."""
    numel = 1
    for d in shape:
        numel *= d
    item = torch.empty(0, dtype=dtype).element_size()
    flat = torch.randn(numel + 128 // item, generator=gen).to(device, dtype)
    skip = ((misalign - flat.data_ptr()) % 64) // item
    return flat[skip : skip + numel].view(shape)


@functools.lru_cache(maxsize=1024)
def _bmm_is_lone_row(k: int, n: int, dtype: torch.dtype, device: str, misalign: int, with_bias: bool) -> bool:
    """Does a batched matrix-vector product give each row exactly what `F.linear` gives that row
    alone, for any number of rows? True for most shapes; for very small outputs (a router, a
    gate) the lone-row GEMM takes another path, and rows are then computed one by one."""
    gen = torch.Generator().manual_seed(0)
    w = _random_at((n, k), misalign, dtype, device, gen)
    b = _random_at((n,), misalign, dtype, device, gen) if with_bias else None
    x = torch.randn(33, k, generator=gen).to(device, dtype)
    alone = torch.cat([F.linear(r, w, b) for r in x.split(1)])
    return all(torch.equal(_bmm_rows(x[:r], w, b), alone[:r]) for r in (1, 2, 3, 33))


def _lone_row_bmm_ok(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    n, k = weight.shape
    return _bmm_is_lone_row(k, n, weight.dtype, str(weight.device), weight.data_ptr() % 64, bias is not None)


def _bmm_rows(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[R, K] -> [R, N] as R matrix-vector products in one call."""
    w = weight.t().unsqueeze(0).expand(rows.shape[0], *weight.t().shape)
    if bias is None:
        return torch.bmm(rows.unsqueeze(1), w).squeeze(1)
    return torch.baddbmm(bias.view(1, 1, -1).expand(rows.shape[0], 1, -1), rows.unsqueeze(1), w).squeeze(1)


def _lone_rows(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Each row of [R, K] exactly as `F.linear` computes it alone."""
    if _lone_row_bmm_ok(weight, bias):
        return _bmm_rows(rows, weight, bias)
    return torch.cat([F.linear(r, weight, bias) for r in rows.split(1)])


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lengths: Sequence[int]
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` over rows `x[R, K]` grouped into requests of `lengths` rows,
    each group computed as if it were alone."""
    pieces = []
    for start, end, single in _runs(lengths):
        rows = x[start:end]
        if single:
            pieces.append(_lone_rows(rows, weight, bias))
        else:
            pieces.append(F.linear(rows, weight, bias))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class ExactLinear(nn.Linear):
    """`nn.Linear` whose rows, inside a packed step of its model, are each request's lone result."""

    batching: PackedBatching

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layout = self.batching.layout
        if layout is None or len(layout.lengths) == 1 or x.ndim < 2 or self.batching.fast:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] != layout.rows:
            raise RuntimeError(
                f"packed forward: a linear layer got {rows.shape[0]} rows, expected {layout.rows}; "
                "its rows cannot be assigned to requests"
            )
        out = grouped_linear(rows, self.weight, self.bias, layout.lengths)
        return out.view(*x.shape[:-1], out.shape[-1])


class _PerRequestRows(nn.Module):
    """Runs a module on each request's rows alone, as `generate()` runs it: a MoE router, which
    calls `F.linear` itself, or a whole MoE block whose elementwise math is not row-independent
    (the talker's `sigmoid(shared_expert_gate(x))` over an [N, 1] tensor: on CPU, an element's
    result depends on whether it lands in the vectorized part of the loop, hence on the number of
    rows and the row's position; measured on an AVX-512 machine). A 2-d input is rows, a 3-d one
    is packed `[1, rows, H]`; outputs (a tensor or a tuple of them) have the input's row layout.
    Inside, the step looks like one request's."""

    def __init__(self, inner: nn.Module, batching: PackedBatching) -> None:
        super().__init__()
        self.inner = inner
        self.batching = batching

    def forward(self, hidden_states: torch.Tensor) -> Any:
        layout = self.batching.layout
        if layout is None or len(layout.lengths) == 1 or self.batching.fast:
            return self.inner(hidden_states)
        axis = hidden_states.dim() - 2  # the rows' axis: [rows, H] or packed [1, rows, H]
        parts = []
        for piece, rows in zip(hidden_states.split(layout.lengths, dim=axis), layout.lengths, strict=True):
            with self.batching.alone(rows):
                parts.append(self.inner(piece))
        if isinstance(parts[0], tuple):
            return tuple(torch.cat(items, dim=axis) for items in zip(*parts, strict=True))
        return torch.cat(parts, dim=axis)


class PackedCache:
    """The `past_key_values` of a packed forward: hands each request's slice of the new keys
    and values to that request's own cache and keeps the full ones for attention.

    One-row requests whose caches are slots of one `KVPool` or ranges of one `TokenPool` (fast
    mode's decode steps) are written together and attended together (`PooledRows`,
    `PooledRanges`); the rest request by request."""

    is_compileable = False

    def __init__(self, caches: Sequence[Any], lengths: Sequence[int]) -> None:
        """`caches`: each request's (`SlotCache`, `DynamicCache`, `PoolSlot` or `PoolRange`)."""
        if len(caches) != len(lengths):
            raise ValueError("one cache per request")
        self.caches = list(caches)
        self.lengths = list(lengths)
        for cache, n in zip(self.caches, self.lengths, strict=True):
            if isinstance(cache, PoolRange):  # room first: no range moves while the layers write
                cache.reserve(cache.filled[0] + n)
        self.pooled: PooledRows | PooledRanges | None = PooledRows.of(self.caches, self.lengths) or PooledRanges.of(
            self.caches, self.lengths
        )
        self.full: dict[int, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, cache_kwargs: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        full: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        start = 0
        members = self.pooled.members if self.pooled is not None else frozenset()
        for i, (cache, n) in enumerate(zip(self.caches, self.lengths, strict=True)):
            if i in members:
                full.append(None)  # written below with the pool's other rows
            else:
                k = key_states[:, :, start : start + n]
                v = value_states[:, :, start : start + n]
                full.append(cache.update(k, v, layer_idx))
            start += n
        if self.pooled is not None:
            self.pooled.write(key_states, value_states, layer_idx)
        self.full[layer_idx] = full
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly


def _causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Bool mask [1, 1, q, kv] for a chunk whose first row sits at kv_len - q_len."""
    q = torch.arange(kv_len - q_len, kv_len, device=device).view(-1, 1)
    return (torch.arange(kv_len, device=device).view(1, -1) <= q).view(1, 1, q_len, kv_len)


def _layout_of(module: nn.Module) -> _Layout | None:
    batching: PackedBatching | None = getattr(module, "_exact_batching", None)
    return None if batching is None else batching.layout


def _fast(module: nn.Module) -> bool:
    batching: PackedBatching | None = getattr(module, "_exact_batching", None)
    return batching is not None and batching.fast


def exact_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA per request, with the shapes (and `is_causal`) a lone request has."""
    layout = _layout_of(module)
    if layout is None:
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return out, None
    outs = []
    if layout.batch_axis and _fast(module):  # one SDPA over the whole batch
        out, _ = sdpa_attention_forward(module, query, key, value, None, **kwargs)
        return out, None
    if layout.batch_axis:  # equal-length requests on the batch axis, each with its batch row of the cache
        for b in range(query.shape[0]):
            sl = slice(b, b + 1)
            out, _ = sdpa_attention_forward(module, query[sl], key[sl], value[sl], None, **kwargs)
            outs.append(out)
        return torch.cat(outs), None
    cache = layout.cache
    if cache is None:
        raise RuntimeError("packed forward over the sequence axis needs a PackedCache")
    layer_idx = module.layer_idx  # type: ignore[attr-defined]
    pooled = cache.pooled.attend(module, query, layer_idx, **kwargs) if cache.pooled is not None else None
    if pooled is not None and len(cache.pooled.members) == len(layout.lengths):  # type: ignore[union-attr]
        return pooled.transpose(0, 1), None  # a decode step of pooled requests only, in step order: [1, B, heads, dim]
    start = 0
    for n, full in zip(layout.lengths, cache.full[layer_idx], strict=True):
        if full is None:  # a pooled row, placed below
            outs.append(query.new_empty((1, 1, query.shape[1], query.shape[3])))
            start += n
            continue
        k, v = full
        q = query[:, :, start : start + n]
        past = k.shape[-2] - n
        mask = _causal_mask(n, k.shape[-2], q.device) if n > 1 and past > 0 else None
        out, _ = sdpa_attention_forward(module, q, k, v, mask, **kwargs)
        outs.append(out)
        start += n
    packed = torch.cat(outs, dim=1)
    if pooled is not None:
        assert cache.pooled is not None
        packed[0, cache.pooled.rows] = pooled[:, 0]
    return packed, None


def exact_experts(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' `grouped_mm` experts, per request: a request of several rows runs it on its
    own rows; requests of one row run together, each (row, expert) pair as a matrix-vector
    product, which is what `grouped_mm` computes for a lone row (expert groups of one row)."""
    layout = _layout_of(self)
    if layout is None or len(layout.lengths) == 1 or _fast(self):
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    out = torch.empty_like(hidden_states)
    singles: list[int] = []
    start = 0
    for n in layout.lengths:
        if n == 1:
            singles.append(start)
        else:
            sl = slice(start, start + n)
            out[sl] = grouped_mm_experts_forward(self, hidden_states[sl], top_k_index[sl], top_k_weights[sl])
        start += n
    if singles:
        idx = torch.tensor(singles, device=hidden_states.device)
        out[idx] = _one_row_experts(self, hidden_states[idx], top_k_index[idx], top_k_weights[idx])
    return out


def _one_row_experts(
    self: nn.Module, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """`grouped_mm_experts_forward` for R requests of one row each, in its float order: a lone
    row's expert groups hold one row each, so each (row, expert) pair is a lone-row product."""
    num_rows, top_k = top_k_index.shape
    experts = top_k_index.reshape(-1)
    pairs = x.repeat_interleave(top_k, dim=0)  # (row, slot) order
    proj = _per_expert(pairs, experts, self.gate_up_proj)  # type: ignore[arg-type]
    proj = self._apply_gate(proj)  # type: ignore[operator]
    proj = _per_expert(proj, experts, self.down_proj)  # type: ignore[arg-type]
    weighted = proj * top_k_weights.reshape(-1).unsqueeze(-1)
    return weighted.view(num_rows, top_k, -1).sum(dim=1)


def _per_expert(rows: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    out = rows.new_empty(rows.shape[0], weights.shape[1])
    for e in torch.unique(experts).tolist():
        sel = (experts == e).nonzero().flatten()
        out[sel] = _lone_rows(rows[sel], weights[e], None)
    return out


def _register_kernels() -> None:
    """Make the two implementations known to transformers' interfaces (idempotent)."""
    AttentionInterface.register(IMPLEMENTATION, exact_attention)
    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, exact_experts)


@functools.lru_cache(maxsize=64)
def _body(cls: type) -> str | None:
    """`cls.forward`'s source after its signature, each line stripped (None: no source)."""
    try:
        return "\n".join(line.strip() for line in inspect.getsource(cls.forward).splitlines()[1:])  # type: ignore[attr-defined]
    except (OSError, TypeError):
        return None


def _standard_rms_norm(cls: type) -> bool:
    """Is `cls.forward` transformers' standard RMSNorm, line for line (LlamaRMSNorm's, which
    the Qwen Omni families' norms copy)? Any other norm (an offset weight, another upcast) is
    left as it is."""
    body = _body(cls)
    return body is not None and body == _body(LlamaRMSNorm)


class _FusedRMSNorm(nn.Module):
    """The standard RMSNorm in one `F.rms_norm` call: the same math in float32, without the
    per-op dispatch of five tensor ops (at decode widths that overhead is the norm's cost)."""

    weight: nn.Parameter
    variance_epsilon: float

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = (hidden_states.shape[-1],)
        if hidden_states.dtype == torch.float32:
            return F.rms_norm(hidden_states, shape, self.weight, self.variance_epsilon)
        normed = F.rms_norm(hidden_states.float(), shape, None, self.variance_epsilon)
        return self.weight * normed.to(hidden_states.dtype)


@functools.lru_cache(maxsize=64)
def _fused_class(cls: type) -> type:
    return type(f"Fused{cls.__name__}", (_FusedRMSNorm, cls), {})


def fuse_rms_norms(model: nn.Module) -> int:
    """Give every standard RMSNorm of `model` the fused forward (fast mode); returns how many."""
    count = 0
    for module in model.modules():
        cls = type(module)
        if not isinstance(module, _FusedRMSNorm) and _standard_rms_norm(cls):
            module.__class__ = _fused_class(cls)
            count += 1
    return count


class PackedBatching:
    """Packed batching of one loaded model, exact or fast (see the module docstring).

    `row_modules`: module types that call `F.linear` on their own weights (MoE routers) or whose
    math is not row-independent (a MoE block with a shared-expert gate); exact mode runs them
    per request. Use `with batching.step(lengths, cache):` around a packed forward.
    """

    def __init__(self, model: nn.Module, row_modules: tuple[type[nn.Module], ...] = (), mode: str = "exact") -> None:
        if mode not in MODES:
            raise ValueError(f"batching mode {mode!r}; expected one of {', '.join(MODES)}")
        self.model = model
        self.mode = mode
        self.fast = mode == "fast"
        self.layout: _Layout | None = None
        self.kv_pool: KVPool | None = None  # fast mode's request caches (`new_cache`), made on first use
        self.token_pool: TokenPool | None = None
        self.kv_budget: int | None = None  # the token pool's bound: the scheduler's cache_capacity_tokens
        _register_kernels()
        self._check_defaults(model)
        # Fast mode computes every row together: nothing to wrap, and its norms are fused.
        self.linears = [] if self.fast else self._own_linears(model, row_modules)
        self.fused_norms = fuse_rms_norms(model) if self.fast else 0
        model.set_attn_implementation(IMPLEMENTATION)  # type: ignore[operator]
        if hasattr(model, "set_experts_implementation"):
            model.set_experts_implementation(IMPLEMENTATION)
        for module in model.modules():
            module._exact_batching = self  # type: ignore[assignment]
        if self.fast:
            log.info("fast batching (%s): one GEMM per linear layer over all requests' rows, %d RMSNorms fused",
                     type(model).__name__, self.fused_norms)  # fmt: skip
        else:
            self.self_test()

    @staticmethod
    def _check_defaults(model: nn.Module) -> None:
        """Packed steps reproduce SDPA attention and `grouped_mm` experts; refuse anything else."""
        config = model.config  # type: ignore[attr-defined]
        subs = [config, *(getattr(config, k) for k in config.sub_configs if getattr(config, k, None) is not None)]
        for sub in subs:
            if sub._attn_implementation not in ("sdpa", IMPLEMENTATION):
                raise ValueError(f"exact batching reproduces SDPA attention, not {sub._attn_implementation!r}")
            moe = getattr(sub, "num_experts", None)  # a dense model's experts setting names nothing it runs
            if moe and getattr(sub, "_experts_implementation", None) not in (None, "grouped_mm", IMPLEMENTATION):
                raise ValueError(f"exact batching reproduces grouped_mm experts, not {sub._experts_implementation!r}")

    def _own_linears(self, model: nn.Module, row_modules: tuple[type[nn.Module], ...]) -> list[ExactLinear]:
        owned: list[ExactLinear] = []
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    exact = ExactLinear.__new__(ExactLinear)
                    exact.__dict__.update(child.__dict__)  # the same parameters, hooks and flags
                    exact.batching = self
                    setattr(parent, name, exact)
                    owned.append(exact)
                elif row_modules and isinstance(child, row_modules):
                    setattr(parent, name, _PerRequestRows(child, self))
        return owned

    def self_test(self) -> dict[str, int]:
        """Probe each linear weight: does a batched matrix-vector product give a lone row's
        result? Logged once at start-up; failing shapes are computed row by row."""
        seen: dict[tuple[Any, ...], bool] = {}
        for lin in self.linears:
            key = (tuple(lin.weight.shape), lin.weight.dtype, lin.weight.device, lin.weight.data_ptr() % 64,
                   lin.bias is not None)  # fmt: skip
            if key not in seen:
                seen[key] = _lone_row_bmm_ok(lin.weight, lin.bias)
        result = {"linears": len(self.linears), "shapes": len(seen), "row_by_row": sum(not ok for ok in seen.values())}
        log.info(
            "exact batching self-test (%s): %d linear layers, %d weight shapes, %d computed row by row",
            type(self.model).__name__, result["linears"], result["shapes"], result["row_by_row"],
        )  # fmt: skip
        return result

    def new_cache(self, config: Any, limit: int | None = None) -> SlotCache | DynamicCache | PoolSlot | PoolRange:
        """A new request's KV cache for the decoder of `config`. In fast mode, pooled (a decode
        step writes and attends its row with the other requests'): with a `limit` (the positions
        the scheduler reserved for it: the thinker's) a range of this model's `TokenPool`, whose
        memory stays within `kv_budget`; without one (the talkers', of unknown length) a slot of
        its `KVPool`. Otherwise its own `SlotCache` of at most `limit` positions (transformers'
        `DynamicCache` where the decoder has sliding-window layers). `free_cache` gives a pooled
        one back."""
        if not self.fast or not SlotCache.fits(config):
            return SlotCache.for_model(config, limit)
        layers = int(config.num_hidden_layers)
        if limit is not None:
            if self.token_pool is None:
                self.token_pool = TokenPool(layers, budget=self.kv_budget)
            return self.token_pool.acquire(limit)
        if self.kv_pool is None:
            self.kv_pool = KVPool(layers)
        return self.kv_pool.acquire()

    def pooled_tokens(self) -> int:
        """Positions per layer this model's pools hold now (0 when idle or not pooling)."""
        return sum(pool.tokens for pool in (self.kv_pool, self.token_pool) if pool is not None)

    @staticmethod
    def free_cache(cache: Any) -> None:
        if isinstance(cache, PoolSlot | PoolRange):
            cache.release()

    @contextmanager
    def step(
        self, lengths: Sequence[int], cache: PackedCache | None = None, *, batch_axis: bool = False
    ) -> Iterator[None]:
        """Run the forwards inside as one packed step over requests of `lengths` rows each."""
        if self.layout is not None:
            raise RuntimeError("packed steps do not nest")
        self.layout = _Layout(list(lengths), batch_axis, cache)
        try:
            yield
        finally:
            self.layout = None

    @contextmanager
    def alone(self, rows: int) -> Iterator[None]:
        """Inside a packed step: one request's rows, as if the step held only it (no cache: what
        runs inside is a row-wise part of a layer, not attention)."""
        outer = self.layout
        self.layout = _Layout([rows], batch_axis=False)
        try:
            yield
        finally:
            self.layout = outer
