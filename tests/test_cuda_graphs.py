"""CUDA graphs of the talker's code-predictor loop (models/cuda_graphs.py, `talker.cuda_graphs`).

What the graphs rest on is checked on CPU: a row of the loop does not depend on the rows beside
it (exact mode, bitwise), which is what lets a call pad its batch up to a captured size; and the
loop replays a graph only for greedy batches that fit one. The captures themselves run where a
GPU is (the device machine: `OMNISTAGE_TEST_DEVICE=cuda`); here those tests skip, saying so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from omnistage.config import ConfigError, parse_config
from omnistage.models.cuda_graphs import BatchGraphs, bucket_sizes
from omnistage.models.qwen3_omni.code_predictor import greedy
from omnistage.models.sampling import SamplingParams
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
        self.batches: list[int] = []

    def __call__(self, first: torch.Tensor) -> torch.Tensor:
        self.batches.append(first.shape[0])
        return torch.zeros(2, first.shape[0], dtype=torch.long)


def test_the_loop_replays_graphs_only_for_greedy_batches_that_fit(
    pipeline: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop = _loop(pipeline)
    recorder = _Recorder()
    monkeypatch.setattr(loop, "graphs", recorder)
    like = next(pipeline.talker.model.parameters())
    hidden = pipeline.spec.talker_hidden
    assert loop.run(_first(3, hidden, 0, like)).shape == (2, 3)  # the recorder's
    loop.run(_first(5, hidden, 0, like))  # over the largest captured: eager
    loop.run(_first(2, hidden, 0, like), lambda logits: greedy(logits))  # not the plain greedy choice: eager
    assert recorder.batches == [3]


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
