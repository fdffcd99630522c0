"""Exact batching: a request's numbers do not depend on what else is in the step.

The kernel facts the design rests on are checked here too, on random weights at the alignment
checkpoint weights have, so a torch upgrade that breaks them fails here first.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F

from omnistage.models.batching import ExactLinear, PackedBatching, fuse_rms_norms, grouped_linear
from omnistage.models.sampling import SamplingParams


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
    """Why batching.py exists: on this CPU a GEMM row depends on the number of rows."""
    torch.manual_seed(0)
    weight, x = torch.randn(64, 64), torch.randn(8, 64)
    batched = F.linear(x, weight)
    assert not all(torch.equal(batched[i : i + 1], F.linear(x[i : i + 1], weight)) for i in range(8))


def test_a_linear_over_rows_it_cannot_place_is_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    model.config = _NoSubConfigs()  # type: ignore[assignment]
    model.set_attn_implementation = lambda name: None  # type: ignore[assignment]
    batching = PackedBatching(model)
    assert isinstance(model[0], ExactLinear)
    with batching.step([2, 1]), pytest.raises(RuntimeError, match="expected 3"):
        model(torch.randn(4, 8))


class _NoSubConfigs:
    sub_configs: ClassVar[dict[str, Any]] = {}
    _attn_implementation = "sdpa"


def test_exact_mode_is_explicit_and_self_tested(pipeline: Any) -> None:
    """The loaded thinker owns its linear layers (no global intercept), its start-up self-test
    probed every weight shape, and outside a packed step it computes exactly as loaded."""
    thinker = pipeline.thinker
    linears = [m for m in thinker.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, ExactLinear) for m in linears)
    report = thinker.batching.self_test()
    assert report["linears"] == len(linears) and 0 < report["shapes"] <= len(linears)
    x = torch.randn(3, linears[0].in_features)
    assert torch.equal(linears[0](x), F.linear(x, linears[0].weight, linears[0].bias))


def _thinker_run(pipeline: Any, prompts: list[list[int]], join_at: int, chunk: int | None = None) -> list[Any]:
    """Greedy-decode several requests together; request i > 0 joins at step `join_at * i`."""
    thinker = pipeline.thinker
    states = []
    for p in prompts:
        state = thinker.new_state(SamplingParams(max_tokens=6))
        thinker.set_prompt(state, p)
        states.append(state)
    done = [0] * len(prompts)  # tokens in each request's cache
    outs: list[list[Any]] = [[] for _ in prompts]
    step = 0
    while not all(s.finished for s in states):
        live = [i for i, s in enumerate(states) if not s.finished and step >= join_at * i]
        items = []
        for i in live:
            left = len(prompts[i]) - done[i]
            items.append((states[i], done[i], min(chunk or left, left) if left > 0 else 1))
        for i, (_, _, n), result in zip(live, items, thinker.step(items), strict=True):
            done[i] += n
            if result.token is not None:
                outs[i].append(result.token)
        step += 1
    for s in states:
        thinker.release(s)
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
    talker = pipeline.talker
    spec = pipeline.spec
    prompts = [pipeline.prompt_ids(p) for p in ("hi", "Tell me about the sea.", "Name three colours.")]
    hidden = spec.thinker_hidden
    torch.manual_seed(3)
    inputs = [(torch.tensor(p), torch.randn(len(p), hidden), [torch.randn(hidden) for _ in range(4)]) for p in prompts]

    def run(group: list[int]) -> dict[int, list[Any]]:
        states = {i: talker.new_state(SamplingParams(max_tokens=6), spec.default_speaker) for i in group}
        for i in group:
            ids, embeds, tokens = inputs[i]
            states[i].set_prompt(ids, embeds, None, spec)
            for k, t in enumerate(tokens):
                states[i].add_token(t, k == len(tokens) - 1)
        trace: dict[int, list[Any]] = {i: [] for i in group}
        for _ in range(8):
            live = [i for i in group if states[i].can_step(True)]
            if not live:
                break
            frames = talker.step([(states[i], True) for i in live])
            for i, frame in zip(live, frames, strict=True):
                past = states[i].past_hidden
                trace[i].append((None if frame is None else frame.tolist(), None if past is None else past.clone()))
        return trace

    alone = {i: run([i])[i] for i in range(3)}
    together = run([0, 1, 2])
    assert any(f is not None for i in alone for f, _ in alone[i])
    for i in range(3):
        assert [f for f, _ in alone[i]] == [f for f, _ in together[i]]
        assert all((a is None and b is None) or torch.equal(a, b)
                   for (_, a), (_, b) in zip(alone[i], together[i], strict=True))  # fmt: skip


def test_a_frame_comes_out_in_the_step_that_chose_its_code0(pipeline: Any) -> None:
    """The talker prompt's step already gives the first frame (its code-0 and, in the same step,
    its residuals), and each later step one more, until the step whose code-0 ends the reply: the
    first audio waits for one talker step less."""
    talker, spec = pipeline.talker, pipeline.spec
    ids = torch.tensor(pipeline.prompt_ids("Tell me about the sea."))
    torch.manual_seed(3)
    state = talker.new_state(SamplingParams(max_tokens=5), spec.default_speaker)
    state.set_prompt(ids, torch.randn(len(ids), spec.thinker_hidden), None, spec)
    for k in range(6):
        state.add_token(torch.randn(spec.thinker_hidden), k == 5)
    frames = []
    while state.can_step(True) and len(frames) < 10:
        frames.append(talker.step([(state, True)])[0])
    assert state.finished and len(frames) >= 2
    assert all(f is not None for f in frames[:-1]) and frames[-1] is None
    assert state.frames == len(frames) - 1 == len(state.history) - 1


@pytest.fixture(scope="module")
def fast_pipeline(tiny_dir: Any) -> Any:
    from omnistage.config import parse_config
    from services.pipeline import InProcessPipeline

    return InProcessPipeline(tiny_dir, parse_config({"thinker": {"batching": "fast"}, "talker": {"batching": "fast"}}))


def _linear_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every F.linear call from here on."""
    rows: list[int] = []
    real = F.linear

    def spy(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        rows.append(x.numel() // x.shape[-1])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(F, "linear", spy)
    return rows


def test_fast_mode_is_one_gemm_per_linear_over_every_row(
    pipeline: Any, fast_pipeline: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fast: every linear call of a packed step takes all of the step's rows (one GEMM per layer,
    routers included), except the lm_head, which takes only the row each request's token is
    chosen from. Exact: the rows are split per request."""
    prompts = [pipeline.prompt_ids(p) for p in ("hi", "Tell me about the sea.", "Name three colours.")]
    total = sum(len(p) for p in prompts)
    for pipe, fast in ((fast_pipeline, True), (pipeline, False)):
        thinker = pipe.thinker
        assert thinker.batching.mode == ("fast" if fast else "exact")
        states = [thinker.new_state(SamplingParams(max_tokens=2)) for _ in prompts]
        for s, p in zip(states, prompts, strict=True):
            thinker.set_prompt(s, p)
        rows = _linear_rows(monkeypatch)
        thinker.step([(s, 0, len(p)) for s, p in zip(states, prompts, strict=True)])
        monkeypatch.undo()
        assert rows
        if fast:
            assert rows[-1] == len(prompts) and set(rows[:-1]) == {total}, sorted(set(rows))
        else:
            assert total not in rows, sorted(set(rows))
        for s in states:
            thinker.release(s)


def test_fast_mode_is_close_to_exact_and_equal_for_a_lone_request(pipeline: Any, fast_pipeline: Any) -> None:
    prompts = [pipeline.prompt_ids(p) for p in ("hi", "Tell me about the sea.", "Name three colours.")]
    exact_alone = [_thinker_run(pipeline, [p], 0)[0] for p in prompts]
    fast_alone = [_thinker_run(fast_pipeline, [p], 0)[0] for p in prompts]
    # one request: the same kernels in both modes (the fused RMSNorm is, on CPU, the same ops)
    for a, b in zip(exact_alone, fast_alone, strict=True):
        assert [t.token_id for t in a] == [t.token_id for t in b]
        assert all(torch.equal(x.hidden, y.hidden) for x, y in zip(a, b, strict=True))
    together = _thinker_run(fast_pipeline, prompts, 0)
    first = [(a[0].hidden - b[0].hidden).abs().max() for a, b in zip(exact_alone, together, strict=True)]
    assert max(float(d) for d in first) < 1e-3  # other GEMM shapes: the last bits, not more


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_rms_norm_computes_what_transformers_norm_does(dtype: torch.dtype) -> None:
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeRMSNorm

    torch.manual_seed(0)
    norm = Qwen3OmniMoeRMSNorm(96, eps=1e-6).to(dtype)
    torch.nn.init.normal_(norm.weight)
    x = (torch.randn(3, 5, 96) * 4).to(dtype)
    before = norm(x)
    model = torch.nn.Sequential(norm)
    assert fuse_rms_norms(model) == 1
    assert type(norm) is not Qwen3OmniMoeRMSNorm and isinstance(norm, Qwen3OmniMoeRMSNorm)
    assert fuse_rms_norms(model) == 0  # already fused
    after = norm(x)
    assert after.dtype == before.dtype
    torch.testing.assert_close(after, before, rtol=0, atol=0 if dtype == torch.float32 else 1e-2)


def test_only_the_standard_rms_norm_is_fused() -> None:
    """A norm whose forward is not transformers' standard one line for line (Gemma's scales by
    1 + weight) keeps its own forward."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    model = torch.nn.Sequential(GemmaRMSNorm(32), torch.nn.LayerNorm(32))
    assert fuse_rms_norms(model) == 0
    assert type(model[0]) is GemmaRMSNorm


def test_fast_mode_fuses_norms_and_wraps_nothing(pipeline: Any, fast_pipeline: Any) -> None:
    """Fast mode leaves every linear a plain `nn.Linear` (one GEMM needs no wrapper) and fuses
    the norms; exact mode keeps transformers' own norm forward."""
    for pipe, fast in ((fast_pipeline, True), (pipeline, False)):
        for part in (pipe.thinker, pipe.talker):
            assert (part.batching.fused_norms > 0) == fast
            assert any(isinstance(m, ExactLinear) for m in part.model.modules()) != fast


def test_an_unknown_batching_mode_is_refused() -> None:
    from omnistage.config import ConfigError, parse_config

    with pytest.raises(ValueError, match="batching mode 'quick'"):
        PackedBatching(torch.nn.Linear(2, 2), mode="quick")
    with pytest.raises(ConfigError, match=r"talker\.batching"):
        parse_config({"talker": {"batching": "quick"}})


@pytest.mark.parametrize("name", ["published", "variant"])
def test_code_predictor_loop_is_the_forward_bitwise(checkpoints: Any, name: str) -> None:
    """The talker's code-predictor loop (hoisted RoPE, slot cache, no mask) gives the logits
    transformers' forward gives when called group by group as generate() calls it, alone and
    for each row of a batch (exact mode)."""
    from transformers import DynamicCache

    pipe, _ = checkpoints(name)
    talker = pipe.talker
    cp = talker.model.code_predictor
    groups = pipe.spec.num_code_groups
    torch.manual_seed(5)
    first = torch.randn(3, 2, talker.model.config.text_config.hidden_size)

    def loop(rows: torch.Tensor) -> list[torch.Tensor]:
        seen: list[torch.Tensor] = []

        def choose(logits: torch.Tensor, group: int) -> torch.Tensor:
            seen.append(logits.clone())
            return torch.argmax(logits, dim=-1)

        talker.code_predictor._run(rows, choose, talker.code_predictor.cache)
        return seen

    def forward(row: torch.Tensor) -> list[torch.Tensor]:
        cache = DynamicCache(config=cp.config)
        out = cp(inputs_embeds=row, past_key_values=cache, use_cache=True)
        seen = [out.logits[:, -1].clone()]
        for j in range(1, groups - 1):
            ids = torch.argmax(out.logits[:, -1], dim=-1).view(1, 1)
            out = cp(input_ids=ids, past_key_values=cache, use_cache=True, generation_steps=j)
            seen.append(out.logits[:, -1].clone())
        return seen

    together = loop(first)
    assert len(together) == groups - 1
    for b in range(3):
        alone = loop(first[b : b + 1])
        reference = forward(first[b : b + 1])
        assert all(torch.equal(x, y) for x, y in zip(alone, reference, strict=True))
        assert all(torch.equal(x[b : b + 1], y) for x, y in zip(together, alone, strict=True))


def test_choose_rows_is_each_rows_own_choice() -> None:
    """Greedy rows with a repetition penalty and suppressed ids chosen as one batch (histories of
    different lengths, one empty) pick what each row's own `choose` picks; a sampled row too."""
    from omnistage.models.sampling import TokenChooser, choose_rows

    vocab = 40
    torch.manual_seed(1)
    logits = torch.randn(5, vocab)
    top = torch.argmax(logits, dim=-1).tolist()
    greedy = SamplingParams(repetition_penalty=4.0)
    sampled = SamplingParams(do_sample=True, top_k=5, seed=11)
    histories = [[top[0]], [], [top[2], 3, 3, 7], [top[3], 1], [2]]
    params = [greedy, greedy, greedy, greedy, sampled]

    def choosers() -> list[TokenChooser]:
        return [TokenChooser(p, suppress_ids=[top[1]]) for p in params]

    own = [c.choose(logits[i], torch.tensor(histories[i], dtype=torch.long)) for i, c in enumerate(choosers())]
    assert choose_rows(choosers(), logits, histories) == own
    assert own[0] != top[0] and own[1] != top[1]  # the penalty and the suppression both acted
    # a sampled row with no distribution gets its error; the others their own ids, the sampled
    # one among them drawn once (what it draws alone)
    broken = logits.clone()
    broken[2] = float("nan")
    params[2] = sampled
    got = choose_rows(choosers(), broken, histories)
    assert isinstance(got[2], RuntimeError) and "not a distribution" in str(got[2])
    assert [got[i] for i in (0, 1, 3, 4)] == [own[i] for i in (0, 1, 3, 4)]
    assert choose_rows([], logits[:0], []) == []


def test_a_draw_follows_its_rows_probabilities_from_its_own_generator() -> None:
    from omnistage.models.sampling import draw

    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3], [0.0, 0.0, 0.0, 1.0], [0.25, 0.25, 0.25, 0.25]])
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    counts = torch.zeros(3, 4)
    n = 20000
    for _ in range(n):
        counts[torch.arange(3), draw(probs, gens)] += 1
    assert counts[0, 1] == 0 and counts[1, 3] == n  # no draw where a row has no probability
    assert torch.allclose(counts / n, probs, atol=0.015)  # ~5 standard deviations at 20,000 draws
    # a row's draws are its own: alone, with the same seed, it draws the same ids
    alone, beside = torch.Generator().manual_seed(7), [torch.Generator().manual_seed(s) for s in (7, 8)]
    row = probs[2:3]
    assert [int(draw(row, [alone])) for _ in range(50)] == [int(draw(probs[[2, 0]], beside)[0]) for _ in range(50)]
    edge = torch.tensor([[0.0, 0.5, 0.5, 0.0]])
    assert {int(draw(edge, [torch.Generator().manual_seed(s)])) for s in range(200)} == {1, 2}
    for broken in (torch.full((1, 4), float("nan")), torch.zeros(1, 4)):  # no distribution: an error, no id past V
        with pytest.raises(RuntimeError, match="not a distribution"):
            draw(torch.cat((probs[:1], broken)), gens[:2])


@pytest.mark.parametrize(("mode", "checkpoint"), [("exact", "tiny_dir"), ("fast", "tiny_dir"),
                                                  ("fast", "tiny_variant_dir")])  # fmt: skip
def test_the_code_predictors_sampled_rows_pick_what_each_rows_own_choose_picks(
    mode: str, checkpoint: str, request: pytest.FixtureRequest
) -> None:
    """The talker's residual codes for a batch of frames, chosen for every row at once
    (`ResidualChoice`: every row through the same ops, a sampled row with the uniforms it drew
    from its own generator when the frame started, one per group), are the codes each row's own
    `TokenChooser` picks from the same logits with those uniforms, seed for seed, greedy rows
    among them; rows of several sampled kinds (each kind through its own processors) too."""
    from omnistage.models import open_checkpoint
    from omnistage.models.qwen3_omni.code_predictor import ResidualChoice
    from omnistage.models.sampling import CODE_PREDICTOR_SAMPLED, GREEDY, TokenChooser

    ckpt = open_checkpoint(request.getfixturevalue(checkpoint))  # the variant: other code groups, widths
    loop = ckpt.family.talker(ckpt, "float32", "cpu", mode).code_predictor
    groups = ckpt.spec.num_code_groups
    first = torch.randn(5, 2, ckpt.spec.talker_hidden, generator=torch.Generator().manual_seed(3))
    other = SamplingParams(do_sample=True, top_k=5, temperature=0.7)
    empty = torch.empty(0, dtype=torch.long)
    greedy_codes = loop.run(first)
    for kinds in ([CODE_PREDICTOR_SAMPLED] * 3, [CODE_PREDICTOR_SAMPLED, other, CODE_PREDICTOR_SAMPLED]):
        params = [p.with_overrides(seed=s) for p, s in zip(kinds, (1, 2, 3), strict=True)] + [GREEDY]
        params.insert(1, GREEDY)
        own = [TokenChooser(p) for p in params]
        # a sampled row's uniforms: G - 1 from its generator, at the start of the frame
        drawn = [torch.rand(groups - 1, generator=c.generator) if c.generator is not None else None for c in own]

        def per_row(logits: torch.Tensor, group: int, own: list[TokenChooser] = own,
                    drawn: list[Any] = drawn) -> torch.Tensor:  # fmt: skip
            picks = []
            for b, c in enumerate(own):
                scores = c.processors(empty.view(1, 0), logits[b : b + 1].float())
                u = None if drawn[b] is None else drawn[b][group - 1 : group]
                picks.append(int(c.pick(scores, [None], check=True, uniforms=u)))
            return torch.tensor(picks)

        reference = loop._run(first, per_row, loop.cache)
        choice = ResidualChoice([TokenChooser(p) for p in params], groups, "cpu")
        assert (choice.lead is None) == (other in kinds)  # several sampled kinds: each its own processors
        batched = loop.run(first, choice)
        assert torch.equal(batched, reference), kinds
        assert batched.shape == (groups - 1, 5)
        assert torch.equal(batched[:, [1, 4]], greedy_codes[:, [1, 4]])  # the greedy rows are greedy
        assert not torch.equal(batched[:, 0], greedy_codes[:, 0])  # and the sampled ones sampled
    empty_choice = ResidualChoice([], groups, "cpu")
    assert empty_choice.uniforms.shape == (0, groups - 1) and empty_choice(torch.zeros(0, 8), 1).shape == (0,)


def test_one_kind_of_sampled_row_gives_the_ids_rowchoice_gives() -> None:
    """`greedy_or_drawn` (every row through the sampled rows' processors, then each row's argmax
    or draw: what a CUDA graph replays) picks what `RowChoice` (each kind through its own) picks
    from the same uniforms, and keeps no id past the vocabulary on a row with no distribution."""
    from omnistage.models.sampling import CODE_PREDICTOR_SAMPLED, GREEDY, RowChoice, TokenChooser, greedy_or_drawn

    g = torch.Generator().manual_seed(0)
    params = [CODE_PREDICTOR_SAMPLED, GREEDY, CODE_PREDICTOR_SAMPLED, GREEDY, CODE_PREDICTOR_SAMPLED]
    choosers = [TokenChooser(p) for p in params]
    sampled = torch.tensor([p.do_sample for p in params])
    lead = choosers[0]
    for _ in range(20):
        logits = torch.randn(5, 300, generator=g) * 3
        uniforms = torch.rand(5, generator=g)
        rows = RowChoice(choosers, "cpu")(logits, uniforms=uniforms)
        assert torch.equal(greedy_or_drawn(lead, logits, uniforms, sampled), rows)
        assert torch.equal(rows[[1, 3]], logits[[1, 3]].argmax(-1))
    broken = torch.randn(5, 300, generator=g)
    broken[2] = float("nan")
    with pytest.raises(RuntimeError, match="not a distribution"):
        greedy_or_drawn(lead, broken, torch.rand(5, generator=g), sampled)
    broken[2] = 0.0
    broken[1] = float("nan")  # a greedy row's NaN is its own argmax's business, not a draw's
    assert greedy_or_drawn(lead, broken, torch.rand(5, generator=g), sampled).shape == (5,)


def test_slot_cache_holds_what_dynamic_cache_holds_without_concatenating() -> None:
    """Rows written in place: the same keys and values as transformers' DynamicCache after every
    update (prefill chunks and single rows, past the first capacity), the buffer moved only
    when it doubled, and reused after `reset`."""
    from transformers import DynamicCache

    from omnistage.models.kv_caches import SlotCache

    torch.manual_seed(2)
    slot, dyn = SlotCache(num_layers=2, capacity=4), DynamicCache()
    moves = 0
    for n in (3, 1, 1, 5, 1, 1, 1, 7, 1):
        before = slot.layers[1].k.data_ptr() if slot.layers[1].k is not None else None
        for layer in range(2):
            k, v = torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)
            got, want = slot.update(k, v, layer), dyn.update(k, v, layer)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        moves += before is not None and slot.layers[1].k.data_ptr() != before
        assert slot.get_seq_length() == dyn.get_seq_length()
    assert slot.get_seq_length() == 21 and slot.layers[0].k.shape[2] == 32
    assert moves == 3  # 4 -> 8 -> 16 -> 32: copied only when full
    slot.reset()
    keys, _ = slot.update(torch.ones(3, 2, 2, 8), torch.ones(3, 2, 2, 8), 0)  # a larger batch: new buffer
    assert keys.shape == (3, 2, 2, 8) and torch.equal(keys, torch.ones(3, 2, 2, 8))
    buffer = slot.layers[0].k.data_ptr()
    slot.reset()
    keys, _ = slot.update(torch.zeros(2, 2, 5, 8), torch.zeros(2, 2, 5, 8), 0)  # a smaller one: reused
    assert slot.layers[0].k.data_ptr() == buffer and torch.equal(keys, torch.zeros(2, 2, 5, 8))
    slot.reset()
    slot.update(torch.ones(3, 2, 1, 8), torch.ones(3, 2, 1, 8), 0)
    with pytest.raises(RuntimeError, match="batch 1 on a cache filled with batch 3"):
        slot.update(torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8), 0)


def test_a_slot_cache_with_a_limit_never_holds_more_than_it() -> None:
    """A request's cache grows by doubling up to its limit (its reservation), never past it: the
    memory it takes stays within what the scheduler reserved. Without a limit, 70 positions take
    a 128-slot buffer."""
    from omnistage.models.kv_caches import SlotCache

    for limit, slots in ((70, 70), (None, 128), (20, 20)):
        cache = SlotCache(num_layers=1, capacity=64, limit=limit)
        filled = 0
        for n in (15, 1, 1, 1, 1, 1):
            cache.update(torch.ones(1, 2, n, 8), torch.ones(1, 2, n, 8), 0)
            filled += n
        while filled < (limit or 70):
            cache.update(torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8), 0)
            filled += 1
        assert cache.layers[0].k.shape[2] == slots, (limit, cache.layers[0].k.shape)
        assert cache.get_seq_length() == filled


def test_the_thinkers_cache_stays_within_its_reservation(pipeline: Any) -> None:
    thinker = pipeline.thinker
    prompt = pipeline.prompt_ids("Tell me a short story about a robot who learns to sing.")
    state = thinker.new_state(SamplingParams(max_tokens=6))
    thinker.set_prompt(state, prompt)
    pos = 0
    while not state.finished:
        n = len(prompt) if pos == 0 else 1
        thinker.step([(state, pos, n)])
        pos += n
    assert state.cache.layers[0].k.shape[2] == len(prompt) + 6  # not the 64 the first buffer had
    thinker.release(state)


def test_a_model_with_sliding_window_layers_keeps_transformers_cache() -> None:
    from transformers import DynamicCache, Qwen2Config

    from omnistage.models.kv_caches import SlotCache

    full = Qwen2Config(num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=16)
    assert isinstance(SlotCache.for_model(full), SlotCache)
    sliding = Qwen2Config(num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=16,
                          use_sliding_window=True, sliding_window=8, max_window_layers=0)  # fmt: skip
    assert isinstance(SlotCache.for_model(sliding), DynamicCache)


def test_a_choosers_history_ids_follow_its_history_as_it_grows() -> None:
    """`history_ids` converts only what was appended since its last call; another list starts
    over; a view it handed out stays as it was."""
    from omnistage.models.sampling import TokenChooser

    chooser = TokenChooser(SamplingParams(repetition_penalty=1.5))
    history: list[int] = []
    assert chooser.history_ids(history).tolist() == []
    seen = []
    for i in range(40):  # past several growths of the buffer
        history.append(i * 7 % 11)
        seen.append(chooser.history_ids(history))
        assert seen[-1].tolist() == history
    assert seen[3].tolist() == history[:4]  # earlier views unchanged by later appends
    other = [5, 4, 3]
    assert chooser.history_ids(other).tolist() == other and seen[-1].tolist() == history
    assert chooser.history_ids(history[:2]).tolist() == history[:2]  # a new list, shorter
