"""CUDA graphs of the talker's code-predictor loop (models/cuda_graphs.py, `talker.cuda_graphs`).

What the graphs rest on is checked on CPU: a row of the loop does not depend on the rows beside
it (exact mode, bitwise), which is what lets a call pad its batch up to a captured size; the
loop replays a graph only for batches of a captured kind (greedy, or sampled the code
predictor's way) that fit one; and what the graphs record gives the eager loop's codes. The
captures themselves run where a GPU is (the device machine: `OMNISTAGE_TEST_DEVICE=cuda`); here
those tests skip, saying so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from omnistage.config import ConfigError, parse_config
from omnistage.models.cuda_graphs import BatchGraphs, bucket_sizes
from omnistage.models.qwen3_omni.code_predictor import ResidualChoice, greedy
from omnistage.models.sampling import CODE_PREDICTOR_SAMPLED, GREEDY, SamplingParams, TokenChooser, alike
from services.pipeline import DoneEvent, InProcessPipeline, PipelineRequest

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")


def test_bucket_sizes_are_powers_of_two_up_to_the_largest_batch() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(16) == [1, 2, 4, 8, 16]
    assert bucket_sizes(12) == [1, 2, 4, 8, 12]
    with pytest.raises(ValueError, match="at least 1"):
        bucket_sizes(0)


def test_graphs_are_refused_off_cuda() -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        BatchGraphs(lambda x: x, [1], torch.zeros(1, 2))
    with pytest.raises(ConfigError, match=r"talker.*cuda_graphs needs a CUDA device"):
        parse_config({"talker": {"cuda_graphs": True}})
    assert parse_config({"talker": {"cuda_graphs": True, "device": "cuda"}}).talker.cuda_graphs


def _first(batch: int, hidden: int, seed: int, like: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, hidden, generator=g).to(like.device, like.dtype)


def _loop(pipeline: Any) -> Any:
    return pipeline.talker.code_predictor


def test_a_rows_codes_do_not_depend_on_the_rows_beside_it(pipeline: Any) -> None:
    """Exact mode: frames padded with other rows (as a graph bucket pads them) get the codes they
    get alone, and the loop's logits bitwise."""
    loop = _loop(pipeline)
    like = next(pipeline.talker.model.parameters())
    hidden = pipeline.spec.talker_hidden
    real = _first(3, hidden, 0, like)
    alone = loop.run(real)
    for pad in (1, 5):
        padded = loop.run(torch.cat((real, _first(pad, hidden, pad, like))))
        assert torch.equal(padded[:, :3], alone)
    assert alone.shape == (pipeline.spec.num_code_groups - 1, 3)


class _Recorder:
    max_batch = 4

    def __init__(self) -> None:
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, first: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        self.calls.append((first.shape[0], *(t.shape[0] for t in rest)))
        return torch.zeros(2, first.shape[0], dtype=torch.long)


def _choice(pipeline: Any, *params: SamplingParams) -> ResidualChoice:
    device = next(pipeline.talker.model.parameters()).device
    return ResidualChoice([TokenChooser(p, device=str(device)) for p in params], pipeline.spec.num_code_groups, device)


def test_the_loop_replays_graphs_only_for_batches_of_the_captured_kinds_that_fit(
    pipeline: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy batches replay the greedy graphs; batches whose sampled rows sample the captured
    way (greedy rows among them) replay the sampled graphs, with their uniforms and which rows
    sample; anything else, or a batch over the largest captured, runs eagerly."""
    loop = _loop(pipeline)
    greedy_graphs, sampled_graphs = _Recorder(), _Recorder()
    monkeypatch.setattr(loop, "graphs", greedy_graphs)
    monkeypatch.setattr(loop, "sampled_graphs", sampled_graphs)
    monkeypatch.setattr(loop, "sampled_kind", alike(TokenChooser(CODE_PREDICTOR_SAMPLED)))
    like = next(pipeline.talker.model.parameters())
    hidden = pipeline.spec.talker_hidden
    groups = pipeline.spec.num_code_groups
    sampled, other = CODE_PREDICTOR_SAMPLED.with_overrides(seed=1), SamplingParams(do_sample=True, top_k=3, seed=2)
    assert loop.run(_first(3, hidden, 0, like)).shape == (2, 3)  # the recorder's
    assert loop.run(_first(5, hidden, 0, like)).shape == (groups - 1, 5)  # over the largest captured: eager
    assert loop.run(_first(2, hidden, 0, like), _choice(pipeline, sampled, GREEDY)).shape == (2, 2)  # recorded
    assert loop.run(_first(2, hidden, 0, like), _choice(pipeline, other, GREEDY)).shape == (groups - 1, 2)  # eager
    assert loop.run(_first(5, hidden, 0, like), _choice(pipeline, *[sampled] * 5)).shape == (groups - 1, 5)  # eager
    assert greedy_graphs.calls == [(3,)]
    assert sampled_graphs.calls == [(2, 2, 2)]  # the frames, their uniforms, which rows sample


class _Direct:
    """Stands in for BatchGraphs on the CPU: calls what would be captured."""

    def __init__(self, fn: Any, sizes: list[int], like: Any, out_batch_dim: int = 0) -> None:
        self.fn, self.sizes = fn, sizes

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def __call__(self, *xs: torch.Tensor) -> torch.Tensor:
        return self.fn(*xs)


def test_what_the_graphs_record_gives_the_eager_loops_codes(pipeline: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """`capture`'s functions, the loops the graphs record (with their own caches, the sampled one
    taking its uniforms and which rows sample as inputs), run here without a capture: they give
    the eager loop's codes, greedy and sampled."""
    from omnistage.models.qwen3_omni import code_predictor

    loop = _loop(pipeline)
    for name in ("graphs", "sampled_graphs", "sampled_kind"):
        monkeypatch.setattr(loop, name, None)  # put back after the test (the pipeline is shared)
    monkeypatch.setattr(code_predictor, "BatchGraphs", _Direct)
    like = next(pipeline.talker.model.parameters())
    loop.capture(4, like.new_zeros(1, 2, pipeline.spec.talker_hidden), TokenChooser(CODE_PREDICTOR_SAMPLED))
    assert isinstance(loop.sampled_graphs, _Direct) and loop.sampled_graphs.sizes == [1, 2, 4]
    first = _first(3, pipeline.spec.talker_hidden, 7, like)
    params = [CODE_PREDICTOR_SAMPLED.with_overrides(seed=5), GREEDY, CODE_PREDICTOR_SAMPLED.with_overrides(seed=6)]
    assert torch.equal(loop.run(first), loop._run(first, greedy, loop.cache))
    recorded = loop.run(first, _choice(pipeline, *params))
    assert torch.equal(recorded, loop._run(first, _choice(pipeline, *params), loop.cache))
    assert torch.equal(recorded[:, 1], loop.run(first)[:, 1]) and not torch.equal(recorded, loop.run(first))


class _HostSyncs(TorchDispatchMode):
    """Records the ops that bring a value to the host or size a tensor by its contents: each is
    a host sync on a GPU, which a CUDA graph capture refuses."""

    SYNCS = frozenset({torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
                       torch.ops.aten.masked_select.default, torch.ops.aten.unique_dim.default,
                       torch.ops.aten._unique2.default})  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in self.SYNCS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("batching", "checkpoint"), [("exact", "tiny_dir"), ("fast", "tiny_dir"),
                                                     ("exact", "tiny_variant_dir")])  # fmt: skip
def test_what_the_graphs_record_brings_nothing_to_the_host(
    batching: str, checkpoint: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loops the graphs record, greedy and sampled, run here op by op: none of their ops is a
    host sync (which a capture would refuse), the CPU's own check that a draw found an id aside
    (on a GPU the id is kept in range instead, `in_vocabulary`). The variant checkpoint has
    other code groups and widths."""
    from omnistage.models import sampling
    from omnistage.models.checkpoint import open_checkpoint
    from omnistage.models.qwen3_omni import code_predictor

    ckpt = open_checkpoint(request.getfixturevalue(checkpoint))
    loop = ckpt.family.talker(ckpt, "float32", "cpu", batching).code_predictor
    monkeypatch.setattr(code_predictor, "BatchGraphs", _Direct)
    like = torch.zeros(1, 2, ckpt.spec.talker_hidden)
    loop.capture(4, like, TokenChooser(CODE_PREDICTOR_SAMPLED))
    assert isinstance(loop.graphs, _Direct) and isinstance(loop.sampled_graphs, _Direct)
    monkeypatch.setattr(sampling, "in_vocabulary", lambda picks, vocab, check: picks.clamp_(max=vocab - 1))
    first = _first(3, ckpt.spec.talker_hidden, 2, like)
    uniforms = torch.rand(3, ckpt.spec.num_code_groups - 1, generator=torch.Generator().manual_seed(0))
    sampled = torch.tensor([True, False, True])
    with torch.no_grad(), _HostSyncs() as syncs:
        greedy_codes = loop.graphs.fn(first)
        sampled_codes = loop.sampled_graphs.fn(first, uniforms, sampled)
    assert syncs.seen == []
    assert greedy_codes.shape == sampled_codes.shape == (ckpt.spec.num_code_groups - 1, 3)
    assert torch.equal(sampled_codes[:, 1], greedy_codes[:, 1])  # the greedy row among sampled ones
    with _HostSyncs() as syncs:  # the mode sees them
        bool(first.sum() > 0)
    assert syncs.seen == ["aten._local_scalar_dense.default"]


def test_a_sampled_capture_that_fails_leaves_sampled_batches_eager(
    pipeline: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The sampled loop's capture failing (an op a graph cannot hold on some GPU) keeps the
    stage serving: the greedy graphs stay, sampled batches run eagerly, and the log says why."""
    from omnistage.models.qwen3_omni import code_predictor

    loop = _loop(pipeline)
    for name in ("graphs", "sampled_graphs", "sampled_kind"):
        monkeypatch.setattr(loop, name, None)

    def graphs(fn: Any, sizes: list[int], like: Any, out_batch_dim: int = 0) -> _Direct:
        if not isinstance(like, torch.Tensor):  # the sampled set's inputs
            raise RuntimeError("operation not permitted when stream is capturing")
        return _Direct(fn, sizes, like)

    monkeypatch.setattr(code_predictor, "BatchGraphs", graphs)
    like = next(pipeline.talker.model.parameters())
    with caplog.at_level("WARNING"):
        loop.capture(2, like.new_zeros(1, 2, pipeline.spec.talker_hidden), TokenChooser(CODE_PREDICTOR_SAMPLED))
    assert isinstance(loop.graphs, _Direct) and loop.sampled_graphs is None and loop.sampled_kind is None
    assert "sampled batches run eagerly" in caplog.text and "stream is capturing" in caplog.text
    first = _first(2, pipeline.spec.talker_hidden, 1, like)
    choice = [CODE_PREDICTOR_SAMPLED.with_overrides(seed=1), GREEDY]
    assert torch.equal(loop.run(first, _choice(pipeline, *choice)), loop._run(first, _choice(pipeline, *choice),
                                                                              loop.cache))  # fmt: skip


def _graphed_pipeline(model_dir: Path, batching: str) -> InProcessPipeline:
    device = {"device": "cuda", "batching": batching}
    cfg = parse_config({"thinker": device, "talker": {**device, "cuda_graphs": True, "max_num_seqs": 8},
                        "code2wav": {"device": "cuda"}})  # fmt: skip
    return InProcessPipeline(model_dir, cfg)


@cuda
@pytest.mark.parametrize("batching", ["exact", "fast"])
def test_a_graph_gives_the_eager_loops_codes(tiny_dir: Path, batching: str) -> None:
    """Each captured bucket, and batches padded up to one, against the eager loop at the bucket's
    size over the same rows (bitwise: the same kernels run)."""
    pipe = _graphed_pipeline(tiny_dir, batching)
    loop = _loop(pipe)
    assert loop.graphs is not None and loop.graphs.sizes == [1, 2, 4, 8]
    like = next(pipe.talker.model.parameters())
    hidden = pipe.spec.talker_hidden
    for batch in (1, 2, 3, 4, 5, 8):
        bucket = next(s for s in loop.graphs.sizes if s >= batch)
        first = _first(bucket, hidden, batch, like)
        eager = loop._run(first, greedy, loop.cache)
        graphed = loop.run(first[:batch])
        assert torch.equal(graphed, eager[:, :batch]), f"batch {batch} (bucket {bucket})"
    assert loop.run(_first(9, hidden, 9, like)).shape[1] == 9  # over the largest: eager


@cuda
@pytest.mark.parametrize("batching", ["exact", "fast"])
def test_a_sampled_graph_gives_the_eager_loops_codes(tiny_dir: Path, batching: str) -> None:
    """Batches with sampled rows (greedy ones among them), against the eager loop at the
    bucket's size over the same rows and the same seeds (bitwise: the same kernels run)."""
    pipe = _graphed_pipeline(tiny_dir, batching)
    loop = _loop(pipe)
    assert loop.sampled_graphs is not None and loop.sampled_graphs.sizes == [1, 2, 4, 8]
    like = next(pipe.talker.model.parameters())
    hidden = pipe.spec.talker_hidden
    for batch in (1, 2, 3, 5, 8):
        bucket = next(s for s in loop.sampled_graphs.sizes if s >= batch)
        params = [GREEDY if i % 3 == 1 else CODE_PREDICTOR_SAMPLED.with_overrides(seed=i) for i in range(bucket)]
        first = _first(bucket, hidden, batch, like)
        eager = loop._run(first, _choice(pipe, *params), loop.cache)
        graphed = loop.run(first[:batch], _choice(pipe, *params[:batch]))
        assert torch.equal(graphed, eager[:, :batch]), f"batch {batch} (bucket {bucket})"
        assert not torch.equal(graphed[:, 0], loop.run(first[:1])[:, 0])  # row 0 sampled


@cuda
def test_exact_mode_with_graphs_is_generate(tiny_dir: Path, reference: Any) -> None:
    """Parity holds with the graphs on: the staged pipeline's codes equal generate()'s."""
    pipe = _graphed_pipeline(tiny_dir, "exact")
    for prompt in ("Tell me a short story about a robot who learns to sing.", "Numbers one two three"):
        ids = pipe.prompt_ids(prompt)
        eos = pipe.spec.im_end_id
        ref_ids, ref_codes, _ = reference.generate(ids, 40, 80, eos)
        req = PipelineRequest(prompt_ids=ids, thinker=pipe.thinker_defaults().with_overrides(max_tokens=40),
                              talker=SamplingParams(max_tokens=80))  # fmt: skip
        done = list(pipe.run(req))[-1]
        assert isinstance(done, DoneEvent)
        assert done.token_ids == ref_ids
        assert torch.equal(done.codes, ref_codes)
