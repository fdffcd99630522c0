"""`omnistage bench` end to end, in-process only (no gRPC): 2 tiny requests, then the JSON's
schema (keys, types, counts). No timing assertions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.harness import BenchOptions, main
from benchmarks.stages import make_start, run_stage
from benchmarks.stats import RATIO_KEYS, SUMMARY_KEYS
from omnistage.models.sampling import SamplingParams
from services import edges

RECORD_KEYS = {
    "config", "index", "prompt_index", "prompt_chars", "issued_at", "ok", "error", "ttft", "ttfa", "e2e",
    "text_tokens", "token_ids", "audio_samples", "sample_rate", "audio_s", "rtf", "text_times", "audio_times",
    "audio_chunk_samples", "chunk_gaps", "stall_s", "info",
}


def test_harness_in_process(tiny_dir: Path, tmp_path: Path) -> None:
    opts = BenchOptions(
        model=tiny_dir, concurrency=[1, 2], num_requests=2, thinker_max_tokens=8, talker_max_tokens=12,
        stage_batch_sizes=[1, 2], json_out=tmp_path / "r.json", plot_out=tmp_path / "r.png",
        markdown_out=tmp_path / "r.md", progress=False, quiet=True,
    )
    returned = main(opts, command="omnistage bench --test")
    result: dict[str, Any] = json.loads((tmp_path / "r.json").read_text())
    assert result == json.loads(json.dumps(returned))
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "omnistage bench --test" in (tmp_path / "r.md").read_text()

    assert result["command"] == "omnistage bench --test"
    assert result["system_under_test"] == "inprocess"
    m = result["machine"]
    assert isinstance(m["cpu_count"], int) and isinstance(m["platform"], str)
    assert m["torch_threads"] == 1 and len(m["load_average"]) == 3
    # which code made the figures (they could not be traced to a commit)
    assert m["omnistage_version"] and (m["git_commit"] is None or len(m["git_commit"]) == 40)
    assert "stack_config" in result and "stack_run_dirs" in result

    assert tuple(result["ratios"]) == RATIO_KEYS
    assert result["ratios"]["e2e_grpc_over_inprocess_c1"] is None  # no gRPC in this run
    for key in set(RATIO_KEYS) - {"e2e_grpc_over_inprocess_c1"}:
        assert isinstance(result["ratios"][key], float), key
        assert result["ratio_basis"][key]

    names = [c["name"] for c in result["configurations"]]
    assert names == ["inprocess c=1", "inprocess c=2", "inprocess full_payload c=1", "monolithic sequential"]
    # generate()'s baseline ran half before the system under test and half after, as one level
    mono = result["configurations"][-1]
    assert list(result["phase_seconds"])[:2] == ["baseline_before", "system_under_test"]
    assert any(n.startswith("run in two halves, before and after the system under test: 1 request at ")
               for n in mono["notes"]), mono["notes"]  # fmt: skip
    for cfg in result["configurations"]:
        assert len(cfg["requests"]) == 2
        s = cfg["summary"]
        assert (s["requests"], s["ok"], s["failed"]) == (2, 2, 0)
        for k in ("ttft_s", "ttfa_s", "e2e_s", "rtf", "audio_s", "chunk_gap_s", "stall_s"):
            assert set(s[k]) == set(SUMMARY_KEYS)
        assert s["ttfa_s"]["n"] == 2  # every built-in prompt speaks
        for k in ("requests_per_s", "audio_s_per_s", "text_tokens_per_s", "wall_s"):
            assert isinstance(s[k], float) and s[k] > 0
        for r in cfg["requests"]:
            assert set(r) == RECORD_KEYS
            assert r["ok"] and r["error"] is None
            assert 0 <= r["ttft"] <= r["e2e"] and 0 <= r["ttfa"] <= r["e2e"]
            assert r["text_tokens"] == len(r["token_ids"]) > 0
            assert r["audio_samples"] == sum(r["audio_chunk_samples"]) > 0
            assert len(r["chunk_gaps"]) == max(0, len(r["audio_times"]) - 1)
    # Greedy everywhere: the staged pipeline and generate() did the same work.
    assert result["consistency"]["prompts_compared"] == len(set(result["request_prompt_indices"]))
    assert result["consistency"]["mismatches"] == []

    st = result["stage_baseline"]
    assert set(st["stages"]) == {"thinker", "talker", "code2wav"}
    assert st["bottleneck"] in st["stages"]
    for stage in st["stages"].values():
        assert stage["batch_sizes_tried"] == [1, 2] and stage["best_batch_size"] in (1, 2)
        assert set(stage["requests_per_s_by_batch"]) == {"1", "2"}
    assert "batches of [1, 2]" in st["note"]


def _replay(pipeline: Any, prompts: list[list[int]], thinker: SamplingParams, talker: SamplingParams) -> list[Any]:
    """Thinker alone on the prompts together, then the talker alone on its recorded chunks."""
    starts = [make_start(thinker, talker) for _ in prompts]
    th = run_stage(pipeline, "thinker", [(s, [edges.prompt_chunk(p)]) for s, p in zip(starts, prompts, strict=True)])
    mode = edges.edge_mode("async_chunk")
    talker_in = [(edges.downstream_start(s, mode), r.down) for s, r in zip(starts, th, strict=True)]
    tk = run_stage(pipeline, "talker", talker_in)
    out = []
    for t, k in zip(th, tk, strict=True):
        ids = [int(i) for x in t.tensors(edges.IDS) for i in x.tolist()]
        frames = k.tensors(edges.CODES)
        empty = torch.zeros((pipeline.spec.num_code_groups, 0), dtype=torch.long)
        codes = torch.cat(frames, dim=1) if frames else empty
        out.append((ids, codes))
    return out


def test_stage_replay_matches_pipeline(pipeline: Any) -> None:
    """The standalone thinker and talker runs do the pipeline's work: the same ids and codes."""
    from services.pipeline import DoneEvent, PipelineRequest

    ids = pipeline.prompt_ids("Tell me a joke about cats.")
    thinker = pipeline.thinker_defaults().with_overrides(max_tokens=8)
    talker = SamplingParams(max_tokens=12)
    done = list(pipeline.run(PipelineRequest(ids, thinker=thinker, talker=talker)))[-1]
    assert isinstance(done, DoneEvent)
    ((tokens, codes),) = _replay(pipeline, [ids], thinker, talker)
    assert tokens == done.token_ids
    assert codes.shape[1] > 0
    assert torch.equal(codes, done.codes)


def test_batched_stage_replays_match_one_at_a_time(pipeline: Any) -> None:
    """The stage-alone baseline's batched thinker and talker do each request's own work."""
    prompts = [pipeline.prompt_ids(p) for p in ("Tell me a joke about cats.", "hi there", "Name a colour.")]
    thinker = pipeline.thinker_defaults().with_overrides(max_tokens=8, do_sample=False)
    talker = SamplingParams(max_tokens=12)
    alone = [_replay(pipeline, [ids], thinker, talker)[0] for ids in prompts]
    together = _replay(pipeline, prompts, thinker, talker)
    assert [t for t, _ in together] == [t for t, _ in alone]
    for (_, a), (_, b) in zip(alone, together, strict=True):
        assert torch.equal(a, b)
    assert any(c.shape[1] > 0 for _, c in together)


def test_compare_counts_identical_requests_and_first_divergence() -> None:
    from benchmarks.stages import compare

    got = compare([[1, 2, 3], [4, 5], [7, 8]], [[1, 2, 3], [4, 6], [7]])
    assert got == {"requests": 3, "identical": 1 / 3, "first_divergence": [1, 1]}


def test_fast_stages_record_their_agreement_instead_of_refusing(tiny_dir: Path) -> None:
    from benchmarks.stages import time_stages
    from omnistage.config import parse_config
    from services.pipeline import InProcessPipeline

    pipe = InProcessPipeline(tiny_dir, parse_config({"thinker": {"batching": "fast"}, "talker": {"batching": "fast"}}))
    ids = [pipe.prompt_ids(p) for p in ("hi", "Tell me about the sea.", "Name three colours.")]
    thinker = pipe.thinker_defaults().with_overrides(max_tokens=6)
    times = time_stages(pipe, ids, thinker, SamplingParams(max_tokens=6), [1, 3])
    for name in ("thinker", "talker"):
        a = times.agreement[name][3]
        assert a["requests"] == 3 and len(a["first_divergence"]) == round(3 * (1 - a["identical"]))
    assert "code2wav" not in times.agreement
    assert len(times.thinker_tokens) == 3 and all(times.thinker_tokens)


def test_the_monolithic_baseline_takes_the_stacks_dtype_auto(tiny_dir: Path) -> None:
    """deploy/examples/cuda.yaml runs `dtype: auto`; the bench's generate() baseline resolves it
    as the stages do (the checkpoint's own) instead of failing on `torch.auto`."""
    from benchmarks.drivers import MonolithicDriver
    from omnistage.models import open_checkpoint

    ckpt = open_checkpoint(tiny_dir)
    mono = MonolithicDriver(tiny_dir, lambda prompt: [1], ckpt.spec.im_end_id, ckpt.sample_rate, dtype="auto")
    assert str(next(mono.reference.model.parameters()).dtype) == f"torch.{ckpt.resolve_dtype('auto')}"


def test_sampled_speech_runs_the_talkers_seeded_defaults_the_same_in_every_configuration(
    tiny_dir: Path, tmp_path: Path, pipeline: Any
) -> None:
    """`--sampled-speech`: each request's talker samples (the family's defaults, seed = request
    index) while its text stays greedy; exact mode gives a request the same speech at every
    level; the greedy-only baselines are skipped, saying so."""
    from benchmarks.drivers import BenchRequest, _sampling

    request = BenchRequest(3, 0, "hi", 8, 12, talker_seed=3)
    thinker, talker = _sampling(pipeline, request)
    assert not thinker.do_sample and talker.do_sample and talker.seed == 3 and talker.max_tokens == 12
    assert talker == pipeline.family.talker_defaults().with_overrides(max_tokens=12, seed=3)
    assert not _sampling(pipeline, BenchRequest(3, 0, "hi", 8, 12))[1].do_sample

    (tmp_path / "prompts.txt").write_text("Tell me a story.\n")  # one prompt: its requests differ by seed alone
    opts = BenchOptions(model=tiny_dir, concurrency=[1, 2], num_requests=3, thinker_max_tokens=8,
                        talker_max_tokens=60, sampled_speech=True, markdown_out=tmp_path / "r.md", progress=False,
                        quiet=True, prompts=tmp_path / "prompts.txt")  # fmt: skip
    result = main(opts, command="omnistage bench --sampled-speech")
    assert [c["name"] for c in result["configurations"]] == ["inprocess c=1", "inprocess c=2",
                                                             "inprocess full_payload c=1"]  # fmt: skip
    assert result["stage_baseline"] is None and result["ratios"]["throughput_cmax_over_sequential_monolithic"] is None
    assert any("sampled speech" in n for n in result["notes"])
    assert result["consistency"] == {"prompts_compared": 3, "compared_by": "request", "mismatches": []}
    assert "for each of the 3 requests" in (tmp_path / "r.md").read_text()
    assert [c["summary"]["ok"] for c in result["configurations"]] == [3, 3, 3]
    samples = {r["index"]: r["audio_samples"] for r in result["configurations"][0]["requests"]}
    assert len(set(samples.values())) > 1, samples  # one prompt, three seeds: not three times the same speech
    with pytest.raises(ValueError, match="--sampled-speech with --http"):
        main(BenchOptions(model=tiny_dir, sampled_speech=True, http=True))
