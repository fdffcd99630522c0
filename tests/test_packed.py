"""Packed forwards: a request's numbers do not depend on what else is in the step.

The kernel facts the design rests on are checked here too, on random weights at the alignment
checkpoint weights have, so a torch upgrade that breaks them fails here first.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from services.runtime.packed import grouped_linear, packed
from services.runtime.sampling import GREEDY, SamplingParams
from services.talker.runner import TalkerRequest
from services.thinker.runner import ThinkerRequest


def _at(shape: tuple[int, ...], misalign: int) -> torch.Tensor:
    flat = torch.randn(shape[0] * shape[1] + 32)
    skip = ((misalign - flat.data_ptr()) % 64) // 4
    return flat[skip : skip + shape[0] * shape[1]].view(shape)


@pytest.mark.parametrize("misalign", [0, 12])
@pytest.mark.parametrize(("n", "k"), [(64, 64), (1152, 64), (64, 32), (4, 64), (1, 64)])
def test_grouped_linear_gives_each_request_its_lone_result(n: int, k: int, misalign: int) -> None:
    torch.manual_seed(n + k + misalign)
    weight = _at((n, k), misalign)
    lengths = [1, 5, 1, 1, 12, 2, 1]
    x = torch.randn(sum(lengths), k)
    got = grouped_linear(x, weight, None, lengths)
    start = 0
    for length in lengths:
        alone = F.linear(x[start : start + length], weight)
        assert torch.equal(got[start : start + length], alone)
        start += length


def test_plain_batching_would_not_be_exact() -> None:
    """Why packed.py exists: on this CPU a GEMM row depends on the number of rows."""
    torch.manual_seed(0)
    weight, x = torch.randn(64, 64), torch.randn(8, 64)
    batched = F.linear(x, weight)
    assert not all(torch.equal(batched[i : i + 1], F.linear(x[i : i + 1], weight)) for i in range(8))


def test_a_linear_over_rows_it_cannot_place_is_refused() -> None:
    with packed([2, 1]), pytest.raises(RuntimeError, match="expected 3"):
        F.linear(torch.randn(4, 8), torch.randn(8, 8))


def _thinker_run(pipeline: Any, prompts: list[list[int]], join_at: int, chunk: int | None = None) -> list[Any]:
    """Greedy-decode several requests together; request i > 0 joins at step `join_at * i`."""
    runner = pipeline.thinker
    params = SamplingParams(max_tokens=6)
    reqs: list[ThinkerRequest] = [runner.new_request(p, params) for p in prompts]
    outs: list[list[Any]] = [[] for _ in prompts]
    step = 0
    while not all(r.finished for r in reqs):
        live = [i for i, r in enumerate(reqs) if not r.finished and step >= join_at * i]
        items = [(reqs[i], chunk or len(prompts[i])) for i in live]
        for i, result in zip(live, runner.step_many(items), strict=True):
            if result.token is not None:
                outs[i].append(result.token)
        step += 1
    for r in reqs:
        runner.release(r)
    return outs


def test_thinker_requests_are_bitwise_the_same_alone_and_packed(pipeline: Any) -> None:
    prompts = [pipeline.prompt_ids(p) for p in ("hi", "Tell me about the sea.", "Name three colours.")]
    alone = [_thinker_run(pipeline, [p], 0)[0] for p in prompts]
    for join_at in (0, 2):  # all prefill together, or later ones prefill while others decode
        together = _thinker_run(pipeline, prompts, join_at)
        for a, b in zip(alone, together, strict=True):
            assert [t.token_id for t in a] == [t.token_id for t in b]
            for x, y in zip(a, b, strict=True):
                assert torch.equal(x.hidden, y.hidden) and torch.equal(x.embed, y.embed)


def test_chunked_prefill_gives_the_same_tokens(pipeline: Any) -> None:
    prompt = pipeline.prompt_ids("Describe a red house on a hill in autumn, with a garden.")
    whole = _thinker_run(pipeline, [prompt], 0)[0]
    chunked = _thinker_run(pipeline, [prompt], 0, chunk=7)[0]
    assert len(prompt) > 14
    assert [t.token_id for t in whole] == [t.token_id for t in chunked]
    # Different chunk shapes change the last bits (other GEMM shapes), not more.
    assert max(float((a.hidden - b.hidden).abs().max()) for a, b in zip(whole, chunked, strict=True)) < 1e-4


def test_talker_steps_are_bitwise_the_same_alone_and_batched(pipeline: Any) -> None:
    runner = pipeline.talker
    hidden = runner.model.config.text_config.hidden_size
    torch.manual_seed(3)
    prompts = [torch.randn(1, n, hidden) for n in (9, 14, 11)]

    def run(group: list[int]) -> dict[int, list[Any]]:
        reqs = {i: runner.new_request(SamplingParams(max_tokens=5, stop_ids=(1,)), "ethan") for i in group}
        trace: dict[int, list[Any]] = {i: [] for i in group}
        runner.forward_many([(reqs[i], prompts[i]) for i in group])
        for _ in range(3):
            live = [i for i in group if not reqs[i].finished]
            if not live:
                break
            frames = runner.residuals_many([reqs[i] for i in live])
            rows = []
            for i, frame in zip(live, frames, strict=True):
                trace[i].append((frame.tolist(), reqs[i].past_hidden.clone()))
                rows.append((reqs[i], runner.advance_embeds(reqs[i], frame, torch.zeros(1, 1, hidden))))
            runner.forward_many(rows)
        return trace

    assert isinstance(runner.new_request(GREEDY), TalkerRequest)
    alone = {i: run([i])[i] for i in range(3)}
    together = run([0, 1, 2])
    assert any(alone[i] for i in alone)
    for i in range(3):
        assert [f for f, _ in alone[i]] == [f for f, _ in together[i]]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(alone[i], together[i], strict=True))
