"""Qwen3-Omni's code predictor, run for a batch of frames with its per-step work hoisted out of
the loop.

`generate()` calls the code predictor's `forward` once per residual group: each call builds a
causal mask, recomputes RoPE for its positions, grows a `DynamicCache` by concatenation and
passes through transformers' output-capturing wrappers. At the tiny widths of the talker's
per-frame loop that overhead, not the matrix products, is most of the time (profiled: the
wrappers, mask and RoPE were a quarter of the loop at batch 16). This loop runs the same
modules (the decoder layers, the final norm, the per-group heads and embeddings) in the same
order on the same inputs, so its numbers are the forward's bitwise:

* RoPE's cos/sin of every step are computed once, with the shapes each step's own call has
  (positions `[[0, 1]]`, then `[[2]]`, `[[3]]`, ...), and reused for every frame;
* the keys and values go into preallocated slots (models/kv_caches.py's `SlotCache`), one
  buffer per layer reused from frame to frame; attention reads a view of the filled slots
  instead of a concatenation;
* no mask is built: the packed attention kernels (models/batching.py) take none on the batch
  axis, where a two-row prefill is causal and a one-row step sees every slot.

Sampled rows (the talker's default over HTTP) draw their codes with `ResidualChoice`: a row's
uniforms for all of a frame's groups come from its generator before the frame, so the loop
itself is the same fixed ops whatever the rows are (`greedy_or_drawn`).

On CUDA, `capture(max_batch, like, sampled)` records the loop as CUDA graphs
(models/cuda_graphs.py), one per batch size bucket, for greedy batches and for batches with
rows sampled `sampled`'s way, each set with its own slot cache at fixed addresses: a frame's 15
groups are then one launch instead of hundreds. Each row is computed on its own in both
batching modes (exact: by construction; fast: a GEMM's rows and the batch axis of SDPA are
independent in value, only their last bits depend on the batch), so the padding rows of a
bucket touch no real row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from omnistage.models.batching import PackedBatching
from omnistage.models.cuda_graphs import BatchGraphs, bucket_sizes
from omnistage.models.kv_caches import SlotCache
from omnistage.models.sampling import RowChoice, TokenChooser, alike, draw_uniforms, greedy_or_drawn

__all__ = ["CodePredictorLoop", "ResidualChoice", "greedy"]

log = logging.getLogger(__name__)

# choose(logits [B, V], group) -> [B] ids on the logits' device
Choose = Callable[[torch.Tensor, int], torch.Tensor]


def greedy(logits: torch.Tensor, group: int = 0) -> torch.Tensor:
    """Each row's argmax, on the logits' device (no host sync: capturable)."""
    return torch.argmax(logits.float(), dim=-1)


class ResidualChoice:
    """How one batch of frames picks its residual codes, row i as `choosers[i]` would: the
    argmax of its raw logits, or drawn through its processors. A sampled row draws all of the
    frame's uniforms (one per group, `[G - 1]`) from its generator here, before the loop: the
    loop then runs the same ops whatever the rows are (a CUDA graph can replay it, with the
    uniforms and which rows sample as inputs), and a row's draws stay its own whatever rows are
    beside it (a seed replays them)."""

    def __init__(self, choosers: Sequence[TokenChooser], groups: int, device: torch.device | str) -> None:
        sampled = [c.params.do_sample for c in choosers]
        self.uniforms = draw_uniforms([c.generator for c in choosers], groups - 1, device)  # greedy rows: none
        self.sampled = torch.tensor(sampled, dtype=torch.bool, device=device)
        # the sampled rows' processors, when they all have the same and the other rows none
        leads = {alike(c): c for c, s in zip(choosers, sampled, strict=True) if s}
        greedy_rest = all(s or c.plain_greedy for c, s in zip(choosers, sampled, strict=True))
        self.lead = next(iter(leads.values())) if len(leads) == 1 and greedy_rest else None
        self.rows = None if self.lead is not None else RowChoice(choosers, device)

    def __call__(self, logits: torch.Tensor, group: int) -> torch.Tensor:
        uniforms = self.uniforms[:, group - 1]
        if self.rows is not None:  # rows of several kinds: each kind through its own processors
            return self.rows(logits, uniforms=uniforms)
        assert self.lead is not None
        return greedy_or_drawn(self.lead, logits, uniforms, self.sampled)


class CodePredictorLoop:
    """The residual codes of a batch of frames: the two-row prefill (the talker's last hidden
    state and embed(code-0)), then one row per group, with requests along the batch axis."""

    def __init__(self, code_predictor: nn.Module, batching: PackedBatching, num_code_groups: int) -> None:
        model = code_predictor.model  # type: ignore[union-attr]
        self.groups = num_code_groups
        self.layers = list(model.layers[: model.config.num_hidden_layers])
        self.norm = model.norm
        self.rotary = model.rotary_emb
        self.embeddings = model.get_input_embeddings()  # group j's input embedding is [j - 1]
        self.heads = code_predictor.lm_head  # group j's head is [j - 1]
        self.batching = batching
        # Positions 0..groups-1: the prefill's two, then one per later group.
        self.cache = SlotCache(len(self.layers), capacity=num_code_groups)
        self._rope: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.graphs: BatchGraphs | None = None
        self.sampled_graphs: BatchGraphs | None = None
        self.sampled_kind: tuple[object, ...] | None = None

    def _step_rope(self, like: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each step's (cos, sin), as the forward computes them for that step's positions."""
        rope = self._rope
        if rope is None or rope[0][0].dtype != like.dtype or rope[0][0].device != like.device:
            device = like.device
            spans = [torch.arange(0, 2, device=device)] + [torch.arange(p, p + 1, device=device)
                                                            for p in range(2, self.groups)]  # fmt: skip
            rope = self._rope = [self.rotary(like, span.unsqueeze(0)) for span in spans]
        return rope

    def _forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], group: int,
                 cache: SlotCache) -> torch.Tensor:  # fmt: skip
        batch, rows = hidden.shape[:2]
        with self.batching.step([rows] * batch, batch_axis=True):
            for layer in self.layers:
                hidden = layer(hidden, attention_mask=None, past_key_values=cache, use_cache=True,
                               position_embeddings=rope)  # fmt: skip
            return self.heads[group - 1](self.norm(hidden))

    @torch.no_grad()
    def run(self, first: torch.Tensor, choice: ResidualChoice | None = None) -> torch.Tensor:
        """`first`: `[B, 2, H]`; `choice` picks each group's codes (None: greedy). Returns the
        codes of groups 1..groups-1, `[groups - 1, B]`, where the forwards ran: the ids go from
        one group's head to the next group's embedding without leaving the device (on CUDA, no
        host sync per group). A batch up to the captured size replays a CUDA graph: a greedy
        one, or one whose sampled rows are all of the captured kind."""
        batch = first.shape[0]
        if choice is None:
            if self.graphs is not None and batch <= self.graphs.max_batch:
                return self.graphs(first)
            return self._run(first, greedy, self.cache)
        graphs = self.sampled_graphs
        if (graphs is not None and batch <= graphs.max_batch and choice.lead is not None
                and alike(choice.lead) == self.sampled_kind):  # fmt: skip
            return graphs(first, choice.uniforms, choice.sampled)
        return self._run(first, choice, self.cache)

    @torch.no_grad()  # nothing recorded for autograd, in the warm-up or the capture
    def capture(self, max_batch: int, like: torch.Tensor, sampled: TokenChooser | None = None) -> None:
        """CUDA graphs of the loop for batches up to `max_batch`, for inputs of `like`'s dtype and
        device (`[1, 2, H]`): greedy, and, given `sampled`, with rows that sample its way (its
        processors; each row's own uniforms) among greedy ones."""
        # Each set its own cache, sized for the largest batch before the first capture: the eager
        # loop's may grow (reallocate) later, which would leave a graph writing to freed memory.
        # The same for RoPE's tables: held here, not recomputed by a call in another dtype.
        rope = self._step_rope(like)
        sizes = bucket_sizes(max_batch)
        cache = SlotCache(len(self.layers), capacity=self.groups)
        self.graphs = BatchGraphs(lambda first: self._run(first, greedy, cache, rope), sizes, like,
                                  out_batch_dim=1)  # fmt: skip
        if sampled is None:
            return
        lead = sampled
        sampled_cache = SlotCache(len(self.layers), capacity=self.groups)

        def loop(first: torch.Tensor, uniforms: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            def choose(logits: torch.Tensor, group: int) -> torch.Tensor:
                return greedy_or_drawn(lead, logits, uniforms[:, group - 1], rows)

            return self._run(first, choose, sampled_cache, rope)

        # the frames, the uniforms and which rows sample (their shapes and dtypes: BatchGraphs holds zeros)
        inputs = (like, like.new_zeros((1, self.groups - 1), dtype=torch.float32),
                  like.new_zeros(1, dtype=torch.bool))  # fmt: skip
        try:
            self.sampled_graphs = BatchGraphs(loop, sizes, inputs, out_batch_dim=1)
        except RuntimeError as e:  # sampled batches still run, eagerly: the stage serves
            log.warning("the code predictor's sampled loop could not be captured as CUDA graphs (%s); sampled "
                        "batches run eagerly", e)  # fmt: skip
            return
        self.sampled_kind = alike(lead)

    def _run(self, first: torch.Tensor, choose: Choose, cache: SlotCache,
             rope: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:  # fmt: skip
        batch = first.shape[0]
        rope = rope or self._step_rope(first)
        cache.reset()
        logits = self._forward(first, rope[0], 1, cache)
        codes = []
        for group in range(1, self.groups):
            step = choose(logits[:, -1], group)
            codes.append(step)
            if group == self.groups - 1:
                break
            logits = self._forward(self.embeddings[group - 1](step.view(batch, 1)), rope[group], group + 1, cache)
        return torch.stack(codes)
