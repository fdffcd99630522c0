"""Exact incremental (streaming) code2wav decoding for Qwen3-Omni.

``Qwen3OmniMoeCode2Wav`` maps codec frames ``[B, Q, T]`` to audio ``[B, 1, S(T)]`` with
``S(T) = T * U - H`` (``U`` = product of all upsampling factors, 1920 for the real model; ``H`` =
the summed left trims of the transposed convolutions, 555 for the real model).  Every part of the
network is causal in frames:

* the pre-transformer is causal sliding-window attention with absolute RoPE positions;
* every ``Qwen3OmniMoeCausalConvNet`` has stride 1, so it is ``conv1d`` over ``[history, new]``
  where ``history`` is the last ``(kernel - 1) * dilation`` inputs (zeros at the start);
* every ``Qwen3OmniMoeCausalTransConvNet`` (kernel ``K``, stride ``s``) trims ``K - s`` samples at
  both ends, so after ``L`` inputs exactly the samples that no later input touches are emitted,
  and the ``K - s`` not-yet-final samples live on as partial sums (the overlap) until the next
  input arrives;
* SnakeBeta, LayerNorm, the MLPs and the final clamp are pointwise in time.

So a full decode of ``T`` frames is exactly a prefix of a full decode of ``T + 1`` frames, and a
stateful decoder that keeps the attention KV inside the window, each causal convolution's left
history and each transposed convolution's overlap can stream the full decode while computing
every frame once.  The ``H`` samples that still depend on the next frame are *held back* (as
partial sums inside the transposed convolutions); they become final when the next frame
arrives, and a full decode of the frames received so far does not contain them either, so
``finish`` emits nothing extra.

The decoder reuses the modules and parameters of a ``Qwen3OmniMoeCode2Wav`` (it calls the
transformer layers, embeddings, norms, activations and the ``nn.Conv1d`` / ``nn.ConvTranspose1d``
weights of the given model); it only re-expresses how they are chained so that state can be
threaded through.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCausalConvNet,
    Qwen3OmniMoeCausalTransConvNet,
    Qwen3OmniMoeCode2Wav,
    Qwen3OmniMoeCode2WavDecoderBlock,
    Qwen3OmniMoeCode2WavDecoderResidualUnit,
    Qwen3OmniMoeConvNeXtBlock,
    Qwen3OmniMoeSnakeBeta,
)

__all__ = [
    "Code2WavStreamState",
    "GroupBy",
    "IncrementalCode2Wav",
    "exact_decode_stream",
    "full_decode",
    "place_windowed_chunks",
    "tiny_code2wav_config",
    "windowed_decode_stream",
]

_SUPPORTED_ATTENTION = ("sdpa", "eager")

GroupBy = Literal["frames", "none", "shape"]


def tiny_code2wav_config(
    *,
    hidden_size: int = 32,
    num_hidden_layers: int = 2,
    sliding_window: int = 72,
    decoder_dim: int = 64,
    num_quantizers: int = 16,
    codebook_size: int = 64,
    upsample_rates: Sequence[int] = (8, 5, 4, 3),
    upsampling_ratios: Sequence[int] = (2, 2),
) -> Qwen3OmniMoeCode2WavConfig:
    """A small code2wav config with the real upsampling (1920 samples per frame by default)."""
    return Qwen3OmniMoeCode2WavConfig(
        hidden_size=hidden_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        sliding_window=sliding_window,
        codebook_size=codebook_size,
        num_quantizers=num_quantizers,
        decoder_dim=decoder_dim,
        upsample_rates=list(upsample_rates),
        upsampling_ratios=list(upsampling_ratios),
    )


# --------------------------------------------------------------------------------------------
# Reference decoders
# --------------------------------------------------------------------------------------------


def _as_batch(codes: Tensor) -> Tensor:
    if codes.dim() == 2:
        return codes.unsqueeze(0)
    if codes.dim() == 3 and codes.shape[0] == 1:
        return codes
    shape = tuple(codes.shape)
    raise ValueError(f"expected codes [num_quantizers, T] or [1, num_quantizers, T], got {shape}")


@torch.inference_mode()
def full_decode(model: Qwen3OmniMoeCode2Wav, codes: Tensor) -> Tensor:
    """One ``model.forward`` over all frames; returns the 1-D waveform ``[S(T)]``."""
    return model(_as_batch(codes))[0, 0]


@torch.inference_mode()
def windowed_decode_stream(
    model: Qwen3OmniMoeCode2Wav, codes: Tensor, chunk_frames: int, left_context_frames: int
) -> list[Tensor]:
    """The approximate windowed streaming other stacks use (and ``chunked_decode``).

    Each chunk of ``chunk_frames`` new frames is decoded from scratch together with up to
    ``left_context_frames`` earlier frames, and the context's ``context * U`` samples are
    dropped.  Returns the per-chunk 1-D waveforms; their concatenation is the streamed audio.
    Each chunk recomputes its context, misses everything before the context, and ends ``H``
    samples early (those samples are never produced), so the stream is not the full decode.
    """
    if chunk_frames <= 0 or left_context_frames < 0:
        raise ValueError("chunk_frames must be > 0 and left_context_frames >= 0")
    batch = _as_batch(codes)
    total_upsample = int(model.total_upsample)
    out: list[Tensor] = []
    for start in range(0, batch.shape[-1], chunk_frames):
        end = min(start + chunk_frames, batch.shape[-1])
        context = min(left_context_frames, start)
        wav = model(batch[..., start - context : end])[0, 0]
        out.append(wav[context * total_upsample :])
    return out


def place_windowed_chunks(chunks: Sequence[Tensor], chunk_frames: int, total_upsample: int) -> list[tuple[int, Tensor]]:
    """Where each windowed chunk belongs in the full decode: ``(start_sample, chunk)`` pairs.

    Chunk ``i`` approximates full-decode samples ``[i * chunk_frames * U, ... + len(chunk))``;
    use this to measure the context-truncation error separately from the missing samples.
    """
    return [(i * chunk_frames * total_upsample, c) for i, c in enumerate(chunks)]


# --------------------------------------------------------------------------------------------
# Incremental decoder
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Code2WavStreamState:
    """Per-request streaming state; create with ``IncrementalCode2Wav.new_state()``.

    Holds, in the model's dtype and device:
      * ``kv[layer] = (keys, values)``, each ``[num_kv_heads, n, head_dim]`` with keys after RoPE,
        at most ``sliding_window - 1`` frames (the only ones a later frame can attend to; a
        ``full_attention`` layer, which Qwen3-Omni's code2wav does not have, would keep all);
      * ``conv_history[i]``: ``[channels, (kernel - 1) * dilation]`` last inputs of the i-th
        stateful causal convolution (zeros at the start = the model's zero left padding);
      * ``trans_tail[j]``: ``[channels, kernel - stride]`` partial sums (without bias) of the
        j-th transposed convolution's not-yet-final outputs (the held-back samples);
      * ``trans_drop[j]``: how many of the j-th transposed convolution's leading outputs are
        still to be trimmed (its left pad; non-zero only until its first output).

    Size is fixed once the window is full (it does not grow with the stream).  ``close()`` (or
    ``IncrementalCode2Wav.finish/close``) drops every tensor; the decoder itself keeps no
    reference to any state.  A state must not be stepped from two threads at once, and if a
    step raises, the states in it are in an undefined position and should be closed.
    """

    frames_seen: int = 0
    samples_emitted: int = 0
    kv: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    conv_history: list[Tensor] = field(default_factory=list)
    trans_tail: list[Tensor] = field(default_factory=list)
    trans_drop: list[int] = field(default_factory=list)
    closed: bool = False

    def nbytes(self) -> int:
        """Bytes held by this state's tensors (0 once closed)."""
        tensors = [t for kv in self.kv for t in kv] + self.conv_history + self.trans_tail
        return sum(t.numel() * t.element_size() for t in tensors)

    def close(self) -> None:
        """Drop every cached tensor; the state cannot be stepped again."""
        self.kv = []
        self.conv_history = []
        self.trans_tail = []
        self.trans_drop = []
        self.closed = True


class _KVAppend:
    """Duck-typed ``Cache`` for one transformer layer call: prepends the padded past KV.

    ``Qwen3OmniMoeCode2WavAttention`` calls ``update(key, value, layer_idx)`` and attends over
    what it returns; we keep the new (post-RoPE) keys/values to update each request's cache.
    """

    def __init__(self, past_k: Tensor, past_v: Tensor) -> None:
        self.past_k = past_k
        self.past_v = past_v
        self.new_k: Tensor | None = None
        self.new_v: Tensor | None = None
        self.keys: Tensor | None = None  # [past | new] as attended
        self.values: Tensor | None = None

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: object, **kw: object):
        self.new_k = key_states
        self.new_v = value_states
        self.keys = torch.cat([self.past_k, key_states], dim=2)
        self.values = torch.cat([self.past_v, value_states], dim=2)
        return self.keys, self.values


def _windows(x: Tensor, starts: Sequence[int], length: int) -> tuple[Tensor, ...]:
    """`x[b, :, starts[b] : starts[b] + length]` for every b of `[B, C, T, ...]`, copied out in one
    op for the whole batch (one slice, or one gather where the starts differ) and handed back as
    views of that copy: what each request keeps for its next step. (A view keeps the batch's copy
    alive until every request of the step has stepped again or closed: one step's worth.)"""
    if len(set(starts)) == 1:
        return x[:, :, starts[0] : starts[0] + length].clone().unbind(0)
    at = torch.tensor(starts, device=x.device)[:, None] + torch.arange(length, device=x.device)
    index = at.view(x.shape[0], 1, length, *[1] * (x.dim() - 3)).expand(*x.shape[:2], length, *x.shape[3:])
    return torch.gather(x, 2, index).unbind(0)


class _Batch:
    """A padded batch in the conv part: ``x`` is ``[B, C, max(lens)]``, request b's valid part is
    ``x[b, :, :lens[b]]`` (the rest is padding whose values never reach a valid output)."""

    __slots__ = ("lens", "x")

    def __init__(self, x: Tensor, lens: list[int]) -> None:
        self.x = x
        self.lens = lens

    @property
    def uniform(self) -> bool:
        return all(n == self.x.shape[-1] for n in self.lens)


class IncrementalCode2Wav:
    """Stateful, batched, exact streaming decoder over a ``Qwen3OmniMoeCode2Wav``.

    ``step(states, codes)`` takes for each request its new frames ``[num_quantizers, n_i]``
    (``n_i`` may differ, may be 0) and returns each request's newly final samples (1-D).
    Request i's first step emits ``n_i * U - H`` samples, every later one ``n_i * U`` (for the
    real model ``U = 1920``, ``H = 555``), so after ``T`` frames exactly ``S(T) = T * U - H``
    samples have been emitted: the full decode of those ``T`` frames, bit-for-bit up to fp
    rounding.  The ``H`` held-back samples depend on the next frame; ``finish`` emits what is
    left (nothing, since a full decode of the same frames trims them too) and frees the state.

    Batching: one step runs several requests through one batched forward.  Requests are padded
    on the right (new frames) and on the left (cached attention KV) and masked, so no request
    can see another's data and each request's output is, mathematically, what it gets alone.
    ``group_by`` chooses which requests share one forward: ``"frames"`` (default) groups equal
    ``n_i`` so no conv compute is wasted on padding (in steady state, equal chunk sizes, that
    is one group); ``"none"`` pads everything into one forward; ``"shape"`` also splits by
    cached-KV length and trim phase so nothing at all is padded.  Numerically, CPU kernels
    (oneDNN convolutions) are not batch-invariant, so results agree with a solo run to fp32
    rounding (about 1e-6 here), not bit for bit; in float64 they agree to ~1e-12.
    """

    def __init__(self, model: Qwen3OmniMoeCode2Wav, *, group_by: GroupBy = "frames") -> None:
        if group_by not in ("frames", "none", "shape"):
            raise ValueError(f"group_by must be 'frames', 'none' or 'shape', got {group_by!r}")
        self.model = model
        self.config: Qwen3OmniMoeCode2WavConfig = model.config
        self.group_by: GroupBy = group_by
        pre = model.pre_transformer
        impl = getattr(pre.config, "_attn_implementation", None) or "eager"
        if impl not in _SUPPORTED_ATTENTION:
            raise NotImplementedError(
                f"incremental code2wav needs attn_implementation in {_SUPPORTED_ATTENTION}, got {impl!r}"
            )
        self.num_layers = int(self.config.num_hidden_layers)
        layer_types = list(self.config.layer_types)
        sw = self.config.sliding_window
        # Frames a query can see, counting itself (None: unbounded).
        self.windows: list[int | None] = [
            int(sw) if (t == "sliding_attention" and sw is not None) else None for t in layer_types
        ]
        attn0 = pre.layers[0].self_attn
        self.num_kv_heads = int(attn0.k_proj.out_features // attn0.head_dim)
        self.head_dim = int(attn0.head_dim)
        self.total_upsample = int(model.total_upsample)

        # Flat "program" for the conv part: validated against the module types we understand.
        self._conv_modules: list[Qwen3OmniMoeCausalConvNet] = []
        self._trans_modules: list[Qwen3OmniMoeCausalTransConvNet] = []
        self._program: list[tuple[str, nn.Module, int]] = []
        for blocks in model.upsample:
            trans, convnext = list(blocks)
            self._add_trans(trans)
            if not isinstance(convnext, Qwen3OmniMoeConvNeXtBlock):
                raise NotImplementedError(f"unexpected upsample block {type(convnext).__name__}")
            self._program.append(("convnext", convnext, self._register_conv(convnext.dwconv)))
        for block in model.decoder:
            self._add_decoder_module(block)
        self.holdback_samples = self.total_upsample - self.samples_for_frames(1)

    # ---- program construction -------------------------------------------------------------

    def _register_conv(self, conv: nn.Module) -> int:
        if not isinstance(conv, Qwen3OmniMoeCausalConvNet):
            raise NotImplementedError(f"expected Qwen3OmniMoeCausalConvNet, got {type(conv).__name__}")
        if conv.stride != 1 or conv.padding != conv.kernel_size - 1:
            raise NotImplementedError("only stride-1 causal convolutions can be streamed")
        self._conv_modules.append(conv)
        return len(self._conv_modules) - 1

    def _add_trans(self, trans: nn.Module) -> None:
        if not isinstance(trans, Qwen3OmniMoeCausalTransConvNet):
            raise NotImplementedError(f"expected Qwen3OmniMoeCausalTransConvNet, got {type(trans).__name__}")
        kernel = int(trans.conv.kernel_size[0])
        stride = int(trans.conv.stride[0])
        if trans.left_pad != kernel - stride or trans.right_pad != kernel - stride or kernel < stride:
            raise NotImplementedError("transposed conv must trim kernel - stride samples on both sides")
        if trans.conv.padding[0] != 0 or trans.conv.output_padding[0] != 0 or trans.conv.dilation[0] != 1:
            raise NotImplementedError("transposed conv with padding/dilation is not supported")
        self._trans_modules.append(trans)
        self._program.append(("trans", trans, len(self._trans_modules) - 1))

    def _add_decoder_module(self, block: nn.Module) -> None:
        if isinstance(block, Qwen3OmniMoeCausalConvNet):
            self._program.append(("conv", block, self._register_conv(block)))
        elif isinstance(block, Qwen3OmniMoeSnakeBeta):
            self._program.append(("pointwise", block, -1))
        elif isinstance(block, Qwen3OmniMoeCode2WavDecoderBlock):
            for sub in block.block:
                self._add_decoder_module(sub)
        elif isinstance(block, Qwen3OmniMoeCausalTransConvNet):
            self._add_trans(block)
        elif isinstance(block, Qwen3OmniMoeCode2WavDecoderResidualUnit):
            conv1 = self._register_conv(block.conv1)
            self._register_conv(block.conv2)  # index conv1 + 1 (kernel 1: no history)
            self._program.append(("resunit", block, conv1))
        else:
            raise NotImplementedError(f"cannot stream decoder module {type(block).__name__}")

    # ---- sizes ------------------------------------------------------------------------------

    def samples_for_frames(self, frames: int) -> int:
        """Length of a full decode of ``frames`` frames (= samples streamed after that many)."""
        length = frames
        for op, mod, _ in self._program:
            if op == "trans" and length > 0:
                assert isinstance(mod, Qwen3OmniMoeCausalTransConvNet)
                length = max(length * int(mod.conv.stride[0]) - int(mod.left_pad), 0)
        return length

    # ---- state ------------------------------------------------------------------------------

    def new_state(self) -> Code2WavStreamState:
        """Fresh per-request state (zero histories, empty KV)."""
        p = next(self.model.parameters())
        dev, dt = p.device, p.dtype
        empty = torch.zeros(self.num_kv_heads, 0, self.head_dim, device=dev, dtype=dt)
        state = Code2WavStreamState()
        state.kv = [(empty, empty) for _ in range(self.num_layers)]
        state.conv_history = [
            torch.zeros(c.conv.in_channels, c.padding, device=dev, dtype=dt) for c in self._conv_modules
        ]
        state.trans_tail = [
            torch.zeros(t.conv.out_channels, t.left_pad, device=dev, dtype=dt) for t in self._trans_modules
        ]
        state.trans_drop = [int(t.left_pad) for t in self._trans_modules]
        return state

    def close(self, states: Sequence[Code2WavStreamState]) -> None:
        for s in states:
            s.close()

    # ---- stepping ---------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, states: Sequence[Code2WavStreamState], codes: Sequence[Tensor]) -> list[Tensor]:
        """Feed new frames ``codes[i]`` (``[num_quantizers, n_i]`` ints) to request ``states[i]``;
        return each request's newly final samples as a 1-D tensor."""
        if len(states) != len(codes):
            raise ValueError("states and codes must have the same length")
        if len({id(s) for s in states}) != len(states):
            raise ValueError("a state may appear only once per step")
        q = int(self.config.num_quantizers)
        for s, c in zip(states, codes, strict=True):
            if s.closed:
                raise RuntimeError("step on a closed Code2WavStreamState")
            if c.dim() != 2 or c.shape[0] != q:
                raise ValueError(f"codes must be [num_quantizers={q}, n], got {tuple(c.shape)}")
        out: list[Tensor | None] = [None] * len(states)
        groups: dict[tuple[object, ...], list[int]] = {}
        for i, (s, c) in enumerate(zip(states, codes, strict=True)):
            key: tuple[object, ...] = ()
            if self.group_by != "none":
                key = (int(c.shape[1]),)
            if self.group_by == "shape":
                key += (int(s.kv[0][0].shape[1]) if s.kv else 0, tuple(s.trans_drop))
            groups.setdefault(key, []).append(i)
        index_groups = list(groups.values())
        for idx in index_groups:
            res = self._step_batch([states[i] for i in idx], [codes[i] for i in idx])
            for i, r in zip(idx, res, strict=True):
                out[i] = r
        return [r for r in out if r is not None]

    def finish(self, states: Sequence[Code2WavStreamState]) -> list[Tensor]:
        """End the requests: return their remaining samples and free their state.

        The samples still held back depend on frames that will never come; a full decode of
        the received frames trims them as well, so this returns empty tensors (the stream is
        already complete) and closes each state."""
        p = next(self.model.parameters())
        res = [torch.zeros(0, device=p.device, dtype=p.dtype) for _ in states]
        self.close(states)
        return res

    # ---- internals --------------------------------------------------------------------------

    def _step_batch(self, states: list[Code2WavStreamState], codes: list[Tensor]) -> list[Tensor]:
        model = self.model
        p = next(model.parameters())
        lens = [int(c.shape[1]) for c in codes]
        n_max = max(lens)
        if n_max == 0:
            return [torch.zeros(0, device=p.device, dtype=p.dtype) for _ in states]
        bsz = len(states)
        padded = torch.zeros(bsz, codes[0].shape[0], n_max, dtype=torch.long, device=p.device)
        for b, c in enumerate(codes):
            padded[b, :, : lens[b]] = c.to(device=p.device, dtype=torch.long)
        hidden = model.code_embedding(padded + model.code_offset).mean(1)  # [B, n_max, H]
        hidden = self._transformer(states, hidden, lens)
        batch = _Batch(hidden.permute(0, 2, 1), lens)
        for op, mod, idx in self._program:
            if op == "pointwise":
                batch = _Batch(_snake_beta(mod, batch.x), batch.lens)
            elif op == "conv":
                assert isinstance(mod, Qwen3OmniMoeCausalConvNet)
                batch = _Batch(self._causal_conv(mod, idx, batch, states), batch.lens)
            elif op == "trans":
                assert isinstance(mod, Qwen3OmniMoeCausalTransConvNet)
                batch = self._trans_conv(mod, idx, batch, states)
            elif op == "convnext":
                assert isinstance(mod, Qwen3OmniMoeConvNeXtBlock)
                h = self._causal_conv(mod.dwconv, idx, batch, states).permute(0, 2, 1)
                h = mod.pwconv2(mod.act(mod.pwconv1(mod.norm(h))))
                batch = _Batch(batch.x + (mod.gamma * h).permute(0, 2, 1), batch.lens)
            elif op == "resunit":
                assert isinstance(mod, Qwen3OmniMoeCode2WavDecoderResidualUnit)
                h = self._causal_conv(mod.conv1, idx, _Batch(_snake_beta(mod.act1, batch.x), batch.lens), states)
                h = self._causal_conv(mod.conv2, idx + 1, _Batch(_snake_beta(mod.act2, h), batch.lens), states)
                batch = _Batch(h.add_(batch.x), batch.lens)  # h is this step's own: h + x, in place
            else:  # pragma: no cover
                raise AssertionError(op)
        wav = batch.x.clamp(min=-1, max=1)[:, 0]
        result: list[Tensor] = []
        for b, s in enumerate(states):
            s.frames_seen += lens[b]
            s.samples_emitted += batch.lens[b]
            result.append(wav[b, : batch.lens[b]] if batch.uniform else wav[b, : batch.lens[b]].clone())
        return result

    def _transformer(self, states: list[Code2WavStreamState], hidden: Tensor, lens: list[int]) -> Tensor:
        pre = self.model.pre_transformer
        bsz, n_max, _ = hidden.shape
        dev = hidden.device
        cache_lens = [int(s.kv[0][0].shape[1]) if self.num_layers else 0 for s in states]
        c_max = max(cache_lens)
        starts = torch.tensor([s.frames_seen for s in states], device=dev)
        ar = torch.arange(n_max, device=dev)
        position_ids = starts[:, None] + ar[None, :]  # [B, n_max]
        position_embeddings = pre.rotary_emb(hidden, position_ids)

        # Absolute frame position of every key slot ([cache padded left | new padded right]).
        cache_pos = starts[:, None] - c_max + torch.arange(c_max, device=dev)[None, :]
        key_pos = torch.cat([cache_pos, position_ids], dim=1)  # [B, c_max + n_max]
        cl = torch.tensor(cache_lens, device=dev)
        nl = torch.tensor(lens, device=dev)
        key_valid = torch.cat(
            [torch.arange(c_max, device=dev)[None, :] >= (c_max - cl)[:, None], ar[None, :] < nl[:, None]],
            dim=1,
        )
        q_pos = position_ids[:, :, None]
        k_pos = key_pos[:, None, :]
        base = key_valid[:, None, :] & (k_pos <= q_pos)
        # Padded query rows attend only to themselves (keeps softmax finite; outputs discarded).
        own = torch.zeros(bsz, n_max, c_max + n_max, dtype=torch.bool, device=dev)
        own[:, ar, c_max + ar] = True
        pad_q = (ar[None, :] >= nl[:, None])[:, :, None]
        masks: dict[int | None, Tensor] = {}
        min_value = torch.finfo(hidden.dtype).min
        for w in set(self.windows):
            allowed = base if w is None else base & (k_pos > q_pos - w)
            allowed = torch.where(pad_q, own, allowed)
            additive = torch.zeros(allowed.shape, dtype=hidden.dtype, device=dev)
            masks[w] = additive.masked_fill(~allowed, min_value)[:, None]  # [B, 1, n_max, c_max + n_max]

        adapters: list[_KVAppend] = []
        full_caches = all(n == c_max for n in cache_lens)
        for i, layer in enumerate(pre.layers[: self.num_layers]):
            if full_caches:  # every cache as long (a full window): stacked, one op for the batch
                past_k = torch.stack([s.kv[i][0] for s in states])
                past_v = torch.stack([s.kv[i][1] for s in states])
            else:
                past_k = hidden.new_zeros(bsz, self.num_kv_heads, c_max, self.head_dim)
                past_v = torch.zeros_like(past_k)
                for b, s in enumerate(states):
                    if cache_lens[b]:
                        past_k[b, :, c_max - cache_lens[b] :] = s.kv[i][0]
                        past_v[b, :, c_max - cache_lens[b] :] = s.kv[i][1]
            adapter = _KVAppend(past_k, past_v)
            hidden = layer(
                hidden,
                attention_mask=masks[self.windows[i]],
                position_embeddings=position_embeddings,
                past_key_values=adapter,
            )
            adapters.append(adapter)
        hidden = pre.norm(hidden)

        for i, adapter in enumerate(adapters):
            assert adapter.new_k is not None and adapter.new_v is not None
            keep = None if self.windows[i] is None else self.windows[i] - 1
            # each request keeps the last `keep` of its valid keys, [c_max - cache, c_max + new) of
            # the attended [past padded left | new padded right]: as one copy when all keep as many
            held = [n + m if keep is None else min(keep, n + m) for n, m in zip(cache_lens, lens, strict=True)]
            if len(set(held)) == 1 and adapter.keys is not None and adapter.values is not None:
                ends = [c_max + m for m in lens]
                starts = [end - held[0] for end in ends]
                for s, k, v in zip(states, _windows(adapter.keys, starts, held[0]),
                                   _windows(adapter.values, starts, held[0]), strict=True):  # fmt: skip
                    s.kv[i] = (k, v)
                continue
            for b, s in enumerate(states):
                k = torch.cat([s.kv[i][0], adapter.new_k[b, :, : lens[b]]], dim=1)
                v = torch.cat([s.kv[i][1], adapter.new_v[b, :, : lens[b]]], dim=1)
                if keep is not None:
                    first = k.shape[1] - min(keep, k.shape[1])
                    k, v = k[:, first:], v[:, first:]
                s.kv[i] = (k.contiguous(), v.contiguous())
        return hidden

    def _causal_conv(
        self, mod: Qwen3OmniMoeCausalConvNet, idx: int, batch: _Batch, states: list[Code2WavStreamState]
    ) -> Tensor:
        hist_len = int(mod.padding)
        if batch.x.shape[-1] == 0:
            return batch.x.new_zeros(batch.x.shape[0], mod.conv.out_channels, 0)
        if hist_len == 0:
            return _pointwise_conv(mod.conv, batch.x)
        hist = torch.stack([s.conv_history[idx] for s in states])
        xx = torch.cat([hist, batch.x], dim=-1)
        y = _in_parts(mod.conv, xx, _rows_per_call(xx, mod.conv.out_channels * batch.x.shape[-1]))
        for s, kept in zip(states, _windows(xx, batch.lens, hist_len), strict=True):
            s.conv_history[idx] = kept
        return y

    def _trans_conv(
        self, mod: Qwen3OmniMoeCausalTransConvNet, idx: int, batch: _Batch, states: list[Code2WavStreamState]
    ) -> _Batch:
        conv = mod.conv
        stride = int(conv.stride[0])
        tail_len = int(mod.left_pad)  # = kernel - stride: outputs still waiting for the next input
        x = batch.x
        if x.shape[-1] == 0:
            return _Batch(x.new_zeros(x.shape[0], conv.out_channels, 0), [0] * x.shape[0])
        if not batch.uniform:  # padded inputs must contribute nothing to the overlap
            lens_t = torch.tensor(batch.lens, device=x.device)
            valid = torch.arange(x.shape[-1], device=x.device)[None, :] < lens_t[:, None]
            x = x * valid[:, None, :].to(x.dtype)
        out_len = (x.shape[-1] - 1) * stride + int(conv.kernel_size[0])

        def transposed(part: Tensor) -> Tensor:
            return F.conv_transpose1d(part, conv.weight, None, stride=stride)

        y = _in_parts(transposed, x, _rows_per_call(x, conv.out_channels * out_len))  # [B, C, (L-1)s + K]
        if tail_len:
            y[..., :tail_len] += torch.stack([s.trans_tail[idx] for s in states])  # y is this step's own
        bias = conv.bias[None, :, None] if conv.bias is not None else None
        out_lens: list[int] = []
        starts: list[int] = []
        finals = [n * stride for n in batch.lens]  # outputs [0, final) can no longer change
        if tail_len:
            for s, tail in zip(states, _windows(y, finals, tail_len), strict=True):
                s.trans_tail[idx] = tail
        for b, s in enumerate(states):
            final = finals[b]
            drop = min(s.trans_drop[idx], final)
            s.trans_drop[idx] -= drop
            starts.append(drop)
            out_lens.append(final - drop)
        if len(set(starts)) == 1 and len(set(out_lens)) == 1:
            out = y[..., starts[0] : starts[0] + out_lens[0]]
        else:
            out = y.new_zeros(y.shape[0], y.shape[1], max(out_lens))
            for b in range(len(states)):
                out[b, :, : out_lens[b]] = y[b, :, starts[b] : starts[b] + out_lens[b]]
        if bias is not None:
            out = out.add_(bias)  # y is this step's own, its tails already copied out
        return _Batch(out, out_lens)


# oneDNN's CPU convolutions (every one wider than 1, and 1-wide ones as below) get slower per row
# as one call's batch outgrows the caches, while under a few hundred kB a row batching still pays.
# Measured per row (torch 2.13, one thread, a 2-core AMD EPYC VM: 1 MB of L2 a core, 32 MB of L3):
# a 7-wide convolution with 4 channels over 47,451 samples, 0.30-0.43 ms at 1-8 rows and 1.7 ms at
# 12-16; with the real model's 96 channels over 48,000 samples, 32 ms alone and 54 ms at 2-4 rows;
# with its 192 over 16,000, 40 ms at 1-2 rows and 49 at 4; with 16 over 4,000, 0.12 ms alone and
# 0.08 at 8 rows. So a CPU call gets as many rows as fit this many bytes of input and output.
_CPU_CONV_CALL_BYTES = 8 << 20

# ATen runs a single-threaded CPU convolution with a 1-wide kernel on its own per-row kernel
# below a batch of 16 and on oneDNN from 16 on (`ConvParams::use_mkldnn`; with more threads always
# on oneDNN). On this decoder's shapes (torch 2.13, one thread, 16-32 rows) oneDNN's is 13-16x slower
# with 4 channels over 30,720 samples, 1.1-2.0x slower with the real model's 96 and 192 channels
# and within 5 % either way with its 384 and 768. So such a convolution gets at most this many
# rows per call.
_CPU_POINTWISE_ROWS = 15


def _rows_per_call(x: Tensor, out_row: int) -> int:
    """How many rows of `x` (`[B, C, L]`) one convolution call gets: on CPU as many as fit
    `_CPU_CONV_CALL_BYTES` with their outputs (`out_row` elements a row), at least one."""
    if x.device.type != "cpu":
        return max(1, x.shape[0])
    return max(1, _CPU_CONV_CALL_BYTES // ((x[0].numel() + out_row) * x.element_size()))


def _in_parts(conv: Callable[[Tensor], Tensor], x: Tensor, rows: int) -> Tensor:
    """`conv(x)`, in calls of at most `rows` rows of `x`, as even as they go, each written into
    the one output as it comes (a concatenation would hold every part's output beside it)."""
    if x.shape[0] <= rows:
        return conv(x)
    parts = x.tensor_split(-(-x.shape[0] // rows))
    first = conv(parts[0])
    out = first.new_empty((x.shape[0], *first.shape[1:]))
    out[: first.shape[0]] = first
    at = first.shape[0]
    for part in parts[1:]:
        y = conv(part)
        out[at : at + y.shape[0]] = y
        at += y.shape[0]
    return out


def _pointwise_conv(conv: nn.Conv1d, x: Tensor) -> Tensor:
    """`conv(x)` for a kernel of 1, in calls of at most `_CPU_POINTWISE_ROWS` rows on one CPU
    thread (the kernel, and so each row's result, is the one a request gets alone, at any batch
    size) and of at most `_rows_per_call`'s."""
    rows = _rows_per_call(x, conv.out_channels * x.shape[-1])
    if x.device.type == "cpu" and torch.get_num_threads() == 1:
        rows = min(rows, _CPU_POINTWISE_ROWS)
    return _in_parts(conv, x, rows)


def _snake_beta(act: Qwen3OmniMoeSnakeBeta, x: Tensor) -> Tensor:
    """`act(x)`, bitwise: transformers' SnakeBeta (`x + 1/(exp(beta) + eps) * sin(x * exp(alpha))**2`)
    with its ops in the same order, but into one new tensor instead of four. On CPU each fresh
    tensor of this size costs page faults: 1.4-3.7x faster on the tiny checkpoint's shapes
    (tests/code2wav/test_streaming_exact.py checks it against the module)."""
    alpha = torch.exp(act.alpha.unsqueeze(0).unsqueeze(-1))
    beta = torch.exp(act.beta.unsqueeze(0).unsqueeze(-1))
    y = x * alpha
    y.sin_()
    y.pow_(2)
    y.mul_(1.0 / (beta + act.no_div_by_zero))  # (1/b) * s == s * (1/b), and x + s == s + x, bitwise
    return y.add_(x)


def exact_decode_stream(decoder: IncrementalCode2Wav, codes: Tensor, chunk_frames: int) -> list[Tensor]:
    """Stream one request through ``decoder`` in chunks of ``chunk_frames`` frames (the last one
    may be shorter); returns the emitted pieces, ``finish``'s (empty) tail included.  Their
    concatenation equals ``full_decode`` of all frames."""
    if chunk_frames <= 0:
        raise ValueError("chunk_frames must be > 0")
    frames = _as_batch(codes)[0]
    state = decoder.new_state()
    try:
        out = [
            decoder.step([state], [frames[:, s : s + chunk_frames]])[0]
            for s in range(0, frames.shape[-1], chunk_frames)
        ]
        out += decoder.finish([state])
    finally:
        state.close()
    return out
